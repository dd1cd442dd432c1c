"""A small model with nested modules, for record and table tests."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(torch.relu(self.proj(x)) + x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        h = self.blocks(x)
        return self.head(h).squeeze(-1)


def make():
    torch.manual_seed(0)
    return Net(), torch.randn(3, 4), torch.randn(3)


def step(model, x, y):
    pred = model(x)
    loss = ((pred - y) ** 2).mean()
    loss.backward()
    return loss
