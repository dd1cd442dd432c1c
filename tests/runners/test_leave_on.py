"""Leave it on (issue 18): the optimizer step as a check point of a watch, ``python -m opwatch
--guard``, and the trainers' guard mode; real training loops, real GradScaler."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import opwatch
from opwatch.runners.leave_on import LeaveOn
from support import needs
from support.equivalence import opwatch_warnings
from support.helpers import fp16_regression_script, guard_in_process, line_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: its opwatch in the subprocesses


class Regressor(nn.Module):
    """A small MLP; ``bug="backward nan"`` makes a nan only in backward,
    ``bug="broadcast"`` returns ``(B, 1)`` predictions."""

    def __init__(self, bug=None):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 1)
        self.bug = bug

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.bug == "device":
            h = h + torch.zeros(16, device="meta")  # BUG device: meta stands in for the GPU
        if self.bug == "backward nan":
            h = h + (h * 0).sqrt()  # BUG backward: sqrt'(0) * 0 = nan; forward adds 0
        out = self.fc2(h)
        return out if self.bug == "broadcast" else out.squeeze(-1)  # BUG broadcast: keeps (B, 1)


def batches(count, size=8):
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        x = torch.randn(size, 4, generator=generator)
        yield x, x.sum(-1)


# -- item 2: the optimizer step is a check point of a watch ---------------------------------


def test_strict_raises_before_the_optimizer_writes_a_backward_nan_into_the_weights():
    torch.manual_seed(0)
    model = Regressor("backward nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(batches(1))
    with pytest.raises(opwatch.AnomalyError) as caught:
        with opwatch.strict():
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()  # no host read: only the optimizer step is a check point before
            optimizer.step()
    anomaly = caught.value.anomaly
    assert anomaly.kind in ("nan", "inf")
    assert (anomaly.filename, anomaly.lineno) == (__file__, line_of("BUG backward", __file__))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_watch_reports_at_the_optimizer_step_and_the_step_runs():
    torch.manual_seed(0)
    model = Regressor("backward nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(batches(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with opwatch.watch() as w:
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            found_at_step = [a.kind for a in w.anomalies]
    assert found_at_step and found_at_step[0] in ("nan", "inf")  # found before the block ended: at the optimizer step
    assert not torch.isfinite(model.fc1.weight).all()  # watch() only reports


def test_a_healthy_step_under_strict_is_bitwise_eager_and_raises_nothing():
    results = []
    for watched in (False, True):
        torch.manual_seed(0)
        model = Regressor()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        for x, y in batches(3):
            optimizer.zero_grad()
            with opwatch.strict() if watched else _nothing():
                ((model(x) - y) ** 2).mean().backward()
                optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_hook_is_registered_once_for_nested_watches_and_removed_by_the_last():
    from opwatch.session import _steps_checked

    calls = []
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not _steps_checked.registered
    with opwatch.watch() as outer:
        outer._before_optimizer_step = lambda: calls.append("outer")
        with opwatch.watch() as inner:
            inner._before_optimizer_step = lambda: calls.append("inner")
            assert _steps_checked.registered
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
        assert _steps_checked.registered
        optimizer.step()
    assert not _steps_checked.registered
    optimizer.step()
    assert calls == ["inner", "outer", "outer"]


def scaled_fp16_loop(steps, wrap, init_scale=2.0**40):
    """A CPU autocast fp16 loop with a real GradScaler; the huge first scale overflows the
    first steps' gradients, which the scaler skips (and lowers its scale)."""
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scales = []
    for x, y in batches(steps):
        optimizer.zero_grad()
        with wrap():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x) - y) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scales.append(scaler.get_scale())
    return model, scales


def test_gradscaler_skipped_steps_do_not_raise_under_strict():
    model, scales = scaled_fp16_loop(8, opwatch.strict)
    assert scales[0] < 2.0**40  # the scaler found inf and skipped at least one step
    assert all(torch.isfinite(p).all() for p in model.parameters())
    eager, eager_scales = scaled_fp16_loop(8, _nothing)
    assert scales == eager_scales
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- item 3: python -m opwatch --guard ------------------------------------------------------

TRAIN = """\
import io
import os
import re
import numpy as np
import torch
from torch import nn

BUG = os.environ.get("BUG", "")
STEPS = int(os.environ.get("STEPS", "6"))
NAN_AT = int(os.environ.get("NAN_AT", "0"))
NAN_FROM = int(os.environ.get("NAN_FROM", "0"))
STOP_AT = int(os.environ.get("STOP_AT", "0"))  # a batch with an inf; the loop stops on its loss
REPAIR = os.environ.get("REPAIR") == "1"  # a loop that puts non-finite weights back to 0
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 1)
        self.shift = torch.zeros(16, device="meta" if BUG == "device" else "cpu")

    def forward(self, x, poison=False):
        h = torch.relu(self.fc1(x)) + self.shift  # SHIFT: the device mix
        if poison:
            h = torch.where(h > 0, h, h.log())  # POISON: the nan, made in backward
        return self.fc2(h).float()


model = Net()
weights = torch.from_numpy(np.ones(8)) if BUG == "float64" else torch.ones(8)  # numpy's float64
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, STEPS + 1):
    x = torch.randn(8, 4)
    y = x.sum(-1) if BUG == "broadcast" else x.sum(-1, keepdim=True)
    if step == STOP_AT:
        x[0, 0] = float("inf")  # a bad batch
    optimizer.zero_grad()
    error = (model(x, poison=step == NAN_AT or 0 < NAN_FROM <= step) - y) ** 2  # LOSS: the broadcast
    loss = (error.mean(-1) * weights).mean()  # WEIGHTS: upcast to float64
    if STOP_AT and not torch.isfinite(loss):
        print("non-finite loss at step", step)
        break
    loss.backward()
    optimizer.step()
    if REPAIR:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.nan_to_num_(0.0)
print("weights finite:", bool(torch.isfinite(model.fc1.weight).all()))
"""


