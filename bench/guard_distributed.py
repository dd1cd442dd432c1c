"""What the guard's one decision for all ranks costs a healthy DDP step: 2 CPU ranks on gloo
(127.0.0.1), interleaved round by round: the unguarded step, the guarded step (its fused check
and the failure flag's all-reduce), and the guarded step with the flag left out (what a single
process pays), so the all-reduce's share is read off directly.

    python -m bench.guard_distributed            # under a minute
    python -m bench.guard_distributed --width 1024    # a longer step: the flag's share shrinks

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


def _model(width: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))


def _worker(rank: int, world: int, port: int, rounds: int, steps: int, width: int) -> None:
    import torch.distributed as dist

    import opwatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    model = torch.nn.parallel.DistributedDataParallel(_model(width))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.manual_seed(rank)
    x, y = torch.randn(32, 64), torch.randn(32, 8)

    def train_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    guarded = opwatch.guard(train_step, model, audit="never")
    no_flag = opwatch.guard(train_step, model, audit="never")
    no_flag(x, y)  # its first call reads the job; then its flag is left out (as in one process)
    no_flag._agreement = None
    kinds = {"plain": train_step, "guard": guarded, "guard, no flag": no_flag}

    def block(step) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            step(x, y)
            optimizer.step()
        return (time.perf_counter() - started) / steps

    for step in kinds.values():
        block(step)  # warm up
    times = {name: [] for name in kinds}
    for index in range(rounds):
        order = list(kinds.items())
        if index % 2:
            order.reverse()  # neither goes first every round
        for name, step in order:
            times[name].append(block(step))
    if rank == 0:
        print(f"torch {torch.__version__}, DDP MLP of width {width} on 2 gloo ranks (CPU), {rounds} rounds x {steps} steps, wall clock")
        for name, found in times.items():
            print(f"{name:<16} {statistics.median(found) * 1e3:8.3f} ms/step")
        for over, under in (("guard", "plain"), ("guard", "guard, no flag"), ("guard, no flag", "plain")):
            ratio = statistics.median(a / b for a, b in zip(times[over], times[under]))
            print(f"{over + ' / ' + under:<30} {ratio:6.3f}x")
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
    options = parser.parse_args(argv)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(2, port, options.rounds, options.steps, options.width), nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
