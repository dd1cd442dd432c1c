"""A float16 run GradScaler skips for good: its gradients are not finite unscaled either.

GradScaler finds its scale by overflowing now and then: it skips the step and halves the scale.
What it finds at a scale of 2 or more may be its own doing (the scaled gradients overflow); below
1 it scales the loss *down*, so gradients it finds not finite are so unscaled too, and it skips
every step from then on while its scale falls toward 0. The watch contains the first kind (the
scaler's business) and reports the second as an anomaly, with its cause; before, every such
origin was contained and a run whose scale fell to 1e-13 said "no anomalies".

The program: a metric-learning step whose pairwise Euclidean distances include each embedding's
distance to itself (0), masked out by a multiplication. sqrt's backward at 0 is 0 / 0 = nan in
every step's gradients while the loss stays finite.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import opwatch
from support.helpers import line_of


def metric_learning_loop(steps, *, clamped=False, init_scale=2.0**16, fused=False):
    """An fp16 autocast encoder trained on a contrastive loss with GradScaler; returns the scaler.
    ``clamped``: the distances' sqrt takes a clamped input (the fix), so every gradient is finite."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    for _ in range(steps):
        x, labels = torch.randn(32, 16), torch.randint(0, 4, (32,))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            emb = encoder(x).float()
        squared = ((emb[:, None] - emb[None]) ** 2).sum(-1)
        dist = squared.clamp_min(1e-12).sqrt() if clamped else squared.sqrt()  # distances: the sqrt
        same = (labels[:, None] == labels[None]).float()
        off_diagonal = 1 - torch.eye(len(x))
        loss = (same * off_diagonal * dist).mean() + ((1 - same) * torch.relu(1 - dist)).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaler


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_a_scale_that_fell_below_1_makes_the_skipped_origin_an_anomaly_with_its_cause(fused):
    """A fused optimizer's check runs at GradScaler's dummy scale of exactly 1 and its step takes
    the scale (``grad_scale``): its origins are judged there, as the others' at the check (they
    were all contained: "no anomalies" at a scale of 5.7e-14)."""
    if fused and not _fused_adamw_runs_on_cpu():
        pytest.skip("this torch has no fused AdamW on the CPU")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        with opwatch.watch() as w:
            scaler = metric_learning_loop(20, fused=fused)
    assert scaler.get_scale() < 1  # GradScaler skipped every step: 65536 halved 20 times
    anomalies = [anomaly for anomaly in w.anomalies if anomaly.kind == "nan"]
    # 65536 / 2**16 = 1: the 17th check ran at 1, the 18th to 20th below it
    assert len(anomalies) == 3 and len(w.contained) == 17
    first = anomalies[0]
    assert (first.op, first.lineno, first.phase) == ("aten.div.Tensor", line_of("# distances: the sqrt", __file__), "backward")
    assert ("GradScaler found it with its scale down to 0.5 and skipped the step: below 1 the gradients are not finite unscaled "
            "either, so it skips every such step and its scale falls for ever") in first.message
    assert "cause:    undefined math: the divisor holds 0, and so does the dividend: 0 / 0 = nan" in first.message
    assert "fix:      the gradient of sqrt at 0 is inf: clamp the input" in first.message


def test_the_skips_while_the_scale_finds_its_level_stay_contained():
    """A scale started far too high (2**40): the first steps overflow the scaled gradients and are
    skipped until the scale is low enough; the gradients are finite, and nothing is reported."""
    with opwatch.watch() as w:
        scaler = metric_learning_loop(30, clamped=True, init_scale=2.0**40)
    assert 1 <= scaler.get_scale() < 2.0**40
    assert list(w.anomalies) == [] and len(w.contained) >= 1
    assert all(anomaly.finding.facts.skipped_by_grad_scaler and anomaly.finding.facts.grad_scaler_scale is None for anomaly in w.contained)


def test_a_fused_optimizer_checks_at_a_dummy_scale_of_1_and_its_skips_stay_contained():
    """A fused optimizer's step is checked with GradScaler's dummy ``inv_scale`` of exactly 1, which
    says nothing of its scale: its skips while the scale is far too high stay the scaler's."""
    if not _fused_adamw_runs_on_cpu():
        pytest.skip("this torch has no fused AdamW on the CPU")
    with opwatch.watch() as w:
        scaler = metric_learning_loop(30, clamped=True, init_scale=2.0**40, fused=True)
    assert scaler.get_scale() < 2.0**40 and list(w.anomalies) == []


def test_the_fixed_program_trains_under_grad_scaler_with_no_finding():
    with opwatch.watch() as w:
        scaler = metric_learning_loop(20, clamped=True)
    assert scaler.get_scale() >= 1 and list(w.anomalies) == [] and list(w.contained) == []


def _fused_adamw_runs_on_cpu() -> bool:
    try:
        parameter = nn.Parameter(torch.ones(2))
        parameter.grad = torch.ones(2)
        torch.optim.AdamW([parameter], fused=True).step()
        return True
    except RuntimeError:
        return False
