"""Scenarios for the diagnoses that explain a cause: input health, the torch.where gradient
trap, where a stray tensor was made, fp16 headroom. Tests look lines up by their comments."""

import torch
from torch import nn


class LogLikelihood(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 1)

    def forward(self, x):
        probability = torch.sigmoid(self.score(x)).squeeze(-1) * (x[:, 0] > -10)
        return probability.log()  # log of a probability that can be 0


def train_log_likelihood(steps=3):
    torch.manual_seed(0)
    model = LogLikelihood()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 4)
    x[2, 0] = -20.0  # this row's probability is masked to 0
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = -model(x).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


class SafeDistance(nn.Module):
    """sqrt of a squared distance that can be negative after a subtraction: masked with where."""

    def __init__(self, double_where=False):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.double_where = double_where

    def forward(self, x):
        d = self.proj(x).sum(-1) - 0.5
        if self.double_where:
            return torch.where(d > 0, torch.sqrt(torch.where(d > 0, d, 1.0)), 0.0)  # the double where
        return torch.where(d > 0, torch.sqrt(d), 0.0)  # the where-gradient trap


def train_distance(double_where=False, steps=2):
    torch.manual_seed(0)
    model = SafeDistance(double_where)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 3)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = torch.ones(4) * 0.5  # a plain tensor attribute: .to() does not move it

    def forward(self, x):
        return self.proj(x) * self.scale  # meets the stray scale


def attention_moved_to_meta():
    model = Attention().to("meta")
    return model(torch.randn(2, 4, device="meta"))


def float64_noise():
    x = torch.randn(4, 3)
    noise = torch.zeros(4, 3, dtype=torch.float64)  # the stray float64
    return x + noise  # meets the float64


class Growing(nn.Module):
    """A float16 block whose activations grow toward the float16 limit."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8).half()
        with torch.no_grad():
            self.up.weight.fill_(50.0)

    def forward(self, x):
        return self.up(x)  # activations near the float16 limit


def float16_headroom():
    torch.manual_seed(0)
    return Growing()(torch.rand(2, 8, dtype=torch.float16) * 40)
