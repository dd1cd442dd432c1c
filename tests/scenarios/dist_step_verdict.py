"""The verdict of a DDP step from its reduced gradients, for tests/runners/test_step_verdict.py:
gloo ranks started by torch.multiprocessing (support.distributed.spawn).

Each case trains a small classifier wrapped in DDP (AdamW, clip 1.0, as nanoGPT does) under
leave-on or guard(), counts the collectives opwatch's own code calls at every step (DDP's
reducer runs its all-reduce in C++, the loop calls none: every Python-level collective is
opwatch's), and writes the counts, the steps' fates and the weights.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import opwatch
from opwatch.runners.leave_on import LeaveOn
from dist_cases import _mesh, run_cases

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor", "barrier", "all_gather_object")


class Collectives:
    """Counts the Python-level collectives called while it is entered: torch.distributed's, and
    the functional all-reduce DTensor reduces a partial value with (FSDP2's clip norm)."""

    def __init__(self):
        self.calls = 0
        self._saved = []

    def __enter__(self):
        import torch.distributed._functional_collectives as funcol

        for module, name in [(dist, name) for name in _COLLECTIVES] + [(funcol, "all_reduce")]:
            original = getattr(module, name)
            self._saved.append((module, name, original))

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            setattr(module, name, counted)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        return False


class _Plain:
    """What ``_loop`` reads of a run with no opwatch."""

    failures, skipped, policy = [], 0, None

    def know(self, model):
        pass

    def start_audit(self):
        pass


def _model():
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)))


def _fsdp2(world):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    mesh = _mesh(world)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batch(rank, step, *, ignored=False):
    generator = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(6, 4, generator=generator), torch.randint(0, 3, (6,), generator=generator)
    return x, torch.full_like(y, -100) if ignored else y


def _forward(model, x, y, make_nan):
    logits = model(x)
    if make_nan:
        logits = logits + (logits[:, :1] - 1e4).sqrt()  # nan on this rank only
    return F.cross_entropy(logits, y)


def _loop(rank, *, steps=6, nan_at=None, loss_nan_at=None, model=None, clip=True, guarded=True):
    """Leave-on over a DDP loop (or ``model``'s): rank 1 makes nan at ``nan_at``; its batch has
    every label ignored at ``loss_nan_at`` (its loss is 0/0 = nan, its gradients zero).
    ``guarded=False``: the same loop with no opwatch (its own collectives counted alike)."""
    model = _model() if model is None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_step, norms = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with LeaveOn(audit="manual", on_failure="skip", warn=False) if guarded else contextlib.nullcontext(_Plain()) as run:
            run.know(model)
            for step in range(1, steps + 1):
                if step == 1:
                    run.start_audit()  # the first step under the full watch, as the trainers do
                x, y = _batch(rank, step, ignored=rank == 1 and step == loss_nan_at)
                with Collectives() as counted:
                    loss = _forward(model, x, y, rank == 1 and step == nan_at)
                    loss.backward()
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) if clip else None
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                per_step.append(counted.calls)
                norms.append(None if norm is None else float(_full(norm)))  # outside the count: a partial norm's full_tensor() reduces
    return {
        "collectives": per_step,
        "norms": norms,
        "failed": [failure.step for failure in run.failures],
        "skipped": run.skipped,
        "source": run.policy.verdict.source if guarded else None,
        "weights": [float(_full(parameter).double().sum()) for parameter in model.parameters()],
        "warned": [str(w.message) for w in caught if isinstance(w.message, opwatch.OpwatchWarning)],
    }


def _full(parameter):
    parameter = parameter.detach()
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


def fsdp2_leave_on(rank, world):
    """FSDP2: each rank holds its own shards; the clip's norm, reduced across the ranks by the
    clip's own all-reduce, stands for all of them: the same verdict on every rank."""
    return _loop(rank, nan_at=3, model=_fsdp2(world))


def fsdp2_plain(rank, world):
    """The same FSDP2 loop with no opwatch: the collectives the program makes itself."""
    return _loop(rank, model=_fsdp2(world), guarded=False)


def fsdp2_no_clip(rank, world):
    """FSDP2 without a clip: opwatch's one small all-reduce a step decides (each rank's fused
    pass over its shards)."""
    return _loop(rank, nan_at=3, model=_fsdp2(world), clip=False)


def leave_on_healthy(rank, world):
    return _loop(rank)


def leave_on_nan(rank, world):
    return _loop(rank, nan_at=3)


def leave_on_loss_nan(rank, world):
    return _loop(rank, loss_nan_at=3)


def guard_healthy(rank, world):
    """guard() over a DDP step that clips: no collective of opwatch's after the first call."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(x, y):
        loss = _forward(model, x, y, False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    step = opwatch.guard(train_step, model)
    per_step = []
    for call in range(1, 5):
        x, y = _batch(rank, call)
        with Collectives() as counted:
            step(x, y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_step.append(counted.calls)
    return {"collectives": per_step, "source": step.policy.verdict.source,
            "weights": [float(parameter.detach().double().sum()) for parameter in model.parameters()]}


CASES = {"fsdp2_leave_on": fsdp2_leave_on, "fsdp2_plain": fsdp2_plain, "fsdp2_no_clip": fsdp2_no_clip, "leave_on_healthy": leave_on_healthy, "leave_on_nan": leave_on_nan, "leave_on_loss_nan": leave_on_loss_nan, "guard_healthy": guard_healthy}


def worker(rank: int, world: int, port: int, out_dir: str, cases: list[str]) -> None:
    run_cases(CASES, rank, world, port, out_dir, cases, timeout_s=30)
