"""The watch against ``detect_anomaly(check_nan=True)`` with the training step called from deeper
in the program, in one run, interleaved round by round.

    python -m bench.call_depth --quick    # the MLP and the conv net, depths 0 and 30
    python -m bench.call_depth            # every workload, depths 0, 10, 20 and 30

Anomaly mode keeps the Python stack of every forward op that makes an autograd node, so its cost
grows with how deep the step runs; the watch keeps one frame per op (the user's line, found
from the innermost module call), whatever the depth. ``bench.run`` calls each step from a few
frames below the top; a training loop inside a framework runs deeper (a model's ``forward``
called from Lightning's ``fit`` is about 30 frames below the script, from the Hugging Face
Trainer's ``train`` about 9). Each depth adds that many plain Python frames around the step.
Reports, per workload and depth, the two contenders' ms a step and the paired ratio
detect_anomaly / watch (median over rounds of the same-round ratio; above 1: the watch costs
less).
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch

from .contenders import Contender
from .timing import measure, quick_or_full, paired_ratio
from .workloads import WORKLOADS, Step


def at_depth(step: Step, depth: int) -> Step:
    """``step`` called from ``depth`` more Python frames (``depth`` >= 0)."""
    if depth < 0:
        raise ValueError(f"depth must be 0 or more, got {depth}")

    def down(levels: int) -> None:
        if levels:
            down(levels - 1)
        else:
            step()

    return lambda: down(depth)


def contenders() -> list[Contender]:
    import opwatch

    return [
        Contender("watch", lambda: opwatch.watch(warn=False), is_opwatch=True),
        Contender("detect_anomaly", lambda: torch.autograd.detect_anomaly(check_nan=True)),
    ]


def main(argv: list[str] | None = None) -> int:
    options, clock = quick_or_full("python -m bench.call_depth", __doc__.splitlines()[0], "the MLP and the conv net, depths 0 and 30, few rounds", argv)
    warnings.simplefilter("ignore")  # detect_anomaly warns on every entry
    rounds, target = (7, 0.15) if options.quick else (15, 0.3)
    names = ("mlp", "conv") if options.quick else tuple(WORKLOADS)
    depths = (0, 30) if options.quick else (0, 10, 20, 30)
    print(f"torch {torch.__version__}, {options.clock} clock, {rounds} rounds")
    print(f"{'workload':<10} {'depth':>6} {'watch ms':>9} {'anomaly ms':>11} {'anomaly/watch':>14}")
    for name in names:
        step = WORKLOADS[name].factory()
        for depth in depths:
            found = measure(at_depth(step, depth), contenders(), rounds, target, clock=clock)
            watch, anomaly = found["watch"], found["detect_anomaly"]
            errors = [f"{m.contender.name}: {m.error}" for m in (watch, anomaly) if m.error]
            if errors:
                print(f"{name:<10} {depth:>6} failed: {'; '.join(errors)}")
                continue
            print(f"{name:<10} {depth:>6} {watch.median * 1e3:9.2f} {anomaly.median * 1e3:11.2f} {paired_ratio(anomaly, watch):13.2f}x")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
