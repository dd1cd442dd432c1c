"""Distributed scenarios for tests/runners/test_distributed.py, run on gloo by torch.multiprocessing.

``worker(rank, world, port, out_dir, cases)`` joins a process group on 127.0.0.1 (at the store the
test serves on ``port``: ``support.distributed.spawn``), runs each named
case and writes what it saw to ``out_dir/rank<r>.json``: ``{case: result}``. Every wait is
bounded (the process group's timeout, the exchange's timeout), so a bug fails instead of hanging.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import opwatch

NAN_SHIFT = 100.0  # sqrt(h + 5 - 100) is nan for the tanh-bounded h below, and so is its gradient


def run_cases(table: dict, rank: int, world: int, port: int, out_dir: str, cases: list[str], *, timeout_s: float = 60) -> None:
    """One rank of a scenario file: join the gloo group (bounded by ``timeout_s``), run each of
    ``cases`` from ``table`` as ``table[case](rank, world)``, write ``out_dir/rank<r>.json``
    (also when a case raised), and leave only once every rank has written."""
    from opwatch.core.collective_ops import group_store

    join_group(rank, world, port, timeout_s)
    store = group_store()
    results = {}
    try:
        for case in cases:
            results[case] = table[case](rank, world)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as stream:
            json.dump(results, stream)
        store.set(f"left/{rank}", "1")  # rank 0 leaves last, once every rank has written
        if rank == 0:
            store.wait([f"left/{other}" for other in range(world)], timedelta(seconds=timeout_s))
        dist.destroy_process_group()


def join_group(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join the gloo group of ``world`` ranks through the store served on 127.0.0.1:``port``
    (by the test's process, which picked the port when it bound it: no port can be taken in
    between), bounded by ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def worker(rank: int, world: int, port: int, out_dir: str, cases: list[str]) -> None:
    run_cases(CASES, rank, world, port, out_dir, cases, timeout_s=30)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model, x, shift):
    y = (model(x) + 5 - shift).sqrt()  # nan made here
    loss = y.sum()
    loss.backward()
    return loss


def _seen(w) -> dict:
    return {
        "rank": w.rank,
        "summary": w.summary(),
        "anomalies": [[a.kind, a.op, a.where, a.phase, a.received, a.rank] for a in w.anomalies],
        "rows": [[r.op, r.where, r.phase, len(r.outputs or ())] for r in w.records],
    }


def _every_rank(w, timeout=20.0) -> dict:
    everyone = w.all_anomalies(timeout=timeout)
    return {
        "anomalies": [[a.rank, a.kind, a.op, a.where, a.received] for a in everyone],
        "missing": list(everyone.missing),
        "summary": everyone.summary(),
    }


def ddp(rank, world):
    """DDP: watching changes no gradient; a nan made on the last rank reaches every rank."""
    nan_rank = world - 1
    ddp_model = nn.parallel.DistributedDataParallel
    torch.manual_seed(rank + 1)
    x = torch.randn(3, 4)
    plain = ddp_model(_mlp())
    _step(plain, x, 0.0)
    watched = ddp_model(_mlp())
    with opwatch.watch(warn=False) as healthy:
        _step(watched, x, 0.0)
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), watched.parameters()))
    model = ddp_model(_mlp())
    with opwatch.watch(warn=False) as w:
        _step(model, x, NAN_SHIFT if rank == nan_rank else 0.0)
    result = {"same_grads": same, "healthy": healthy.summary(), **_seen(w)}
    # torch.compile(ddp): the watch runs it eagerly; the bucket is named as DDP names it
    compiled = torch.compile(ddp_model(_mlp()), backend="aot_eager")
    with opwatch.watch(warn=False) as under_compile:
        _step(compiled, x, NAN_SHIFT if rank == nan_rank else 0.0)
    result["compiled"] = _seen(under_compile)["anomalies"]
    if rank == 0:
        result["all"] = _every_rank(w)
    return result


def functional(rank, world):
    """Functional collectives: no false alarm on healthy data (outputs made from uninitialised
    memory that held nan); a nan made on rank 1 is received on rank 0, its consumer not blamed."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    # all_gather_single and reduce_scatter_single are newer than torch 2.6: the older names
    # take the same arguments and run the same ops there.
    gather_single = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
    reduce_scatter_single = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)
    alarms = []
    for _ in range(6):
        x = torch.randn(1000)
        with opwatch.watch(warn=False) as w:
            junk = torch.full((1000 * world,), float("nan"))  # freed: the gather's output may reuse it
            del junk
            gathered = gather_single(x, 0, group)
            doubled = gathered * 2
            reduced = funcol.all_reduce(x * 1, "sum", group).view(10, 100) * 3
            scattered = reduce_scatter_single(x.repeat(world), "sum", 0, group).wait()
            total = float(doubled.sum() + reduced.sum() + scattered.sum())
        alarms += [a.message for a in w.anomalies]
    x = torch.ones(4)
    with opwatch.watch(warn=False) as w:
        y = (x - (2.0 if rank == 1 else 0.0)).sqrt()  # nan on rank 1
        z = funcol.all_reduce(y, "sum", group)  # functional: received on rank 0
        s = (z * 2).sum()  # consumer of the AsyncCollectiveTensor
        s.item()
    result = {"false_alarms": alarms, "total_finite": total == total, **_seen(w)}
    with opwatch.watch(warn=False) as w:
        t = (torch.ones(3) - (2.0 if rank == 1 else 0.0)).sqrt()  # c10d: nan made on rank 1
        parts = [torch.empty(3) for _ in range(world)]
        dist.all_gather(parts, t)  # c10d allgather_: nested outputs
        u = torch.stack(parts).sum()
    result["c10d"] = _seen(w)
    return result


