"""``python -m opwatch``: run a script under a watch, the way ``python -m cProfile`` does.

    python -m opwatch [--strict] [--guard [--on-failure skip|raise|apply] [--max-failed-steps N]] [--checks NAME,...] [--last N] [--allow FIELD=PATTERN,...] [--pdb] [--jsonl PATH] [--trace PATH] [--tensorboard DIR] script.py [args...]
    python -m opwatch [options] -m package.module [args...]
    python -m opwatch show run.jsonl [--last N] [--partial]
    python -m opwatch diff a.jsonl b.jsonl [--rtol X] [--atol Y] [--context N]   (opwatch/runners/cli_diff.py)
    python -m opwatch merge-traces trace.json trace.rank1.json ... -o FILE   (opwatch/runners/cli_trace.py)
    python -m opwatch demo
    python -m opwatch --version

``opwatch`` (the console script) is the same command. Called bare, it prints the usage with
examples.

The script runs as ``python script.py args...`` would run it: ``__main__`` with an absolute
``__file__``, ``sys.argv[0]`` the path as given, ``sys.path[0]`` the script's real directory,
Python's warning filters, ``sys.exit`` codes and messages, the traceback of an uncaught exception
(without opwatch's and runpy's frames) through ``sys.excepthook``, and Ctrl-C ending the process
by SIGINT. The one difference is opwatch's report, printed to stderr at the end. With ``-m``
the module runs as ``python -m package.module args...`` runs it (``runpy.run_module``: its
``__spec__``, ``sys.argv[0]`` its file, ``sys.path[0]`` the working directory).

``--guard`` leaves opwatch on at eager speed for a long run (:mod:`opwatch.runners.leave_on`): a full
watch until the first optimizer step has run, then one fused finiteness check of the gradients
before each optimizer step; ``--on-failure`` says what a step whose gradients hold nan/inf does
(``skip``, the default; ``raise``, the default with ``--strict``; ``apply``).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import importlib.util
import io
import os
import runpy
import shlex
import sys
import traceback
import types
import zipfile
from importlib.machinery import SourceFileLoader

from ..core.collective_ops import current_rank, current_world_size
from ..findings.allow import parse_allow
from ..findings.anomaly import AnomalyError
from ..render.notices import DEMO_STORIES, command_error, compiled_ran_eagerly, module_problem, post_mortem, rank_files
from ..render.summary import every_check, for_the_command_line, raised_above
from ..session import _disabled_by_environment, checks_off, strict, watch
from ..storage.per_rank import rank_folder, rank_path
from .ledger import MAX_FAILED_IN_A_ROW

# Frames of these files are opwatch's launcher and watch, not the user's program: tracebacks
# leave them out. The demo's example scripts are user programs.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # opwatch/
_EXAMPLES_DIR = os.path.join(_PACKAGE_DIR, "examples") + os.sep
_RUNPY_FILES = frozenset({"<frozen runpy>", runpy.__file__})


def main(argv: list[str] | None = None) -> int:
    """The command line: ``python -m opwatch`` (or the ``opwatch`` console script)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser(console=os.path.basename(sys.argv[0] or "") == "opwatch")
    prog = parser.prog
    if not argv:  # called bare: the usage and a few examples, as a usage error
        print(parser.format_usage() + "\n" + parser.epilog, file=sys.stderr)
        return 2
    options = parser.parse_args(argv)
    if options.last < 0:
        parser.error("--last must be 0 or more")
    if options.on_failure is not None and not options.guard:
        parser.error("--on-failure says what --guard does with a step whose gradients hold nan/inf: give --guard too")
    if options.max_failed_steps is not None and not options.guard:
        parser.error("--max-failed-steps says when --guard stops a run whose steps keep failing: give --guard too")
    if options.max_failed_steps is not None and options.max_failed_steps < 0:
        parser.error("--max-failed-steps must be 0 (never stop) or more")
    if options.guard and options.fingerprints:
        parser.error("--fingerprints records every op, --guard only the audited steps: use one of them")
    if options.tensorboard and importlib.util.find_spec("tensorboard") is None:
        parser.error("--tensorboard needs the tensorboard package: pip install tensorboard")
    checks = _checks_option(parser, options.checks)
    try:
        _disabled_by_environment()
    except ValueError as error:  # a bad OPWATCH_DISABLE: one line, not a traceback
        print(command_error(prog, error), file=sys.stderr)
        return 2
    try:
        allow = [parse_allow(text) for text in options.allow]
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    try:
        subcommand = not options.module  # with -m the name is a module's, whatever it is
        if subcommand and options.script == "demo" and not os.path.exists("demo"):
            return run_demo(last=options.last)
        if subcommand and options.script == "show" and not os.path.exists("show"):
            return run_show(options.args)
        if subcommand and options.script == "report" and not os.path.exists("report"):
            from .cli_report import run_report

            return run_report(options.args)
        if subcommand and options.script == "merge-traces" and not os.path.exists("merge-traces"):
            from .cli_trace import run_merge_traces

            return run_merge_traces(options.args)
        if subcommand and options.script == "diff" and not os.path.exists("diff"):
            from .cli_diff import run_diff

            return run_diff(options.args)
        if options.module:
            problem = _module_problem(options.script)
            if problem is not None:
                parser.error(problem)
        elif not os.path.isfile(options.script):
            parser.error(f"no such script: {options.script}")
        return run_script(
            options.script,
            options.args,
            prog=prog,
            strict_mode=options.strict,
            last=options.last,
            jsonl=options.jsonl,
            trace=options.trace,
            allow=allow,
            post_mortem=options.pdb,
            guard=options.guard,
            on_failure=options.on_failure,
            max_failed_steps=options.max_failed_steps,
            fingerprints=options.fingerprints,
            tensorboard=options.tensorboard,
            checks=checks,
            module=options.module,
        )
    except KeyboardInterrupt as interrupt:
        # Reported already. Python ends a process that Ctrl-C interrupted by SIGINT (exit status
        # 130) once it has shut down (threads joined, atexit handlers run): re-raise the
        # interrupt, with Python's own report of it muted, and let Python do exactly that.
        _mute_report_of(interrupt)
        raise


