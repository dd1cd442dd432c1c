"""A script that fails: run by the CLI test as `python -m opwatch fails.py`."""

import torch

x = torch.ones(5, 3)
w = torch.ones(3, 2)
h = torch.relu(x)
y = h.double() @ w
