"""A float16 classifier under DistributedDataParallel with one GradScaler per rank, left on, for
tests/runners/test_leave_on_distributed.py, run as

    torchrun --standalone --nproc-per-node 2 -m opwatch --guard dist_fp16_bad_batch.py

``$BAD_RANK`` (default: none) is the rank whose batch of step 6 is bad: its loss is nan, DDP's
all-reduce carries the nan into every rank's gradients, and GradScaler skips the step on every
rank. ``$BAD=sample`` (default): one corrupt sample; ``$BAD=mask``: the mask drops every sample of
that batch, and the mean over none is 0/0. The process group times out after 30 s.
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
bad = os.environ.get("BAD", "sample")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
torch.manual_seed(rank)  # each rank its own batches
for step in range(12):
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    keep = torch.ones(32)
    if step == 6 and rank == bad_rank and bad == "sample":
        x[7, 3] = float("nan")  # the corrupt sample
    if step == 6 and rank == bad_rank and bad == "mask":
        keep.zero_()  # every sample dropped
    with torch.autocast("cpu", dtype=torch.float16):
        per_sample = nn.functional.cross_entropy(model(x), y, reduction="none")
    loss = (per_sample * keep).sum() / keep.sum()  # the mean over the samples kept
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print(f"rank {rank}: weights finite: {all(bool(p.isfinite().all()) for p in model.parameters())}")
dist.destroy_process_group()