def _parser(*, console: bool) -> argparse.ArgumentParser:
    """The options; ``console``: named as the ``opwatch`` console script rather than ``python -m opwatch``."""
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="opwatch" if console else "python -m opwatch",
        description="Run a Python script with every PyTorch op watched; print the anomalies found "
        "and, if the script fails, the last ops before the failure. 'show' prints a saved log, 'diff' compares two, "
        "'merge-traces' puts the ranks' traces in one, 'demo' runs the built-in demo.",
        epilog="""\
examples:
  {prog} train.py --epochs 1            watch every op; the anomalies at the end
  {prog} --strict train.py              stop at the first anomaly
  {prog} --checks device_mismatch,nonfinite train.py
  {prog} --guard train.py               a long run at eager speed
  {prog} --guard -m mypkg.train         a module, as python -m mypkg.train runs it
  {prog} --jsonl run.jsonl train.py     save the log; read it with: {prog} show run.jsonl
  {prog} diff a.jsonl b.jsonl           the first op where two saved runs differ
  {prog} demo                           three small scripts with real bugs

Every option: {prog} --help""".format(prog="opwatch" if console else "python -m opwatch"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"opwatch {__version__}")
    parser.add_argument("--strict", action="store_true", help="stop the script at the first anomaly")
    parser.add_argument(
        "--guard",
        action="store_true",
        help="watch fully until the first optimizer step, then only check the gradients before each optimizer step (eager speed); a failure re-arms the full watch",
    )
    parser.add_argument(
        "--on-failure",
        choices=("skip", "raise", "apply"),
        default=None,
        help="with --guard, an optimizer step whose gradients hold nan/inf: skip it (default; as GradScaler skips an overflow step), "
        "raise with the op that made them (default with --strict), or apply them",
    )
    parser.add_argument(
        "--max-failed-steps",
        type=int,
        default=None,
        metavar="N",
        help=f"with --guard, stop the run (exit status 1) once N optimizer steps in a row failed (default {MAX_FAILED_IN_A_ROW}; 0: never)",
    )
    parser.add_argument(
        "--checks",
        metavar="NAME,...",
        help="the checks to run, comma-separated, as watch(checks=...): "
        + ", ".join(_check_names())
        + " (default: all but collective_mismatch; 'none': only record)",
    )
    parser.add_argument("--last", type=int, default=20, metavar="N", help="ops shown when the script fails (default 20)")
    parser.add_argument(
        "--jsonl", metavar="PATH", help="write the op log to PATH as JSON Lines (read it with 'show'); under torchrun, rank r > 0 writes PATH with .rank<r> before its extension"
    )
    parser.add_argument("--fingerprints", action="store_true", help="record output fingerprints, for 'diff' of two --jsonl logs")
    parser.add_argument(
        "--trace", metavar="PATH", help="write the op log to PATH as a Chrome trace (Perfetto, chrome://tracing); under torchrun, one a rank, as --jsonl (merge them with 'merge-traces')"
    )
    parser.add_argument(
        "--tensorboard", metavar="DIR", help="write the anomaly counts to a TensorBoard log in DIR after each optimizer step and at the end (needs tensorboard); under torchrun, rank r > 0 into DIR/rank<r>"
    )
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="FIELD=PATTERN,...",
        help="accept matching anomalies (fields kind, op, module, where; glob patterns), e.g. --allow kind=broadcast,where=train.py:42; repeatable",
    )
    parser.add_argument("--pdb", action="store_true", help="on an uncaught exception, open pdb post-mortem in your frame of the failing op")
    parser.add_argument("-m", dest="module", action="store_true", help="run a module as python -m does: the first argument is its name (package.module)")
    parser.add_argument("script", help="the script to run, 'show' (a saved log), 'diff' (two saved logs), 'report' (a saved log as HTML), 'merge-traces' (the ranks' traces in one) or 'demo'; with -m, the module's name")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def _check_names() -> tuple[str, ...]:
    from ..checks import CHECK_NAMES

    return CHECK_NAMES


