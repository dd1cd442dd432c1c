"""A guarded and a left-on compiled step against the compiled step, interleaved in one
process: python -m bench.compiled [ROUNDS] [--backend inductor|eager] [--width N].

One small MLP (64 -> N -> N -> 64, N = 256 by default, batch 64), compiled once (inductor on
CPU by default); the guard's cost per step is fixed, so its share falls as ``--width`` grows;
four lanes step it, each step being ``zero_grad``, the forward and backward, ``optimizer.step()``:

- ``compiled``: the compiled step as it is;
- ``guard``: ``opwatch.guard(step, model)`` around the forward and backward (its first call, the
  audit, runs eagerly under a full watch and is made before the timing);
- ``check's kernel``: the compiled step, then GradScaler's kernel over the gradients and one read
  of its flag, with no opwatch at all: the floor of any check of every gradient;
- ``leave-on``: ``python -m opwatch --guard``'s runner (``LeaveOn``), its first step audited
  before the timing; its fused gradient check runs in the optimizer's pre-hook. Its hooks are
  global, so the run is entered around each of this lane's steps only (registering and removing
  two hooks, a few microseconds, counted in the lane).

The lanes alternate step by step, their order rotating each round, so that the machine's
drifts hit all alike; each step is timed alone in process CPU time, one torch thread. A round
is ``STEPS`` steps of each lane; its ratio is a lane's sum over the compiled lane's; the figure
is the median of the rounds' ratios (and their range). Also printed: whether the compiled code
still ran after the audits (the grad_fn of the forward's output) and Dynamo's unique graphs
before and after (no recompile).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
import warnings

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
    width = int(args[args.index("--width") + 1]) if "--width" in args else 256
    opwatch, status = load_opwatch()
    if opwatch is None:
        sys.exit(status)
    print(status)
    from torch._dynamo.utils import counters

    from opwatch.runners.leave_on import LeaveOn

    warnings.simplefilter("ignore", opwatch.OpwatchWarning)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 64))
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(64, 64)
    target = torch.randn(64, 64)
    grad_fns = []

    def forward_backward(x, y):
        out = compiled(x)
        grad_fns.append(type(out.grad_fn).__name__)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        return loss

    guarded = opwatch.guard(forward_backward, model)
    left_on = LeaveOn(audit="manual", file=open(os.devnull, "w"))

    def plain_step():
        optimizer.zero_grad()
        forward_backward(batch, target)
        optimizer.step()

    def guarded_step():
        optimizer.zero_grad()
        guarded(batch, target)
        optimizer.step()

    # The floor of any check of a step's gradients, with no opwatch at all: GradScaler's kernel
    # over them (the guard's and leave-on's check) and one read of its flag.
    found, one = torch.zeros(1), torch.ones(1)
    params = list(model.parameters())

    def kernel_step():
        optimizer.zero_grad()
        loss = forward_backward(batch, target)
        torch._amp_foreach_non_finite_check_and_unscale_([param.grad for param in params], found, one)
        if found.item() != 0 or not math.isfinite(loss.item()):
            raise RuntimeError("the benchmark's step made nan/inf")
        optimizer.step()

    def left_on_step():
        with left_on:
            optimizer.zero_grad()
            forward_backward(batch, target)
            optimizer.step()

    started = clock()
    plain_step()  # the compile
    guarded_step()  # the guard's audit
    with left_on:  # leave-on's audit
        left_on.start_audit()
        optimizer.zero_grad()
        forward_backward(batch, target)
        optimizer.step()
    for lane in (plain_step, kernel_step, guarded_step, left_on_step):
        lane()
    print(f"compile and warm-up: {clock() - started:.1f} s CPU; backend {backend}; width {width}; forward grad_fn after the audits: {grad_fns[-1]}")
    graphs = counters["stats"]["unique_graphs"]

    lanes = {"compiled": plain_step, "check's kernel": kernel_step, "guard": guarded_step, "leave-on": left_on_step}
    ratios: dict = {"check's kernel": [], "guard": [], "leave-on": []}
    names = list(lanes)
    for round_ in range(rounds):
        totals = dict.fromkeys(lanes, 0.0)
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for _ in range(STEPS):
            for name in order:
                begin = clock()
                lanes[name]()
                totals[name] += clock() - begin
        for name in ratios:
            ratios[name].append(totals[name] / totals["compiled"])
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {1e3 * total / STEPS:.3f} ms/step" for name, total in totals.items())
              + "; ratios " + ", ".join(f"{name} {values[-1]:.3f}" for name, values in ratios.items()))
    for name, values in ratios.items():
        print(f"{name} compiled step / compiled step: median {statistics.median(values):.3f}x over {rounds} rounds of {STEPS} steps "
              f"(range {min(values):.3f}-{max(values):.3f})")
    print(f"guard's audits {guarded.audits}; leave-on's failures {len(left_on.failures)}; unique graphs {graphs} -> "
          f"{counters['stats']['unique_graphs']}; grad_fn of the last step: {grad_fns[-1]}")


if __name__ == "__main__":
    main()
