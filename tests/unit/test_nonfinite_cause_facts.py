"""The nan/inf cause on plain data: the call an origin's op is run again with, rebuilt from the
log's arguments; the bounds the inputs' ranges give; each cause's words from its fact, also
after the JSON round trip."""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
import torch

from opwatch.storage.codec import rule_facts_from_saved
from opwatch.checks.finding import BeforeWatch, Finding, Owned, Place
from opwatch.checks.nonfinite.cause import INPUT, MATH, PRECISION, UNKNOWN, WEIGHTS, Cause, _bound, _call_of, _Slot
from opwatch.checks.nonfinite.rules import ValueRange
from opwatch.core.notation import TensorMeta
from opwatch.render.explanations import cause_line
from opwatch.render.messages import explain
from opwatch.storage.codec import decode, encode

aten = torch.ops.aten
F16, F32 = torch.float16, torch.float32
CPU = torch.device("cpu")


class Logged(NamedTuple):
    """What the cause reads of an op's record."""

    func: object
    args: tuple = ()
    inputs: tuple = ()
    outputs: tuple = ()


def meta(shape, dtype=F32, ident=1):
    return TensorMeta(tuple(shape), dtype, CPU, ident)


@pytest.mark.parametrize("func, args, count, expected", [
    (aten.add.Tensor, (("alpha", 2),), 2, ((_Slot(0), _Slot(1)), {"alpha": 2})),
    (aten.pow.Tensor_Scalar, (("exponent", 2),), 1, ((_Slot(0), 2), {})),
    (aten.sum.dim_IntList, (("dim", (-1,)), ("keepdim", True)), 1, ((_Slot(0), (-1,), True), {})),
    (aten.addmm.default, (), 3, ((_Slot(0), _Slot(1), _Slot(2)), {})),
    (aten.mean.dim, (("dim", (-1,)), ("keepdim", True)), 1, ((_Slot(0), (-1,), True), {})),
])
def test_an_ops_call_is_rebuilt_from_the_logs_arguments(func, args, count, expected):
    call = _call_of(func, Logged(func, args), count)
    assert (call.args, call.kwargs) == expected
    # and it runs
    tensors = [torch.ones(2, 2) for _ in range(count)]
    filled = [tensors[value.number] if type(value) is _Slot else value for value in call.args]
    func(*filled, **call.kwargs)


@pytest.mark.parametrize("func, args, count", [
    (aten.cat.default, (("dim", 0),), 2),  # a tensor list: where each sat is not logged
    (aten.add.out, (), 3),  # a tensor passed by keyword (out=)
    (aten.add.Tensor, (), 1),  # fewer tensors than the schema takes
])
def test_a_call_the_log_cannot_rebuild_is_not_run_again(func, args, count):
    assert _call_of(func, Logged(func, args), count) is None


def test_the_inputs_ranges_bound_an_overflowing_result():
    x = meta((10, 16), F16)
    pow_record = Logged(aten.pow.Tensor_Scalar, (("exponent", 2),), (x,), (x,))
    assert _bound(pow_record, "inf", [ValueRange(-300.0, 400.0)]) == 400.0**2
    mm = Logged(aten.mm.default, (), (meta((4, 32), F16), meta((32, 4), F16)), (meta((4, 4), F16),))
    assert _bound(mm, "inf", [ValueRange(-60.0, 50.0), ValueRange(-2.0, 3.0)]) == 32 * 60 * 3
    assert _bound(mm, "inf", [ValueRange(-60.0, 50.0), None]) is None  # an unknown range: no bound
    assert _bound(mm, "nan", [ValueRange(0.0, 1.0), ValueRange(0.0, 1.0)]) is None  # overflows are inf


def origin(cause, kind="nan", op="aten.addmm.default", inputs=(meta((8,)), meta((3, 4), ident=7), meta((4, 8))), ranges=None):
    facts = {
        "op": op, "inputs": inputs, "outputs": (meta((3, 8)),), "op_name": op.split(".")[1],
        "forward_op_name": None, "spread": 0, "last": None, "became_nan": None, "masked_by": None,
        "masked_by_name": None, "back_in_backward": None, "reached_parameter": False, "reached_gradient": True,
        "contained": False, "skipped_by_grad_scaler": False, "from_deliberate": False,
        "input_ranges": tuple((m, r) for m, r in zip(inputs, ranges or [ValueRange(-1.0, 1.0), None, ValueRange(-1.0, 1.0)])),
        "cause": cause, "absorbed": False,
    }
    return Finding(kind, "nonfinite.origin", rule_facts_from_saved("nonfinite.origin", kind, facts))  # as a log without the derived facts reads


def round_trip(finding):
    facts = decode(json.loads(json.dumps(encode(finding.facts["cause"]))))
    return Finding(finding.kind, finding.rule, finding.facts.replace(cause=facts))


