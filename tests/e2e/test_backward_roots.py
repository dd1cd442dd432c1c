"""The tensor ``backward()`` runs on is a sink of the nan/inf check: a loss of 0 / 0 (a batch
whose every label is ignored) has finite, zero gradients, and before, when nothing kept the loss
(``F.cross_entropy(model(x), y).backward()`` in one line), the watch called its nan "absorbed
before it mattered" and said "no anomalies" while the step trained on a nan loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opwatch
from support.helpers import line_of

IGNORED = -100


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))

    def forward(self, x):
        return self.net(x)


def batches(steps, *, all_ignored_at=()):
    """Token-classification-like batches: labels with padding, every label ignored at the steps
    in ``all_ignored_at`` (a batch of prompts only)."""
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        x = torch.randn(8, 16, generator=generator)
        y = torch.randint(0, 5, (8,), generator=generator)
        y[::3] = IGNORED  # padding
        if step in all_ignored_at:
            y[:] = IGNORED
        yield x, y


def train(*, steps=4, all_ignored_at=(), by="backward"):
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches(steps, all_ignored_at=all_ignored_at):
        optimizer.zero_grad()
        if by == "backward":
            F.cross_entropy(model(x), y, ignore_index=IGNORED).backward()  # ONE LINE: nothing keeps the loss
        else:
            grads = torch.autograd.grad(F.cross_entropy(model(x), y, ignore_index=IGNORED), list(model.parameters()))  # BY GRAD
            for parameter, grad in zip(model.parameters(), grads):
                parameter.grad = grad
        optimizer.step()


@pytest.mark.parametrize("by", ["backward", "grad"])
def test_a_nan_loss_with_zero_gradients_is_named_where_nothing_kept_it(by):
    with opwatch.watch(warn=False) as w:
        train(all_ignored_at=(3,), by=by)
    (anomaly,) = w.anomalies
    line = line_of("ONE LINE" if by == "backward" else "BY GRAD", __file__)
    assert anomaly.kind == "nan" and anomaly.op == "aten.nll_loss_forward.default", anomaly
    assert anomaly.where.endswith(f"test_backward_roots.py:{line}")
    text = str(anomaly)
    assert "every target was ignore_index (-100)" in text and "backward() ran on it (the loss)" in text, text
    assert not w.contained


def test_strict_stops_at_the_step_that_trained_on_it():
    with pytest.raises(opwatch.AnomalyError, match="nan in aten.nll_loss_forward"):
        with opwatch.strict():
            train(all_ignored_at=(2,))


def test_the_same_loop_with_targets_in_every_batch_is_quiet():
    with opwatch.watch(warn=False) as w:
        train(steps=6)
    assert w.anomalies == [] and not w.contained


def test_a_nan_the_program_replaces_before_the_loss_stays_absorbed():
    """A finite loss: backward() ran on it, and the nan that nan_to_num took out before it did
    not reach it: still absorbed, not named."""
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with opwatch.watch(warn=False) as w:
        for x, y in batches(3):
            scale = torch.nan_to_num(x.log().mean(dim=1, keepdim=True)).exp()  # log of negatives: nan, replaced
            optimizer.zero_grad()
            F.cross_entropy(model(x * scale), y, ignore_index=IGNORED).backward()
            optimizer.step()
    assert w.anomalies == []
    assert w.contained and all(found.op == "aten.log.default" for found in w.contained), w.contained
