"""``python -m opwatch script.py`` runs the script exactly as ``python script.py`` does, apart
from opwatch's report on stderr.

Each test writes a script to ``tmp_path``, runs it both ways in a subprocess (same interpreter,
environment and working directory) and compares what Python decides: the exit status, stdout,
the traceback, ``sys.exit``'s message, warnings, ``__file__``, ``sys.argv``, ``sys.path[0]``.
The CLI's own options (``--strict``, ``--last``, ``demo``) are tested in test_rendering.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def run_both(script: str, *args: str, cwd: Path, flags: tuple[str, ...] = ()):
    """``python script args`` and ``python -m opwatch script args``: (plain, watched)."""

    def run(*command):
        return subprocess.run(
            [sys.executable, *flags, *command, script, *args], capture_output=True, text=True, cwd=cwd, env=ENV, timeout=300
        )

    return run(), run("-m", "opwatch")


def assert_same_apart_from_the_report(plain, watched):
    """Same status and stdout; stderr is Python's, then opwatch's report."""
    assert watched.returncode == plain.returncode, watched.stderr
    assert watched.stdout == plain.stdout
    assert watched.stderr.startswith(plain.stderr), (plain.stderr, watched.stderr)
    assert watched.stderr[len(plain.stderr):].startswith("opwatch:"), watched.stderr


def traceback_and_after(stderr: str) -> str:
    assert "Traceback (most recent call last):" in stderr, stderr
    return stderr[stderr.index("Traceback (most recent call last):"):]


def assert_same_traceback(plain, watched):
    """The watched run prints opwatch's report (its findings first, then the dump of the last
    ops), then Python's traceback (user frames only), followed by opwatch's note when an op
    raised."""
    expected = traceback_and_after(plain.stderr)
    got = traceback_and_after(watched.stderr)
    assert got.startswith(expected), (expected, got)
    assert got[len(expected):] == "" or got[len(expected):].startswith("opwatch: raised in"), got
    assert "interceptor.py" not in got and "runpy" not in got and "__main__.py" not in got
    before = plain.stderr[: plain.stderr.index("Traceback (most recent call last):")]
    report = watched.stderr[: watched.stderr.index("Traceback (most recent call last):")]
    assert report.startswith(before) and report[len(before):].startswith("opwatch:"), report


# --------------------------------------------------------------------------------------------
# __main__, __file__, sys.argv, sys.path[0], imports
# --------------------------------------------------------------------------------------------

SHOW = """\
    '''What a script can see of how it was started.'''
    import pickle
    import sys

    import sibling

    class Point:
        pass

    def typed(x: int) -> None:
        pass

    print("__file__", __file__)
    print("argv", sys.argv)
    print("path0", sys.path[0])
    print("name", __name__, "doc", __doc__)
    print("globals", sorted(globals()))
    print("loader", type(__loader__).__name__, __loader__.name, __loader__.path)
    print("spec", __spec__, "package", __package__, "cached", __cached__, "builtins", type(__builtins__).__name__)
    print("main module", sys.modules["__main__"].__dict__ is globals())
    print("code file", sys._getframe().f_code.co_filename)
    print("sibling", sibling.__file__)
    print("pickled", type(pickle.loads(pickle.dumps(Point()))) is Point)
    print("annotations", typed.__annotations__)  # evaluated: no __future__ flag of opwatch's
    try:
        import cwd_only
        print("cwd importable", cwd_only.__file__)
    except ImportError:
        print("cwd not importable")