CASES = [
    (Cause(INPUT, tensor=meta((3, 4), ident=7), held="nan", made=BeforeWatch(), through=meta((3, 4), ident=7)),
     "input: input f32[3, 4] cpu already held nan when addmm ran; it was made before the watch", "check the data", "from finite inputs"),
    (Cause(WEIGHTS, tensor=meta((8, 4), ident=9), held="inf", made=Owned("parameter", "fc", "weight", "Linear"), through=meta((3, 4), ident=7)),
     "weights: parameter f32[8, 4] cpu already held inf when addmm ran (its input f32[3, 4] cpu was taken from it)", "checkpoint", "lower the learning rate"),
    (Cause(PRECISION, None, F16, F32, 1.2e6),
     "precision: addmm made nan in f16, but not in f32: its result reaches 1.2e+06 in magnitude", "LlamaRMSNorm", "lower the learning rate"),
    (Cause(MATH, "div_zero_zero"), "undefined math: the divisor holds 0, and so does the dividend: 0 / 0 = nan, in float64 too", "0 / 0", "LlamaRMSNorm"),
    (Cause(UNKNOWN, tensor=meta((3, 4), ident=7), made=BeforeWatch()),
     "unknown: input f32[3, 4] cpu was made before the watch and is gone by the check point", "start the watch before", "made nan from finite inputs"),
]


@pytest.mark.parametrize("cause, line, fix_words, never", CASES, ids=[case[0].kind for case in CASES])
def test_each_cause_has_its_line_and_fix_also_read_back_from_json(cause, line, fix_words, never):
    for finding in (origin(cause), round_trip(origin(cause))):
        assert finding.facts["cause"] == cause and type(finding.facts["cause"]) is Cause
        assert cause_line(finding).startswith(line), cause_line(finding)
        problem, expected, fix = explain(finding)
        assert fix_words in fix, fix
        assert never not in problem + expected + fix


def test_an_origin_without_a_cause_says_why_none_was_decided_and_keeps_its_fix():
    # every nan/inf finding carries a cause line, or one clause saying why none was decided (issue 39)
    finding = origin(None, ranges=[ValueRange(-1.0, 1.0), ValueRange(-1.0, 1.0), ValueRange(-1.0, 1.0)])
    assert cause_line(finding).startswith("not decided: addmm could not be run again in a wider dtype")
    problem, _, fix = explain(finding)
    assert "made nan from finite inputs" in problem and fix.startswith("guard the inputs of this op")


@pytest.mark.parametrize("made, alive, health, inputs", [
    # made by an op in the watch: that op was checked, so the input was finite
    (Place("aten.add.Tensor", "train.py", 5, "forward"), False,
     "range unknown (made by aten.add.Tensor at train.py:5; its range was not kept, and it was no longer alive at the check point)", "from finite inputs"),
    ("before_watch", False, "range unknown (made before the watch; no longer alive)", "from inputs not all known to be finite"),
    ("before_watch", True, "range unknown (made before the watch; alive, but it held nan/inf or could not be read at the check point)", "from inputs not all known to be finite"),
    ("left_log", False, "range unknown (made by an op that has left the bounded log (max_records); no longer alive)", "from inputs not all known to be finite"),
    # a step GradScaler skipped: no walk of the live objects, so whether it was alive is not said
    ("before_watch", None, "range unknown (made before the watch; not looked for at a step GradScaler skipped)", "from inputs not all known to be finite"),
    (None, False, "range unknown (made before the watch or the last check point, and no longer alive)", "from inputs not all known to be finite"),  # an older log
])
def test_an_input_whose_range_is_unknown_is_told_where_it_was_made_and_whether_it_was_alive(made, alive, health, inputs):
    finding = origin(None)
    if made is None:  # a log of an opwatch before these facts has neither: read as their defaults
        facts = finding.facts.replace(input_made=(), input_alive=())
    else:
        facts = finding.facts.replace(input_made=(None, made, None), input_alive=(False, alive, False))
    finding = Finding(finding.kind, finding.rule, facts)
    problem, _, _ = explain(finding)
    assert f"input f32[3, 4] cpu: {health}" in problem, problem
    assert f"made nan {inputs} (" in problem, problem


def test_a_tensor_whose_storage_was_freed_is_not_read_again():
    """FSDP frees an unsharded parameter's storage after its forward (resize_(0)), the tensor
    object keeping its shape: the cause's re-runs must not read it (they crashed FSDP2 ranks)."""
    from opwatch.checks.nonfinite.cause import holds_its_data

    weight = torch.nn.Parameter(torch.randn(4, 3))
    assert holds_its_data(weight) and holds_its_data(weight.t()) and holds_its_data(weight[1:, 2])
    freed = torch.randn(4, 3)
    freed.untyped_storage().resize_(0)
    assert freed.shape == (4, 3) and not holds_its_data(freed)
    assert not holds_its_data(torch.empty(2, device="meta"))
    assert holds_its_data(torch.empty(0, 3))