def _checks_option(parser: argparse.ArgumentParser, text: str | None) -> tuple[str, ...] | None:
    """``--checks a,b``: the check names for ``watch(checks=...)``; ``None`` when not given."""
    if text is None:
        return None
    names = tuple(name for name in text.replace(",", " ").split())
    if names == ("none",):
        return ()
    unknown = [name for name in names if name not in _check_names()]
    if unknown or not names:
        parser.error(f"--checks: unknown check name(s) {', '.join(map(repr, unknown)) or repr(text)}; the checks are {', '.join(_check_names())} (or none)")
    return names


def _launcher(prog: str) -> list:
    """How opwatch was launched, as a command's first words: ``prog`` (``python -m opwatch``),
    or in a job torchrun launched (``TORCHELASTIC_RUN_ID``: each rank's script needs the job to
    set up its process group) ``torchrun --nproc-per-node N -m opwatch``, with ``--nnodes`` for
    a job of several nodes (whose rendezvous options the user adds, as they launched it)."""
    environment = os.environ
    per_node = environment.get("LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in environment or not per_node:
        return prog.split()
    nodes = environment.get("GROUP_WORLD_SIZE", "1")
    return ["torchrun", *(["--nnodes", nodes] if nodes != "1" else []), "--nproc-per-node", per_node, "-m", "opwatch"]


def run_script(
    path: str, args: list[str], *, strict_mode: bool = False, last: int = 20, out=None, jsonl=None, trace=None, allow=(), post_mortem: bool = False, guard: bool = False,
    fingerprints: bool = False, tensorboard=None, checks=None, on_failure=None, prog: str | None = None, module: bool = False,
    max_failed_steps: int | None = None,
) -> int:
    """Run ``path`` as ``python path args...`` would (``module``: ``path`` is a module's name,
    run as ``python -m path args...`` would), under a watch (``guard``: under
    :class:`opwatch.runners.leave_on.LeaveOn`), then print the summary to ``out`` (stderr) and write the
    log to ``jsonl`` / ``trace`` and the counts to a TensorBoard log in ``tensorboard`` (after
    each optimizer step and at the end) when given. Where the summary cannot speak for the
    whole run (checks turned off, a ``--guard`` run that ended after ops no check saw), it is
    followed by the command that checks the rest (``prog``: how opwatch was called). Returns
    the exit status; an uncaught ``KeyboardInterrupt`` is reported and then re-raised."""
    out = out if out is not None else sys.stderr
    runner = None
    # The watch's dump of the last ops goes here, to be printed after opwatch's findings and
    # before the traceback: the finding first, once, under --guard as under a watch.
    dump = _Held(out)
    prog = prog or _parser(console=False).prog

    def command(strict_run: bool) -> str:
        """The command that runs this script again under a full watch (under torchrun, as
        torchrun launched it: :func:`_launcher`)."""
        return shlex.join([*_launcher(prog), *(["--strict"] if strict_run else []), *(["-m"] if module else []), path, *args])

    if guard:
        from .leave_on import LeaveOn

        # its file is its watch's (the dump); the runner's counts are printed below, to out
        stop = {} if max_failed_steps is None else {"max_failed_in_a_row": max_failed_steps or None}
        runner = LeaveOn(strict_mode=strict_mode, on_failure=on_failure, warn=False, last=last, file=dump, allow=allow, checks=checks,
                         rerun=command(strict_mode), **stop)
    w = runner.watch if guard else (strict if strict_mode else watch)(warn=False, last=last, file=dump, allow=allow, fingerprints=fingerprints, checks=checks)
    status, interrupt, failure = 0, None, None
    # Under torchrun, every rank writes a file of its own (opwatch.storage.per_rank): rank 0 the
    # path given, rank r > 0 the path with .rank<r> (TensorBoard: a run rank<r> in the folder).
    counts = _tensorboard_counts(tensorboard and rank_folder(tensorboard, current_rank()), runner if guard else w)
    with _running_as_module(path, args) if module else _running_as_main(path, args) as main_module:
        try:
            program = None if module else _compile(main_module.__file__)
            with runner if guard else w, counts or contextlib.nullcontext():
                if module:  # runpy sets __main__, sys.argv[0] and the module's __spec__, as python -m does
                    runpy.run_module(path, run_name="__main__", alter_sys=True)
                elif program is None:  # a zip application or a .pyc: runpy knows those
                    runpy.run_path(path, run_name="__main__")
                else:
                    exec(program, main_module.__dict__)
        except SystemExit as exit_:
            status = _exit_status(exit_)
        except BaseException as error:  # noqa: BLE001 -- reported as Python reports it
            failure, status = error, 1
            if isinstance(error, KeyboardInterrupt):
                interrupt = error
        if jsonl:  # before printing: a closed stderr must not lose the log
            from ..storage.jsonl import write_jsonl

            # the watch ran from the script's first line; a --guard run's ledger goes with it
            write_jsonl(w, rank_path(jsonl, w.rank), whole_script=True, guard=runner.ledger.log() if guard else None)
        if trace:
            w.export_chrome_trace(rank_path(trace, w.rank))
        if counts is not None:
            counts.close()
        print(for_the_command_line(runner.watch_summary() if guard else w.summary()), file=out)
        if w.compiled_eagerly:  # the Python API warns it; the command line says it beside the summary
            print(compiled_ran_eagerly(w.compiled_eagerly), file=out)
        if checks is not None and checks_off(checks):
            print(every_check(command(strict_mode)), file=out)
        if guard:  # a run that ended unjudged: strict finds the first anomaly at once
            print(runner.summary(rerun=command(True)), file=out)
        _print_every_rank(w, out, files={"--jsonl": jsonl, "--trace": trace, "--tensorboard": tensorboard}, guard=runner if guard else None)
        if failure is not None:
            if dump.getvalue():
                out.write("\n" + dump.getvalue() + "\n")
            out.flush()
            _report_uncaught(failure)
            if post_mortem and interrupt is None:
                _post_mortem(failure)
    if interrupt is not None:
        raise interrupt
    return status


def _tensorboard_counts(log_dir, source):
    """The counts written into a TensorBoard log in ``log_dir`` at each optimizer step
    (:class:`opwatch.runners.tensorboard.OptimizerStepCounts`); ``None`` without one."""
    if not log_dir:
        return None
    from .tensorboard import OptimizerStepCounts, summary_writer

    return OptimizerStepCounts(summary_writer(log_dir), source)


class _Held(io.StringIO):
    """Text held to be written to ``stream`` later, measured as ``stream`` is: the dump is
    fitted to the terminal it will be printed on."""

    def __init__(self, stream):
        super().__init__()
        self._stream = stream

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self._stream.fileno()


def _print_every_rank(w, out, files: dict, guard=None) -> None:
    """In a job of several ranks (``torchrun ... -m opwatch script.py``), rank 0 also prints the
    combined summary: every rank's anomalies, naming the rank, op and line that made the first
    nan/inf (with ``--guard``, never "no anomalies" beside failed steps: ``guard``'s
    :meth:`~opwatch.runners.leave_on.LeaveOn.watch_summary`), then where each rank wrote the
    ``files`` given (option -> path or ``None``). The other ranks' summaries arrive through the
    process group's store."""
    if w.rank != 0:
        return
    everyone = w.all_anomalies()
    if everyone.world and everyone.world > 1:
        print(everyone.summary() if guard is None else guard.watch_summary(everyone), file=out)
    world = everyone.world or current_world_size()
    given = [(option, path) for option, path in files.items() if path]
    if world and world > 1 and given:
        name = {"--tensorboard": rank_folder}
        print(rank_files([(option, [name.get(option, rank_path)(path, rank) for rank in range(world)]) for option, path in given]), file=out)


def run_show(argv: list[str]) -> int:
    """``show run.jsonl [--last N]``: print the table and the summary of a saved log."""
    from ..storage.jsonl import load

    parser = argparse.ArgumentParser(prog="python -m opwatch show", description="Print the op table and the summary of a log written by --jsonl or Watch.export_jsonl.")
    parser.add_argument("log", help="the .jsonl file")
    parser.add_argument("--last", type=int, default=None, metavar="N", help="show the last N ops (default: all)")
    parser.add_argument("--partial", action="store_true", help="print what a log cut short holds, instead of refusing it")
    options = parser.parse_args(argv)
    if options.last is not None and options.last < 0:
        parser.error("--last must be 0 or more")
    try:
        log = load(options.log, partial=options.partial)
    except (OSError, ValueError) as error:  # one line: a missing, foreign or cut-short log
        print(command_error(parser.prog, error), file=sys.stderr)
        return 1
    print(log.table(last=options.last))
    print()
    print(log.summary())
    return 0


@contextlib.contextmanager
def _running_as_main(path: str, args: list[str]):
    """``sys`` set up as ``python path args...`` sets it, and a fresh ``__main__`` module for
    the script (yielded); everything restored on exit."""
    # Python 3.9+ joins a relative script path to the working directory without normalizing it.
    file = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=file, __cached__=None, __loader__=SourceFileLoader("__main__", file), __builtins__=builtins, __annotations__={}
    )
    # sys.path[0] is where ``python -m`` (or the ``opwatch`` console script) was started from;
    # ``python script.py`` puts the script's real directory there instead, unless -P / -I.
    with _program_sys([path, *args], os.path.dirname(os.path.realpath(path))):
        sys.modules["__main__"] = module
        yield module


