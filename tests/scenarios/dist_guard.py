"""opwatch.guard in distributed jobs, for tests/runners/test_guard_distributed.py: gloo ranks
started by torch.multiprocessing (support.distributed.spawn).

``worker(rank, world, port, out_dir, cases)`` joins a process group (timeout 60 s), runs each
named case and writes ``{case: result}`` to ``out_dir/rank<r>.json``. The ranks leave through
the store, not a collective: the ``silent`` case leaves a flag all-reduce pending on rank 0.
"""

from __future__ import annotations

import os
from functools import partial
from datetime import timedelta

import torch
from torch import nn

import opwatch
from opwatch.core.collective_ops import group_store
from dist_cases import NAN_SHIFT, _mesh, _mlp, _step, run_cases  # the step whose sqrt makes the nan


def worker(rank: int, world: int, port: int, out_dir: str, cases: list[str]) -> None:
    run_cases(CASES, rank, world, port, out_dir, cases)


def _fsdp2(world):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(world)
    model = _mlp()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tensor_parallel(world):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(_mlp(), _mesh(world), {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _ddp(world):
    return nn.parallel.DistributedDataParallel(_mlp())


MAKE = {"fsdp2": _fsdp2, "ddp": _ddp, "tp": _tensor_parallel}


def _error(error) -> dict:
    anomaly = getattr(error, "anomaly", None)
    return {
        "type": type(error).__name__,
        "message": str(error),
        "rank": getattr(anomaly, "rank", None),
        "op": getattr(anomaly, "op", None),
        "lineno": getattr(anomaly, "lineno", None),
    }


def _nan_on_last_rank(rank, world, layout):
    """A healthy guarded step, then one whose nan is made on the last rank only."""
    model = MAKE[layout](world)
    torch.manual_seed(rank + 1)
    x = torch.randn(3, 4)
    step = opwatch.guard(_step, model)
    step(model, x, 0.0)
    try:
        step(model, x, NAN_SHIFT if rank == world - 1 else 0.0)
    except Exception as error:
        return {"raised": _error(error), "failures": len(step.failures)}
    return {"raised": None}


def fsdp2_nan(rank, world):
    return _nan_on_last_rank(rank, world, "fsdp2")


def ddp_nan(rank, world):
    return _nan_on_last_rank(rank, world, "ddp")


def tp_nan(rank, world):
    return _nan_on_last_rank(rank, world, "tp")


def _train(model, guarded, rank, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank + 1)
    step = opwatch.guard(_step, model) if guarded else _step
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(float(step(model, torch.randn(3, 4), 0.0)))
        optimizer.step()
    return losses, [param.detach().full_tensor() if hasattr(param, "full_tensor") else param.detach() for param in model.parameters()]


def _healthy(layout, rank, world):
    """Guarded and unguarded training of one layout: the same losses and parameters, no error."""
    make = MAKE[layout]
    plain_losses, plain = _train(make(world), False, rank)
    guarded_losses, guarded = _train(make(world), True, rank)
    return {"same_losses": plain_losses == guarded_losses, "same_params": all(torch.equal(a, b) for a, b in zip(plain, guarded))}


def _metric_step(model, x, rank):
    loss = model(x).sum()
    loss.backward()
    metric = (loss.detach().abs() + 1 - (1e4 if rank == 1 else 0.0)).log()  # nan in rank 1's metric only
    return loss, metric


def elsewhere(rank, world):
    """DDP: a nan only in rank 1's returned metric (the reduced gradients finite everywhere):
    rank 1 tells it, and both ranks go on alike (decided from the gradients they share, with no
    collective of opwatch's), raise or skip."""
    result = {}
    for on_failure in ("raise", "skip"):
        model = _ddp(world)
        torch.manual_seed(rank + 1)
        x = torch.randn(3, 4)
        step = opwatch.guard(_metric_step, model, on_failure=on_failure)
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                returned = step(model, x, rank)
                result[on_failure] = {"raised": None, "returned_none": returned is None, "skipped": step.skipped,
                                      "grads_none": all(param.grad is None for param in model.parameters()),
                                      "warned": [str(w.message) for w in caught if isinstance(w.message, opwatch.OpwatchWarning)]}
            except Exception as error:
                result[on_failure] = {"raised": _error(error)}
    return result


def silent(rank, world):
    """Rank 1 leaves the loop one step early: rank 0 waits at the failure flag at most 2 s and
    names rank 1 instead of waiting for ever."""
    os.environ["OPWATCH_COLLECTIVE_TIMEOUT"] = "2"
    store = group_store()
    model = _mlp()  # no collective in the step: only the guard's flag meets the ranks
    step = opwatch.guard(lambda x: model(x).sum().backward(), model)
    result = {"raised": None}
    try:
        for _ in range(2 if rank == 0 else 1):
            step(torch.randn(3, 4))
    except Exception as error:
        result["raised"] = _error(error)
    if rank == 0:
        store.set("silent/done", "1")
    else:
        store.wait(["silent/done"], timedelta(seconds=60))  # rank 1 stays until rank 0 gave up
    return result


def raised(rank, world):
    """Rank 1's step raises at call 2 (its own bug, not the others'): it takes part in the
    failure flag before re-raising, so every other rank raises ``RaisedElsewhere`` naming rank 1,
    the exception and its line at once (the flag waits at most 2 s: a bug fails, never hangs);
    the ``.grad`` are dropped on every rank (a failing step's gradients are; no copy is kept)."""
    os.environ["OPWATCH_COLLECTIVE_TIMEOUT"] = "2"
    store = group_store()
    model = _mlp()

    def step(x, call):
        if rank == 1 and call == 2:
            raise ValueError("a batch this rank cannot read")  # rank 1 raises here
        model(x).sum().backward()

    guarded = opwatch.guard(step, model)
    result = {"raised": None}
    try:
        for call in (1, 2):
            guarded(torch.randn(3, 4), call)
    except Exception as error:
        result["raised"] = _error(error)
        result["raised"]["notes"] = list(getattr(error, "__notes__", ()))
        result["raised"]["facts"] = [getattr(error, name, None) for name in ("rank", "error_type", "where", "line")]
        result["grads_dropped"] = all(param.grad is None for param in model.parameters())
    if rank == 0:
        store.set("raised/done", "1")
    else:
        store.wait(["raised/done"], timedelta(seconds=60))
    return result


def _shard_step(model, x, rank):
    loss = model(x).sum()
    loss.backward()
    shard = model[2].weight.grad.to_local()  # this rank's shard of the gradient, no collective
    if rank == 1:
        shard[0].fill_(-1.0).sqrt_()  # nan in rank 1's shard only
    return loss


def fsdp2_shard(rank, world):
    """FSDP2: a nan written into rank 1's shard of a gradient after the reduce-scatter: only rank
    1's own check sees it. Both ranks replay (their collectives matched) and raise; rank 0's
    error names rank 1's op and line."""
    model = _fsdp2(world)
    torch.manual_seed(rank + 1)
    step = opwatch.guard(_shard_step, model)
    try:
        step(model, torch.randn(3, 4), rank)
    except Exception as error:
        return {"raised": _error(error)}
    return {"raised": None}


CASES = {"fsdp2_shard": fsdp2_shard, "fsdp2_nan": fsdp2_nan, "ddp_nan": ddp_nan, "elsewhere": elsewhere, "silent": silent, "raised": raised, "tp_nan": tp_nan}
# One case per layout, so a torch that cannot run FSDP2 on the CPU (torch 2.6) runs the others.
CASES.update({f"healthy_{layout}": partial(_healthy, layout) for layout in MAKE})
