"""The nan/inf explanations on hand-built facts: each cause its own reason and its own fix
(log of a negative number is nan, log(0) is -inf), from the inputs' ranges when they are
known, else from the op and the kind it made."""

from __future__ import annotations

import pytest
import torch

from opwatch.storage.codec import rule_facts_from_saved
from opwatch.checks.finding import Finding
from opwatch.checks.nonfinite.rules import ValueRange
from opwatch.render.messages import explain

F32 = torch.float32


def meta(shape=(6,), dtype=F32):
    return (shape, dtype, torch.device("cpu"), 1)


def origin(op, kind, ranges, *, forward_op_name=None, dtype=F32):
    """The facts of a ``nonfinite.origin`` finding of ``op`` (``aten.log.default``) whose
    floating inputs had ``ranges`` (``(min, max)`` or ``None`` each)."""
    inputs = tuple(meta(dtype=dtype) for _ in ranges)
    facts = {
        "op": op, "inputs": inputs, "outputs": (meta(dtype=dtype),), "op_name": op.split(".")[1].rstrip("_"),
        "forward_op_name": forward_op_name, "spread": 0, "last": None, "became_nan": None, "masked_by": None,
        "masked_by_name": None, "back_in_backward": None, "reached_parameter": False, "reached_gradient": True,
        "contained": False, "skipped_by_grad_scaler": False, "from_deliberate": False,
        "input_ranges": tuple((m, None if r is None else ValueRange(*r)) for m, r in zip(inputs, ranges)),
    }
    return Finding(kind, "nonfinite.origin", rule_facts_from_saved("nonfinite.origin", kind, facts))  # as a log without the derived facts reads


# (op, kind, input ranges, words the reason must hold (None: no reason), words the fix must
# hold, words neither may hold)
CASES = [
    ("aten.log.default", "nan", [(-0.5, 0.9)], "log of a negative number is nan", "must be positive", "log(0)"),
    ("aten.log.default", "inf", [(0.0, 0.9)], "log(0) = -inf", "clamp_min(eps).log()", "negative"),
    ("aten.log.default", "nan", [None], None, "must be positive", "log(0)"),
    ("aten.log.default", "inf", [None], None, "log(0) = -inf", "negative"),
    ("aten.log2.default", "nan", [(-1.0, 1.0)], "log2 of a negative number is nan", "must be positive", "log2(0)"),
    ("aten.log10.default", "inf", [(0.0, 3.0)], "log10(0) = -inf", "clamp_min(eps).log10()", "negative"),
    ("aten.log1p.default", "nan", [(-2.0, 1.0)], "below -1 it is nan", "x > -1", "log(0)"),
    ("aten.sqrt.default", "nan", [(-1.0, 4.0)], "sqrt of a negative number is nan", "clamp_min(0).sqrt()", "log"),
    ("aten.sqrt.default", "nan", [None], None, "sqrt of a negative number is nan", "log"),
    ("aten.rsqrt.default", "inf", [(0.0, 2.0)], "rsqrt(0) = inf", "(x + eps).rsqrt()", "negative"),
    ("aten.rsqrt.default", "nan", [(-2.0, 2.0)], "rsqrt of a negative number is nan", "clamp_min(0) + eps", "rsqrt(0)"),
    ("aten.div.Tensor", "inf", [(1.0, 2.0), (0.0, 3.0)], "x / 0 = inf", "division by zero", "0 / 0"),
    ("aten.div.Tensor", "nan", [(0.0, 2.0), (0.0, 3.0)], "0 / 0 = nan", "0 / 0 = nan", "x / 0 = inf"),
    ("aten.div_.Tensor", "nan", [None, None], None, "0 / 0 = nan", "x / 0 = inf"),
    ("aten.div.Tensor", "inf", [None, (0.0, 1.0)], "x / 0 = inf", "division by zero", "0 / 0"),
    ("aten.pow.Tensor_Scalar", "nan", [(-3.0, 3.0)], "negative base to a fractional power", "clamp_min(0) ** p", "overflow"),
    ("aten.pow.Tensor_Scalar", "inf", [(0.0, 0.5)], "0 to a negative power is inf", "clamp_min(eps) ** p", "fractional"),
    ("aten.pow.Tensor_Scalar", "inf", [(2.0, 90.0)], None, "pow overflowed", "fractional"),
    ("aten.acos.default", "nan", [(-0.5, 1.0001)], "outside [-1, 1] is nan", "x.clamp(-1, 1)", "overflow"),
    ("aten.asin.default", "nan", [None], None, "asin is nan outside [-1, 1]", "overflow"),
    ("aten.atanh.default", "inf", [(-0.2, 1.0)], "atanh(+-1) = +-inf", "(-1 + eps, 1 - eps)", "overflow"),
    ("aten.exp.default", "inf", [(0.0, 120.0)], "exp overflows f32 above 88.72", "subtract the max", "negative"),
    ("aten.exp.default", "inf", [None], None, "exp overflowed", "negative"),
    ("aten.mul.Tensor", "inf", [(-3e38, 3e38), (2.0, 2.0)], None, "outgrew the dtype", "division"),
    ("aten.mm.default", "inf", [None, None], None, "outgrew the dtype", "division"),
]


