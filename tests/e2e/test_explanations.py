"""Diagnoses that explain the cause, each on a realistic program, with a message golden and a
case that must stay quiet: the inputs' health at a nan/inf origin, the torch.where gradient
trap, where a stray tensor was made, and fp16 headroom (``overflow_risk``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sys

import json

import opwatch
from opwatch.checks.nonfinite.rules import ValueRange
from opwatch.render.messages import explain
from opwatch.storage.codec import finding_fields, finding_from_fields
from support import SCENARIOS, assert_golden, needs_columns
from support.helpers import line_of as _line_of

import explanations as scenarios  # noqa: E402


def line_of(marker):
    return _line_of(marker, str(SCENARIOS / "explanations.py"))


def watched(program, **options):
    with opwatch.watch(warn=False, **options) as w:
        try:
            program()
        except RuntimeError:
            pass  # torch's own error after the report (a device mix)
    return w


def first(w, kind):
    return next(anomaly for anomaly in w.anomalies if anomaly.kind == kind)


# -- input health at the origin ------------------------------------------------------------


@needs_columns
def test_an_origin_states_its_inputs_ranges_and_what_explains_the_result():
    w = watched(scenarios.train_log_likelihood, dump_on_error=False)
    anomaly = first(w, "inf")
    assert (anomaly.op, anomaly.lineno) == ("aten.log.default", line_of("# log of a probability"))
    assert "(input f32[6] cpu: min 0, max " in anomaly.message
    assert "-> log(0) = -inf)" in anomaly.message
    assert_golden("message_input_health.txt", anomaly.message + "\n")


def test_an_input_made_before_the_watch_and_alive_is_measured_at_the_check_point():
    x = torch.tensor([-1.0, 4.0])  # made before the watch, alive at the check point
    with opwatch.watch(warn=False) as w:
        y = x.sqrt()
    (anomaly,) = w.anomalies
    assert "input f32[2] cpu: min -1, max 4 -> sqrt of a negative number is nan" in anomaly.message
    del y


# -- the torch.where gradient trap ------------------------------------------------------------


@needs_columns
def test_the_where_gradient_trap_tells_its_story():
    w = watched(scenarios.train_distance)
    anomaly = first(w, "nan")
    assert (anomaly.op, anomaly.lineno, anomaly.phase) == ("aten.sqrt.default", line_of("# the where-gradient trap"), "forward")
    assert "masked in forward by aten.where.self" in anomaly.message
    assert "came back in backward" in anomaly.message and "the torch.where gradient trap" in anomaly.message
    assert "double-where trick" in anomaly.message
    assert_golden("message_where_trap.txt", anomaly.message + "\n")
    facts = anomaly.finding.facts
    assert anomaly.finding.rule == "nonfinite.origin" and facts["op_name"] == "sqrt"
    assert (facts["masked_by"].op, facts["masked_by_name"]) == ("aten.where.self", "where")
    assert facts["back_in_backward"].phase == "backward" and facts["reached_gradient"] and not facts["contained"]


def test_the_double_where_fix_is_quiet_and_its_gradients_finite():
    with opwatch.strict():
        parameters = scenarios.train_distance(double_where=True)
    assert all(torch.isfinite(p).all() for p in parameters)


def test_a_where_that_masks_a_nan_nobody_differentiates_is_contained():
    with opwatch.strict() as w:
        d = torch.tensor([-1.0, 4.0])
        r = torch.where(d > 0, torch.sqrt(d), 0.0)
        total = r.sum().item()
    assert total == 2.0 and w.anomalies == [] and len(w.contained) == 1
    facts = w.contained[0].finding.facts
    assert facts["contained"] and facts["masked_by"] is not None and facts["back_in_backward"] is None
    assert [value_range for _, value_range in facts["input_ranges"]] == [ValueRange(-1.0, 4.0, within=False)]


# -- facts survive a saved log ----------------------------------------------------------------


def _json_round_trip(finding):
    """The finding as a JSON export stores it and ``opwatch.load`` reads it back."""
    return finding_from_fields(json.loads(json.dumps(finding_fields(finding))))


@pytest.mark.parametrize("program, kind", [
    (scenarios.train_distance, "nan"),
    (scenarios.train_log_likelihood, "inf"),
    (scenarios.float16_headroom, "overflow_risk"),
])
def test_nonfinite_facts_survive_a_json_round_trip_and_render_the_same(program, kind):
    w = watched(program, dump_on_error=False)
    finding = first(w, kind).finding
    saved = _json_round_trip(finding)
    assert type(saved.facts) is type(finding.facts) and explain(saved) == explain(finding)


# -- where a stray tensor was made ----------------------------------------------------------


@needs_columns
def test_a_device_mix_names_the_plain_tensor_attribute_that_to_did_not_move():
    w = watched(scenarios.attention_moved_to_meta, dump_on_error=False)
    anomaly = first(w, "device_mismatch")
    assert anomaly.lineno == line_of("# meets the stray scale")
    assert "Attention.scale is a plain tensor attribute of module Attention" in anomaly.message
    assert "self.register_buffer('scale', ...)" in anomaly.message
    assert_golden("message_stray_attribute.txt", anomaly.message + "\n")


def test_a_dtype_mix_names_the_op_and_line_that_made_the_odd_operand():
    w = watched(scenarios.float64_noise)
    anomaly = first(w, "dtype_mismatch")
    assert f"f64[4, 3] cpu: made by aten.zeros at explanations.py:{line_of('# the stray float64')} with dtype=torch.float64" in anomaly.message


def test_a_parameter_is_named_as_such():
    model = nn.Linear(3, 2)
    model.bias.data = model.bias.data.double()  # one float64 parameter, loaded from a checkpoint
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        with pytest.raises(RuntimeError):  # torch's own error follows the report
            model(torch.randn(4, 3))
    (anomaly,) = w.anomalies
    assert "Where the odd one came from: f64[2] cpu: it is the parameter bias of Linear." in anomaly.message


def test_an_operand_made_before_the_watch_says_so():
    stray = torch.zeros(3, dtype=torch.float64)
    with opwatch.watch(warn=False) as w:
        torch.ones(3) + stray
    assert "f64[3] cpu: it was made before the watch" in w.anomalies[0].message


# -- fp16 headroom ----------------------------------------------------------------------------


@needs_columns
def test_float16_activations_near_the_limit_are_an_overflow_risk():
    w = watched(scenarios.float16_headroom)
    anomaly = first(w, "overflow_risk")
    assert (anomaly.op, anomaly.lineno, anomaly.module) == ("aten.addmm.default", line_of("# activations near the float16 limit"), "up")
    assert "below the largest float16 (65504)" in anomaly.message
    assert_golden("message_overflow_risk.txt", anomaly.message + "\n")


def test_healthy_float16_training_and_grad_scaler_gradients_are_no_overflow_risk():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    with opwatch.strict() as w:
        for _ in range(4):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()  # scaled gradients near the limit: no risk in backward
            scaler.step(optimizer)
            scaler.update()
    assert [a for a in w.anomalies if a.kind == "overflow_risk"] == []


def test_overflow_risk_can_be_allowed():
    with opwatch.strict(allow=[opwatch.Allow(kind="overflow_risk", module="up")]) as w:
        scenarios.float16_headroom()
    assert [a.kind for a in w.allowed] == ["overflow_risk"]
