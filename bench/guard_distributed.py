"""What the one decision for all ranks costs a healthy step: 2 CPU ranks on gloo (127.0.0.1),
interleaved round by round in one run, for DDP and FSDP2 (``fully_shard`` on a CPU mesh):

- ``plain``: the unguarded step;
- ``plain, bare flag``: the unguarded step followed by one all-reduce of one slot per rank on a
  gloo group of its own, no opwatch at all: what any decision taken together each step costs;
- ``guard``: ``opwatch.guard`` (snapshot, fused check, the failure flag's all-reduce);
- ``guard, default group``: the flag on the program's default group instead of its own gloo group
  (measured, not offered: a rank whose step raised before a collective the others run would meet
  that collective with the flag; gloo aborts the process on the size mismatch);
- ``guard, no flag``: the same with the flag left out (what a single process pays; under DDP
  it would still decide the gradients alike, under FSDP2 it would not: measured, not offered);
- ``leave-on`` (DDP): ``python -m opwatch --guard``'s runner after its audit (the fused gradient
  check in the optimizer's pre-hook, and the flag), and ``leave-on, no flag``.

    python -m bench.guard_distributed                 # an MLP of width 256 (a ~2 ms step)
    python -m bench.guard_distributed --width 1024    # a ~10x longer step: the flag's share shrinks

Prints, on rank 0, milliseconds per step (median over rounds, wall clock: a collective waits)
and the paired ratios (median over rounds of the same-round ratio).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch

LAYOUTS = ("ddp", "fsdp2")


def _model(width: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))


def _wrapped(layout: str, width: int, world: int):
    model = _model(width)
    if layout == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _lanes(layout: str, width: int, world: int, x, y) -> dict:
    """name -> block(steps): seconds per step of that lane."""
    import opwatch
    from opwatch.runners.leave_on import LeaveOn

    model = _wrapped(layout, width, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    guarded = opwatch.guard(train_step, model, audit="never")
    no_flag = opwatch.guard(train_step, model, audit="never")
    no_flag(x, y)  # its first call reads the job; then its flag is left out (as in one process)
    no_flag._agreement = None

    def stepping(step):
        def block(steps: int) -> float:
            started = time.perf_counter()
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                step(x, y)
                optimizer.step()
            return (time.perf_counter() - started) / steps

        return block

    on_default = opwatch.guard(train_step, model, audit="never")
    on_default(x, y)
    on_default._agreement._group = None  # the flag on the program's own (default) group, as before
    # The floor of any per-step decision across ranks: one all-reduce of one slot per rank on a
    # gloo group of its own after the backward, with no opwatch at all.
    import torch.distributed as dist

    group, flag = dist.new_group(backend="gloo"), torch.zeros(world)

    def bare_flag_step(x, y):
        loss = train_step(x, y)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return loss

    lanes = {f"{layout} plain": stepping(train_step), f"{layout} plain, bare flag": stepping(bare_flag_step),
             f"{layout} guard": stepping(guarded), f"{layout} guard, no flag": stepping(no_flag),
             f"{layout} guard, default group": stepping(on_default)}
    if layout == "ddp":
        runner = LeaveOn(audit="manual", warn=False)
        unflagged = LeaveOn(audit="manual", warn=False)
        unflagged._job_read = True  # its flag is left out

        def leave_on(run):
            def block(steps: int) -> float:
                with run:
                    return stepping(train_step)(steps)

            return block

        lanes[f"{layout} leave-on"] = leave_on(runner)
        lanes[f"{layout} leave-on, no flag"] = leave_on(unflagged)
    return lanes


RATIOS = (("plain, bare flag", "plain"), ("guard", "plain"), ("guard", "guard, no flag"), ("guard, default group", "plain"), ("guard, no flag", "plain"), ("leave-on", "plain"), ("leave-on", "leave-on, no flag"))


def _worker(rank: int, world: int, port: int, rounds: int, steps: int, width: int, layouts: list) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(rank)
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    lanes: dict = {}
    for layout in layouts:
        lanes.update(_lanes(layout, width, world, x, y))
    for block in lanes.values():
        block(steps)  # warm up
    times = {name: [] for name in lanes}
    for index in range(rounds):
        order = list(lanes.items())
        if index % 2:
            order.reverse()  # neither goes first every round
        for name, block in order:
            times[name].append(block(steps))
    if rank == 0:
        print(f"torch {torch.__version__}, MLP of width {width} on {world} gloo ranks (CPU), {rounds} rounds x {steps} steps, wall clock")
        for name, found in times.items():
            print(f"{name:<24} {statistics.median(found) * 1e3:8.3f} ms/step")
        for layout in layouts:
            for over, under in RATIOS:
                a, b = f"{layout} {over}", f"{layout} {under}"
                if a in times and b in times:
                    ratio = statistics.median(p / q for p, q in zip(times[a], times[b]))
                    print(f"{a + ' / ' + under:<40} {ratio:6.3f}x")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import socket

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(prog="python -m bench.guard_distributed", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width (1024: a step ~10x longer)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: ddp, fsdp2")
    options = parser.parse_args(argv)
    layouts = [layout for layout in options.layouts.split(",") if layout]
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown or not layouts:
        parser.error(f"--layouts takes {', '.join(LAYOUTS)}, got {options.layouts!r}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(2, port, options.rounds, options.steps, options.width, layouts), nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
