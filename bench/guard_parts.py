"""Where a healthy guarded step's own time goes, timed where it runs: python -m bench.guard_parts [ROUNDS].

The tfm32 training step runs as a guarded loop does (zero_grad, forward and backward, SGD);
in each step one part of the guard runs at its place (before the forward, or right after the
backward, when the caches are as cold as a guard finds them) and only that part is timed
(wall time, one torch thread, ROUNDS rounds of 20 steps per part, medians). The parts, timed
alone, each pay for the cold caches that in a guarded step only the first of them meets, so
they add up to more than the whole. (The look at the parameters' version counters after the
step runs only on the first call, on audits and on failing steps: it is not a part here.) Then the whole guarded call against the plain forward and
backward, alternating step by step in the same rounds: the median of the paired differences.
"""
import statistics
import sys
import time

import torch

from bench.contenders import _free_variable
from bench.workloads import WORKLOADS
from opwatch import guard

torch.set_num_threads(1)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
step = WORKLOADS["tfm32"].factory()
loss_fn = _free_variable(step, "loss_fn")
model = _free_variable(loss_fn, "model")
optimizer = _free_variable(step, "opt")
clock = time.perf_counter


def forward_backward():
    loss = loss_fn()
    loss.backward()
    return loss


guarded = guard(forward_backward, model, audit="never")
guarded()
audited = guard(forward_backward, model)  # audit="new": the signature is computed on every call
audited()
snapshots = guarded._snapshots


def before(part):
    """One step with ``part`` timed before the forward; its seconds."""
    optimizer.zero_grad(set_to_none=True)
    start = clock()
    part()
    spent = clock() - start
    forward_backward()
    optimizer.step()
    return spent


def after(part):
    """One step with ``part(loss, start)`` timed right after the backward; its seconds."""
    optimizer.zero_grad(set_to_none=True)
    kept = snapshots.take((), {})
    loss = forward_backward()
    start = clock()
    part(loss, kept)
    spent = clock() - start
    optimizer.step()
    return spent


def call(function):
    optimizer.zero_grad(set_to_none=True)
    start = clock()
    function()
    spent = clock() - start
    optimizer.step()
    return spent


parts = {
    "keeping the start": lambda: before(lambda: snapshots.take((), {})),
    "the audit's signature": lambda: before(lambda: audited._audits.wanted(2, (), {})),
    "the fused check": lambda: after(lambda loss, kept: guarded._checked(loss)),
}
times = {name: [] for name in parts}
whole = []  # guarded call - plain call, paired
for _ in range(30):  # warm-up
    step()
for _ in range(rounds):
    for name, part in parts.items():
        times[name] += [part() for _ in range(20)]
    for index in range(20):  # alternating, the order switching: paired differences
        if index % 2:
            plain = call(forward_backward)
            whole.append(call(guarded) - plain)
        else:
            spent = call(guarded)
            whole.append(spent - call(forward_backward))
print(f"tfm32 training step, {rounds} rounds of 20 steps per part, wall time, 1 thread, medians:")
for name, spent in times.items():
    print(f"  {name}: {statistics.median(spent) * 1e6:.1f} us")
print(f"  the whole guarded call - the plain forward and backward: {statistics.median(whole) * 1e6:.1f} us")