@contextlib.contextmanager
def _running_as_module(name: str, args: list[str]):
    """``sys`` set up as ``python -m name args...`` sets it before running the module (which
    ``runpy.run_module(..., alter_sys=True)`` then finishes: ``sys.argv[0]``, ``__main__``);
    everything restored on exit. Yields ``None``: runpy makes the module."""
    # python -m puts the working directory first (the console script's own folder otherwise).
    with _program_sys([name, *args], os.getcwd()):
        yield None


@contextlib.contextmanager
def _program_sys(argv: list[str], first_path: str):
    """``sys.argv`` and ``sys.path[0]`` (unless -P / -I) as the program expects them; those and
    ``sys.modules["__main__"]`` put back on exit."""
    saved_argv, saved_path, saved_main = sys.argv, sys.path[:], sys.modules["__main__"]
    sys.argv = argv
    if not getattr(sys.flags, "safe_path", False):
        sys.path[:1] = [first_path]
    try:
        yield
    finally:
        sys.argv, sys.path[:], sys.modules["__main__"] = saved_argv, saved_path, saved_main


def _module_problem(name: str) -> str | None:
    """Why ``python -m name`` would not run (a usage error's words), or ``None``: the module is
    found (a package: its ``__main__``), with the working directory first on the path as
    ``python -m`` has it. Like ``python -m``, this imports the module's parent packages (their
    ``__init__`` runs before the watch starts)."""
    if not name or name.startswith(".") or name.endswith(".py") or not all(part.isidentifier() for part in name.split(".")):
        return module_problem(name, "not_a_name")
    with _program_sys(sys.argv, os.getcwd()):
        try:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
                if importlib.util.find_spec(f"{name}.__main__") is None:
                    return module_problem(name, "package")
        except (ImportError, ValueError):
            spec = None
    return None if spec is not None else module_problem(name, "missing", os.getcwd())


