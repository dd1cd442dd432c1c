"""Sentences of the runners and of opwatch's own troubles: the command line's demo and
post-mortem, the pytest plugin's failure line, and the warnings opwatch gives about itself."""

from __future__ import annotations

import sys

__all__ = ["DEMO_STORIES", "command_error", "post_mortem", "test_failed", "internal_error", "exchange_failed", "counts_not_written", "compiled_ran_eagerly", "rank_files", "traces_merged"]

# The built-in demo: each example script of opwatch/examples with what it shows.
DEMO_STORIES = (
    ("device_mix", "a tensor on the wrong device, then a mask of the wrong dtype (TorchSnooper example 1)"),
    ("broadcast_loss", "a (4,) target minus a (4, 1) prediction: the loss silently becomes (4, 4) (example 2)"),
    ("log_zero", "log(0) turns into inf in forward, and into nan in backward (example 3)"),
)


def module_problem(name: str, why: str, where: str = "") -> str:
    """Why ``python -m opwatch -m name`` cannot run ``name``, as ``python -m`` would not:
    ``why`` is ``"not_a_name"``, ``"package"`` (no ``__main__``) or ``"missing"`` (looked for
    from ``where``)."""
    if why == "not_a_name":
        return f"-m takes a module's name (package.module, as for python -m), got {name!r}"
    if why == "package":
        return f"{name!r} is a package without a __main__ module: it cannot be run with -m"
    return f"no module named {name!r} (looked for from {where}, as python -m does)"


def command_error(prog: str, error: BaseException) -> str:
    """A subcommand's error on one line, in argparse's own form (``prog: error: ...``): a
    missing file, a foreign log, a bad environment variable, rather than a traceback."""
    return f"{prog}: error: {error}"


def post_mortem(filename: str, lineno: int) -> str:
    """The line before ``--pdb`` opens the debugger in the user's frame."""
    return f"opwatch: post-mortem in {filename}:{lineno}"


def test_failed(headline: str) -> str:
    """Why the pytest plugin fails a test: the summary's headline."""
    return f"{headline} in this test (see 'Captured opwatch call' below)"


def internal_error(error: BaseException, formatted_traceback: str, torch_version: str) -> str:
    """The one warning given when opwatch itself breaks and stops watching."""
    return (
        f"opwatch hit an internal error and stopped watching this block: "
        f"{type(error).__name__}: {error}\nYour program is unaffected. Please report this "
        f"to the opwatch issue tracker with the traceback below and your versions "
        f"(torch {torch_version}, Python {sys.version.split()[0]}).\n{formatted_traceback}"
    )


def exchange_failed(publishing: bool, error: BaseException) -> str:
    """The warning when the anomalies of the ranks could not be published or read."""
    if publishing:
        return f"opwatch could not publish this rank's anomalies for the other ranks: {type(error).__name__}: {error}"
    return f"opwatch could not read the other ranks' anomalies: {type(error).__name__}: {error}"


def counts_not_written(error: BaseException) -> str:
    """The warning when opwatch's counts could not be written to TensorBoard (it stops trying)."""
    return f"opwatch could not write its counts to TensorBoard and stops writing them: {type(error).__name__}: {error}"


def rank_files(files: list[tuple[str, list[str]]]) -> str:
    """Rank 0's one line on where each rank writes what the command line was given one path for
    (``python -m opwatch --jsonl PATH`` under torchrun): ``files`` holds ``(option, names)``,
    ``names[r]`` rank r's file. A job of more than 3 ranks shows the first two and the last."""

    def ranks(names: list[str]) -> str:
        shown = [f"{name} (rank {rank})" for rank, name in enumerate(names)]
        if len(shown) <= 3:
            return ", ".join(shown)
        first, second, *_, last = shown
        return f"{first}, {second} ... {last}"

    world = max(len(names) for _, names in files)
    return f"opwatch, all {world} ranks: each rank writes its own: " + "; ".join(f"{option} {ranks(names)}" for option, names in files)


def traces_merged(count: int, path) -> str:
    """The command line's line after ``merge-traces`` wrote ``count`` traces into one."""
    return f"opwatch: {count} trace{'s' if count != 1 else ''} merged into {path} (open it in https://ui.perfetto.dev or chrome://tracing)"


def compiled_ran_eagerly(eager) -> str:
    """The one notice of a watch under which ``torch.compile``d code ran: ``eager`` holds the
    facts of each compiled callable (``name``, ``kind``, ``where``, ``calls``), most calls first."""
    shown = eager[:5]
    named = ", ".join(
        f"{fact.name} ({'compiled module, ' if fact.kind == 'module' else ''}{fact.where}): "
        f"{fact.calls} call{'s' if fact.calls != 1 else ''}"
        for fact in shown
    )
    more = f" and {len(eager) - len(shown)} more" if len(eager) > len(shown) else ""
    return (
        f"opwatch ran compiled code uncompiled under this watch: {named}{more}. It ran their Python "
        f"code eagerly, op by op (torch.compiler's force_eager stance), so it checked the ops eager "
        f"PyTorch runs, not the compiled kernels: a nan/inf or an error that only the compiled code "
        f"makes is not seen here (opwatch.guard replays a failing compiled step eagerly and says "
        f"which one fails). The compiled code is kept and runs again after the watch, without recompiling."
    )