def run_guard(tmp_path, *options, **env):
    (tmp_path / "train.py").write_text(TRAIN)
    environment = dict(os.environ, PYTHONPATH=ROOT, **{key: str(value) for key, value in env.items()})
    return subprocess.run(
        [sys.executable, "-m", "opwatch", "--guard", *options, "train.py"], capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=300
    )


def train_line(marker):
    return next(number for number, line in enumerate(TRAIN.splitlines(), 1) if marker in line)


@pytest.mark.parametrize("bug, kind, marker", [("broadcast", "broadcast", "LOSS"), ("float64", "dtype", "WEIGHTS"), ("device", "device", "SHIFT")])
def test_guard_cli_audit_reports_the_silent_bugs(tmp_path, bug, kind, marker):
    result = run_guard(tmp_path, BUG=bug)
    line = train_line(marker)
    assert f"train.py:{line}" in result.stderr, result.stderr
    assert kind in result.stderr.lower()
    if bug != "device":  # the device mix raises in eager too; the others train silently
        assert result.returncode == 0, result.stderr
        assert "opwatch guard: 6 optimizer steps ran, 1 audited under a full watch, 0 failed" in result.stderr


def test_guard_cli_healthy_run_reports_nothing(tmp_path):
    result = run_guard(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "opwatch guard: 6 optimizer steps ran, 1 audited under a full watch, 0 failed." in result.stderr
    assert "nan/inf" not in result.stderr  # no cause for failures there were not
    assert "judged" not in result.stderr and "--strict" not in result.stderr
    # Its end judged: an evaluation forward outside any step would not be.
    assert result.stderr.count("\n") == 2


def test_guard_cli_says_when_the_run_ended_before_it_judged_the_last_ops(tmp_path):
    # The loop stops itself on a non-finite loss before backward(): no optimizer step, so no
    # gradient check, ever sees the nan. Not "no anomalies ... 0 failed" alone.
    result = run_guard(tmp_path, STOP_AT=4)
    assert result.returncode == 0 and "non-finite loss at step 4" in result.stdout, result.stderr
    assert "opwatch guard: 3 optimizer steps ran, 1 audited under a full watch, 0 failed" in result.stderr
    assert (
        "opwatch guard: the run ended before opwatch judged its last ops: the model ran forward after optimizer step 3 and no "
        "optimizer step followed" in result.stderr
    ), result.stderr
    # What those ops left is read at the run's end: the batch held the inf.
    assert ("what they left: the batch held inf before the model ran: Net's argument 0 (f32[8, 4] cpu) held inf when it entered "
            f"the model at train.py:{train_line('LOSS: the broadcast')}, so no op of the model made it: it came in with the batch;") in result.stderr
    assert result.stderr.rstrip("\n").endswith("a full watch checks every op: python -m opwatch --strict train.py")
    # The command it gives finds the nan, at its line.
    environment = dict(os.environ, PYTHONPATH=ROOT, STOP_AT="4")
    strict = subprocess.run([sys.executable, "-m", "opwatch", "--strict", "train.py"], capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=300)
    assert strict.returncode == 1 and f"AnomalyError: nan in aten.addmm.default at train.py:{train_line('return self.fc2')}" in strict.stderr, strict.stderr


def test_guard_cli_names_the_step_the_parameters_and_the_origin_of_a_nan_first_made_at_step_k(tmp_path):
    result = run_guard(tmp_path, NAN_FROM=4)
    assert result.returncode == 0, result.stderr
    assert "optimizer step 4: the gradients about to be applied hold nan/inf: fc1.weight (nan), fc1.bias (nan)" in result.stderr, result.stderr
    assert "The optimizer step did not run (skipped, as GradScaler skips an overflow step)" in result.stderr
    assert f"the failure of step 4 recurred at step 5: " in result.stderr
    assert f"first made by aten.log.default at train.py:{train_line('POISON')}" in result.stderr
    assert "6 optimizer steps ran, 2 audited under a full watch, 3 failed (nan/inf in the gradients), 3 of them skipped" in result.stderr
    assert "weights finite: True" in result.stdout


def test_guard_cli_apply_says_since_when_the_weights_hold_nan_and_names_no_false_origin(tmp_path):
    result = run_guard(tmp_path, "--on-failure", "apply", NAN_AT=4)
    assert result.returncode == 0, result.stderr
    assert "the weights hold nan since optimizer step 4: fc1.weight (nan)" in result.stderr, result.stderr
    # Weights that hold nan make every op that reads them look like an origin: none is named.
    assert "recurred" not in result.stderr and "min nan" not in result.stderr and "first made by" not in result.stderr
    assert "weights finite: False" in result.stdout
    assert "6 optimizer steps ran, 1 audited under a full watch, 3 failed" in result.stderr


def test_guard_cli_says_plainly_when_a_failure_did_not_recur(tmp_path):
    result = run_guard(tmp_path, NAN_AT=3)
    assert "optimizer step 3: the gradients about to be applied hold nan/inf" in result.stderr, result.stderr
    assert "the failure of step 3 did not recur: step 4 ran under a full watch" in result.stderr
    assert "6 optimizer steps ran, 2 audited under a full watch, 1 failed (nan/inf in the gradients), 1 of them skipped" in result.stderr
    assert "weights finite: True" in result.stdout


STOPPED = "    try:\n        optimizer.step()\n    except RuntimeError as error:\n        print('stopped:', type(error).__name__); break\n"


def run_strict(tmp_path, **env):
    (tmp_path / "train.py").write_text(TRAIN.replace("    optimizer.step()\n", STOPPED))
    environment = dict(os.environ, PYTHONPATH=ROOT, **{key: str(value) for key, value in env.items()})
    return subprocess.run([sys.executable, "-m", "opwatch", "--guard", "--strict", "train.py"], capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=300)


def test_guard_cli_strict_names_the_origin_of_a_failure_that_recurs_and_keeps_the_weights_finite(tmp_path):
    result = run_strict(tmp_path, NAN_FROM=4)
    assert "stopped: AnomalyError" in result.stdout, result.stdout + result.stderr
    assert f"in aten.log.default at train.py:{train_line('POISON')}" in result.stderr
    assert "weights finite: True" in result.stdout
    # step 4 skipped, step 5 raised before it ran: both failed, neither ran (the ledger counts every failed step)
    assert "5 optimizer steps ran, 2 audited under a full watch, 2 failed (nan/inf in the gradients), 2 of them skipped" in result.stderr


def test_guard_cli_strict_says_what_it_checked_when_the_failure_did_not_recur(tmp_path):
    result = run_strict(tmp_path, NAN_AT=4)
    assert "stopped: GradientsNotFinite" in result.stdout, result.stdout + result.stderr
    assert "loop ended" not in result.stderr and "weights hold" not in result.stderr
    assert "weights finite: True" in result.stdout
    assert "5 optimizer steps ran, 2 audited under a full watch, 1 failed (nan/inf in the gradients), 1 of them skipped" in result.stderr


def test_guard_cli_strict_names_the_command_when_the_loop_ends_before_the_recheck(tmp_path):
    result = run_strict(tmp_path, NAN_AT=6)
    assert result.returncode == 1
    assert "GradientsNotFinite: opwatch: optimizer step 6: the gradients held nan/inf" in result.stderr, result.stderr
    assert "the program's loop ended before another optimizer step could run under a full watch" in result.stderr
    assert "To find the op that made them: python -m opwatch --strict train.py." in result.stderr


def test_guard_cli_tells_a_loop_that_ended_before_the_recheck_at_the_failed_step_s_line(tmp_path):
    """The run ends after the failed step's check: no frame of the script runs any more when it
    is told. Before, it was told at opwatch's own line (``opwatch/runners/policy/outcomes.py``)."""
    result = run_guard(tmp_path, NAN_AT=6)
    (told,) = [line for line in result.stderr.splitlines() if "loop ended before another optimizer step" in line]
    assert re.match(rf"\S*train\.py:{train_line('optimizer.step()')}: OpwatchWarning: opwatch: optimizer step 6: ", told), told


DATA_GLITCH = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
for step in range(1, 31):
    x = torch.randn(64, 20)
    y = x.sum(-1, keepdim=True)
    scale = torch.tensor(0.0 if step in (10, 11) else 1.0)
    x = x / scale  # BAD DATA: a zero scale at steps 10 and 11
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
print("weights finite:", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
"""


@pytest.mark.parametrize("on_failure", [None, pytest.param("apply", marks=pytest.mark.thorough)])
def test_guard_cli_a_two_step_data_glitch_in_a_30_step_momentum_run(tmp_path, on_failure):
    (tmp_path / "train.py").write_text(DATA_GLITCH)
    option = ["--on-failure", on_failure] if on_failure else []
    result = subprocess.run([sys.executable, "-m", "opwatch", "--guard", *option, "train.py"], capture_output=True, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert result.returncode == (0 if on_failure is None else 1), result.stderr
    if on_failure is None:  # skip: the two bad steps never reach the weights
        assert "weights finite: True" in result.stdout
        assert "the failure of step 10 recurred at step 11: inf first made by aten.div.Tensor at train.py:11" in result.stderr, result.stderr
        assert "30 optimizer steps ran, 2 audited under a full watch, 2 failed (the batch held nan/inf: 1; nan/inf in the gradients: 1), 2 of them skipped" in result.stderr
    else:  # as asked: the weights take the nan and keep it, every later step fails: the run is stuck and stops
        assert "the weights hold nan since optimizer step 10" in result.stderr
        assert "19 optimizer steps ran, 1 audited under a full watch, 10 failed (the batch held nan/inf: 1; the weights already held nan/inf: 9), 1 of them skipped." in result.stderr  # the step that stopped the run did not run
        assert "RunStuck: opwatch: the run is stuck: 10 optimizer steps in a row failed (steps 10 to 19), the optimizer applied all but the last" in result.stderr


def test_on_failure_is_checked_everywhere_with_the_same_words(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    expected = "on_failure must be one of 'skip', 'raise', 'apply', got 'ignore'"
    with pytest.raises(ValueError, match=expected):
        LeaveOn(on_failure="ignore")
    with pytest.raises(ValueError, match=expected):
        OpwatchCallback(mode="guard", on_failure="ignore")
    with pytest.raises(ValueError, match=expected):
        opwatch.guard(lambda: None, nn.Linear(2, 2), on_failure="ignore")
    with pytest.raises(ValueError, match="on_failure is an option of mode='guard'"):
        OpwatchCallback(on_failure="skip")
    result = run_guard(tmp_path, "--on-failure", "ignore")
    assert result.returncode == 2 and "--on-failure: invalid choice: 'ignore'" in result.stderr, result.stderr


@pytest.mark.parametrize("make", [
    lambda parameters: torch.optim.SGD(parameters, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda parameters: torch.optim.AdamW(parameters, lr=0.1, weight_decay=0.01),
], ids=["sgd-momentum", "adamw"])
def test_a_skipped_step_moves_no_weight_and_no_optimizer_state_where_a_zeroed_one_would(make):
    """Skipping is not zeroing the gradients: momentum and weight decay move the weights at a
    step whose gradients are zero."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = make(model.parameters())
    x = torch.randn(8, 4)

    def state():
        return [(key, value.clone() if torch.is_tensor(value) else value) for p in model.parameters() for key, value in optimizer.state[p].items()]

    with warnings.catch_warnings(), LeaveOn(warn=False, file=io.StringIO()) as runner:
        warnings.simplefilter("ignore")
        for scale in (1.0, 1.0, 0.0):
            optimizer.zero_grad()
            model(x / scale).pow(2).mean().backward()
            before, before_state = [parameter.detach().clone() for parameter in model.parameters()], state()
            optimizer.step()
    assert (runner.steps, runner.failed, runner.skipped) == (3, 1, 1)
    assert all(torch.equal(old, new) for old, new in zip(before, model.parameters()))
    assert all(key == other and (torch.equal(value, new) if torch.is_tensor(value) else value == new)
               for (key, value), (other, new) in zip(before_state, state()))
    optimizer.zero_grad()
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # a zeroed step, for contrast
    assert not all(torch.equal(old, new) for old, new in zip(before, model.parameters()))


def test_parameters_of_layers_called_one_by_one_are_told_apart_by_their_module_and_line():
    """No model holds the two layers (or the loop calls them one by one): each is a module of
    its own, and both hold a ``weight`` and a ``bias``. The failed step names each with its
    module and where it was called, not four bare names."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 8), nn.Linear(8, 1)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    with pytest.warns(opwatch.OpwatchWarning) as told, LeaveOn(file=io.StringIO()):
        for step in range(3):
            x = torch.randn(8, 4)
            if step == 1:
                x[0, 0] = float("nan")  # a corrupted sample
            hidden = torch.relu(first(x))  # FIRST LAYER
            loss = second(hidden).pow(2).mean()  # SECOND LAYER
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    text = "\n".join(opwatch_warnings(told))
    for line in (line_of("FIRST LAYER", __file__), line_of("SECOND LAYER", __file__)):
        for name in ("weight", "bias"):
            assert f"{name} (Linear at {__file__}:{line}) (nan)" in text, text


# -- item 4: the trainers' guard mode --------------------------------------------------------


def steady_data(count=12, width=4):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(count, width, generator=generator)
    return x, x.sum(-1)


def lightning_guard(tmp_path, callback, *, bug=None, nan_at=0, steps=3, data=None, clip=None):
    lightning = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Regressor()
            self.weights = torch.from_numpy(np.ones(1)) if bug == "float64" else torch.ones(1)

        def training_step(self, batch, batch_idx):
            x, target = batch
            self.net.bug = "backward nan" if self.global_step + 1 == nan_at else bug
            pred = self.net(x)  # REGRESSOR CALL
            return (((pred - target) ** 2) * self.weights).mean()  # LIGHTNING LOSS

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = lightning.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=[callback],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
    )
    module = Regression()
    trainer.fit(module, DataLoader(TensorDataset(*(data or steady_data(4 * steps))), batch_size=4))
    return module


@pytest.mark.parametrize("bug, kind", [("broadcast", "broadcast"), ("float64", "dtype_mismatch")])
def test_lightning_guard_audit_reports_the_silent_bug_once(tmp_path, bug, kind):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    lightning_guard(tmp_path, callback, bug=bug)
    assert [anomaly.kind for anomaly in callback.anomalies] == [kind]
    assert callback.anomalies[0].filename == __file__
    assert (callback.runner.steps, callback.runner.audited, callback.runner.failed) == (3, 1, 0)


def test_lightning_guard_audit_reports_a_device_mix(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    with pytest.raises(RuntimeError):  # the mix fails in eager too: the audit names it first
        lightning_guard(tmp_path, callback, bug="device")
    assert [anomaly.kind for anomaly in callback.anomalies] == ["device_mismatch"]
    assert (callback.anomalies[0].filename, callback.anomalies[0].lineno) == (__file__, line_of("BUG device", __file__))


def test_lightning_guard_audits_a_new_batch_signature(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    lightning_guard(tmp_path, callback, steps=4, data=steady_data(14))  # batches of 4, 4, 4, 2
    assert (callback.runner.steps, callback.runner.audited) == (4, 2)
    assert not callback.anomalies


def test_lightning_guard_strict_replays_the_failing_batch_and_raises_its_origin(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback(mode="guard", strict=True, warn=False, file=io.StringIO())
    with pytest.raises(opwatch.AnomalyError) as raised:
        lightning_guard(tmp_path, callback, nan_at=2)
    anomaly = raised.value.anomaly
    assert (anomaly.filename, anomaly.lineno) == (__file__, line_of("BUG backward", __file__))
    assert (callback.runner.steps, callback.runner.failed, callback.runner.skipped) == (2, 1, 1)


def test_lightning_guard_replays_the_failing_batch_names_its_origin_and_skips_its_step(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    with pytest.warns(opwatch.OpwatchWarning) as told:
        module = lightning_guard(tmp_path, callback, nan_at=2, steps=4)
    text = "\n".join(str(warning.message) for warning in told)
    assert "optimizer step 2: the gradients about to be applied hold nan/inf" in text
    assert f"ran again from its start (RNG states and buffers restored, .grad cleared) under a full watch: inf first made by aten.div.Tensor at {__file__}:{line_of('BUG backward', __file__)}" in text
    runner = callback.runner
    assert (runner.steps, runner.audited, runner.failed, runner.skipped) == (4, 1, 1, 1)  # no re-check: the replay named it
    assert all(torch.isfinite(parameter).all() for parameter in module.parameters())
    # The summary shows the replayed origin's own message (its problem, cause and fix) under the
    # line that names it, as a watch's summary shows what it found: it was told nowhere else.
    summary = runner.watch_summary()
    (origin,) = runner.origins
    assert summary.startswith("opwatch: 1 optimizer step failed; the first origin a replay named: inf first made by aten.div.Tensor")
    assert "\n\n" + origin.message + "\n" in summary and "\n  cause:    " in summary and "\n  fix:      " in summary, summary


def test_lightning_guard_tells_a_bad_batch_as_what_its_step_came_in_with(tmp_path):
    """The training_step hands the batch to an inner module (``self.net``), never calling the
    LightningModule: the batch hook used to go on the LightningModule, which no call reached, so
    the failing batch was replayed under a full watch to find that no op of the step made the
    nan. It goes on the first module the audit saw called: the batch is named as it entered it,
    with no replay, and no line says that addmm made it."""
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    x, target = steady_data(16)
    x[5, 2] = float("nan")  # a corrupted sample, in the second batch of 4
    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    with pytest.warns(opwatch.OpwatchWarning) as told:
        module = lightning_guard(tmp_path, callback, steps=4, data=(x, target))
    text = "\n".join(str(warning.message) for warning in told)
    came_in = (f"cause: input: the batch held nan before the model ran: Regressor's argument 0 (f32[4, 4] cpu) held nan when it entered "
               f"the model at {__file__}:{line_of('REGRESSOR CALL', __file__)}, so no op of the model made them")
    assert "optimizer step 2: the gradients about to be applied hold nan/inf" in text and came_in in text, text
    assert "first made by" not in text and callback.runner.ledger.replays == 0, text
    (row,) = callback.runner.ledger.rows()
    assert row["action"] == "skipped", row
    # counted as a bad batch, as the guard that checks the model's inputs counts one
    assert row["cause"] == "input" and "1 failed (the batch held nan/inf), 1 of them skipped" in callback.runner.summary(), row
    assert all(torch.isfinite(parameter).all() for parameter in module.parameters())


def test_lightning_guard_with_gradient_clip_val_decides_on_lightning_s_clip_and_still_replays_a_failing_batch(tmp_path):
    """Lightning clips after the callback's hook, right before the update: the step is decided
    there, on the clip's norm (no pass over the gradients), and a failing batch is replayed and
    skipped as without a clip."""
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    lightning_guard(tmp_path / "healthy", callback, clip=1.0)
    assert (callback.runner.steps, callback.runner.failed, callback.runner.policy.verdict.source) == (3, 0, "clip")

    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    with pytest.warns(opwatch.OpwatchWarning) as told:
        module = lightning_guard(tmp_path / "nan", callback, nan_at=2, steps=4, clip=1.0)
    text = "\n".join(str(warning.message) for warning in told)
    assert f"inf first made by aten.div.Tensor at {__file__}:{line_of('BUG backward', __file__)}" in text
    runner = callback.runner
    assert (runner.steps, runner.failed, runner.skipped, runner.policy.verdict.source) == (4, 1, 1, "clip")
    assert all(torch.isfinite(parameter).all() for parameter in module.parameters())


def hf_guard(tmp_path, callback, *, bug=None, steps=3, guard=None, nan_at=0, bad_sample=None, compile_backend=None):
    """A Hugging Face train; ``nan_at``: the forward call that makes a backward nan;
    ``bad_sample``: the sample (a huge value) whose batch makes it, whichever step that is;
    ``compile_backend``: the Trainer's ``torch_compile`` with that backend."""
    transformers = needs("transformers")
    needs("accelerate")

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Regressor()
            self.calls = 0

        def forward(self, x, labels=None):
            self.calls += 1
            poisoned = self.calls == nan_at or bool((x.abs() > 100).any())
            self.net.bug = "backward nan" if poisoned else bug
            pred = self.net(x)
            return {"loss": ((pred - labels) ** 2).mean(), "logits": pred}  # HF LOSS

    x, y = steady_data(4 * steps)
    if bad_sample is not None:
        x[bad_sample] = 1000.0
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=0.01, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        **({} if compile_backend is None else {"torch_compile": True, "torch_compile_backend": compile_backend}),
    )
    model = Regression()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[{"x": a, "labels": b} for a, b in zip(x, y)], callbacks=[callback])
    if guard is not None:
        guard(trainer)
    with callback:
        trainer.train()
    return model


