"""``watch(fingerprints=True, compiled=BACKEND)`` against eager, in one run (issue 28 item 5):
how far inductor's and aot_eager's recorded graphs are from eager's ops, and what recording
costs over the compiled step.

    OMP_NUM_THREADS=1 python -m bench.diff_compiled            # 64-256-256-64 MLP, batch 64, CPU

Per backend: the records compared with eager ops, the eager ops not visible in the compiled run,
the largest relative gap of any statistic over the compared outputs (0: bitwise equal
statistics), and the paired ratio of a step under the recording watch to the same compiled step
with no watch (median over rounds, the two interleaved in each round; CPU time).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64))


def _largest_gap(result) -> float:
    from opwatch.runners.divergence import _gaps

    largest = 0.0
    prints_a, prints_b = result._prints
    for record, other in result.pairs:
        if record is None or other is None:
            continue
        for x, y in zip(prints_a.get(record.index) or (), prints_b.get(other.index) or ()):
            if x is not None and y is not None:
                for gap, scale in _gaps(x, y):
                    largest = max(largest, gap / scale if scale else (0.0 if not gap else float("inf")))
    return largest


def main(argv=None) -> int:
    import opwatch

    parser = argparse.ArgumentParser(prog="python -m bench.diff_compiled", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per lane per round")
    options = parser.parse_args(argv)
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); 64-256-256-64 MLP, batch 64, SGD")
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        model = _model()
        eager_model, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
        with opwatch.watch(fingerprints=True, warn=False) as eager:
            train_step(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.01), x, y)
        step = torch.compile(train_step)
        optimizer = torch.optim.SGD(compiled_model.parameters(), lr=0.01)
        with opwatch.watch(fingerprints=True, warn=False, compiled=backend) as compiled:
            step(compiled_model, optimizer, x, y)
        result = opwatch.diff(compiled, eager)
        # Timing: the compiled step alone against the compiled step under the recording watch.
        step(compiled_model, optimizer, x, y)  # warm outside
        ratios = []
        for _ in range(options.rounds):
            lanes = {}
            for lane in ("compiled", "recorded"):
                start = time.process_time()
                for _ in range(options.steps):
                    if lane == "compiled":
                        step(compiled_model, optimizer, x, y)
                    else:
                        with opwatch.watch(fingerprints=True, warn=False, compiled=backend):
                            step(compiled_model, optimizer, x, y)
                lanes[lane] = (time.process_time() - start) / options.steps
            ratios.append(lanes["recorded"] / lanes["compiled"])
        print(
            f"{backend:>10}: agree={result.agree}, {result.compared} records compared, {result.not_visible} eager ops not visible, "
            f"largest relative gap {_largest_gap(result):.2g}; recorded step / compiled step: median {statistics.median(ratios):.2f}x "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
