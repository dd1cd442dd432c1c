"""opwatch.guard's audits: the first call and each new signature of the arguments run under a
full watch, so that the silent bugs (broadcast, dtype upcast, device mix) are reported while
healthy steps keep eager speed and eager results."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import opwatch
from support.helpers import line_of

HERE = os.path.abspath(__file__)


@pytest.fixture(autouse=True)
def _repros_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


class MLP(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x)  # (B, 1)


def mlp_loop(loss_of, batches, **options):
    """An MLP trained with AdamW through a guarded step; returns the guard and the model."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(x, y):
        loss = loss_of(model(x), y)
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, **options)
    for x, y in batches:
        optimizer.zero_grad()
        step(x, y)
        optimizer.step()
    return step, model


def batches(count=4, size=16, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=generator), torch.randn(size, generator=generator).to(dtype)) for _ in range(count)]


def broadcast_loss(prediction, target):
    return ((prediction - target) ** 2).mean()  # BUG broadcast: (B, 1) - (B,) -> (B, B)


def fixed_loss(prediction, target):
    return ((prediction.squeeze(-1) - target) ** 2).mean()


def kinds(step):
    return [anomaly.kind for anomaly in step.anomalies]


# -- what an audit reports -----------------------------------------------------------------------


def test_a_broadcast_in_the_loss_is_reported_by_the_first_calls_audit_and_warned_once():
    with pytest.warns(opwatch.OpwatchWarning) as warned:
        step, _ = mlp_loop(broadcast_loss, batches(4) + batches(2, size=12))
    line = line_of("BUG broadcast", HERE)
    found = [anomaly for anomaly in step.anomalies if anomaly.kind == "broadcast"]
    assert found and {anomaly.lineno for anomaly in found} == {line}
    assert step.audits == 2 and step.calls == 6  # two signatures: two audits
    said = [str(warning.message) for warning in warned if "broadcast" in str(warning.message)]
    assert len(said) == 1 and f"test_guard_audits.py:{line}" in said[0]  # once per line, over both audits
    assert not step.failures


def test_the_fixed_loss_is_audited_and_reports_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step, _ = mlp_loop(fixed_loss, batches(4))
    assert step.audits == 1 and list(step.anomalies) == [] and not step.failures


def test_a_float64_numpy_weight_in_the_loss_is_reported():
    class_weight = torch.from_numpy(np.linspace(0.5, 1.5, 16))  # float64, as numpy makes it

    def weighted(prediction, target):
        return (class_weight * (prediction.squeeze(-1) - target) ** 2).mean()  # BUG float64 weight

    with pytest.warns(opwatch.OpwatchWarning, match="dtype"):
        step, _ = mlp_loop(weighted, batches(3))
    assert "dtype_mismatch" in kinds(step)
    assert {anomaly.lineno for anomaly in step.anomalies} == {line_of("BUG float64 weight", HERE)}


def test_a_device_mix_is_reported_with_meta_standing_in_for_the_gpu():
    torch.manual_seed(0)
    model = MLP()
    shift = torch.zeros(1, device="meta")  # left on the "GPU" while the model is on the CPU

    def train_step(x, y):
        loss = fixed_loss(model(x) + shift, y)  # BUG device
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, repro=False)
    with pytest.raises(opwatch.AnomalyError) as caught:
        step(*batches(1)[0])
    anomaly = caught.value.anomaly
    assert anomaly.kind == "device_mismatch" and anomaly.lineno == line_of("BUG device", HERE)
    assert all(param.grad is None for param in model.parameters())


def test_a_float64_batch_first_seen_at_step_k_is_caught_by_a_reaudit():
    k = 5
    data = batches(k - 1) + batches(1, dtype=torch.float64, seed=7)  # a loader that changed dtype
    with pytest.warns(opwatch.OpwatchWarning, match="dtype"):
        step, _ = mlp_loop(fixed_loss, data)
    assert step.audits == 2
    assert kinds(step) and set(kinds(step)) == {"dtype_mismatch"}


def test_same_signature_calls_are_not_audited_again():
    step, _ = mlp_loop(fixed_loss, batches(6))
    assert step.audits == 1 and step.last_audit is not None


def test_max_audits_bounds_the_audits_of_variable_length_batches():
    data = [batch for size in range(4, 24) for batch in batches(1, size=size)]
    step, _ = mlp_loop(fixed_loss, data, max_audits=3)
    assert step.calls == 20 and step.audits == 3


def test_audit_every_n_calls_and_never():
    every, _ = mlp_loop(fixed_loss, batches(9), audit=4)
    assert every.audits == 3  # the first call (new), the 4th and the 8th
    never, _ = mlp_loop(broadcast_loss, batches(3), audit="never")
    assert never.audits == 0 and list(never.anomalies) == [] and never.last_audit is None


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"audit": "sometimes"}, ValueError, 'audit must be "new", "never" or an int >= 1, got \'sometimes\''),
    ({"audit": 0}, ValueError, 'audit must be "new", "never" or an int >= 1, got 0'),
    ({"audit": 2.5}, TypeError, 'audit must be "new", "never" or an int >= 1, got float'),
    ({"audit": True}, TypeError, "got bool"),
    ({"max_audits": -1}, ValueError, "max_audits must be an int >= 0, got -1"),
    ({"max_audits": "8"}, TypeError, "max_audits must be an int >= 0, got str"),
    ({"strict": "yes"}, TypeError, "strict must be True or False"),
])
def test_bad_audit_options_are_refused_naming_what_is_accepted(options, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        opwatch.guard(lambda: None, nn.Linear(2, 2), **options)


# -- strict -----------------------------------------------------------------------------------------


def test_strict_raises_an_audits_finding_before_the_optimizer_sees_the_gradients():
    torch.manual_seed(0)
    model = MLP()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}

    def train_step(x, y):
        loss = broadcast_loss(model(x), y)
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, strict=True)
    with pytest.raises(opwatch.AnomalyError) as caught:
        step(*batches(1)[0])
    assert caught.value.anomaly.kind == "broadcast" and caught.value.anomaly.lineno == line_of("BUG broadcast", HERE)
    assert all(param.grad is None for param in model.parameters())
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())