def test_transformers_guard_audit_reports_the_broadcast_once(tmp_path):
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(mode="guard", warn=False, file=out)
    hf_guard(tmp_path, callback, bug="broadcast")
    assert [anomaly.kind for anomaly in callback.anomalies] == ["broadcast"]
    assert (callback.runner.steps, callback.runner.audited, callback.runner.failed) == (3, 1, 0)
    assert "opwatch guard: 3 optimizer steps ran, 1 audited under a full watch, 0 failed" in out.getvalue()


def test_transformers_guard_rides_on_the_trainer_s_own_clip(tmp_path):
    """The Trainer clips by default (max_grad_norm=1.0): its total norm decides each healthy
    step, no pass of opwatch's over the gradients; a nan under it still fails its step."""
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback

    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    hf_guard(tmp_path / "healthy", callback)
    assert (callback.runner.failed, callback.runner.policy.verdict.source) == (0, "clip")

    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    # Trainer's default optimizer is the fused AdamW where torch has it: the verdict is handed over as found_inf
    with pytest.warns(opwatch.OpwatchWarning, match="optimizer step 2: (the gradients about to be applied hold|its gradients held) nan/inf"):
        hf_guard(tmp_path / "nan", callback, nan_at=2)
    assert [failure.step for failure in callback.runner.failures] == [2] and callback.runner.policy.verdict.source == "clip"


