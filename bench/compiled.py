"""A guarded compiled step against the compiled step, interleaved in one process:
python -m bench.compiled [ROUNDS] [--backend inductor|eager].

One small MLP (64 -> 256 -> 256 -> 64, batch 64), compiled once (inductor on CPU by default);
two lanes step it: the compiled step as it is, and ``opwatch.guard(step, model)`` around the
same step (its first call, the audit, runs eagerly under a full watch and is made before the
timing; the figures are healthy steps). The lanes alternate step by step, the order flipping
each round, so that the machine's drifts hit both alike; each step is timed alone in process
CPU time, one torch thread. A round is ``STEPS`` steps of each lane; its ratio is the guarded
lane's sum over the compiled lane's; the figure is the median of the rounds' ratios (and their
range). Also printed: whether the compiled code still ran after the guard's audit (the grad_fn
of the forward's output) and Dynamo's unique graphs before and after (no recompile).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

from bench.contenders import load_opwatch

STEPS = 50
torch.set_num_threads(1)
clock = time.process_time


def main() -> None:
    args = sys.argv[1:]
    rounds = int(args[0]) if args[:1] and args[0].isdigit() else 5
    backend = args[args.index("--backend") + 1] if "--backend" in args else "inductor"
    opwatch, status = load_opwatch()
    if opwatch is None:
        sys.exit(status)
    print(status)
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(64, 64)
    target = torch.randn(64, 64)
    grad_fns = []

    def step(x, y):
        out = compiled(x)
        grad_fns.append(type(out.grad_fn).__name__)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        return loss

    guarded = opwatch.guard(step, model)
    started = clock()
    for lane in (step, guarded, step, guarded):  # the compile, then the guard's audit
        optimizer.zero_grad()
        lane(batch, target)
        optimizer.step()
    print(f"compile and warm-up: {clock() - started:.1f} s CPU; backend {backend}; forward grad_fn after the audit: {grad_fns[-1]}")
    graphs = counters["stats"]["unique_graphs"]

    ratios = []
    for round_ in range(rounds):
        totals = {step: 0.0, guarded: 0.0}
        order = (step, guarded) if round_ % 2 == 0 else (guarded, step)
        for _ in range(STEPS):
            for lane in order:
                optimizer.zero_grad()
                begin = clock()
                lane(batch, target)
                totals[lane] += clock() - begin
                optimizer.step()
        ratios.append(totals[guarded] / totals[step])
        print(f"round {round_ + 1}: compiled {1e3 * totals[step] / STEPS:.3f} ms/step, guarded {1e3 * totals[guarded] / STEPS:.3f} ms/step, ratio {ratios[-1]:.3f}")
    print(
        f"guarded compiled step / compiled step: median {statistics.median(ratios):.3f}x over {rounds} rounds of {STEPS} steps "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); audits {guarded.audits}; unique graphs {graphs} -> {counters['stats']['unique_graphs']}; "
        f"grad_fn of the last step: {grad_fns[-1]}"
    )


if __name__ == "__main__":
    main()
