"""Sharded training on gloo for tests/runners/test_sharded.py: FSDP2 (``fully_shard`` with a
``MixedPrecisionPolicy``, ``reshard_after_forward`` both ways), DTensor tensor parallel
(``ColwiseParallel``/``RowwiseParallel``), sequence parallel (``SequenceParallel`` on a norm,
``PrepareModuleInput``), DDP; started by torch.multiprocessing (support.distributed.spawn).

``worker(rank, world, port, out_dir, cases)`` joins a process group (timeout 60 s), runs each
named case and writes ``{case: result}`` to ``out_dir/rank<r>.json``; rank 0 holds the store and
leaves last, through the store (bounded). Each layout case trains a few optimizer steps under a
watch and under guard (healthy: no finding), then plants a nan on the last rank and a
broadcast in the loss on every rank.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import opwatch
from dist_cases import run_cases

DIM, HIDDEN, BATCH, SEQ = 8, 16, 4, 4
NAN_SHIFT = 100.0  # sqrt(|x| + 1 - 100) is nan for the small inputs below


def worker(rank: int, world: int, port: int, out_dir: str, cases: list[str]) -> None:
    os.environ["OPWATCH_SHARDED_OUT"] = out_dir  # where a case saves its logs
    run_cases(CASES, rank, world, port, out_dir, cases)


_MESH = {}


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    if world not in _MESH:
        _MESH[world] = init_device_mesh("cpu", (world,))
    return _MESH[world]


# -- the models, one a layout ---------------------------------------------------------------


class Block(nn.Module):
    """A transformer's MLP block: a norm, then up and down projections."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def _block():
    torch.manual_seed(0)  # the same weights on every rank (tensor parallel shards them)
    return Block()


def _fsdp2(world, reshard):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _block()
    for module in (model.up, model.down, model):
        fully_shard(module, mesh=_mesh(world), mp_policy=policy, reshard_after_forward=reshard)
    return model