def test_transformers_guard_strict_raises_before_the_optimizer(tmp_path):
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback
    from opwatch.runners.leave_on import GradientsNotFinite

    callback = OpwatchCallback(mode="guard", strict=True, warn=False, file=io.StringIO())
    with pytest.raises(GradientsNotFinite) as raised:
        model = hf_guard(tmp_path, callback, nan_at=2)
    assert raised.value.step == 2


def test_guard_trainer_replays_the_failing_batch_and_raises_its_origin_with_the_callbacks_on_failure(tmp_path):
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback, guard_trainer

    callback = OpwatchCallback(mode="guard", on_failure="raise", warn=False, file=io.StringIO())
    with pytest.raises(opwatch.AnomalyError) as raised:
        hf_guard(tmp_path, callback, bad_sample=5, guard=guard_trainer)
    anomaly = raised.value.anomaly
    assert anomaly.kind in ("nan", "inf") and (anomaly.filename, anomaly.lineno) == (__file__, line_of("BUG backward", __file__))


def test_guard_trainer_skip_goes_on_and_keeps_the_weights_finite(tmp_path):
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback, guard_trainer

    guarded = []
    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    with pytest.warns(opwatch.OpwatchWarning):
        model = hf_guard(tmp_path, callback, bad_sample=5, guard=lambda t: guarded.append(guard_trainer(t, on_failure="skip")))
    assert len(guarded[0].failures) == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # One ledger: the batch guard skipped is the callback's failed and skipped step too (its metrics say so)
    assert (callback.runner.failed, callback.runner.skipped) == (1, 1)
    assert callback.runner.failures[0].origin is guarded[0].failures[0]


