"""Floating promotions judged as the program wrote them: what it passed to torch's composite
functions (not what they do inside), where the promoted result is used (a cast straight back is
deliberate), and a fix naming the dtype the rest of the program uses.

Scenario programs: ``tests/scenarios/promotions.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import opwatch
import promotions as scenes  # noqa: E402
from support import SCENARIOS
from support.helpers import line_of as _line_of
from opwatch.checks import dtype as dtype_check
from opwatch.checks.promotions import LIMIT, PendingPromotions
from opwatch.render.messages import explain

SCENARIO = str(SCENARIOS / "promotions.py")
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def line_of(marker: str) -> int:
    return _line_of(marker, SCENARIO)


def watched(story, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with opwatch.watch(warn=False) as w:
            story(*args, **kwargs)
    return w


def strictly(story, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("error", opwatch.OpwatchWarning)
        with opwatch.strict() as w:
            result = story(*args, **kwargs)
    assert w.anomalies == []
    return result


def found(w):
    return [(a.kind, a.op, a.lineno) for a in w.anomalies]


# == a promotion cast straight back is deliberate ==============================================


@pytest.mark.parametrize("story", [scenes.moe_cast_back, scenes.moe_cast_back_bf16])
def test_moe_routing_weights_in_float32_cast_back_are_not_flagged(story):
    loss = strictly(story)
    assert torch.isfinite(loss)


def test_moe_product_flowing_on_in_float32_is_flagged_once_per_step():
    w = watched(scenes.moe_flows_on)
    # every expert, every step, at the product's line; the cast back of the sum is deliberate
    assert set(found(w)) == {("dtype_mismatch", "aten.mul.Tensor", line_of("# MOE_FLOWS"))}
    facts = w.anomalies[0].finding.facts
    assert facts["dtypes"] == [F16, F32] and facts["result"] == F32 and facts["common"] == F16


def test_strict_raises_before_the_promoted_value_is_used():
    hidden, weights = torch.randn(4, 8, dtype=F16), torch.rand(4, 1) + 1
    kept = []
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict(dump_on_error=False):
            kept.append(hidden * weights)  # the promotion runs: it is judged at its use
            kept[0].mul_(0)  # the first use computes on in float32: raises before it runs
    assert raised.value.anomaly.op == "aten.mul.Tensor"
    assert kept[0].dtype == F32 and bool((kept[0] != 0).all())


@pytest.mark.parametrize(
    "use, rules",
    [
        (lambda p, h: p.to(h.dtype), []),
        (lambda p, h: p.half(), []),
        (lambda p, h: p.view(-1)[:8].to(h.dtype), []),  # a view, then the cast back
        (lambda p, h: torch.zeros_like(h).copy_(p), []),
        # added into the float16 tensor: the promotion is cast back, but the in-place add rounds
        # a float32 operand silently (the accumulation check's rule, not the promotion's)
        (lambda p, h: h.clone().add_(p), ["dtype.narrowing_write"]),
        (lambda p, h: p.sum(), ["dtype.silent_upcast"]),
        (lambda p, h: p.to(F64), ["dtype.silent_upcast"]),  # cast wider: still not the program's dtype
        (lambda p, h: p.mul_(2), ["dtype.silent_upcast"]),  # computed on in place
        (lambda p, h: p.view(-1) + 1, ["dtype.silent_upcast"]),
    ],
)
def test_the_first_use_of_a_promoted_result_decides(use, rules):
    hidden, weights = torch.randn(4, 8, dtype=F16), torch.rand(4, 1)
    with opwatch.watch(warn=False) as w:
        kept = use(hidden * weights, hidden)
    assert [a.finding.rule for a in w.anomalies] == rules
    del kept


def test_a_promoted_result_never_used_is_reported_at_the_end_of_the_block():
    with opwatch.watch(warn=False) as w:
        product = torch.randn(4, dtype=F16) * torch.rand(4)
    assert [a.op for a in w.anomalies] == ["aten.mul.Tensor"]
    assert product.dtype == F32


def test_a_float32_parameter_left_in_a_float16_model_stays_flagged():
    w = watched(scenes.quantizer_training)
    assert set(found(w)) == {("dtype_mismatch", "aten.mul.Tensor", line_of("# CODEVECTORS"))}
    message = w.anomalies[0].message
    assert "parameter" in message and "codevectors" in message


def test_pending_promotions_are_bounded():
    pending = PendingPromotions()
    facts = dtype_check.SilentUpcast(first=F16, second=F32, dtypes=[F16, F32], result=F32, count=2, names=["self", "other"], common=F16)
    finding = dtype_check.Finding(dtype_check.KIND, "dtype.silent_upcast", facts)
    kept = [torch.zeros(1) for _ in range(LIMIT)]
    for tensor in kept:
        assert pending.takes(finding)
        assert pending.wait(finding, None, (tensor,))
    assert not pending.takes(finding)  # the next one is reported at once
    assert len(pending.unused()) == LIMIT and not pending


# == what the program passed to a composite, not what torch does inside ========================


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("math", [True, False], ids=["math", "default"])
def test_sdpa_with_one_dtype_is_not_flagged(dtype, math):
    loss = strictly(scenes.attention_training, dtype, math=math)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("math", [True, False], ids=["math", "default"])
def test_sdpa_with_a_float32_mask_into_bfloat16_is_legal(math):
    # torch documents a float mask as legal; the math path adds it in float32 and casts back.
    loss = strictly(scenes.attention_training, BF16, mask_dtype=F32, math=math)
    assert torch.isfinite(loss)


def test_the_math_sdpa_upcasts_inside():
    """The premise: torch's math SDPA does promote inside the user's one call."""
    q = torch.randn(1, 2, 4, 8, dtype=F16)
    mask = torch.zeros(1, 1, 4, 4, dtype=F16)
    records = []
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with opwatch.watch(warn=False) as w, sdpa_kernel([SDPBackend.MATH]):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    records = [r for r in w.records if r.op == "aten.add.Tensor"]
    assert [m.dtype for m in records[0].inputs] == [F32, F16] and w.anomalies == []


def test_rms_norm_in_half_precision_is_not_flagged():
    x, weight = torch.randn(4, 8, dtype=F16), torch.randn(8, dtype=F16)
    with opwatch.watch(warn=False) as w:
        y = F.rms_norm(x, (8,), weight).sum()
    assert w.anomalies == [] and y.dtype == F16


def test_a_composite_given_mixed_dtypes_is_still_flagged():
    # F.gaussian_nll_loss with a float64 variance from numpy: the program passed two floating
    # dtypes, and the float64 loss flows on.
    prediction, target = torch.randn(6), torch.randn(6)
    variance = torch.from_numpy(np.full(6, 0.5))
    with opwatch.watch(warn=False) as w:
        loss = F.gaussian_nll_loss(prediction, target, variance)
        loss.item()
    assert loss.dtype == F64 and w.anomalies and w.anomalies[0].kind == "dtype_mismatch"


def test_a_composite_casting_its_result_back_is_not_flagged():
    # rms_norm with a float64 weight computes in float64, then casts back to the input's dtype
    # (torch 2.13 and 2.14; 2.6's returns the float64, which flows on: flagged, as any silent upcast).
    x, weight = torch.randn(4, 8), torch.randn(8, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "Cannot dispatch to fused implementation"
        casts_back = F.rms_norm(x, (8,), weight).dtype == F32
        with opwatch.watch(warn=False) as w:
            y = F.rms_norm(x, (8,), weight).sum()
    if casts_back:
        assert y.dtype == F32 and w.anomalies == []
    else:
        assert y.dtype == F64 and [(a.kind, a.op) for a in w.anomalies] == [("dtype_mismatch", "aten.mul.Tensor")]


# == the fix names the dtype the rest of the program uses =====================================


@pytest.mark.parametrize("first", [True, False], ids=["float64-first", "float64-second"])
def test_float64_numpy_weights_are_flagged_with_the_models_dtype_in_the_fix(first):
    w = watched(scenes.numpy_weight_training, first)
    marker = "# FLOAT64_FIRST" if first else "# FLOAT64_SECOND"
    assert set(found(w)) == {("dtype_mismatch", "aten.mul.Tensor", line_of(marker))}
    anomaly = w.anomalies[0]
    assert anomaly.finding.facts["common"] == F32 and anomaly.finding.odd[0][1] == F64
    problem, expected, fix = explain(anomaly.finding)
    assert "torch.from_numpy(a).to(f32)" in fix and "f64)" not in fix
    assert "silent promotion " + ("f64 with f32" if first else "f32 with f64") + " -> f64" in problem


@pytest.mark.parametrize("first", [F64, F32])
def test_one_dtype_ops_expect_the_non_odd_dtype_first(first):
    second = F32 if first == F64 else F64
    a, b = torch.ones(5, 3, dtype=first), torch.ones(3, 2, dtype=second)
    with opwatch.watch(warn=False) as w, pytest.raises(RuntimeError):
        a @ b
    finding = w.anomalies[0].finding
    assert finding.rule == "dtype.one_dtype" and finding.facts["common"] == F32
    assert explain(finding)[1] == "every operand in f32 (or all in f64)"
