"""opwatch.guard with audits over 200-step runs of the tfm32 step vs eager and vs a guard that
never audits, interleaved step by step: python -m bench.guard_audits [ROUNDS].

Three lanes train three identical copies of the d_model-32 transformer (same seed, same
batch): eager; ``guard(forward_backward, model)`` (``audit="new"``, the default); and
``guard(..., audit="never")``; the optimizer step outside the guard, as the docs show. A round
is a 200-step run of each lane with a guard made fresh at its start (made inside the first
step's timing, so each run bills its one audit, as a 200-step training run does). The lanes'
steps alternate one by one, in every order of the lanes in turn, so that the machine's drifts,
which on a small shared machine move a step's time by 10% within seconds, hit the three lanes
alike, and each lane follows each other lane as often (a fixed rotation would have one guarded
lane always run right after the other, with the guard's code still in the caches). Every step
thus runs with the caches the lane before it left; a training loop's steps follow their own,
so the guard's figures here, if anything, are a little high.
Each step is timed alone in process CPU time (one torch thread); a round's ratio is the sum
of a lane's 200 steps over the eager lane's; the figure is the median of the rounds' ratios.
"""
import gc
import itertools
import statistics
import subprocess
import sys
import time

import torch

from bench.contenders import _free_variable, load_opwatch
from bench.workloads import WORKLOADS

STEPS = 200  # steps of one run: one fresh guard, one audit
torch.set_num_threads(1)
opwatch, status = load_opwatch()
rounds = int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 5
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


if sys.argv[1:] == ["--first-audit"]:
    # Run in a fresh process (below): its first audit also pays what a process pays once
    # (opwatch's lazy imports, per-op facts read once); the bench's rounds, in a warm process, do not.
    lane = Lane("first", "new")
    lane.audit = None
    for _ in range(5):
        lane.start_run()
        lane.step()
    audits = []
    for _ in range(3):
        guarded = opwatch.guard(lane.forward_backward, lane.model)
        start = clock()
        lane.optimizer.zero_grad(set_to_none=True)
        guarded()
        lane.optimizer.step()
        audits.append(clock() - start)
    lane.totals.clear()
    for _ in range(20):
        lane.start_run()
        lane.step()
    step = statistics.median(lane.totals)
    print(f"  in a fresh process: its first audited step costs {audits[0] / step:.1f} eager steps, the next two (fresh guards) {audits[1] / step:.1f} and {audits[2] / step:.1f}")
    sys.exit(0)

lanes = [Lane("eager", None), Lane("guard(audit='new')", "new"), Lane("guard(audit='never')", "never")]
eager, audited, never = lanes
# Every order of the lanes in turn: each lane follows each other lane as often, so none is
# favoured by the code and data the one before it left in the caches.
orders = list(itertools.permutations(lanes))
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
        for lane in orders[index % len(orders)]:
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
print(subprocess.run([sys.executable, "-m", "bench.guard_audits", "--first-audit"], capture_output=True, text=True, timeout=300).stdout.rstrip())