def test_guard_trainer_over_a_compiled_trainer_skips_the_bad_batch_and_the_rest_runs(tmp_path):
    # Trainer(torch_compile=True) compiles the model it calls: the callback's forward pre-hook on
    # that model and the guarded training step run inside and around compiled frames. Dynamo's
    # eager backend: the compiled model computes what the eager one does (the bad batch's nan).
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback, guard_trainer

    guarded = []
    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    with pytest.warns(opwatch.OpwatchWarning, match="opwatch.guard skipped a step") as told:
        model = hf_guard(tmp_path, callback, steps=5, bad_sample=13, compile_backend="eager",
                         guard=lambda t: guarded.append(guard_trainer(t, on_failure="skip")))
    # Only opwatch's warnings: Dynamo warns too (on Python 3.13.0, "Guards may run slower" per compile).
    ours = opwatch_warnings(told)
    assert len(ours) == 1 and "call 4 of guard_trainer" in ours[0], ours  # samples 12-15: the fourth batch
    assert [failure.step for failure in callback.runner.failures] == [4]
    assert (callback.runner.failed, callback.runner.skipped) == (1, 1) and callback.runner.ledger.steps == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_bad_mode_is_a_value_error_naming_the_modes():
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    with pytest.raises(ValueError, match="'watch', 'guard'"):
        OpwatchCallback(mode="fast")




