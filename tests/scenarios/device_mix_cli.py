"""A model moved to another device and an input left behind: what ``python -m opwatch`` prints.

``meta`` stands for ``cuda`` here (no GPU needed): ``model.to(...)`` copies every parameter
(a run of ``aten._to_copy``), then the first layer meets the input made on the CPU.
"""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
model = model.to("meta")
batch = torch.randn(16, 8)
loss = model(batch).sum()