def _compile(file: str) -> types.CodeType | None:
    """The script's code, compiled as Python compiles a script (no ``__future__`` flags of
    opwatch's own); ``None`` for what is not source: a zip application, a .pyc file."""
    if file.endswith(".pyc") or zipfile.is_zipfile(file):
        return None
    with open(file, "rb") as source:  # bytes: compile() honours the coding cookie
        return compile(source.read(), file, "exec", dont_inherit=True)


def _exit_status(exit_: SystemExit) -> int:
    """What Python does with an uncaught ``SystemExit``: an int is the status, None is 0, any
    other value is printed to stderr and the status is 1."""
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code
    print(exit_.code, file=sys.stderr)
    return 1


def _report_uncaught(error: BaseException) -> None:
    """Report ``error`` as Python reports an uncaught exception, through ``sys.excepthook``
    (the script's own, if it set one), with only the program's frames in its traceback."""
    seen = set()
    pending = [error]
    while pending:  # the exception and every exception chained to it, each once
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = _program_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]
    from .policy import GradientsNotFinite

    if isinstance(error, GradientsNotFinite) and sys.excepthook is sys.__excepthook__:
        # opwatch stopped the run on purpose (RunStuck, --strict): its message says why, a traceback
        # down to torch's optimizer hook would not.
        sys.stderr.write(f"{type(error).__name__}: {error}\n")
        sys.stderr.flush()
        return
    if isinstance(error, AnomalyError) and sys.excepthook is sys.__excepthook__:
        # Its message is the finding opwatch's report above holds in full: one line here.
        reported = "".join(traceback.format_exception_only(error))
        full = "".join(traceback.format_exception(error))
        message = f"{reported.partition(': ')[0]}: {error}\n"
        if reported.startswith(message) and full.endswith(reported):
            sys.stderr.write(full[: -len(reported)] + raised_above(error, reported) + reported[len(message):])
            sys.stderr.flush()
            return
    sys.excepthook(type(error), error, error.__traceback__)
    if sys.version_info < (3, 11) and sys.excepthook is sys.__excepthook__:
        # Python 3.10's traceback leaves out exception notes (PEP 678 prints them from 3.11):
        # opwatch's (raised in which op, the replay's) go where 3.11 puts them, after it.
        for note in getattr(error, "__notes__", None) or ():
            sys.stderr.write(f"{note}\n")
        sys.stderr.flush()