@pytest.mark.parametrize("op, kind, ranges, reason, fix_words, wrong", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_each_cause_gets_its_own_reason_and_fix(op, kind, ranges, reason, fix_words, wrong):
    problem, _, fix = explain(origin(op, kind, ranges))
    health = problem.split(" made ", 1)[1]
    if reason is None:
        assert " -> " not in health, health
    else:
        assert f" -> {reason}" in health or reason in health.split(" -> ", 1)[1], health
    assert fix_words in fix, fix
    assert wrong not in fix and (reason is None or wrong not in health.split(" -> ", 1)[1]), (health, fix)


def test_a_cause_that_does_not_fit_the_kind_is_not_claimed():
    """inf from log whose input range dips below 0 (a range known only as a bound): the inf is
    log(0); nan from log whose input's min is 0 is not log(0)."""
    _, _, fix = explain(origin("aten.log.default", "inf", [(-1.0, 2.0)]))
    assert "log(0) = -inf" in fix
    problem, _, fix = explain(origin("aten.log.default", "nan", [(0.0, 2.0)]))
    assert "log(0)" not in problem and "log(0)" not in fix and "must be positive" in fix


@pytest.mark.parametrize("forward, words", [
    ("log", "the gradient of log at 0 is inf"),
    ("sqrt", "the gradient of sqrt at 0 is inf"),
    ("rsqrt", "the gradient of rsqrt at 0 is inf"),
    ("atanh", "the gradient of atanh is inf at +-1"),
    ("div", "the gradient of a / b is inf where b is 0"),
])
def test_a_backward_origin_gets_the_fix_of_its_forward_op(forward, words):
    _, _, fix = explain(origin("aten.div.Tensor", "inf", [(-1.0, 1.0), (0.0, 1.0)], forward_op_name=forward))
    assert fix.startswith(words), fix


def test_an_origin_without_a_cause_says_in_one_clause_why_none_was_decided():
    """Every nan/inf origin has a cause line (issue 39): where the check decided none, the line
    says why, with the reason its facts show."""
    from opwatch.render.nonfinite import explain_cause

    finding = origin("aten.erfinv.default", "inf", [(-0.5, 0.5)])
    finding = Finding(finding.kind, finding.rule, finding.facts.replace(cause=None))
    line = explain_cause(finding)
    assert line.startswith("not decided: erfinv could not be run again in a wider dtype") and line.count(":") == 1
    unknown = origin("aten.erfinv.default", "inf", [None])
    unknown = Finding(unknown.kind, unknown.rule, unknown.facts.replace(cause=None, input_made=("before_watch",), input_alive=(False,)))
    assert explain_cause(unknown).startswith("not decided: an input's values were not known")
    skipped = origin("aten.mul.Tensor", "inf", [(1.0, 2.0)])
    skipped = Finding(skipped.kind, skipped.rule, skipped.facts.replace(cause=None, skipped_by_grad_scaler=True, contained=True))
    assert explain_cause(skipped).startswith("transient: mul overflowed in the gradients GradScaler scaled up")
