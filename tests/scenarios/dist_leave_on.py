"""Leave-on across ranks, for tests/runners/test_leave_on_distributed.py: a plain training loop
(no DDP: each rank's gradients are its own) with one collective a step, run as

    torchrun --standalone --nproc-per-node 2 -m opwatch --guard dist_leave_on.py

The gradients hold nan on rank 1 only, at steps 3 and 4 (``$NAN_STEPS``). Deciding per rank,
rank 1 would skip (or raise) while rank 0 went on: with ``--on-failure raise`` rank 0 then waited
in the next all-reduce for a rank that had left. The process group times out after 30 s.
"""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
nan_steps = {int(step) for step in os.environ.get("NAN_STEPS", "3,4").split(",") if step}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(rank + 1)
stop_at = int(os.environ.get("STOP_AT", "0"))  # the last rank leaves the loop before this step
for step in range(1, 6):
    if step == stop_at and rank == dist.get_world_size() - 1:
        time.sleep(12)  # alive (torchrun would end the others), but never at the next check
        break
    shift = 100.0 if rank == dist.get_world_size() - 1 and step in nan_steps else 0.0
    y = (model(torch.randn(3, 4)) + 5 - shift).sqrt()  # nan on the last rank
    loss = y.nansum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # one collective a step: every rank must be at the same step
print(f"rank {rank}: weights finite: {all(bool(torch.isfinite(p).all()) for p in model.parameters())}", flush=True)
dist.destroy_process_group()
