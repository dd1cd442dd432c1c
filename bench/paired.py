"""watch() of this tree against watch() of an earlier git revision, in one process.

The earlier revision's ``opwatch`` package is extracted with ``git archive`` into a temporary
folder and imported as ``opwatch_old`` (its absolute ``opwatch`` imports rewritten), so both
run side by side on the same workload, interleaved round by round with the rotation and the
per-round ratios of :mod:`bench.timing`. It prints ``new/old`` per workload: a refactor that
costs nothing shows ratios within the noise of 1.00x.

    python -m bench.paired --old 5146b65                 # tfm32, mlp, gpt2
    python -m bench.paired --old HEAD~3 --workloads tfm32 --rounds 21
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pathlib
import re
import subprocess
import sys
import tempfile

import torch

from .contenders import Contender, Passthrough
from .timing import measure
from .workloads import WORKLOADS, add_paired_options, chosen_workloads

OLD_NAME = "opwatch_old"


def extract(revision: str, into: pathlib.Path) -> None:
    """``opwatch/`` of ``revision`` as the package ``opwatch_old`` under ``into``."""
    archive = subprocess.run(["git", "archive", revision, "opwatch"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "opwatch").rename(into / OLD_NAME)
    for path in (into / OLD_NAME).rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\b(import|from) opwatch\b", rf"\1 {OLD_NAME}", text)
        text = text.replace("sys.modules['opwatch']", f"sys.modules['{OLD_NAME}']")
        path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the git revision to compare against (e.g. 5146b65)")
    add_paired_options(parser, workloads="tfm32,mlp,gpt2", target_seconds=0.1)
    args = parser.parse_args(argv)
    names = chosen_workloads(parser, args.workloads)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        extract(args.old, pathlib.Path(folder))
        sys.path.insert(0, folder)
        old = importlib.import_module(OLD_NAME)
        import opwatch as new

        contenders = [
            Contender("passthrough", Passthrough),
            Contender("old watch()", lambda: old.watch(warn=False), is_opwatch=True),
            Contender("new watch()", lambda: new.watch(warn=False), is_opwatch=True),
        ]
        print(f"new = this tree, old = {args.old}; {args.rounds} interleaved rounds, CPU time")
        print(f"{'workload':10} {'old/pass':>9} {'new/pass':>9} {'new/old':>8}  spread(old, new)")
        for name in names:
            step = WORKLOADS[name].factory()
            results = measure(step, contenders, args.rounds, args.target_seconds)
            base, before, after = (results[c.name] for c in contenders)
            for m in (base, before, after):
                if m.error:
                    print(f"{name:10} {m.contender.name} failed: {m.error}")
                    break
            else:
                per_round = sorted(a / b for a, b in zip(after.seconds, before.seconds))
                new_over_old = per_round[len(per_round) // 2]
                print(
                    f"{name:10} {before.median / base.median:8.2f}x {after.median / base.median:8.2f}x "
                    f"{new_over_old:7.2f}x  ({before.spread:.0%}, {after.spread:.0%})"
                )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
