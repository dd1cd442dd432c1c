"""A small regression trained with DDP on gloo for a few SGD steps, the same data on every rank;
on rank 1 only (BAD_RANK, default 1) the loss broadcasts: its (4,) target minus the (4, 1)
prediction. Outside torchrun (no RANK in the environment) the same training in one process,
no process group, with the bad loss.

    torchrun --standalone --nproc-per-node 2 -m opwatch --jsonl run.jsonl dist_rank_files.py
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank() if distributed else 1
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
if distributed:
    model = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
bad = rank == int(os.environ.get("BAD_RANK", "1"))
for step in range(3):
    x, y = torch.randn(4, 3), torch.randn(4)
    pred = model(x)
    target = y if bad else y.unsqueeze(1)
    loss = ((target - pred) ** 2).mean()  # broadcasts on the bad rank
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
if distributed:
    dist.barrier()
    dist.destroy_process_group()