"""


@pytest.fixture
def show(tmp_path):
    """``tmp_path/scripts/show.py`` (with a sibling module), a symlink ``tmp_path/link.py`` to it,
    and a module ``cwd_only.py`` that only the working directory ``tmp_path`` holds."""
    script = write(tmp_path / "scripts" / "show.py", SHOW)
    write(tmp_path / "scripts" / "sibling.py", "VALUE = 1\n")
    write(tmp_path / "cwd_only.py", "VALUE = 2\n")
    (tmp_path / "link.py").symlink_to(script)
    return tmp_path


@pytest.mark.parametrize(
    "path, cwd",
    [
        ("scripts/show.py", "."),
        ("./scripts/show.py", "."),  # Python keeps the "./" in __file__
        ("scripts/../scripts/show.py", "."),  # ... and the "..", but not in sys.path[0]
        ("show.py", "scripts"),
        ("link.py", "."),  # sys.path[0] is the real directory of the script, not the link's
        ("ABSOLUTE", "."),
    ],
)
def test_file_argv_path0_and_main_module_are_as_python_sets_them(show, path, cwd):
    path = str(show / "scripts" / "show.py") if path == "ABSOLUTE" else path
    plain, watched = run_both(path, "--last", "3", "two words", cwd=show / cwd)
    assert plain.returncode == 0, plain.stderr
    assert_same_apart_from_the_report(plain, watched)
    seen = dict(line.split(" ", 1) for line in watched.stdout.splitlines())
    assert seen["argv"] == repr([path, "--last", "3", "two words"])  # options after the script are the script's
    assert os.path.isabs(seen["__file__"])
    assert seen["path0"] == str((show / "scripts").resolve())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P is new in Python 3.11")
def test_safe_path_puts_no_script_directory_on_the_path(show):
    plain, watched = run_both("scripts/show.py", cwd=show, flags=("-P",))
    # With -P Python adds neither the script's directory nor the working directory.
    assert "ModuleNotFoundError: No module named 'sibling'" in plain.stderr
    assert_same_traceback(plain, watched)
    assert watched.returncode == plain.returncode == 1


# --------------------------------------------------------------------------------------------
# sys.exit, uncaught exceptions, Ctrl-C
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, status",
    [('sys.exit("stopped: no data in data/")', 1), ("sys.exit(3)", 3), ("sys.exit()", 0), ("sys.exit(None)", 0)],
)
def test_sys_exit_status_and_message(tmp_path, call, status):
    write(tmp_path / "leave.py", f"import sys\nprint('before exit')\n{call}\nprint('not reached')\n")
    plain, watched = run_both("leave.py", cwd=tmp_path)
    assert plain.returncode == status
    assert_same_apart_from_the_report(plain, watched)
    if status == 1:
        assert watched.stderr.startswith("stopped: no data in data/\n")


def test_an_uncaught_exception_prints_the_programs_traceback_and_exits_1(tmp_path):
    write(
        tmp_path / "boom.py",
        """\
        import torch

        def load(name):
            try:
                return {}[name]
            except KeyError as missing:
                raise ValueError(f"no dataset {name!r}") from missing

        print(torch.ones(2).sum().item())
        load("cifar")
        """,
    )
    plain, watched = run_both("boom.py", cwd=tmp_path)
    assert plain.returncode == watched.returncode == 1
    assert watched.stdout == plain.stdout
    assert "The above exception was the direct cause" in plain.stderr
    assert_same_traceback(plain, watched)


def test_an_op_error_keeps_the_traceback_and_gets_opwatchs_note(tmp_path):
    write(
        tmp_path / "fails.py",
        """\
        import torch

        x = torch.ones(5, 3)
        y = x.double() @ torch.ones(3, 2)
        """,
    )
    plain, watched = run_both("fails.py", cwd=tmp_path)
    assert plain.returncode == watched.returncode == 1
    assert_same_traceback(plain, watched)
    assert "opwatch: raised in aten.mm.default" in traceback_and_after(watched.stderr)


def test_a_syntax_error_is_reported_as_python_reports_it(tmp_path):
    write(tmp_path / "typo.py", "print('hello'\n")
    plain, watched = run_both("typo.py", cwd=tmp_path)
    assert plain.returncode == 1 and "SyntaxError" in plain.stderr
    # opwatch's report first, then Python's report of the error.
    assert watched.returncode == 1 and watched.stdout == plain.stdout
    assert watched.stderr.startswith("opwatch: no anomalies.\n") and watched.stderr.endswith(plain.stderr)


def test_the_scripts_own_excepthook_reports_its_uncaught_exception(tmp_path):
    write(
        tmp_path / "hooked.py",
        """\
        import sys

        def hook(kind, value, tb):
            print("hook:", kind.__name__, value, tb.tb_frame.f_code.co_filename == __file__, file=sys.stderr)

        sys.excepthook = hook
        raise ValueError("boom")
        """,
    )
    plain, watched = run_both("hooked.py", cwd=tmp_path)
    assert plain.returncode == watched.returncode == 1
    assert plain.stderr == "hook: ValueError boom True\n"
    assert plain.stderr in watched.stderr and "Traceback" not in watched.stderr


@pytest.mark.parametrize("interrupt", ["raise KeyboardInterrupt", "signal.raise_signal(signal.SIGINT)"])
def test_ctrl_c_ends_the_process_by_sigint_after_the_summary(tmp_path, interrupt):
    write(
        tmp_path / "interrupted.py",
        f"""\
        import atexit
        import signal
        import time

        import torch

        atexit.register(print, "atexit ran")
        print("working", torch.ones(3).sum().item())  # stdout is a pipe: buffered until exit
        {interrupt}
        time.sleep(60)
        """,
    )
    # The scripts start as from a terminal, where Ctrl-C reaches them: a shell's background job
    # starts with SIGINT ignored, and so would they (Python then installs no handler for it). A
    # handler of Python's own is reset to the default in the child at exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        plain, watched = run_both("interrupted.py", cwd=tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    # Python shuts down (atexit, flushed output), then kills itself with SIGINT: status 130.
    assert plain.returncode == watched.returncode == -signal.SIGINT
    assert watched.stdout == plain.stdout == "working 3.0\natexit ran\n"
    assert_same_traceback(plain, watched)
    assert watched.stderr.startswith("opwatch: no anomalies.\n")  # the summary, first


# --------------------------------------------------------------------------------------------
# warnings
# --------------------------------------------------------------------------------------------


def test_warnings_show_as_python_shows_them(tmp_path):
    write(
        tmp_path / "library.py",
        """\
        import warnings

        warnings.warn("hidden: a library's DeprecationWarning", DeprecationWarning)

        def old_api():
            warnings.warn("old_api is deprecated", DeprecationWarning, stacklevel=2)
        """,
    )
    write(
        tmp_path / "warns.py",
        """\
        import warnings

        import library

        warnings.warn("x")
        warnings.warn("shown: __main__'s DeprecationWarning", DeprecationWarning)
        for _ in range(3):
            warnings.warn("once per line")
        library.old_api()
        """,
    )
    plain, watched = run_both("warns.py", cwd=tmp_path)
    assert plain.returncode == 0
    assert f"{tmp_path / 'warns.py'}:5: UserWarning: x\n" in plain.stderr
    assert "shown: __main__'s DeprecationWarning" in plain.stderr and "hidden" not in plain.stderr
    assert plain.stderr.count("once per line") == 2  # the message, and the source line
    assert "warns.py:9: DeprecationWarning: old_api is deprecated" in plain.stderr
    assert_same_apart_from_the_report(plain, watched)
