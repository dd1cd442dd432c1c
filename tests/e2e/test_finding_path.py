"""The path of a finding runs downhill: every call opwatch makes on the way from the op to the
message goes down a floor or stays on its own (the floors: ``tests/support/floors.py``, the
folders of the package in the order a finding travels).

Each test runs a realistic step with a bug under ``watch()``, traces the op that goes wrong and
then ``str(anomaly)`` with ``sys.setprofile``, and fails on any call from a module of opwatch
into a module of a higher floor, naming caller and callee.

One entry is torch's, not opwatch's: torch calls the function mode's ``__torch_function__``
(``opwatch.modes.functions``) from C on a tensor method or attribute read while the mode is on
the stack, so the frame above it is whichever code read the tensor. On the hot path that is
opwatch's own metadata read for an op dispatched outside the mode's handler (a factory such as
``torch.from_numpy``, the autograd engine's backward ops): one dict lookup each, left as it is.
At a check point opwatch's own torch calls (the nan/inf reductions, the cause's replays) run
with the modes off: there they must never enter it.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import opwatch
from support.floors import floor_of

FUNCTION_MODE = ("opwatch.modes.functions", "__torch_function__")


CHECK_POINT = ("opwatch.findings.pipeline", "check_point")


class Calls(list):
    """``(caller module, callee module, callee function)`` of each Python call, in order;
    ``in_check_point``: the same for the calls made inside a check point."""

    def __init__(self):
        super().__init__()
        self.in_check_point: list = []


def traced(run) -> Calls:
    """The Python calls ``run`` makes."""
    calls = Calls()
    depth = [0]  # check points running

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        callee = (frame.f_globals.get("__name__", ""), frame.f_code.co_name)
        if event == "return":
            depth[0] -= callee == CHECK_POINT
            return
        back = frame.f_back
        call = (back.f_globals.get("__name__", "") if back is not None else "", *callee)
        calls.append(call)
        if depth[0]:
            calls.in_check_point.append(call)
        depth[0] += callee == CHECK_POINT

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def uphill(calls) -> list[str]:
    """The calls of opwatch's modules into a module of a higher floor (torch's calls of the
    function mode left out: see the module's doc)."""
    return sorted(
        {
            f"{caller} (floor {floor_of(caller)}) -> {callee}.{function} (floor {floor_of(callee)})"
            for caller, callee, function in calls
            if caller.startswith("opwatch") and callee.startswith("opwatch") and floor_of(callee) > floor_of(caller)
            and (callee, function) != FUNCTION_MODE
        }
    )


def own_calls_into_the_function_mode(calls) -> int:
    return sum(1 for caller, callee, function in calls if (callee, function) == FUNCTION_MODE and caller.startswith("opwatch"))


def assert_downhill(calls, anomaly, kind):
    assert anomaly.kind == kind, anomaly
    assert not uphill(calls), "calls up a floor on a finding's path:\n" + "\n".join(uphill(calls))
    assert own_calls_into_the_function_mode(calls.in_check_point) == 0
    # the trace saw the path: the interceptor, the exit, the reporter and render
    seen = {callee for _, callee, _ in calls}
    assert {"opwatch.modes.interceptor", "opwatch.findings.pipeline", "opwatch.findings.report", "opwatch.render.messages"} <= seen, sorted(seen)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.proj(x).relu())


class Regressor(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def _training(step, *, checks=None):
    """Run two healthy steps and then ``step`` under a watch; the trace covers ``step`` (its op
    and the check point it reaches) and then ``str`` of the first anomaly."""
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16)
    w = opwatch.watch(warn=False, checks=checks)
    with w:
        for _ in range(2):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
            optimizer.step()
        assert not w.anomalies  # a healthy step: nothing to trace
        calls = traced(lambda: step(model, optimizer, x, y, w))
    assert w.anomalies, "the step made no finding"
    calls += traced(lambda: str(w.anomalies[0]))
    return calls, w.anomalies[0]


def test_a_broadcast_finding_runs_downhill():
    def step(model, optimizer, x, y, w):
        loss = ((model(x) - y) ** 2).mean()  # [16, 1] - [16]: a [16, 16] loss
        loss.backward()

    calls, anomaly = _training(step)
    assert_downhill(calls, anomaly, "broadcast")


def test_a_dtype_finding_runs_downhill():
    def step(model, optimizer, x, y, w):
        features = torch.from_numpy(x.numpy().astype("float64"))  # float64 features from numpy
        with pytest.raises(RuntimeError):
            model(features)

    calls, anomaly = _training(step)
    assert_downhill(calls, anomaly, "dtype_mismatch")


def test_a_device_finding_runs_downhill():
    def step(model, optimizer, x, y, w):
        model.head.to("meta")  # the head moved alone (meta stands in for a GPU)
        with pytest.raises((RuntimeError, NotImplementedError)):
            model(x)

    calls, anomaly = _training(step)
    assert_downhill(calls, anomaly, "device_mismatch")
    # provenance asked who holds the odd operand: the running modules, the models' parameters
    assert ("opwatch.checks.owners", "running") in {(callee, function) for _, callee, function in calls}
    assert ", module head (forward)" in str(anomaly) and "made by aten.native_layer_norm" in str(anomaly)


def test_a_nan_finding_runs_downhill_and_the_check_point_keeps_out_of_the_function_mode():
    def step(model, optimizer, x, y, w):
        scale = torch.zeros(16).log()  # -inf
        loss = (model(x).squeeze(-1) * scale - y).pow(2).mean()
        loss.backward()
        loss.item()  # a host read: the check point

    calls, anomaly = _training(step, checks=None)
    assert_downhill(calls, anomaly, "inf")
    assert ("opwatch.checks.nonfinite.tracker", "resolve") in {(callee, function) for _, callee, function in calls.in_check_point}
    assert len(calls.in_check_point) > 100  # the check point's own work was traced


def test_the_detector_sees_a_call_up_a_floor():
    # a check (floor of checks) calling into the modes: what the owners table used to be
    calls = [("opwatch.checks", "opwatch.modes.modules", "owner_of"), ("opwatch.modes.interceptor", "opwatch.checks", "pre_kernel"), ("torch.overrides", "opwatch.modes.functions", "__torch_function__")]
    assert uphill(calls) == ["opwatch.checks (floor 2) -> opwatch.modes.modules.owner_of (floor 5)"]
    assert own_calls_into_the_function_mode(calls + [("opwatch.core.finite", *FUNCTION_MODE)]) == 1


def test_the_tracer_knows_a_check_point_from_the_hot_path():
    def finite(x):
        return torch.isfinite(x).all()  # a torch call under the function mode, outside a check point

    x = torch.ones(3)
    with opwatch.watch(warn=False) as w:
        calls = traced(lambda: (finite(x), w.check()))
    assert ("test_finding_path", *FUNCTION_MODE) in calls and not [call for call in calls.in_check_point if call[0] == "test_finding_path"]
    assert ("opwatch.findings.pipeline", "opwatch.checks", "resolve") in calls.in_check_point