SCALED = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows at first: skipped steps
for step in range(8):
    x = torch.randn(8, 4)
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ((model(x).squeeze(-1) - x.sum(-1)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print("scale", scaler.get_scale())
"""


@pytest.mark.parametrize("strict_option", [(), pytest.param(("--strict",), marks=pytest.mark.thorough)])
def test_guard_cli_gradscaler_skipped_steps_are_not_failures(tmp_path, strict_option):
    (tmp_path / "train.py").write_text(SCALED)
    environment = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", "opwatch", "--guard", *strict_option, "train.py"], capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr
    skipped = 8 - int(re.search(r"opwatch guard: (\d+) optimizer steps ran", result.stderr).group(1))
    assert skipped >= 1 and float(result.stdout.split()[-1]) < 2.0**40  # the scaler skipped steps
    assert ", 0 failed" in result.stderr and "hold nan/inf" not in result.stderr
    # Counted apart, as GradScaler at work: its scale never fell below 1.
    assert f"0 failed; GradScaler skipped {skipped} more (overflows of its scaled gradients)." in result.stderr, result.stderr
    assert "stuck" not in result.stderr and "even unscaled" not in result.stderr


DIVERGED_FP16 = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # too high: the weights grow until float16 overflows
scaler = torch.amp.GradScaler("cpu")
for step in range(300):
    x = torch.randn(32, 16)
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ((model(x).squeeze(-1) - 10 * x.sum(-1)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print("scale", scaler.get_scale())
"""


@pytest.mark.parametrize("limit", [(), ("--max-failed-steps", "0")], ids=["stops", "never stops"])
def test_guard_cli_a_run_gradscaler_skips_for_good_is_stuck(tmp_path, limit):
    """A float16 run whose weights diverged: its forward overflows float16 at every step, so
    GradScaler skips every step and halves its scale toward 0. No optimizer step runs, so no
    check of the guard's ran: the run used to go on for all 300 steps, print "0 failed" and
    exit 0. Ten skips in a row with the scale below 1 stop it (RunStuck); never stopping, the
    summary says so."""
    from opwatch.render.html import guard_section
    from opwatch.storage.jsonl import load

    (tmp_path / "train.py").write_text(DIVERGED_FP16)
    environment = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", "opwatch", "--guard", "--jsonl", "run.jsonl", *limit, "train.py"], capture_output=True,
                            text=True, cwd=tmp_path, env=environment, timeout=300)
    text = result.stderr
    # The weights grow until the forward overflows: some batches' gradients overflow at
    # GradScaler's scale, others' loss is inf itself, which no scale mends (told once, counted).
    counts = re.search(r"opwatch guard: (\d+) optimizer steps ran, 1 audited under a full watch, 0 failed; GradScaler skipped (\d+) more "
                       r"\((\d+) overflows of its scaled gradients, (\d+) on a loss not finite before it was scaled\), the last (\d+) in a row "
                       r"with its scale down to ([0-9.e-]+): the gradients are not finite even unscaled, which no scale mends\.", text)
    assert counts is not None, text[-3000:]
    steps, skipped, overflows, on_loss, in_a_row, scale = *map(int, counts.groups()[:5]), float(counts[6])
    assert scale < 1 and in_a_row <= on_loss and overflows + on_loss == skipped
    assert text.count("before GradScaler scaled it, which no scale mends") == 1
    assert re.search(rf"OpwatchWarning: opwatch: GradScaler skipped (the optimizer step|an optimizer step \(\d+ in a row) after optimizer step {steps}\)?: "
                     "the loss backward\\(\\) ran on held inf before GradScaler scaled it", text), text[:2000]
    saved = load(tmp_path / "run.jsonl").guard  # the log and its report count them alike
    assert (saved["steps"], saved["failed"], saved["scaler_skipped"], saved["scaler_skipped_loss"]) == (steps, 0, skipped, on_loss)
    assert (f"0 failed, 0 of them skipped; GradScaler skipped {skipped} more ({overflows} overflows of its scaled gradients, {on_loss} on "
            "a loss not finite before it was scaled).</p>") in guard_section(saved)
    if limit:
        assert result.returncode == 0 and steps + skipped == 300 and "RunStuck" not in text
        assert f"(GradScaler skipped the {in_a_row} steps after it)" in text  # the run's last ops: judged by no check
        return
    # Stuck after 10: a full watch starts at the next forward and watches one whole skipped step (2 more skips)
    assert result.returncode == 1 and in_a_row == 12 and steps + skipped < 300 and "scale" not in result.stdout
    assert (f"RunStuck: opwatch: the run is stuck: GradScaler skipped 12 optimizer steps in a row (after optimizer step {steps}), and its "
            f"scale fell to {scale:.3g}: below 1 it scales the loss down") in text
    assert ("no optimizer step ran, so no check of opwatch's saw them; the full watch of these steps names it: inf first made by "
            "aten.addmm.default at train.py:12 (forward).") in text
    assert "precision: addmm made inf in f16" in text  # the watch's summary: its cause and fix
    assert "--max-failed-steps N (0: never stop) sets that limit." in text


METRIC_FP16 = """\
import torch
from torch import nn

torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(60):
    x, labels = torch.randn(32, 16), torch.randint(0, 4, (32,))
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        emb = encoder(x).float()
    dist = ((emb[:, None] - emb[None]) ** 2).sum(-1).sqrt()  # each embedding's distance to itself is 0
    same = (labels[:, None] == labels[None]).float()
    loss = (same * (1 - torch.eye(32)) * dist).mean() + ((1 - same) * torch.relu(1 - dist)).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print("scale", scaler.get_scale())
"""


def test_guard_cli_a_run_gradscaler_skips_from_its_first_step_is_stuck_with_the_op_its_audit_saw(tmp_path, capsys, monkeypatch):
    """sqrt's backward at 0 makes every gradient nan while the loss stays finite: GradScaler
    skips every step from the first, so the first step's audit is still running when the run
    is stuck. It saw the origin: the summary reports it (with its cause, the scale below 1 made
    it an anomaly) and RunStuck names it. Before: "opwatch: no anomalies." beside the stuck run
    and "A full watch names the op: python -m opwatch train.py", whose watch said the same."""
    monkeypatch.chdir(tmp_path)  # lines are shown relative to it: train.py:13
    status, _, text = guard_in_process(tmp_path, capsys, METRIC_FP16)
    assert status == 1 and "no anomalies" not in text, text[-3000:]
    assert "opwatch: 1 anomaly at 1 place:\n\nnan in aten.div.Tensor at train.py:13 (backward)" in text
    assert "cause:    undefined math: the divisor holds 0, and so does the dividend: 0 / 0 = nan" in text
    assert "GradScaler found it with its scale down to 0.5 and skipped the step" in text
    assert ("RunStuck: opwatch: the run is stuck: GradScaler skipped 18 optimizer steps in a row (from the first step), and its scale "
            "fell to 0.25") in text
    assert ("no optimizer step ran, so no check of opwatch's saw them; the full watch of these steps names it: nan first made by "
            "aten.div.Tensor at train.py:13 (backward).") in text


FUSED_FP16 = fp16_regression_script("torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # the Hugging Face Trainer's default",
                                    "2.0**40", 30)


def test_guard_cli_leaves_a_fused_optimizer_s_overflow_steps_to_grad_scaler(tmp_path, capsys, monkeypatch):
    """A fused optimizer steps under GradScaler with its gradients still scaled: GradScaler
    checked them and hands it found_inf, and the kernel skips an overflowing update itself.
    leave-on used to check the scaled gradients again, fail every overflow step of a healthy
    run while the scale found its level, and stop it as stuck after 10. Then it counted the
    steps the kernel skipped as steps that ran ("30 optimizer steps ran"): they are GradScaler's
    skips, counted as the same loop's with an unfused AdamW (4 ran, 26 skipped). The first
    step's audit watched a step the kernel skipped: no step that ran was audited."""
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, FUSED_FP16)
    assert status == 0 and "RunStuck" not in err, err[-3000:]
    assert ("opwatch guard: 4 optimizer steps ran, 0 audited under a full watch, 0 failed; GradScaler skipped 26 more "
            "(overflows of its scaled gradients).") in err
    assert float(out.split()[-1]) < 2.0**40  # GradScaler did skip the overflow steps


