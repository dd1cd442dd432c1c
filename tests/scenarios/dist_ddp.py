"""DDP on gloo, as a new user runs it: a nan made on one rank only (NAN_RANK, default 1) reaches
every rank through the gradient all-reduce.

    torchrun --standalone --nproc-per-node 2 -m opwatch dist_ddp.py
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
torch.manual_seed(rank + 1)
x = torch.randn(3, 4)
shift = 100.0 if rank == int(os.environ.get("NAN_RANK", "1")) else 0.0
y = (model(x) + 5 - shift).sqrt()  # nan on one rank
y.sum().backward()
dist.destroy_process_group()
