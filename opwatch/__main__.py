"""``python -m opwatch``: run a script under a watch, the way ``python -m cProfile`` does.

    python -m opwatch [--strict] [--last N] script.py [args...]
    python -m opwatch demo
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback

from .watch import strict, watch

DEMO_STORIES = (
    ("device_mix", "a tensor on the wrong device, then a mask of the wrong dtype (TorchSnooper example 1)"),
    ("broadcast_loss", "a (4,) target minus a (4, 1) prediction: the loss silently becomes (4, 4) (example 2)"),
    ("log_zero", "log(0) turns into inf in forward, and into nan in backward (example 3)"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m opwatch",
        description="Run a Python script with every PyTorch op watched; print the anomalies found "
        "and, if the script fails, the last ops before the failure. 'demo' runs the built-in demo.",
    )
    parser.add_argument("--strict", action="store_true", help="stop the script at the first anomaly")
    parser.add_argument("--last", type=int, default=20, metavar="N", help="ops shown when the script fails (default 20)")
    parser.add_argument("script", help="the script to run, or 'demo'")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    options = parser.parse_args(argv)
    if options.last < 0:
        parser.error("--last must be 0 or more")
    if options.script == "demo" and not os.path.exists("demo"):
        return run_demo(last=options.last)
    if not os.path.isfile(options.script):
        parser.error(f"no such script: {options.script}")
    return run_script(options.script, options.args, strict_mode=options.strict, last=options.last)


def run_script(path: str, args: list[str], *, strict_mode: bool = False, last: int = 20, out=None) -> int:
    """Run ``path`` as ``__main__`` under a watch; print the summary. Returns an exit code."""
    out = out if out is not None else sys.stderr
    make_watch = strict if strict_mode else watch
    saved_argv, saved_path = sys.argv, sys.path[:]
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    code = 0
    w = make_watch(warn=False, last=last, file=out)
    try:
        with w:
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException as error:
        print_user_traceback(error, out)
        code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    print(w.summary(), file=out)
    return code


def print_user_traceback(error: BaseException, out) -> None:
    """The traceback as Python prints it, without the frames of opwatch and runpy."""
    report = traceback.TracebackException.from_exception(error)
    skip = os.path.dirname(os.path.abspath(__file__)) + os.sep
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if not frame.filename.startswith(skip) and "runpy" not in frame.filename]
    )
    print("".join(report.format()), end="", file=out)


def run_demo(*, last: int = 20) -> int:
    """Run the embedded example scripts (real bugs) and show what opwatch reports."""
    from . import examples

    folder = os.path.dirname(examples.__file__)
    for number, (name, story) in enumerate(DEMO_STORIES, 1):
        print(f"\n=== story {number}: {story}", flush=True)
        print(f"    (opwatch/examples/{name}.py)\n", flush=True)
        run_script(os.path.join(folder, f"{name}.py"), [], last=last, out=sys.stdout)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