def test_guard_cli_stops_a_fused_optimizer_s_run_that_grad_scaler_skips_for_good(tmp_path, capsys, monkeypatch):
    """The stuck run above with the fused AdamW (the Hugging Face Trainer's default): GradScaler
    never skips its step, the kernel does, on the found_inf GradScaler hands it. leave-on used to
    count 60 steps that ran, say "no anomalies" and exit 0 with the scale at 5.7e-14, and the
    watch contained every origin (the fused check's dummy scale of 1 says nothing of the scale).
    The kernel's skips are GradScaler's now, the run is stopped, and its audit names the op."""
    monkeypatch.chdir(tmp_path)  # lines are shown relative to it: train.py:13
    status, _, text = guard_in_process(tmp_path, capsys, METRIC_FP16.replace("lr=1e-3)", "lr=1e-3, fused=True)"))
    assert status == 1 and "no anomalies." not in text, text[-3000:]
    assert "opwatch guard: 0 optimizer steps ran, 0 audited under a full watch, 0 failed; GradScaler skipped 20 more" in text
    assert ("RunStuck: opwatch: the run is stuck: GradScaler skipped 20 optimizer steps in a row (from the first step), and its scale "
            "fell to 0.0625") in text
    assert "the full watch of these steps names it: nan first made by aten.div.Tensor at train.py:13 (backward)." in text
    assert "cause:    undefined math: the divisor holds 0, and so does the dividend: 0 / 0 = nan" in text


