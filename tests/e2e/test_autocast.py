"""Mixed precision: ``torch.autocast`` mixes float32 with its lower-precision dtype by design.

Inside an autocast region, float32 meeting the autocast dtype is not an anomaly; float64 still
is; outside autocast nothing changes. Backward ops run by the autograd engine (outside the
autocast region) mirror forward promotions that were already judged and are not judged again.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import opwatch
from support import SCENARIOS, needs
from support.helpers import StubContext
from support.helpers import line_of as _line_of

import mixed_precision as mp  # noqa: E402

from opwatch.checks import dtype  # noqa: E402
from opwatch.core.notation import TensorMeta  # noqa: E402
from opwatch.render.messages import explain  # noqa: E402

SCENARIO = str(SCENARIOS / "mixed_precision.py")
aten = torch.ops.aten
CPU = torch.device("cpu")
F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


def line_of(text: str) -> int:
    return _line_of(text, SCENARIO)


def found(w):
    return [(a.kind, a.op, a.lineno, a.phase) for a in w.anomalies]


# -- the rule on its own (no mode running) ----------------------------------------------------


def context_in(phase="forward"):
    context = StubContext()
    context.phase = phase
    return context


def t(*shape, dtype=F32):
    return TensorMeta(tuple(shape), dtype, CPU, 0)


def promotion(a, b, phase="forward"):
    return dtype.for_op(aten.add.Tensor)((a, b), context_in(phase))


@pytest.mark.parametrize("low", [BF16, F16], ids=["bf16", "f16"])
def test_float32_with_the_autocast_dtype_passes_inside_autocast(low):
    with torch.autocast("cpu", dtype=low):
        assert promotion(t(4), t(4, dtype=low)) is None
    assert promotion(t(4), t(4, dtype=low)) is not None


def test_float64_is_flagged_inside_autocast():
    with torch.autocast("cpu", dtype=BF16):
        finding = promotion(t(4), t(4, dtype=F64))
        assert finding.rule == "dtype.silent_upcast" and finding.facts["result"] == F64
        assert "f32 with f64 -> f64" in explain(finding)[0]
        assert promotion(t(4, dtype=BF16), t(4, dtype=F64)) is not None


def test_a_dtype_autocast_does_not_use_is_flagged_inside_autocast():
    with torch.autocast("cpu", dtype=BF16):
        assert promotion(t(4), t(4, dtype=F16)) is not None


def test_autocast_disabled_inside_an_autocast_region_is_outside_autocast():
    with torch.autocast("cpu", dtype=BF16), torch.autocast("cpu", enabled=False):
        assert promotion(t(4), t(4, dtype=BF16)) is not None


def test_backward_promotions_are_not_judged_again():
    assert promotion(t(4), t(4, dtype=BF16), phase="backward") is None
    assert promotion(t(4), t(4, dtype=F64), phase="backward") is None
    # The kernel-raising rules still apply in backward.
    assert dtype.for_op(aten.mm.default)((t(2, 2), t(2, 2, dtype=F64)), context_in("backward")) is not None


# -- training loops ----------------------------------------------------------------------------


@pytest.mark.parametrize("low", [BF16, F16], ids=["bf16", "f16"])
def test_autocast_transformer_training_loop_runs_to_the_end_under_strict(low):
    reference = mp.train_lm(dtype=low)
    with warnings.catch_warnings():
        warnings.simplefilter("error", opwatch.OpwatchWarning)
        with opwatch.strict() as w:
            losses = mp.train_lm(dtype=low)
    assert w.anomalies == []
    assert losses == reference
    # The mix really happened, forward and backward: the test would be empty otherwise.
    assert any(r.op == "aten.add.Tensor" and {m.dtype for m in r.inputs} == {F32, low} for r in w.records)
    assert any(r.phase == "backward" and r.op == "aten.mul.Tensor" and {m.dtype for m in r.inputs} == {F32, low} for r in w.records)


def test_float64_meeting_the_model_under_autocast_is_still_flagged():
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict(warn=False, dump_on_error=False):
            mp.train_lm(model_class=mp.NumpyPositionsLM)
    anomaly = raised.value.anomaly
    assert (anomaly.kind, anomaly.op, anomaly.lineno, anomaly.phase) == (
        "dtype_mismatch", "aten.add.Tensor", line_of("x = self.embed(ids) + self.positions"), "forward")
    assert "f32 with f64 -> f64" in anomaly.message


def test_float32_with_bfloat16_outside_autocast_is_still_flagged():
    with opwatch.watch(warn=False) as w:
        mp.mixed_outside_autocast()
    assert found(w) == [("dtype_mismatch", "aten.add.Tensor", line_of("return x + h"), "forward")]


def test_a_forward_promotion_is_reported_once_not_again_by_its_backward():
    with opwatch.watch(warn=False) as w:
        mp.float64_parameter(steps=2)
    scale_line = line_of("return (self.body(x) * self.scale).sum(-1)")
    loss_line = line_of("loss = ((model(x) - y) ** 2).mean()")
    assert found(w) == [
        ("dtype_mismatch", "aten.mul.Tensor", scale_line, "forward"),
        ("dtype_mismatch", "aten.sub.Tensor", loss_line, "forward"),
    ] * 2


# -- tiny Hugging Face models -------------------------------------------------------------------

from support import hf_models as hf  # noqa: E402


@pytest.mark.parametrize("name", list(hf.MODELS))
def test_tiny_hf_models_under_bf16_autocast_have_no_anomalies(name):
    needs("transformers")
    model, inputs = hf.build(name, "sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notices
        with opwatch.watch(warn=False) as w:
            with torch.autocast("cpu", dtype=BF16):
                out = model(**inputs)
            out.loss.backward()
    assert torch.isfinite(out.loss)
    assert [repr(a) for a in w.anomalies] == []
    assert any({m.dtype for m in r.inputs} == {F32, BF16} for r in w.records)


def test_tiny_hf_model_under_float16_autocast_with_eager_attention():
    needs("transformers")
    model, inputs = hf.build("llama", "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with opwatch.watch(warn=False) as w:
            with torch.autocast("cpu", dtype=F16):
                out = model(**inputs)
            out.loss.backward()
    assert w.anomalies == []
