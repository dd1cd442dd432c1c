"""A bad batch on one rank, left on, for tests/runners/test_leave_on_distributed.py: a dataset
made up front on each rank (its own shard), one record corrupted with nan on the ranks in
``$BAD_RANKS`` (default ``1``), run as

    torchrun --standalone --nproc-per-node 2 -m opwatch --guard dist_bad_batch.py

``$DDP=1`` (default) wraps the model in DistributedDataParallel (the gradients are reduced, so
every rank's hold the nan); ``$DDP=0`` keeps each rank's own gradients, with one all-reduce a
step; ``$FSDP=1`` shards it with FSDP2's ``fully_shard`` instead, bfloat16 parameters (its
pre-forward hook casts the batch to bfloat16) and float32 gradient reduction. ``$MICRO`` micro-batches a step (default 1). ``$OP_NAN=1``: no record is corrupted, and
rank 1's loss takes the square root of a negative at its fourth batch instead (torch makes the
nan: no batch is to blame); with ``$EVERY=k`` it does so at every k-th step of ``4 * k`` (a
failure at a steady interval). The process group times out after 30 s.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
bad_ranks = {int(name) for name in os.environ.get("BAD_RANKS", "1").split(",") if name}
micro = int(os.environ.get("MICRO", "1"))
op_nan = os.environ.get("OP_NAN") == "1"
every = int(os.environ.get("EVERY", "0"))
steps = 4 * every if every else 6
nan_steps = set(range(every, steps + 1, every)) if every else {4}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
if os.environ.get("FSDP") == "1":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
elif os.environ.get("DDP", "1") == "1":
    model = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
shard = torch.Generator().manual_seed(rank)
data = [torch.randn(8, 8, generator=shard) for _ in range(steps * micro)]
if rank in bad_ranks and not op_nan:
    data[3 * micro][1, 1] = float("nan")  # a corrupted record, in the fourth optimizer step's first micro-batch
for start in range(0, len(data), micro):
    for index in range(start, start + micro):
        out = model(data[index])  # the model is fed
        shift = 100.0 if op_nan and rank == 1 and index // micro + 1 in nan_steps and index % micro == 0 else 0.0
        loss = (out.float().pow(2) + 1 - shift).sqrt().mean() / micro
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # one collective a step: every rank must be at the same step
print(f"rank {rank}: weights finite: {all(bool(torch.isfinite(p).all()) for p in model.parameters())}", flush=True)
dist.destroy_process_group()
