"""A GAN under DistributedDataParallel, left on, for tests/runners/test_leave_on_distributed.py:
the discriminator's step after its own backward, then the generator's after its own, run as

    torchrun --standalone --nproc-per-node 2 -m opwatch --guard dist_gan.py

``$TARGET=wide`` gives the generator's least-squares loss a ``(16,)`` target beside the
discriminator's ``(16, 1)`` (a ``(16, 16)`` loss, on the generator's path only); ``$TARGET=right``
(default) a ``(16, 1)`` one. The process group times out after 30 s.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
target = (16,) if os.environ.get("TARGET", "right") == "wide" else (16, 1)
torch.manual_seed(0)
generator = DDP(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8)))
discriminator = DDP(nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)))
opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
bce = nn.BCEWithLogitsLoss()
torch.manual_seed(rank)  # each rank its own batches
for step in range(6):
    real = torch.randn(16, 8) + 2
    fake = generator(torch.randn(16, 4))
    d_loss = bce(discriminator(real), torch.ones(16, 1)) + bce(discriminator(fake.detach()), torch.zeros(16, 1))
    opt_d.zero_grad(); d_loss.backward(); opt_d.step()
    g_loss = ((discriminator(fake) - torch.ones(*target)) ** 2).mean()  # the generator's loss
    opt_g.zero_grad(); g_loss.backward(); opt_g.step()
print(f"rank {rank}: done")
dist.destroy_process_group()
