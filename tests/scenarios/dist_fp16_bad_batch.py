"""A float16 classifier under DistributedDataParallel with one GradScaler per rank, left on, for
tests/runners/test_leave_on_distributed.py, run as

    torchrun --standalone --nproc-per-node 2 -m opwatch --guard dist_fp16_bad_batch.py

``$BAD_RANK`` (default: none) is the rank whose batch of step 6 holds one corrupt sample: its
loss is nan, DDP's all-reduce carries the nan into every rank's gradients, and GradScaler skips
the step on every rank. The process group times out after 30 s.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
bad_rank = int(os.environ.get("BAD_RANK", "-1"))
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
torch.manual_seed(rank)  # each rank its own batches
for step in range(12):
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    if step == 6 and rank == bad_rank:
        x[7, 3] = float("nan")  # the corrupt sample
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print(f"rank {rank}: weights finite: {all(bool(p.isfinite().all()) for p in model.parameters())}")
dist.destroy_process_group()
