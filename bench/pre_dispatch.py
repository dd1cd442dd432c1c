"""What the pre-dispatch check costs a watch: ``watch()`` (every default check, pre_dispatch
among them) against the same watch without it, in one run, interleaved round by round.

    python -m bench.pre_dispatch --quick    # under a minute
    python -m bench.pre_dispatch            # more rounds, every workload

Reports seconds per training step of eager, eager under a bare ``TorchFunctionMode`` (its
handler only calls the function: what torch itself charges for a function mode on the stack,
the part no handler can save), the watch without pre_dispatch and the default watch; the paired
ratios default / without and bare mode / eager (medians over rounds of the same-round ratio),
and the two differences in ms a step. Guard's and leave-on's healthy steps run no mode at all:
they do not pay it.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

from .contenders import Contender
from .timing import measure, quick_or_full, paired_difference, paired_ratio
from .workloads import WORKLOADS


class BareFunctionMode(TorchFunctionMode):
    """A function mode that only calls the function: torch's own cost of a function mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)


def contenders() -> list[Contender]:
    import opwatch
    from opwatch.checks import DEFAULT_CHECK_NAMES

    without = [name for name in DEFAULT_CHECK_NAMES if name != "pre_dispatch"]
    return [
        Contender("eager", contextlib.nullcontext),
        Contender("bare function mode", BareFunctionMode),
        Contender("watch-pre_dispatch", lambda: opwatch.watch(warn=False, checks=without), is_opwatch=True),
        Contender("watch", lambda: opwatch.watch(warn=False), is_opwatch=True),
    ]


def main(argv: list[str] | None = None) -> int:
    options, clock = quick_or_full("python -m bench.pre_dispatch", __doc__.splitlines()[0], "two workloads, few rounds", argv)
    rounds, target = (7, 0.15) if options.quick else (15, 0.5)
    workloads = [WORKLOADS[name] for name in (("tfm32", "mlp") if options.quick else WORKLOADS)]
    print(f"torch {torch.__version__}, {options.clock} clock, {rounds} rounds")
    print(f"{'workload':<16} {'eager ms':>9} {'bare fm ms':>10} {'no pd ms':>9} {'watch ms':>9} {'watch/no pd':>12} {'bare/eager':>11} {'+pd ms':>7} {'+bare ms':>9}")
    for workload in workloads:
        step = workload.factory()
        found = measure(step, contenders(), rounds, target, clock=clock)
        eager, bare, without, default = (found[name] for name in ("eager", "bare function mode", "watch-pre_dispatch", "watch"))
        errors = [f"{m.contender.name}: {m.error}" for m in (eager, bare, without, default) if m.error]
        if errors:
            print(f"{workload.name:<16} failed: {'; '.join(errors)}")
            continue
        ratio, bare_ratio = paired_ratio(default, without), paired_ratio(bare, eager)
        added, bare_added = paired_difference(default, without) * 1e3, paired_difference(bare, eager) * 1e3
        print(f"{workload.name:<16} {eager.median * 1e3:9.2f} {bare.median * 1e3:10.2f} {without.median * 1e3:9.2f} {default.median * 1e3:9.2f} "
              f"{ratio:11.2f}x {bare_ratio:10.2f}x {added:7.3f} {bare_added:9.3f}")
    print("+pd ms: what pre_dispatch adds to a watched step; +bare ms: what a bare function mode adds to an eager one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