def test_strict_leaves_the_weights_finite_when_a_step_makes_nan():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(x, y):
        loss = fixed_loss(model(x), y).sqrt() * (y - y.mean()).abs().log().mean()  # nan when y is constant
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, strict=True, repro=False)
    data = batches(3)
    data.append((data[0][0], torch.ones(16)))
    with pytest.raises(opwatch.AnomalyError):
        for x, y in data:
            optimizer.zero_grad()
            step(x, y)
            optimizer.step()
    assert all(torch.isfinite(param).all() for param in model.parameters())


# -- nan/inf under audits ----------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        scale = x.abs().amax(-1, keepdim=True)
        return self.fc(x / scale)  # BUG nan: 0 / 0 for an all-zero row


def tiny_loop(data, **options):
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(x, y):
        loss = fixed_loss(model(x), y)
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, **options)
    for x, y in data:
        optimizer.zero_grad()
        step(x, y)
        optimizer.step()
    return step, model


def test_a_nan_first_made_at_step_k_is_named_with_its_op_and_line():
    data = batches(4)
    x, y = batches(1, seed=3)[0]
    x[2] = 0
    data.append((x, y))
    with pytest.raises(opwatch.AnomalyError) as caught:
        tiny_loop(data)
    anomaly = caught.value.anomaly
    assert anomaly.kind == "nan" and anomaly.op == "aten.div.Tensor" and anomaly.lineno == line_of("BUG nan", HERE)
    assert anomaly.step == 5 and anomaly.repro is not None  # not audited (same signature): replayed


def test_a_nan_in_an_audited_step_is_reported_from_the_audit_without_a_replay():
    x, y = batches(1)[0]
    x[0] = 0
    replays = []
    original = opwatch.guard.__globals__["replays"].run

    def counting(*args, **kwargs):
        replays.append(1)
        return original(*args, **kwargs)

    opwatch.guard.__globals__["replays"].run = counting
    try:
        with pytest.raises(opwatch.AnomalyError) as caught:
            tiny_loop([(x, y)])
    finally:
        opwatch.guard.__globals__["replays"].run = original
    anomaly = caught.value.anomaly
    assert replays == [] and anomaly.kind == "nan" and anomaly.op == "aten.div.Tensor"
    assert anomaly.lineno == line_of("BUG nan", HERE) and anomaly.repro is None
    assert anomaly.context[3] is True and "found by the audit of that call" in anomaly.message
    assert "opwatch.guard: the audit's last" in "\n".join(caught.value.notes)
    assert str(caught.value).endswith("\n".join(caught.value.notes))  # what a program logs holds them


def test_grad_scaler_skipped_steps_are_not_failures_under_audits():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # its first steps overflow
    x, y = torch.randn(32, 16), torch.randn(32, 1)

    def train_step(x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        return loss

    step = opwatch.guard(train_step, model, scaler=scaler, audit=2)
    for _ in range(6):
        optimizer.zero_grad()
        step(x, y)
        scaler.step(optimizer)
        scaler.update()
    assert scaler.get_scale() < 2.0**40  # the scaler did skip overflow steps, audited ones too
    assert step.audits == 4 and not step.failures and step.last_replay is None  # calls 1, 2, 4, 6


# -- audits change no result ---------------------------------------------------------------------


class Block(nn.Module):
    """A 2-layer transformer encoder on a next-value regression, with dropout."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).squeeze(-1)


def transformer_parameters(steps, guarded_options):
    torch.manual_seed(0)
    model = Block()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 6 + step % 2, 16, generator=generator), torch.randn(4, 6 + step % 2, generator=generator)) for step in range(steps)]

    def train_step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    step = train_step if guarded_options is None else opwatch.guard(train_step, model, **guarded_options)
    torch.manual_seed(3)
    for x, y in data:
        optimizer.zero_grad()
        step(x, y)
        optimizer.step()
    return [param.detach().clone() for param in model.parameters()], step


def test_audited_steps_give_bitwise_the_results_of_eager_ones():
    eager, _ = transformer_parameters(5, None)
    audited, step = transformer_parameters(5, {"audit": 2})
    assert step.audits == 3  # two signatures, and the 4th call
    assert all(torch.equal(a, b) for a, b in zip(eager, audited))


# -- the name ------------------------------------------------------------------------------------


def test_opwatch_guard_is_the_function_in_a_fresh_process():
    code = (
        "import opwatch, inspect\n"
        "assert inspect.isfunction(opwatch.guard), opwatch.guard\n"
        "from opwatch import guard\n"
        "assert guard is opwatch.guard\n"
        "from opwatch.runners.guarded import Guarded\n"
        "assert inspect.isfunction(opwatch.guard) and Guarded.__module__ == 'opwatch.runners.guarded'\n"
        "print('ok')\n"
    )
    # the leave-on runner (--guard, the trainers' guard mode) imports the guard's modules first
    for first in ("", "from opwatch import guard as g\nassert callable(g)\n", "import opwatch.runners.leave_on\n"):
        done = subprocess.run([sys.executable, "-c", first + code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