_MESH = {}


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    if world not in _MESH:
        _MESH[world] = init_device_mesh("cpu", (world,))
    return _MESH[world]


def fsdp2(rank, world):
    """FSDP2 (fully_shard on gloo): watching changes no gradient; a nan made on rank 1 reaches
    rank 0 through the gradients' reduce-scatter."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(world)

    def make():
        model = _mlp()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    torch.manual_seed(rank + 1)
    x = torch.randn(3, 4)
    plain = make()
    _step(plain, x, 0.0)
    watched = make()
    with opwatch.watch(warn=False) as healthy:
        _step(watched, x, 0.0)
    same = all(torch.equal(a.grad.to_local(), b.grad.to_local()) for a, b in zip(plain.parameters(), watched.parameters()))
    model = make()
    with opwatch.watch(warn=False) as w:
        _step(model, x, NAN_SHIFT if rank == 1 else 0.0)
    return {"same_grads": same, "healthy": healthy.summary(), **_seen(w)}


def dtensor(rank, world):
    """DTensor: watching changes no result; a nan made in rank 1's shard reaches rank 0 through
    full_tensor()'s all-gather."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = _mesh(world)
    full = torch.arange(8.0 * world).reshape(4 * world, 2)
    a = distribute_tensor(full, mesh, [Shard(0)])
    plain = ((a * 2 + 1).sum(0)).full_tensor()
    with opwatch.watch(warn=False) as healthy:
        watched = ((a * 2 + 1).sum(0)).full_tensor()
    with opwatch.watch(warn=False) as w:
        local = (a.to_local() - (100.0 if rank == 1 else 0.0)).sqrt()  # nan in rank 1's shard
        gathered = DTensor.from_local(local, mesh, [Shard(0)]).full_tensor()  # received on rank 0
        gathered.sum()
    return {"same": torch.equal(plain, watched), "healthy": healthy.summary(), **_seen(w)}


def mismatch(rank, world):
    """The collective-mismatch check: quiet on matching calls, off by default, and a mismatch
    raises in strict() on every rank before the collective runs (so before the hang)."""
    from opwatch.checks import collectives
    from opwatch.core.collective_ops import group_store

    with opwatch.watch(warn=False) as w:
        dist.all_reduce(torch.ones(4))
    # The first checked watch of this rank counts itself in the store: none did yet.
    result = {"default_writes_nothing": not group_store().check([collectives.counter_key(rank)]) and not w.anomalies}
    with opwatch.watch(warn=False, checks=["collective_mismatch"]) as w:
        dist.all_reduce(torch.ones(4))
        dist.broadcast(torch.ones(2), src=0)
    result["matching"] = [a.message for a in w.anomalies]
    raised = []
    try:
        with opwatch.strict(checks=["collective_mismatch"], dump_on_error=False):
            dist.all_reduce(torch.ones(4 if rank == 0 else 6))  # shapes differ
    except opwatch.AnomalyError as error:
        raised.append(str(error))
    try:
        with opwatch.strict(checks=["collective_mismatch"], dump_on_error=False):
            if rank == 0:
                dist.all_reduce(torch.ones(2))  # different collectives
            else:
                dist.broadcast(torch.ones(2), src=0)
    except opwatch.AnomalyError as error:
        raised.append(str(error))
    try:
        with opwatch.strict(checks=["collective_mismatch"], dump_on_error=False):
            if rank == 0:
                dist.all_reduce(torch.ones(2))  # rank 1 never calls it (the last case: the ranks' counts part here)
    except opwatch.AnomalyError as error:
        raised.append(str(error))
    result["raised"] = raised
    return result


def missing(rank, world):
    """The last rank never ends a watch: rank 0 names it as not reported within the timeout."""
    if rank == world - 1:
        return {}
    with opwatch.watch(warn=False) as w:
        torch.ones(2).sum()
    if rank == 0:
        return _every_rank(w, timeout=1.0)
    return {}


CASES = {"ddp": ddp, "functional": functional, "fsdp2": fsdp2, "dtensor": dtensor, "mismatch": mismatch, "missing": missing}