def _program_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the frames of opwatch (its launcher, its watch) and runpy."""
    kept = []
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        ours = filename in _RUNPY_FILES or (filename.startswith(_PACKAGE_DIR) and not filename.startswith(_EXAMPLES_DIR))
        if not ours:
            kept.append(tb)
        tb = tb.tb_next
    result = None
    for entry in reversed(kept):
        result = types.TracebackType(result, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return result


def _post_mortem(error: BaseException) -> None:
    """pdb post-mortem, like ``pytest --pdb``, in the program's innermost frame of the failure:
    the user's line that issued the failing op (or raised), not opwatch's or torch's frames."""
    import pdb

    from ..core.sites import USER, classify_code

    entries = []
    tb = error.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    users = [i for i, entry in enumerate(entries) if classify_code(entry.tb_frame.f_code) == USER]
    if not users:
        pdb.post_mortem(error.__traceback__)
        return
    result = None
    for entry in reversed(entries[: users[-1] + 1]):
        result = types.TracebackType(result, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    print(post_mortem(entries[users[-1]].tb_frame.f_code.co_filename, entries[users[-1]].tb_lineno), file=sys.stderr)
    pdb.post_mortem(result)


def _mute_report_of(error: BaseException) -> None:
    """Make ``sys.excepthook`` print nothing for ``error`` (and report anything else as before)."""
    report = sys.excepthook

    def excepthook(kind, value, tb):
        if value is not error:
            report(kind, value, tb)

    sys.excepthook = excepthook


def run_demo(*, last: int = 20) -> int:
    """Run the embedded example scripts (real bugs) and show what opwatch reports."""
    from .. import examples

    folder = os.path.dirname(examples.__file__)
    for number, (name, story) in enumerate(DEMO_STORIES, 1):
        print(f"\n=== story {number}: {story}", flush=True)
        print(f"    (opwatch/examples/{name}.py)\n", flush=True)
        run_script(os.path.join(folder, f"{name}.py"), [], last=last, out=sys.stdout)
        sys.stdout.flush()
    return 0

