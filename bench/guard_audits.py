"""opwatch.guard with audits over 200-step runs of the tfm32 step vs eager and vs a guard that
never audits, interleaved step by step: python -m bench.guard_audits [ROUNDS].

Three lanes train three identical copies of the d_model-32 transformer (same seed, same
batch): eager; ``guard(forward_backward, model)`` (``audit="new"``, the default); and
``guard(..., audit="never")``; the optimizer step outside the guard, as the docs show. A round
is a 200-step run of each lane with a guard made fresh at its start (made inside the first
step's timing, so each run bills its one audit, as a 200-step training run does). The lanes'
steps alternate one by one (the order rotating each step), so that the machine's drifts, which
on a small shared machine move a step's time by 10% within seconds, hit the three lanes alike.
Each step is timed alone in process CPU time (one torch thread); a round's ratio is the sum
of a lane's 200 steps over the eager lane's; the figure is the median of the rounds' ratios.
"""
import gc
import statistics
import sys
import time

import torch

from bench.contenders import _free_variable, load_opwatch
from bench.workloads import WORKLOADS

STEPS = 200  # steps of one run: one fresh guard, one audit
torch.set_num_threads(1)
opwatch, status = load_opwatch()
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
clock = time.process_time


class Lane:
    """One copy of the workload's model, stepped eager or guarded."""

    def __init__(self, name, audit):
        self.name = name
        self.audit = audit  # None: eager
        step = WORKLOADS["tfm32"].factory()  # seeded: every lane builds the same model
        self.loss_fn = _free_variable(step, "loss_fn")
        self.model = _free_variable(self.loss_fn, "model")
        self.optimizer = _free_variable(step, "opt")
        self.call = None
        self.totals = []

    def forward_backward(self):
        loss = self.loss_fn()
        loss.backward()
        return loss

    def start_run(self):
        self.call = None
        self.totals.append(0.0)

    def step(self):
        start = clock()
        if self.call is None:  # the run's first step makes its guard
            self.call = self.forward_backward if self.audit is None else opwatch.guard(self.forward_backward, self.model, audit=self.audit)
        self.optimizer.zero_grad(set_to_none=True)
        self.call()
        self.optimizer.step()
        self.totals[-1] += clock() - start


lanes = [Lane("eager", None), Lane("guard(audit='new')", "new"), Lane("guard(audit='never')", "never")]
eager, audited, never = lanes
for lane in lanes:  # warm-up, then put every lane back on the same footing
    for _ in range(20):
        lane.start_run()
        lane.step()
    lane.totals.clear()
for _ in range(rounds):
    gc.collect(1)
    for lane in lanes:
        lane.start_run()
    for index in range(STEPS):
        turn = index % len(lanes)
        for lane in lanes[turn:] + lanes[:turn]:
            lane.step()
    assert all(guarded.call.calls == STEPS for guarded in (audited, never)) and audited.call.audits == 1


def ratio(lane, base):
    return statistics.median(a / b for a, b in zip(lane.totals, base.totals))


print(f"opwatch: {status}")
print(f"tfm32, {rounds} rounds of {STEPS}-step runs, lanes interleaved step by step, process CPU time, 1 thread:")
for lane in lanes:
    print(f"  {lane.name}: median {statistics.median(lane.totals) / STEPS * 1e3:.3f} ms/step")
print(f"  guard(audit='new') / eager = {ratio(audited, eager):.3f}x (the run's one audit included)")
print(f"  guard(audit='never') / eager = {ratio(never, eager):.3f}x")
print(f"  guard(audit='new') / guard(audit='never') = {ratio(audited, never):.3f}x (the audit's share)")
print("  per-round new/eager: " + " ".join(f"{a / b:.3f}" for a, b in zip(audited.totals, eager.totals)))
