"""Where a healthy guarded step's own time goes: python -m bench.guard_parts [ROUNDS].

A stand-in for tfm32's forward and backward that only sets the 24 gradients (kept from one
real backward) is timed guarded and unguarded, interleaved with the guard's parts: keeping the
start, the check that the parameters were left alone, the audit's signature, the fused check and its parts
(GradScaler's kernel and the host read; then with the loss's largest magnitude), ROUNDS rounds
of 100 calls, medians of per-round differences from the unguarded stand-in (wall time, one
torch thread). What it leaves out: the colder caches after a real backward.
"""
import math
import statistics
import sys
import time

import torch

from bench.contenders import _free_variable
from bench.workloads import WORKLOADS
from opwatch.compat import amp_non_finite_check
from opwatch.guard import guard

torch.set_num_threads(1)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 120
step = WORKLOADS["tfm32"].factory()
loss_fn = _free_variable(step, "loss_fn")
model = _free_variable(loss_fn, "model")
loss = loss_fn()
loss.backward()
params = list(model.parameters())
kept = [param.grad for param in params]
found, one = torch.zeros(1), torch.ones(1)


def stand_in():
    for param, grad in zip(params, kept):
        param.grad = grad
    return loss


def unset():
    for param in params:
        param.grad = None


guarded = guard(stand_in, model, audit="never")
guarded()
snapshot = guarded._snapshots.take((), {})
audits = guard(stand_in, model)._audits  # audit="new": the signature is computed on every call


def kernel():
    grads = [grad for grad in [param.grad for param in params] if grad is not None]
    amp_non_finite_check(grads, found, one)
    found.item()


def kernel_and_loss():
    grads = [grad for grad in [param.grad for param in params] if grad is not None]
    with torch.no_grad():
        amp_non_finite_check(grads + [torch.linalg.vector_norm(loss, math.inf)], found, one)
        found.item()


parts = {
    "unguarded": lambda: (unset(), stand_in()),
    "guarded": lambda: (unset(), guarded()),
    "keeping the start": lambda: (unset(), guarded._snapshots.take((), {}), stand_in()),
    "the parameters left alone": lambda: (unset(), stand_in(), guarded._snapshots.changed_parameters(snapshot)),
    "the audit's signature": lambda: (unset(), stand_in(), audits.wanted(2, (), {})),
    "the fused check": lambda: (unset(), stand_in(), guarded._finite.all_finite(loss, params)),
    "  kernel + host read": lambda: (unset(), stand_in(), kernel()),
    "  + the loss's magnitude": lambda: (unset(), stand_in(), kernel_and_loss()),
}
times = {name: [] for name in parts}
for _ in range(rounds):
    for name, part in parts.items():
        start = time.perf_counter()
        for _ in range(100):
            part()
        times[name].append((time.perf_counter() - start) / 100)
base = times["unguarded"]
print(f"tfm32 stand-in step, {rounds} interleaved rounds of 100 calls, medians of per-round differences, 1 thread:")
for name in list(parts)[1:]:
    print(f"  {name}: {statistics.median(a - b for a, b in zip(times[name], base)) * 1e6:.1f} us")
