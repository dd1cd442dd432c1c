"""Never hurt the program: a fault injected into each stage of opwatch's own work (a check, a
tracker, the report, rendering a message, a check point, the end of the block) becomes one
``OpwatchWarning`` naming an internal error; the program's results and exceptions are those of
an unwatched run, and only ``AnomalyError`` may ever leave opwatch."""

from __future__ import annotations

import io
import os
import sys
import warnings

import pytest
import torch
from torch import nn

import opwatch
from opwatch import render
from opwatch.findings import report
from opwatch.checks import broadcast, nonfinite

from support import equivalence as eq  # noqa: E402
from support.equivalence import opwatch_warnings, run_reference  # noqa: E402


class InjectedFault(Exception):
    pass


def _fail(*args, **kwargs):
    raise InjectedFault("injected into opwatch")


def _training_steps(broadcasting_loss=True):
    """A few real training steps with a broadcasting loss (an anomaly at every step) and a
    host read (a nan/inf check point)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3), torch.randn(4)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        prediction = model(x) if broadcasting_loss else model(x).squeeze(-1)
        loss = ((y - prediction) ** 2).mean()  # (4,) - (4, 1): a broadcast anomaly
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


# stage -> (object, attribute) replaced by a function that raises
STAGES = {
    "pre-kernel check": (broadcast, "check"),
    "tracker observer": (broadcast.ShapeProvenance, "_after_other"),
    "nan/inf reduction": (nonfinite.NonFiniteTracker, "_reduce"),
    "report": (report.Reporter, "report"),
    "render a message": (render, "render_message"),
    "check point": (nonfinite.NonFiniteTracker, "resolve"),
}


def _internal_error_warnings(caught) -> list[str]:
    return [message for message in opwatch_warnings(caught) if "internal error" in message]


@pytest.mark.parametrize("strict", [False, True], ids=["watch", "strict"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_in_any_stage_becomes_one_warning_and_the_run_carries_on(monkeypatch, stage, strict):
    if stage == "check point":
        # Healthy steps (strict would stop at the broadcast before any check point).
        def program():
            return _training_steps(broadcasting_loss=False)
    else:
        program = _training_steps
    expected = run_reference(program, plain=True)
    owner, name = STAGES[stage]
    monkeypatch.setattr(owner, name, _fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (opwatch.strict() if strict else opwatch.watch()):
            got = program()
    assert eq.diff(expected, got) is None, eq.diff(expected, got)
    told = _internal_error_warnings(caught)
    assert len(told) == 1, opwatch_warnings(caught)
    assert "InjectedFault: injected into opwatch" in told[0]
    assert "Your program is unaffected" in told[0]


def test_a_fault_while_rendering_never_raises_on_the_users_line(monkeypatch):
    # Today's failure mode: a KeyError from the renderer surfaced on the user's own line.
    monkeypatch.setattr(render, "render_message", lambda finding, record: {}["missing"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch():
            torch.ones(4) - torch.ones(4, 1)
    assert len(_internal_error_warnings(caught)) == 1


def test_a_fault_at_the_end_of_a_failing_block_keeps_the_users_exception(monkeypatch):
    monkeypatch.setattr(sys.modules["opwatch.session.failure"], "render_failure", _fail)  # as the failure dump calls it
    error = ValueError("the user's own error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError) as raised:
            with opwatch.watch(file=io.StringIO()):
                torch.ones(3).sin()
                raise error
    assert raised.value is error
    assert len(_internal_error_warnings(caught)) == 1


def test_a_fault_at_the_end_of_a_healthy_block_is_one_warning(monkeypatch):
    monkeypatch.setattr(nonfinite.NonFiniteTracker, "resolve", _fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch():
            torch.ones(3).exp()
    assert len(_internal_error_warnings(caught)) == 1


def test_a_fault_when_entering_leaves_the_block_unwatched(monkeypatch):
    from opwatch.modes import modules

    monkeypatch.setattr(modules.ModuleStack, "install", _fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.strict() as w:
            torch.ones(4) - torch.ones(4, 1)  # would raise if watched
    assert w.records == [] and w.anomalies == []
    assert len(_internal_error_warnings(caught)) == 1


def test_only_anomaly_error_leaves_strict_mode():
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict():
            torch.ones(4) - torch.ones(4, 1)
    assert raised.value.anomaly.kind == "broadcast"


def test_strict_reports_every_origin_of_a_check_point_then_raises_for_the_first():
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict() as w:
            a = torch.zeros(3).log()  # -inf
            b = torch.tensor([-1.0]).sqrt()  # nan
            w.check()
    assert raised.value.anomaly.kind == "inf"
    assert [anomaly.kind for anomaly in w.anomalies] == ["inf", "nan"]
    del a, b
