"""One small regression with four bugs, trained the same way by every runner of the
``on_failure`` matrix (tests/runners/test_on_failure_matrix.py): ``opwatch.guard``,
``python -m opwatch --guard`` (its runner), Lightning and Hugging Face.

Each sample is ``(x, y, scale)``: the model divides ``x`` by ``scale`` (1, or 0 in the batch
of the bad steps: "a nan from the data"). ``bug``:

- ``"broadcast"``: the ``(B, 1)`` prediction minus the ``(B,)`` target (a ``(B, B)`` loss);
- ``"float64"``: the loss weighted by numpy's float64 ones (upcast, silent);
- ``"data"``: the bad steps' batches are divided by a zero scale (inf, then nan);
- ``"math"``: at the bad steps, ``sqrt`` of zeros: finite forward, nan in its backward.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

STEPS = 6
BAD_STEPS = (3, 4)  # 1-based: the optimizer steps whose batches are bad ("data", "math"): two in a row,
# so that a runner that cannot replay a batch (--guard) sees the failure recur in the next step
BATCH = 4
BUGS = ("broadcast", "float64", "data", "math")


class Net(nn.Module):
    def __init__(self, bug=None):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)
        self.bug = bug
        self.weights = torch.from_numpy(np.ones(1)) if bug == "float64" else torch.ones(1)

    def forward(self, x, scale):
        x = x / scale[:, None]  # DATA: a zero scale makes inf
        h = torch.relu(self.fc1(x))
        bad = bool((scale < 0.5).any())  # the bad steps' batches carry the marker
        if self.bug == "math" and bad:
            h = h + (h * 0).sqrt()  # MATH: sqrt'(0) * 0 = nan in backward; forward adds 0
        return self.fc2(h)


def loss_of(model, x, y, scale):
    """The loss every runner computes."""
    pred = model(x, scale)
    if model.bug != "broadcast":
        pred = pred.squeeze(-1)
    return (((pred - y) ** 2) * model.weights).mean()  # LOSS: the broadcast, the float64 upcast


def data(bug):
    """``(x, y, scale)`` for ``STEPS`` batches of ``BATCH``, in training order."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 4, generator=generator)
    y = x.sum(-1)
    scale = torch.ones(STEPS * BATCH)
    if bug in ("data", "math"):
        marker = 0.0 if bug == "data" else 0.25  # "math": a marker, the data stay finite
        for step in BAD_STEPS:
            rows = slice((step - 1) * BATCH, step * BATCH)
            scale[rows] = marker
            if bug == "math":
                x[rows] *= 0.25  # x / 0.25 gives them back exactly
    return x, y, scale


def model(bug):
    torch.manual_seed(0)
    return Net(bug)


def optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9, weight_decay=1e-3)
