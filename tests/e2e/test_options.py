"""``watch()``/``strict()`` options: bad values are clear ``ValueError``/``TypeError``s naming the
option, options are keyword-only, valid ones are accepted; and the ``OPWATCH_DISABLE`` kill
switch, its accepted values and its error for any other."""

from __future__ import annotations

import io
import os
import sys
import warnings

import pytest
import torch

import opwatch

from support import equivalence as eq  # noqa: E402
from support.equivalence import ops, opwatch_warnings, run_reference  # noqa: E402


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


BAD_OPTIONS = [
    (dict(checks=["broadcast", "nope"]), ValueError, r"unknown check name.*'nope'.*valid names.*'broadcast'"),
    (dict(checks="broadcast"), TypeError, r"checks=\['broadcast'\]"),
    (dict(checks=5), TypeError, "checks"),
    (dict(max_records=-1), ValueError, "max_records"),
    (dict(max_records=0), ValueError, "max_records"),
    (dict(max_records=10.0), TypeError, "max_records"),
    (dict(max_records="10"), TypeError, "max_records"),
    (dict(max_records=True), TypeError, "max_records"),
    (dict(last=-1), ValueError, "last"),
    (dict(last=None), TypeError, "last"),
    (dict(warn="yes"), TypeError, "warn"),
    (dict(dump_on_error=1), TypeError, "dump_on_error"),
    (dict(file="opwatch.log"), TypeError, "file"),
    (dict(nonsense=1), TypeError, "nonsense"),
]


@pytest.mark.parametrize("factory", [opwatch.watch, opwatch.strict], ids=["watch", "strict"])
@pytest.mark.parametrize("options, error, pattern", BAD_OPTIONS, ids=[repr(o) for o, _, _ in BAD_OPTIONS])
def test_bad_options_are_clear_errors(factory, options, error, pattern):
    with pytest.raises(error, match=pattern):
        factory(**options)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        opwatch.watch(100)


def test_valid_options_are_accepted():
    with opwatch.watch(max_records=1, checks=(), last=0, warn=False, dump_on_error=False, file=io.StringIO()) as w:
        torch.ones(2).sin()
    assert ops(w.records) == ["aten.sin.default"]
    with opwatch.watch(checks={"nonfinite"}) as w:
        torch.ones(3) + torch.ones(3, 1)  # broadcast check off
    assert w.anomalies == []


# --------------------------------------------------------------------------------------------
# OPWATCH_DISABLE
# --------------------------------------------------------------------------------------------


def _buggy_program():
    pred = torch.randn(5, 1)
    y = torch.randn(5)
    loss = (y - pred).pow(2).mean()  # a (5,) - (5, 1) broadcast
    bad = torch.zeros(3).log()  # -inf, alive
    return loss, bad


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", " 1 ", "Yes"])
def test_opwatch_disable_turns_every_watch_into_a_no_op(monkeypatch, value):
    monkeypatch.setenv("OPWATCH_DISABLE", value)
    expected = run_reference(_buggy_program, plain=True)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch() as w:
            got = _buggy_program()
        with opwatch.strict() as s:  # would raise at the broadcast if enabled
            _buggy_program()
    assert eq.diff(expected, got) is None
    assert opwatch_warnings(caught) == []
    for watch in (w, s):
        assert watch.enabled is False
        assert watch.records == [] and watch.anomalies == [] and watch.contained == []
        assert watch.check() == []
        # It watched nothing: its summary says so rather than "no anomalies".
        assert watch.summary() == f"opwatch: nothing was watched (OPWATCH_DISABLE={value.strip()} turned opwatch off), so no anomalies could be found."


@pytest.mark.parametrize("value", ["", "0", "false", "no", "False", " 0 "])
def test_opwatch_disable_off_values_keep_watching(monkeypatch, value):
    monkeypatch.setenv("OPWATCH_DISABLE", value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with opwatch.watch() as w:
            kept = _buggy_program()  # noqa: F841 -- the -inf must be alive at the check point
    assert w.enabled is True
    assert {a.kind for a in w.anomalies} == {"broadcast", "inf"}


@pytest.mark.parametrize("value", ["2", "on", "disable", "y", "1.0"])
def test_opwatch_disable_bad_value_is_a_value_error_naming_the_valid_ones(monkeypatch, value):
    monkeypatch.setenv("OPWATCH_DISABLE", value)
    with pytest.raises(ValueError) as caught:
        opwatch.watch()
    message = str(caught.value)
    assert "OPWATCH_DISABLE" in message and repr(value) in message
    assert "use '1', 'true', 'yes' to turn opwatch off, '0', 'false', 'no' (or leave it unset) to watch" in message
