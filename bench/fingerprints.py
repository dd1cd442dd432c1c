"""What ``watch(fingerprints=True)`` costs: the same watch with and without fingerprints, in one
run, interleaved round by round (issue 19).

    python -m bench.fingerprints --quick    # under a minute
    python -m bench.fingerprints            # more rounds, every workload

Reports seconds per training step of eager, ``watch()`` and ``watch(fingerprints=True)`` and
the paired ratio fingerprints / plain watch (median over rounds of the same-round ratio). CPU
time by default (``--clock wall`` for wall time, e.g. on a GPU, where it includes the kernels
the fingerprints queue).
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

    return [
        Contender("eager", contextlib.nullcontext),
        Contender("watch", lambda: opwatch.watch(warn=False), is_opwatch=True),
        Contender("watch+fingerprints", lambda: opwatch.watch(warn=False, fingerprints=True), is_opwatch=True),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fingerprints", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two workloads, few rounds")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--device", default="cpu", help="the device the workloads run on (cpu, cuda)")
    options = parser.parse_args(argv)
    torch.set_default_device(options.device)
    torch.set_num_threads(1)  # the machine is shared: one thread keeps the rounds comparable
    clock = time.process_time if options.clock == "cpu" else time.perf_counter
    rounds, target = (7, 0.15) if options.quick else (15, 0.5)
    workloads = [WORKLOADS[name] for name in (("tfm32", "mlp") if options.quick else WORKLOADS)]
    print(f"torch {torch.__version__}, device {options.device}, {options.clock} clock, {rounds} rounds")
    print(f"{'workload':<16} {'eager ms':>9} {'watch ms':>9} {'+fp ms':>9} {'fp/watch':>9}")
    for workload in workloads:
        step = workload.factory()
        found = measure(step, contenders(), rounds, target, clock=clock)
        eager, plain, printed = (found[name] for name in ("eager", "watch", "watch+fingerprints"))
        errors = [f"{m.contender.name}: {m.error}" for m in (eager, plain, printed) if m.error]
        if errors:
            print(f"{workload.name:<16} failed: {'; '.join(errors)}")
            continue
        ratio = paired_ratio(printed, plain)
        print(f"{workload.name:<16} {eager.median * 1e3:9.2f} {plain.median * 1e3:9.2f} {printed.median * 1e3:9.2f} {ratio:9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
