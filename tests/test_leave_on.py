"""Leave it on (issue 18): the optimizer step as a check point of a watch, ``python -m opwatch
--guard``, and the trainers' guard mode; real training loops, real GradScaler."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import opwatch
from helpers import line_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Regressor(nn.Module):
    """A small MLP; ``bug="backward nan"`` makes a nan only in backward (a masked log)."""

    def __init__(self, bug=None):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 1)
        self.bug = bug

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.bug == "backward nan":
            h = torch.where(h > 0, h, h.log())  # BUG backward: log'(0) * 0 = nan, forward masked
        return self.fc2(h).squeeze(-1)


def batches(count, size=8):
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        x = torch.randn(size, 4, generator=generator)
        yield x, x.sum(-1)


# -- item 2: the optimizer step is a check point of a watch ---------------------------------


def test_strict_raises_before_the_optimizer_writes_a_backward_nan_into_the_weights():
    torch.manual_seed(0)
    model = Regressor("backward nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(batches(1))
    with pytest.raises(opwatch.AnomalyError) as caught:
        with opwatch.strict():
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()  # no host read: only the optimizer step is a check point before
            optimizer.step()
    anomaly = caught.value.anomaly
    assert anomaly.kind in ("nan", "inf")
    assert (anomaly.filename, anomaly.lineno) == (__file__, line_of("BUG backward", __file__))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_watch_reports_at_the_optimizer_step_and_the_step_runs():
    torch.manual_seed(0)
    model = Regressor("backward nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(batches(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with opwatch.watch() as w:
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            found_at_step = [a.kind for a in w.anomalies]
    assert found_at_step and found_at_step[0] in ("nan", "inf")  # found before the block ended: at the optimizer step
    assert not torch.isfinite(model.fc1.weight).all()  # watch() only reports


def test_a_healthy_step_under_strict_is_bitwise_eager_and_raises_nothing():
    results = []
    for watched in (False, True):
        torch.manual_seed(0)
        model = Regressor()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        for x, y in batches(3):
            optimizer.zero_grad()
            with opwatch.strict() if watched else _nothing():
                ((model(x) - y) ** 2).mean().backward()
                optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_hook_is_registered_once_for_nested_watches_and_removed_by_the_last():
    from opwatch.session import _steps_checked

    calls = []
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not _steps_checked.registered
    with opwatch.watch() as outer:
        outer._before_optimizer_step = lambda: calls.append("outer")
        with opwatch.watch() as inner:
            inner._before_optimizer_step = lambda: calls.append("inner")
            assert _steps_checked.registered
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
        assert _steps_checked.registered
        optimizer.step()
    assert not _steps_checked.registered
    optimizer.step()
    assert calls == ["inner", "outer", "outer"]


def scaled_fp16_loop(steps, wrap, init_scale=2.0**40):
    """A CPU autocast fp16 loop with a real GradScaler; the huge first scale overflows the
    first steps' gradients, which the scaler skips (and lowers its scale)."""
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scales = []
    for x, y in batches(steps):
        optimizer.zero_grad()
        with wrap():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x) - y) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scales.append(scaler.get_scale())
    return model, scales


def test_gradscaler_skipped_steps_do_not_raise_under_strict():
    model, scales = scaled_fp16_loop(8, opwatch.strict)
    assert scales[0] < 2.0**40  # the scaler found inf and skipped at least one step
    assert all(torch.isfinite(p).all() for p in model.parameters())
    eager, eager_scales = scaled_fp16_loop(8, _nothing)
    assert scales == eager_scales
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
