"""The nan/inf flags' buffers (opwatch.checks.nonfinite.tracker): each checked output's (min, max)
is written into two slots of a buffer of its device and dtype, the buffers are read at a check
point and filled again after it. A mixed-precision training loop interleaves float16, bfloat16,
float32 and float64 outputs over several buffers per dtype and several check points: the flag
must still land on the op that made the nan, and a healthy twin must report nothing.
"""

from __future__ import annotations

import torch
from torch import nn

import opwatch


class MixedHead(nn.Module):
    """A float32 layer, a bfloat16 and a float16 copy of its output, and a float64 loss: each
    forward and backward writes flags of four dtypes in turn."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, *, poison_at_step: int | None, step: int):
        h = self.fc(x)
        low = h.to(torch.bfloat16) * 2
        half = h.to(torch.float16) * 2
        if poison_at_step == step:
            half = torch.log(half - 1000)  # the nan's origin: log of a negative number
        return (h.double() + low.double() + half.double()).pow(2).mean()


def _train(*, poison_at_step: int | None, steps: int = 6):
    torch.manual_seed(0)
    model = MixedHead()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    with opwatch.watch(warn=False) as w:
        for step in range(steps):
            optimizer.zero_grad()
            # More than one buffer (32 pairs) per dtype fills between check points (the
            # optimizer step's pre-hook is one).
            for repeat in range(12):
                loss = model(x, poison_at_step=poison_at_step if repeat == 11 else None, step=step)
            loss.backward()
            optimizer.step()
    return w


def test_a_nan_among_interleaved_dtypes_is_flagged_at_its_op_after_buffers_were_reused():
    w = _train(poison_at_step=4)  # check points before it: the buffers are refilled by then
    (anomaly,) = [a for a in w.anomalies if a.kind == "nan"]
    assert anomaly.record.op == "aten.log.default"
    assert anomaly.record.phase == "forward" and anomaly.record.inputs[0].dtype == torch.float16
    assert "half = torch.log(half - 1000)" in anomaly.record.position.line_text()


def test_the_healthy_twin_reports_nothing():
    assert _train(poison_at_step=None).anomalies == []


def test_buffers_first_made_in_inference_mode_are_filled_again_outside_it():
    """A buffer made while inference mode was on serves the ops after it (made as a normal
    tensor: an inference tensor may not be written outside inference mode)."""
    with opwatch.watch() as w:
        with torch.inference_mode():
            torch.randn(3) * 2  # the first buffers are made here
        w.check()
        x = torch.tensor([1.0, 3.0, 4.0], requires_grad=True)
        y = torch.log(x - 2)  # nan from its first element, outside inference mode
        y.sum().backward()
    kinds = [anomaly.kind for anomaly in w.anomalies]
    assert kinds == ["nan"], kinds
    assert w.anomalies[0].record.op == "aten.log.default"


class WideBlock(nn.Module):
    """A wide layer whose activations are large enough (64 x 512) that, on a CPU, the tracker
    reads their (min, max) with amin and amax rather than aminmax; ``transposed`` works on the
    transposed activation, whose elementwise results keep its strides (not contiguous)."""

    def __init__(self, dtype):
        super().__init__()
        self.fc = nn.Linear(64, 512, dtype=dtype)
        self.head = nn.Linear(512, 1, dtype=dtype)

    def forward(self, x, *, fault: str | None, mask):
        h = self.fc(x)
        if fault == "nan":
            h = torch.log(h - 5)  # the nan's origin: log of a negative number
        elif fault == "inf":
            h = torch.exp(h * 1000)  # the inf's origin: exp overflows
        elif fault == "transposed nan":
            h = torch.sqrt(h.t() - 5).t()  # the nan's origin, on a non-contiguous activation
        # A deliberate "minus infinity" (finfo.min) in a large tensor: a mask, not an anomaly.
        scores = h.masked_fill(mask, torch.finfo(h.dtype).min)
        return self.head(torch.softmax(scores, dim=-1) * h).pow(2).mean()


def _train_wide(*, fault: str | None, dtype=torch.float32, steps: int = 5, fault_at: int = 3):
    torch.manual_seed(0)
    model = WideBlock(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 64, dtype=dtype)
    mask = torch.rand(64, 512) < 0.1
    with opwatch.watch(warn=False) as w:
        for step in range(steps):
            optimizer.zero_grad()
            loss = model(x, fault=fault if step == fault_at else None, mask=mask)
            loss.backward()
            optimizer.step()
    return w


def _counting(monkeypatch, name):
    """Count the calls of the tracker's kernel ``name`` (``_amin``): the large tensors' path."""
    from opwatch.checks.nonfinite import tracker

    calls = []
    kernel = getattr(tracker, name)

    def counted(*args, **kwargs):
        calls.append(args[0].numel())
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tracker, name, counted)
    return calls


def test_a_nan_in_a_large_cpu_activation_read_by_amin_and_amax_is_flagged_at_its_op(monkeypatch):
    calls = _counting(monkeypatch, "_amin")
    w = _train_wide(fault="nan")
    assert calls and max(calls) >= 64 * 512  # the large activations took the two-kernel path
    (anomaly,) = [a for a in w.anomalies if a.kind in ("nan", "inf")]
    assert anomaly.kind == "nan" and anomaly.record.op == "aten.log.default"
    assert "h = torch.log(h - 5)" in anomaly.record.position.line_text()


def test_an_inf_in_a_large_float64_activation_is_flagged_at_its_op():
    w = _train_wide(fault="inf", dtype=torch.float64)
    (anomaly,) = [a for a in w.anomalies if a.kind in ("nan", "inf")]
    assert anomaly.kind == "inf" and anomaly.record.op == "aten.exp.default"
    assert anomaly.record.outputs[0].dtype == torch.float64


def test_a_nan_in_a_non_contiguous_activation_is_flagged_at_its_op(monkeypatch):
    assert not torch.sqrt(torch.randn(512, 64).t()).is_contiguous()  # the kind of output it checks
    calls = _counting(monkeypatch, "_amin")
    w = _train_wide(fault="transposed nan")
    assert calls
    (anomaly,) = [a for a in w.anomalies if a.kind in ("nan", "inf")]
    assert anomaly.kind == "nan" and anomaly.record.op == "aten.sqrt.default"


def test_the_wide_healthy_twins_with_a_large_mask_report_nothing():
    for dtype in (torch.float32, torch.float64):
        assert _train_wide(fault=None, dtype=dtype).anomalies == []
