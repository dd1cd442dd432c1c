"""A float32 run that diverged: its causes say so, not "compute it in float64".

A learning rate too high grows the weights step after step until an op's float32 result passes
3.4e38. The first inf is a precision cause (finite in float64), and the fix used to say
"compute this op in float64", which only moves the overflow a few steps on. And a LayerNorm
whose input spans more than sqrt(3.4e38) (its float32 variance overflows) was "not decided".

Must flag: a ReLU MLP and a LayerNorm MLP trained by SGD at a diverging learning rate. Must not:
the same models at a sane learning rate (silent); float16 overflows keep their float32 fix; a
float64 LayerNorm and a batch norm are no variance overflow.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import opwatch
from opwatch.checks.nonfinite.cause import NORM_VARIANCE, PRECISION, range_cause
from opwatch.checks.nonfinite.rules import ValueRange
from opwatch.core.notation import TensorMeta


def mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def layer_norm_mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1))


def train(make, lr, steps=30):
    """SGD on a regression whose targets are ten times the inputs' sum; the watch ends at the
    first loss that is not finite. Returns the watch and the steps run."""
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    w = opwatch.watch(warn=False, dump_on_error=False)
    with w:
        for step in range(steps):
            x = torch.randn(32, 16)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) * 10)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if not math.isfinite(loss.item()):
                return w, step + 1
    return w, steps


def first_nonfinite(w):
    return next(a for a in w.anomalies if a.kind in ("nan", "inf"))


def line(anomaly, label):
    (found,) = [text for text in anomaly.message.splitlines() if text.startswith(f"  {label}:")]
    return found


def test_a_diverged_mlp_s_float32_overflow_is_told_as_a_diverged_run():
    w, _ = train(mlp, lr=0.5)
    first = first_nonfinite(w)
    cause = first.finding.facts["cause"]
    assert first.kind == "inf" and cause.kind == PRECISION and cause.dtype == torch.float32 and cause.wider == torch.float64, cause
    fix = line(first, "fix")
    assert fix.startswith("  fix:      values past f32's range (3.4e+38) do not come from healthy training: values this large (its inputs reach ")
    assert "the run diverged" in fix and "lower the learning rate" in fix and not fix.startswith("  fix:      compute this op in float64")


def test_a_diverged_layer_norm_s_variance_overflow_is_decided():
    w, _ = train(layer_norm_mlp, lr=5.0)
    first = first_nonfinite(w)
    cause = first.finding.facts["cause"]
    assert first.op == "aten.native_layer_norm.default" and first.kind == "nan"
    assert (cause.kind, cause.detail, cause.wider, cause.bound) == (PRECISION, NORM_VARIANCE, torch.float64, True), cause
    told = line(first, "cause")
    assert told.startswith("  cause:    precision: native_layer_norm made nan in f32: its input spans ")
    assert "the variance is inf, and the normalised values nan; finite in f64" in told
    assert "the run diverged" in line(first, "fix")


@pytest.mark.parametrize("make", [mlp, layer_norm_mlp], ids=["mlp", "layer norm"])
def test_the_same_models_at_a_sane_learning_rate_report_nothing(make):
    w, steps = train(make, lr=1e-3)
    assert steps == 30 and w.anomalies == [] and w.contained == []


def _meta(dtype=torch.float32):
    return TensorMeta((32, 64), dtype, torch.device("cpu"), 0)


def test_only_a_float32_layer_or_group_norm_past_sqrt_of_float32_s_max_is_a_variance_overflow():
    wide = [ValueRange(-1e20, 1e20)]
    narrow = [ValueRange(-1e18, 1e18)]  # (2e18)**2 = 4e36: below 3.4e38
    assert range_cause("native_layer_norm", "nan", (_meta(),), wide) == NORM_VARIANCE
    assert range_cause("native_group_norm", "nan", (_meta(torch.bfloat16),), wide) == NORM_VARIANCE
    assert range_cause("native_layer_norm", "nan", (_meta(),), narrow) is None
    assert range_cause("native_layer_norm", "nan", (_meta(torch.float64),), wide) is None  # a float64 variance holds it
    assert range_cause("native_batch_norm", "nan", (_meta(),), wide) is None  # stays finite on a CPU
    assert range_cause("native_layer_norm", "inf", (_meta(),), wide) is None


def test_a_float16_overflow_keeps_its_float32_fix():
    torch.manual_seed(0)
    head = nn.Linear(16, 10).half()
    features = torch.randn(4, 16).half() * 20

    with opwatch.watch(warn=False, dump_on_error=False) as w:
        logits = head(features)
        e = logits.exp()  # softmax by hand, without subtracting the max
        (e / e.sum(-1, keepdim=True)).float().sum().item()
    first = first_nonfinite(w)
    assert first.finding.facts["cause"].wider == torch.float32
    assert "diverged" not in line(first, "fix")
