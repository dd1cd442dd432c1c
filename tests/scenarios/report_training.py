"""A small regression model trained for a few steps, for the HTML report: with ``buggy`` its
loss subtracts a (16, 1) prediction from a (16,) target (a broadcast) and it logs the square
root of a variance shift that goes negative (a nan); without, it trains cleanly."""

import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
        self.scale = nn.Linear(1, 1)

    def forward(self, x):
        return self.scale(self.body(x))


def train(steps=3, buggy=True):
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 2), torch.randn(16)
    for _ in range(steps):
        optimizer.zero_grad()
        pred = model(x) if buggy else model(x).squeeze(-1)
        loss = ((y - pred) ** 2).mean()  # </script><b>not markup</b> & co
        spread = (pred.var() - 1.0).sqrt() if buggy else pred.var().sqrt()
        (loss + 0 * spread.detach()).backward()
        optimizer.step()
    return loss
