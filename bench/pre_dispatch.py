"""What the pre-dispatch check costs a watch: ``watch()`` (every default check, pre_dispatch
among them) against the same watch without it, in one run, interleaved round by round.

    python -m bench.pre_dispatch --quick    # under a minute
    python -m bench.pre_dispatch            # more rounds, every workload

Reports seconds per training step of eager, the watch without pre_dispatch and the default
watch, and the paired ratio default / without (median over rounds of the same-round ratio).
Guard's and leave-on's healthy steps run no mode at all: they do not pay it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from .contenders import Contender
from .timing import measure, paired_ratio
from .workloads import WORKLOADS


def contenders() -> list[Contender]:
    import opwatch
    from opwatch.checks import DEFAULT_CHECK_NAMES

    without = [name for name in DEFAULT_CHECK_NAMES if name != "pre_dispatch"]
    return [
        Contender("eager", contextlib.nullcontext),
        Contender("watch-pre_dispatch", lambda: opwatch.watch(warn=False, checks=without), is_opwatch=True),
        Contender("watch", lambda: opwatch.watch(warn=False), is_opwatch=True),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pre_dispatch", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two workloads, few rounds")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # the machine is shared: one thread keeps the rounds comparable
    clock = time.process_time if options.clock == "cpu" else time.perf_counter
    rounds, target = (7, 0.15) if options.quick else (15, 0.5)
    workloads = [WORKLOADS[name] for name in (("tfm32", "mlp") if options.quick else WORKLOADS)]
    print(f"torch {torch.__version__}, {options.clock} clock, {rounds} rounds")
    print(f"{'workload':<16} {'eager ms':>9} {'no pd ms':>9} {'watch ms':>9} {'watch/no pd':>12}")
    for workload in workloads:
        step = workload.factory()
        found = measure(step, contenders(), rounds, target, clock=clock)
        eager, without, default = (found[name] for name in ("eager", "watch-pre_dispatch", "watch"))
        errors = [f"{m.contender.name}: {m.error}" for m in (eager, without, default) if m.error]
        if errors:
            print(f"{workload.name:<16} failed: {'; '.join(errors)}")
            continue
        ratio = paired_ratio(default, without)
        print(f"{workload.name:<16} {eager.median * 1e3:9.2f} {without.median * 1e3:9.2f} {default.median * 1e3:9.2f} {ratio:11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
