"""FSDP2 on gloo, trained as a script: ``fully_shard`` with a MixedPrecisionPolicy (bfloat16
parameters, float32 gradient reduction), a few SGD steps. ``NAN_RANK`` (unset: none) makes a
nan on that rank only, from step ``NAN_STEP`` (default 2) on: a batch that stays bad.

    torchrun --standalone --nproc-per-node 2 -m opwatch --guard dist_sharded_script.py
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for module in (model[0], model[2], model):
    fully_shard(module, mesh=mesh, mp_policy=policy)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
nan_rank = int(os.environ.get("NAN_RANK", "-1"))
nan_step = int(os.environ.get("NAN_STEP", "2"))
torch.manual_seed(rank + 1)
for step in range(5):
    x, target = torch.randn(4, 8), torch.randn(4)
    shift = 100.0 if rank == nan_rank and step >= nan_step else 0.0
    x = (x.abs() + 1 - shift).sqrt()  # nan made here
    pred = model(x).float().squeeze(1)
    loss = (pred - target).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.barrier()
dist.destroy_process_group()
