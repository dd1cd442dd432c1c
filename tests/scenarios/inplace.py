"""Scenarios of nan/inf made by ops that write in place (``h.sqrt_()``, ``static.copy_(batch)``,
``p16.copy_(p32)``, ``ema.mul_(0.99)``): each op's input is its output, so the range opwatch
shows for it must be the one it had before the write. Tests look lines up by their comments."""

import copy

import torch
from torch import nn


class SqrtFeatures(nn.Module):
    """Features compressed by a square root taken in place. The bug: the Linear's output goes
    negative; the safe one makes it positive first."""

    def __init__(self, safe=False):
        super().__init__()
        self.encode = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.safe = safe

    def forward(self, x):
        h = self.encode(x)
        if self.safe:
            h = h.pow(2).add_(1.0)  # positive by construction
        return self.head(h.sqrt_())  # a square root in place


def train_sqrt_features(safe=False, steps=3):
    torch.manual_seed(0)
    model = SqrtFeatures(safe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def loader_batches(poisoned, count=3):
    """Batches as a DataLoader's workers hand them over: made before the watch."""
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(count)]
    if poisoned:
        batches[1][0][2, 3] = float("nan")  # one bad sample in the second batch
    return batches


def train_from_static_input(batches):
    """A static input buffer (as CUDA graphs need): each batch is copied into it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    static_x = torch.zeros(4, 8)
    losses = []
    for x, y in batches:
        static_x.copy_(x)  # the batch into the static buffer
        optimizer.zero_grad()
        loss = (model(static_x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_half_copy_of_master_weights(scale, steps=2):
    """Mixed precision by hand: float32 master weights, a float16 copy of the model for the
    forward and backward passes, refreshed from the masters after each step. The bug: the
    masters were initialised in the wrong units (``scale``), beyond what float16 holds."""
    torch.manual_seed(0)
    master = nn.Linear(8, 4)
    with torch.no_grad():
        master.weight.mul_(scale)
    half = copy.deepcopy(master).half()
    optimizer = torch.optim.SGD(master.parameters(), lr=1e-3)
    x = torch.randn(16, 8)
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            for p16, p32 in zip(half.parameters(), master.parameters()):
                p16.copy_(p32)  # refresh the float16 copy
        half.zero_grad()
        loss = half(x.half()).float().pow(2).mean()
        loss.backward()
        for p16, p32 in zip(half.parameters(), master.parameters()):
            p32.grad = p16.grad.float()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_with_ema(model, ema_weight, steps=3):
    """An exponential moving average of a weight, kept in a tensor made before the watch (loaded
    from a checkpoint) and updated in place after each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        with torch.no_grad():
            ema_weight.mul_(0.99).add_(model.weight, alpha=0.01)  # the EMA update
    return ema_weight.sum().item()
