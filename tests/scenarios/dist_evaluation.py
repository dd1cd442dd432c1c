"""DDP training with an evaluation after each step, one validation record corrupted with nan on
rank 1, for tests/runners/test_leave_on_distributed.py, run as

    torchrun --standalone --nproc-per-node 2 -m opwatch --guard dist_evaluation.py

The evaluation calls the wrapped model (``model.module``) with gradients off; ``$CLEAN=1``
corrupts nothing. The process group times out after 30 s.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
generator = torch.Generator().manual_seed(rank)
for step in range(6):
    x = torch.randn(32, 16, generator=generator)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x).squeeze(-1), x.sum(-1)).backward()
    optimizer.step()
    with torch.no_grad():
        validation = torch.randn(64, 16, generator=generator)
        if rank == 1 and step == 3 and os.environ.get("CLEAN") != "1":
            validation[3, 4] = float("nan")  # a corrupted validation record on rank 1
        loss = nn.functional.mse_loss(model.module(validation).squeeze(-1), validation.sum(-1))  # THE EVALUATION
print(f"rank {rank}: validation loss {loss.item():.3f}")
dist.destroy_process_group()
