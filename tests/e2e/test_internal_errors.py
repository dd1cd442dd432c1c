"""When opwatch itself breaks: an internal error (injected into a check or the nan/inf tracker)
becomes one ``OpwatchWarning`` that asks for a report, the watch switches itself off, and the
program runs on with unwatched results."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

import opwatch
from opwatch import checks as opwatch_checks
from opwatch.checks import nonfinite as nonfinite_check

from support import equivalence as eq  # noqa: E402
from support.equivalence import ops, opwatch_warnings, run_reference  # noqa: E402


def _program_with_every_check():
    x = torch.randn(4, 3)
    y = x + torch.ones(3)  # broadcast, dtype and device checks all apply to add
    z = (y * 2).sum(0)
    return y, z, z.sum().item()  # a host read: a nan/inf check point


class SimulatedBug(Exception):
    pass


def _raise(*args, **kwargs):
    raise SimulatedBug("simulated opwatch bug")


@pytest.mark.parametrize("target", ["device", "dtype", "broadcast", "_observe_all", "resolve"])
@pytest.mark.parametrize("strict", [False, True])
def test_an_internal_error_becomes_one_warning_and_the_program_carries_on(monkeypatch, target, strict):
    if target in ("_observe_all", "resolve"):
        monkeypatch.setattr(nonfinite_check.NonFiniteTracker, target, _raise)
    else:
        monkeypatch.setattr(getattr(opwatch_checks, target), "for_op", lambda func: _raise)
    expected = run_reference(_program_with_every_check, plain=True)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (opwatch.strict() if strict else opwatch.watch()) as w:
            got = _program_with_every_check()
            for _ in range(5):
                _program_with_every_check()
            after = len(w.records)
            torch.ones(2).sin()  # a watch that stopped records nothing more
            assert len(w.records) == after
    warned = opwatch_warnings(caught)
    assert eq.diff(expected, got) is None, eq.diff(expected, got)
    assert len(warned) == 1, warned
    (message,) = warned
    (warning,) = [found for found in caught if issubclass(found.category, opwatch.OpwatchWarning)]
    assert warning.filename == __file__  # the program's line, not opwatch's
    assert "internal error" in message and "report" in message and "issue tracker" in message
    assert "SimulatedBug: simulated opwatch bug" in message
    assert torch.__version__ in message
    assert "Traceback" in message
    assert w.anomalies == []
    # A fresh watch, with the bug gone, works again.
    monkeypatch.undo()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch() as fresh:
            _program_with_every_check()
    assert opwatch_warnings(caught) == []
    assert "aten.add.Tensor" in ops(fresh.records)