def _tensor_parallel(world):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(_block(), _mesh(world), {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _sequence_parallel(world):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module

    model = _block()
    parallelize_module(model, _mesh(world), {
        "norm": SequenceParallel(),  # the norm runs on this rank's part of the sequence
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    })
    # The input comes whole to every rank: sharded along the sequence before the norm.
    parallelize_module(model.norm, _mesh(world), PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False))
    return model


def _ddp(world):
    return nn.parallel.DistributedDataParallel(_block())


LAYOUTS = {
    "fsdp2_reshard": lambda world: _fsdp2(world, True),
    "fsdp2_keep": lambda world: _fsdp2(world, False),
    "tp": _tensor_parallel,
    "sp": _sequence_parallel,
    "ddp": _ddp,
}


# -- the training step ----------------------------------------------------------------------


def _batch(rank, layout):
    generator = torch.Generator().manual_seed(rank + 1 if layout in ("fsdp2_reshard", "fsdp2_keep", "ddp") else 1)
    x = torch.randn(BATCH, SEQ, DIM, generator=generator)  # tensor parallel: the same batch on every rank
    return x, torch.randn(BATCH, generator=generator)


def forward_backward(model, x, target, shift, broadcast):
    x = (x.abs() + 1 - shift).sqrt()  # nan made here
    pred = model(x).float().flatten(1).sum(1, keepdim=True)  # (BATCH, 1); float: FSDP2's mixed precision gives bfloat16
    if broadcast:
        loss = (target - pred).square().mean()  # broadcast here: (BATCH,) - (BATCH, 1)
    else:
        loss = (target.unsqueeze(1) - pred).square().mean()
    loss.backward()
    return loss


def _train(model, rank, layout, *, steps=3, guarded=False, shift=0.0, broadcast=False):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = opwatch.guard(forward_backward, model) if guarded else forward_backward
    x, target = _batch(rank, layout)
    losses = []
    for _ in range(steps):
        losses.append(float(step(model, x, target, shift, broadcast)))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _anomalies(w) -> list:
    return [[a.kind, a.op, a.where, a.phase, a.received, a.rank] for a in w.anomalies]


def _error(error) -> dict:
    anomaly = getattr(error, "anomaly", None)
    return {"type": type(error).__name__, "message": str(error), "rank": getattr(anomaly, "rank", None),
            "op": getattr(anomaly, "op", None), "lineno": getattr(anomaly, "lineno", None)}


def layout_case(rank, world, layout):
    """Healthy training watched and guarded (no finding, the same losses as unwatched), then a
    nan made on the last rank and a broadcast in the loss on every rank, watched and guarded."""
    nan_shift = NAN_SHIFT if rank == world - 1 else 0.0
    plain = _train(LAYOUTS[layout](world), rank, layout)
    with opwatch.watch(warn=False) as healthy:
        watched = _train(LAYOUTS[layout](world), rank, layout)
    guarded = _train(LAYOUTS[layout](world), rank, layout, guarded=True)
    with opwatch.watch(warn=False) as nan:
        _train(LAYOUTS[layout](world), rank, layout, steps=1, shift=nan_shift)
    with opwatch.watch(warn=False) as broadcast:
        _train(LAYOUTS[layout](world), rank, layout, steps=1, broadcast=True)
    try:
        _train(LAYOUTS[layout](world), rank, layout, steps=2, guarded=True, shift=nan_shift)
        guard_nan = None
    except Exception as error:
        guard_nan = _error(error)
    sharded = [str(meta) for record in healthy.records for meta in (*record.inputs, *(record.outputs or ())) if meta.sharding is not None]
    return {
        "same_losses": plain == watched == guarded,
        "losses": plain,
        "healthy": _anomalies(healthy),
        "healthy_ops": len(healthy.records),
        "sharded": sorted(set(sharded)),
        "nan": _anomalies(nan),
        "nan_summary": nan.summary(),
        "broadcast": _anomalies(broadcast),
        "broadcast_messages": [a.message for a in broadcast.anomalies],
        "guard_nan": guard_nan,
    }


def fsdp2_reshard(rank, world):
    return layout_case(rank, world, "fsdp2_reshard")


def fsdp2_keep(rank, world):
    return layout_case(rank, world, "fsdp2_keep")


def tp(rank, world):
    return layout_case(rank, world, "tp")


def sp(rank, world):
    return layout_case(rank, world, "sp")


def ddp(rank, world):
    return layout_case(rank, world, "ddp")


CASES = {"fsdp2_reshard": fsdp2_reshard, "fsdp2_keep": fsdp2_keep, "tp": tp, "sp": sp, "ddp": ddp}


# -- what a DTensor looks like in the table and the messages --------------------------------


def dtensor_origin(rank, world):
    """Tensor parallel code that keeps DTensors: a nan made by an op on DTensors in the last
    rank's shard, named there (its message shows the shard, the global shape and the
    placement); the others receive it through full_tensor()'s all-reduce. The log saved as
    JSONL renders the same table and messages again."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from opwatch.storage.jsonl import load

    mesh = _mesh(world)
    torch.manual_seed(0)
    weight = distribute_tensor(torch.randn(HIDDEN, DIM), mesh, [Shard(0)])  # each rank: HIDDEN / world rows
    x = distribute_tensor(torch.randn(BATCH, DIM), mesh, [Replicate()])
    offset = DTensor.from_local(torch.full((BATCH, HIDDEN // world), NAN_SHIFT if rank == world - 1 else 0.0), mesh, [Shard(1)])
    with opwatch.watch(warn=False) as w:
        h = x @ weight.T  # (BATCH, HIDDEN), sharded along HIDDEN
        scores = (h.abs() + 1 - offset).sqrt()  # nan in the last rank's shard
        total = scores.sum().full_tensor()  # all-reduced: every rank receives it
        float(total)
    path = os.path.join(os.environ["OPWATCH_SHARDED_OUT"], f"dtensor_origin{rank}.jsonl")
    w.export_jsonl(path)
    saved = load(path)
    return {
        "table": w.table(),
        "messages": [a.message for a in w.anomalies],
        "anomalies": _anomalies(w),
        "saved_table_same": saved.table() == w.table(),
        "saved_messages_same": [a.message for a in saved.anomalies] == [a.message for a in w.anomalies],
        "saved_sharding": [list(map(str, record.inputs)) for record in saved.records if record.op == "aten.sqrt.default"],
    }


# -- the finite checks read local shards, no collective ---------------------------------------


class _Collectives:
    """Counts the collectives run while it is on (c10d and functional collectives: a DTensor
    reduced as a whole would run one)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional"):
                    counter.seen.append(str(func))
                return func(*args, **(kwargs or {}))

        self.seen = []
        self.mode = Mode()


def finite_local(rank, world):
    """FusedFiniteCheck and guard's gradient check on FSDP2's DTensor gradients and tensor
    parallel ones: this rank's shard decides, with no collective; a nan put in the last rank's
    shard is found there only."""
    from opwatch.core.finite import FusedFiniteCheck, finite_by_device
    from opwatch.runners.guarded.check import FiniteCheck

    result = {}
    for layout in ("fsdp2_reshard", "tp"):
        model = LAYOUTS[layout](world)
        x, target = _batch(rank, layout)
        loss = forward_backward(model, x, target, 0.0, False)
        params = list(model.parameters())
        grads = [param.grad for param in params]
        sharded = next(grad for grad in grads if type(grad).__name__ == "DTensor")
        counter = _Collectives()
        checks = {}
        with counter.mode:
            checks["healthy"] = [FusedFiniteCheck()(grads), finite_by_device(grads), FiniteCheck().all_finite(loss.detach(), params)]
            if rank == world - 1:
                sharded.to_local().view(-1)[0] = float("nan")  # in this rank's shard only
            checks["nan"] = [FusedFiniteCheck()(grads), finite_by_device(grads), FiniteCheck().all_finite(loss.detach(), params)]
        control = _Collectives()  # the counter sees the collective of a DTensor read as a whole
        with control.mode:
            torch.linalg.vector_norm(sharded, float("inf")).full_tensor()
        result[layout] = {"dtensor_grads": sum(type(grad).__name__ == "DTensor" for grad in grads), "checks": checks,
                          "collectives": counter.seen, "control": control.seen}
    return result


CASES.update(dtensor_origin=dtensor_origin, finite_local=finite_local)


def tp_poisoned_weight(rank, world):
    """Tensor parallel, the last rank's shard of ``up.weight`` holding a nan written before the
    watch (a bad checkpoint): checked when an op first reads it, the nan is that rank's weights
    (cause ``weights``), named at the op that read it; the other ranks receive it."""
    model = LAYOUTS["tp"](world)
    if rank == world - 1:
        with torch.no_grad():
            model.up.weight.to_local()[0, 0] = float("nan")
    with opwatch.watch(warn=False) as w:
        _train(model, rank, "tp", steps=1)
    causes = [getattr(a.finding.facts.get("cause"), "kind", None) for a in w.anomalies]
    return {"anomalies": _anomalies(w), "causes": causes, "messages": [a.message for a in w.anomalies]}


CASES["tp_poisoned_weight"] = tp_poisoned_weight