SHARDED_STUCK = METRIC_FP16.replace(
    'scaler = torch.amp.GradScaler("cpu")',
    "import torch.distributed as dist\n"
    "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
    "import datetime\n"
    "dist.init_process_group('gloo', init_method='file://{store}', rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))\n"
    'scaler = ShardedGradScaler("cpu")')


@pytest.mark.thorough
def test_guard_cli_sees_the_skips_of_fsdp_s_sharded_grad_scaler(tmp_path):
    """FSDP's ShardedGradScaler has an unscale_ of its own (it all-reduces its flag), which the
    wrap of GradScaler's did not see: its skips were never counted, and a run it skipped for
    good went on. GradScaler's step, which it inherits, tells them now."""
    (tmp_path / "train.py").write_text(SHARDED_STUCK.replace("{store}", str(tmp_path / "store")))
    result = subprocess.run([sys.executable, "-m", "opwatch", "--guard", "train.py"], capture_output=True, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert ("RunStuck: opwatch: the run is stuck: GradScaler skipped 18 optimizer steps in a row (from the first step), and its scale "
            "fell to 0.25") in result.stderr


SPARSE = """\
import torch
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)  # its gradient is a sparse tensor
        self.fc = nn.Linear(4, 1)

    def forward(self, index, poison=False):
        h = self.emb(index)
        if poison:
            h = torch.where(h > 0, h, h.sqrt())  # sqrt of the negatives: nan in backward
        return self.fc(h).squeeze(-1)


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 7):
    index = torch.randint(0, 10, (8,))
    optimizer.zero_grad()
    loss = model(index, poison=step == 4).pow(2).mean()
    loss.backward()
    try:
        optimizer.step()
    except RuntimeError as error:
        print("stopped:", error)
        break
print("embedding finite:", bool(torch.isfinite(model.emb.weight).all()))
"""


def test_guard_cli_checks_and_names_a_sparse_gradient(tmp_path):
    (tmp_path / "train.py").write_text(SPARSE)
    environment = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", "opwatch", "--guard", "--strict", "train.py"], capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=300)
    assert "optimizer step 4: the gradients about to be applied hold nan/inf: emb.weight (nan)" in result.stderr, result.stdout + result.stderr
    # The sparse gradient is checked and named; the step is skipped, and the next one (healthy) says it did not recur.
    assert "stopped: opwatch: optimizer step 4: the gradients held nan/inf: emb.weight (nan)" in result.stdout
    assert "the failure did not recur: step 5 ran under a full watch" in result.stdout
    assert "embedding finite: True" in result.stdout
    assert "5 optimizer steps ran, 2 audited under a full watch, 1 failed (nan/inf in the gradients), 1 of them skipped" in result.stderr
    assert "judged" not in result.stderr  # the failing step's check judged what ran before it
