"""opwatch.guard: healthy steps at eager speed, failing steps replayed under a full watch with
their origin named, one-op repros, and the cases a replay cannot be faithful to."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
from torch import nn

import opwatch
from support import CountingMode
from support.helpers import line_of

HERE = os.path.abspath(__file__)


class Net(nn.Module):
    """Linear, BatchNorm, ReLU, Dropout, Linear; ``bug`` switches on one deterministic bug."""

    def __init__(self, bug=None):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(8, 1)
        self.bug = bug
        keep = torch.ones(16, 1)
        keep[0] = 0
        self.register_buffer("keep", keep)
        # Not a buffer, so .to() would not move it: the classic device mix (meta stands in for cuda).
        self.shift = torch.zeros(8, device="meta")

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.fc1(x))))
        if self.bug == "forward inf":
            h = h.log()  # BUG forward: log(0) where relu and dropout made zeros
        elif self.bug == "backward nan":
            h = h + (h * self.keep).pow(2).sum(-1, keepdim=True).sqrt()  # BUG backward: sqrt'(0) = inf
        elif self.bug == "device mix":
            h = h + self.shift  # BUG device
        return self.fc2(h).squeeze(-1)


@pytest.fixture(autouse=True)
def _repros_in_tmp_path(tmp_path, monkeypatch):
    # Repro folders go to the system's temporary folder by default: keep them in the test's.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def make(bug=None, **options):
    torch.manual_seed(0)
    model = Net(bug)
    model.train()

    def train_step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    options.setdefault("audit", "never")  # these tests are about the replay; audits: test_guard_audits.py
    return model, train_step, opwatch.guard(train_step, model, **options)


def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=generator), torch.randn(16, generator=generator)


def fail(bug, **options):
    """One guarded call of a step with ``bug``: the model, the guard and the AnomalyError."""
    model, _, step = make(bug, **options)
    with pytest.raises(opwatch.AnomalyError) as caught:
        step(*batch())
    return model, step, caught.value


def state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


# -- healthy steps -------------------------------------------------------------------------------


def test_a_healthy_step_runs_with_no_dispatch_mode_and_returns_what_the_step_returns():
    model, train_step, step = make()
    modes = []

    def watched(x, y):
        modes.append(torch._C._len_torch_dispatch_stack())
        return train_step(x, y)

    guarded = opwatch.guard(watched, model, audit="never")
    x, y = batch()
    reference = copy.deepcopy(model)
    torch.manual_seed(5)
    loss = guarded(x, y)
    torch.manual_seed(5)
    expected = ((reference(x) - y) ** 2).mean()
    expected.backward()
    assert modes == [0]
    assert torch.equal(loss, expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert guarded.calls == 1 and not guarded.failures and guarded.last_replay is None
    assert guarded.__name__ == "watched" and guarded.__wrapped__ is watched


def added_ops(model, train_step, guarded, steps=3):
    """The ops a counting mode entered outside sees on guarded calls, minus those of plain ones."""
    x, y = batch()
    guarded(x, y)  # the first call allocates the copies it keeps
    model.zero_grad(set_to_none=True)
    with CountingMode() as plain:
        for _ in range(steps):
            train_step(x, y)
            model.zero_grad(set_to_none=True)
    with CountingMode() as watched:
        for _ in range(steps):
            guarded(x, y)
            model.zero_grad(set_to_none=True)
    extra = {op: watched.count(op) - plain.count(op) for op in set(watched.ops) | set(plain.ops)}
    return {op: count / steps for op, count in extra.items() if count}


def test_the_only_ops_added_on_a_healthy_step_are_the_finiteness_check():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.25), nn.ReLU(), nn.Linear(8, 1))

    def train_step(x, y):
        loss = ((model(x).squeeze(-1) - y) ** 2).mean()
        loss.backward()
        return loss

    assert added_ops(model, train_step, opwatch.guard(train_step, model, audit="never")) == {
        "aten._amp_foreach_non_finite_check_and_unscale_.default": 1,  # the gradients
        "aten._local_scalar_dense.default": 2,  # the CPU loss, read where it lies; the kernel's flag
    }


def _detaches_of_one_detach_call() -> int:
    """The detach ops a mode sees for one ``.detach()`` of a tensor that needs grad: 1, and 2
    on torch 2.6, which shows a mode two per call."""
    made = torch.ones(2, requires_grad=True) * 2
    with CountingMode() as counted:
        made.detach()
    return counted.count("aten.detach.default")


def test_a_returned_tensor_that_is_not_a_cpu_scalar_joins_the_fused_check():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def train_step(x, y):
        per_sample = (model(x).squeeze(-1) - y) ** 2
        per_sample.mean().backward()
        return per_sample

    assert added_ops(model, train_step, opwatch.guard(train_step, model, audit="never")) == {
        "aten.detach.default": _detaches_of_one_detach_call(),  # of the returned tensor
        "aten.linalg_vector_norm.default": 1,  # the returned tensor's largest magnitude
        "aten._amp_foreach_non_finite_check_and_unscale_.default": 1,  # the gradients and that
        "aten._local_scalar_dense.default": 1,  # the one host read
    }


@pytest.mark.cuda
def test_on_cuda_the_loss_joins_the_fused_check_and_a_step_reads_the_host_once():
    model, train_step, _ = make()
    model.cuda()
    x, y = (tensor.cuda() for tensor in batch())
    guarded = opwatch.guard(train_step, model, audit="never")
    guarded(x, y)
    model.zero_grad(set_to_none=True)
    with CountingMode() as counted:
        guarded(x, y)
    assert counted.count("aten.linalg_vector_norm.default") == 1  # the CUDA loss, not read alone
    assert counted.count("aten._local_scalar_dense.default") == 1  # the kernel's flag: one sync

    bad, bad_step, _ = make("forward inf")
    bad.cuda()
    with pytest.raises(opwatch.AnomalyError, match="aten.log"):
        opwatch.guard(bad_step, bad, audit="never", repro=False)(x, y)


def test_a_model_with_buffers_adds_one_copy_of_them_per_step():
    model, train_step, step = make()
    extra = added_ops(model, train_step, step)
    assert extra.pop("aten._foreach_copy_.default") == 1
    assert set(extra) == {"aten._amp_foreach_non_finite_check_and_unscale_.default", "aten._local_scalar_dense.default"}


def test_the_check_leaves_the_gradients_bitwise_unchanged_and_sees_a_returned_float():
    model, train_step, step = make()
    x, y = batch()
    reference = copy.deepcopy(model)
    torch.manual_seed(3)
    step(x, y)
    torch.manual_seed(3)
    ((reference(x) - y) ** 2).mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))

    model, train_step, _ = make("forward inf")
    floats = opwatch.guard(lambda x, y: train_step(x, y).item(), model, repro=False)
    with pytest.raises(opwatch.AnomalyError, match="returned float"):
        floats(x, y)


def test_gradients_the_fused_kernel_does_not_take_are_checked_per_device():
    weight = nn.Parameter(torch.ones(3, dtype=torch.complex64))
    scale = nn.Parameter(torch.ones(3))

    def train_step(x):
        loss = (weight * x).abs().log().sum() + (scale * x.real).sum()
        loss.backward()
        return loss

    step = opwatch.guard(train_step, [weight, scale], repro=False, audit="never")
    assert step(torch.ones(3, dtype=torch.complex64)) == 3 and step.policy.verdict.check.by_device
    weight.grad = scale.grad = None
    with pytest.raises(opwatch.AnomalyError, match="inf in aten.log.default") as caught:
        step(torch.tensor([1, 0, 1], dtype=torch.complex64))
    assert "the check after it found inf in the returned tensor" in str(caught.value)


# -- failing steps ------------------------------------------------------------------------------


def test_forward_inf_is_replayed_and_named_with_the_model_as_one_run_left_it():
    model, train_step, step = make("forward inf")
    x, y = batch()
    plain = copy.deepcopy(model)
    start = state(model)
    torch.manual_seed(7)
    with pytest.raises(opwatch.AnomalyError) as caught:
        step(x, y)
    rng_after = torch.get_rng_state()
    torch.manual_seed(7)
    ((plain(x) - y) ** 2).mean().backward()

    anomaly = caught.value.anomaly
    assert (anomaly.kind, anomaly.op, anomaly.phase, anomaly.module) == ("inf", "aten.log.default", "forward", "Net")
    assert (anomaly.filename, anomaly.lineno) == (HERE, line_of("# BUG forward", HERE))
    message = str(caught.value)
    assert "call 1 of make.<locals>.train_step failed: the check after it found nan in the returned tensor" in message
    assert "and nan in the .grad of 6 parameter(s): fc1.weight, fc1.bias, bn.weight, bn.bias, +2 more;" in message
    assert "replayed from the same start (RNG states and 4 buffer(s) restored, .grad cleared) under a full watch" in message
    assert "repro:    python " in message
    assert "the replay's last 10 ops up to op #" in caught.value.notes[0]
    assert caught.value.notes[0] in message and not getattr(caught.value, "__notes__", None)  # printed once
    # The buffers are as one run of the step left them (dropout drew the same masks), the
    # gradients as the step found them, the RNG as one run leaves it.
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in plain.state_dict().items() if name.startswith("bn."))
    assert not torch.equal(model.bn.running_mean, start["bn.running_mean"])
    assert int(model.bn.num_batches_tracked) == 1
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng_after, torch.get_rng_state())
    assert step.failures[-1] is anomaly and step.last_replay.anomalies


def test_backward_nan_is_named_at_its_forward_line():
    _, _, error = fail("backward nan")
    anomaly = error.anomaly
    assert anomaly.kind in ("nan", "inf") and anomaly.phase == "backward"
    assert anomaly.lineno == line_of("# BUG backward", HERE)
    assert "nan in the .grad of" in str(error)
    assert error.__cause__ is None


def test_an_exception_from_a_device_mix_is_replayed_and_chained():
    model, _, error = fail("device mix")
    anomaly = error.anomaly
    assert (anomaly.kind, anomaly.op, anomaly.lineno) == ("device_mismatch", "aten.add.Tensor", line_of("# BUG device", HERE))
    assert isinstance(error.__cause__, RuntimeError) and "meta" in str(error.__cause__)
    assert "call 1 of make.<locals>.train_step failed: it raised RuntimeError" in str(error)
    assert int(model.bn.num_batches_tracked) == 1


def test_the_repro_reruns_the_origin_op_alone_in_a_subprocess(tmp_path):
    folder = fail("forward inf", repro_dir=tmp_path)[2].anomaly.repro
    assert os.path.dirname(folder) == str(tmp_path)
    assert sorted(os.listdir(folder)) == ["inputs.pt", "repro.py"]
    script = open(os.path.join(folder, "repro.py")).read()
    assert "inf in aten.log.default at" in script and "torch.ops.aten.log.default(self)" in script
    done = subprocess.run([sys.executable, "repro.py"], cwd=folder, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["aten.log.default, inputs:", "  self: f32[16, 8] cpu: 0 nan, 0 inf of 128 values"]
    made = re.fullmatch(r"  0: f32\[16, 8\] cpu: 0 nan, (\d+) inf of 128 values", lines[3])
    assert lines[2] == "outputs:" and made and int(made.group(1)) > 0  # the infs, made again by the one op


def test_a_repro_over_its_size_limit_says_what_it_left_out(tmp_path):
    error = fail("device mix", repro_dir=tmp_path, repro_max_bytes=100)[2]
    script = open(os.path.join(error.anomaly.repro, "repro.py")).read()
    assert "inputs:   inputs.pt, 1 of 2 tensor(s), 0 bytes (limit 100 bytes)" in script
    assert "left out: self (f32[16, 8] cpu): 512 bytes over what was left of the limit (100 bytes) (zeros here)" in script
    assert "other = _load('other', (8,), torch.float32, 'meta')" in script  # no data: made on meta again


def test_skip_undoes_the_step_warns_once_and_goes_on():
    model, train_step, step = make("forward inf", on_failure="skip", repro=False)
    x, y = batch()
    start = state(model)
    with pytest.warns(opwatch.OpwatchWarning, match="opwatch.guard skipped a step:\ninf in aten.log.default"):
        assert step(x, y) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same origin line warns once
        assert step(x, y) is None
    assert step.skipped == 2 and len(step.failures) == 2
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in start.items())
    assert all(p.grad is None for p in model.parameters())
    model.bug = None
    assert step(x, y) is not None and step.skipped == 2


def test_a_failing_step_drops_the_gradients_it_accumulated_onto_and_its_replay_starts_from_zero():
    model, train_step, step = make()
    x, y = batch()
    step(x, y)  # accumulate once: no copy of these gradients is kept
    model.bug = "forward inf"
    with CountingMode() as counted, pytest.raises(opwatch.AnomalyError, match="aten.log"):
        step(x, y)
    assert all(p.grad is None for p in model.parameters())  # dropped, as GradScaler drops an overflowing step
    copies = [args for op, args in zip(counted.ops, counted.shapes) if op == "aten._foreach_copy_.default"]
    assert copies and all(tuple(model.fc1.weight.shape) not in shapes for shapes in copies)  # the buffers' copy only

    # on_failure="apply": the optimizer gets the replay's gradients, one run of the step from zeroed ones
    model, train_step, step = make(on_failure="apply")
    reference = copy.deepcopy(model)
    torch.manual_seed(5)
    step(x, y)
    held = [p.grad for p in model.parameters()]
    model.bug = reference.bug = "forward inf"
    torch.manual_seed(6)
    with pytest.warns(opwatch.OpwatchWarning, match="aten.log"):
        step(x, y)
    torch.manual_seed(6)
    ((reference(x) - y) ** 2).mean().backward()
    assert all(p.grad is kept for p, kept in zip(model.parameters(), held))  # the same tensors, zeroed in place first
    assert all(torch.allclose(p.grad, r.grad, equal_nan=True)
               for p, r in zip(model.parameters(), reference.parameters()))


# -- what a replay cannot be faithful to ---------------------------------------------------------


def test_a_step_that_changes_the_parameters_is_refused_at_its_first_call():
    model, train_step, _ = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def with_optimizer(x, y):
        loss = train_step(x, y)
        optimizer.step()
        return loss

    step = opwatch.guard(with_optimizer, model)
    with pytest.raises(ValueError, match=r"with_optimizer changed 6 parameter\(s\) while it ran \(fc1.weight, fc1.bias, bn.weight, bn.bias, \+2 more\): an optimizer.step\(\) inside it\?"):
        step(*batch())


def test_a_failing_step_that_changed_its_argument_in_place_is_refused():
    model, train_step, _ = make("forward inf")

    def normalizes(x, y):
        x.div_(2)
        return train_step(x, y)

    with pytest.raises(ValueError, match=r"cannot replay call 1 of .*normalizes \(the check after it found nan .*\): it changed its argument args\[0\] \(f32\[16, 4\] cpu\) in place"):
        opwatch.guard(normalizes, model, audit="never")(*batch())


def test_an_argument_changed_in_place_inside_a_batch_dict_is_named_by_its_path():
    model, train_step, _ = make("forward inf")

    def normalizes(batch, scale=1.0):
        batch["x"].div_(2)
        return train_step(batch["x"], batch["y"])

    x, y = batch()
    with pytest.raises(ValueError, match=r"it changed its argument args\[0\]\['x'\] \(f32\[16, 4\] cpu\) in place"):
        opwatch.guard(normalizes, model, audit="never")({"x": x, "y": y}, scale=2.0)


def test_a_batch_entry_replaced_by_a_new_tensor_is_not_taken_for_an_in_place_change():
    model, train_step, _ = make("forward inf")

    def moves(batch):
        batch["x"] = batch["x"].to(torch.float32).div_(1.0)  # a new tensor (the usual .to()), scaled in place
        batch["mask"] = torch.ones(1)  # and a new entry
        return train_step(batch["x"], batch["y"])

    x, y = batch()
    with pytest.raises(opwatch.AnomalyError, match="aten.log"):  # replayed, not refused
        opwatch.guard(moves, model, audit="never", repro=False)({"x": x.double(), "y": y})


def test_a_later_healthy_call_that_changes_the_parameters_goes_on_and_a_failing_one_is_refused():
    model, train_step, _ = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def accumulates(x, y, apply):
        loss = train_step(x, y)
        if apply:  # the optimizer inside the step, every other call: no replay could undo it
            optimizer.step()
        return loss

    step = opwatch.guard(accumulates, model, audit="never")
    x, y = batch()
    step(x, y, False)
    step(x, y, True)  # healthy: nothing to replay, the look is skipped
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")  # the next step makes nan and changes the parameters
    with pytest.raises(ValueError, match=r"accumulates changed \d+ parameter\(s\) while it ran"):
        step(x, y, True)


def test_a_failure_the_replay_does_not_find_again_is_said_plainly():
    model, train_step, _ = make()
    calls = []

    def flaky(x, y):
        calls.append(1)
        loss = train_step(x, y)
        return loss * float("nan") if len(calls) == 1 else loss

    with pytest.raises(RuntimeError, match="found no nan/inf origin: the failure did not reproduce. A replay runs the step again"):
        opwatch.guard(flaky, model)(*batch())
    assert all(p.grad is None for p in model.parameters())

    calls.clear()

    def raises_once(x, y):
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("only once")
        return train_step(x, y)

    with pytest.raises(KeyError) as caught:
        opwatch.guard(raises_once, model)(*batch())
    assert "it did not raise again: the failure did not reproduce" in caught.value.__notes__[-1]


def test_an_exception_with_no_anomaly_keeps_its_type_and_gets_a_note():
    model, train_step, _ = make()

    def broken(x, y):
        train_step(x, y)
        return x.view(3, 7)  # not a shape x has

    with pytest.raises(RuntimeError, match="shape") as caught:
        opwatch.guard(broken, model, repro=False)(*batch())
    assert not isinstance(caught.value, opwatch.AnomalyError)
    note = caught.value.__notes__[-1]
    assert "it raised RuntimeError again, with no anomaly before it" in note and "aten.view.default" in note


# -- options -------------------------------------------------------------------------------------


def test_options_are_checked():
    model, train_step, _ = make()
    with pytest.raises(ValueError, match="on_failure must be one of 'skip', 'raise', 'apply', got 'ignore'"):
        opwatch.guard(train_step, model, on_failure="ignore")
    with pytest.raises(ValueError, match="unknown check name"):
        opwatch.guard(train_step, model, checks=["nan"])
    with pytest.raises(TypeError, match="for one tensor, pass \\[tensor\\]"):
        opwatch.guard(train_step, torch.ones(2))
    with pytest.raises(TypeError, match="model must be an nn.Module or an iterable of parameters, got int"):
        opwatch.guard(train_step, 3)
    with pytest.raises(TypeError, match="repro must be True or False"):
        opwatch.guard(train_step, model, repro="yes")
    # Nothing to check the gradients of: said at once, not a guard that never checks a gradient.
    for nothing in ([], iter(()), torch.nn.ReLU()):
        with pytest.raises(ValueError, match=r"model holds no parameters; .* guard\(step, model\) or guard\(step, model.parameters\(\)\)"):
            opwatch.guard(train_step, nothing)


def test_parameters_may_be_given_as_an_iterable_and_checks_narrow_what_is_checked():
    model, train_step, _ = make("forward inf")
    step = opwatch.guard(train_step, model.parameters(), repro=False)
    with pytest.raises(opwatch.AnomalyError, match="nan in the .grad of 6 parameter\\(s\\): parameter 0 \\(f32\\[8, 4\\] cpu\\), parameter 1"):
        step(*batch())
    unchecked = opwatch.guard(train_step, model, checks=["device_mismatch"])
    assert unchecked(*batch()).isnan()  # no nan/inf check: only exceptions are replayed


def test_opwatch_disable_makes_the_guard_a_plain_call(monkeypatch):
    monkeypatch.setenv("OPWATCH_DISABLE", "1")
    model, train_step, step = make("forward inf")
    assert step(*batch()).isnan() and step.calls == 0


@pytest.mark.skipif(not hasattr(opwatch, "Allow"), reason="opwatch.Allow is not in this tree")
def test_allow_reaches_the_replay_and_an_allowed_origin_is_named_as_such():
    model, train_step, step = make("forward inf", allow=[opwatch.Allow(op="aten.log*")], repro=False)
    with pytest.raises(RuntimeError, match=r"found only nan/inf origins that match an allow entry \(1, the first: inf in aten.log.default at"):
        step(*batch())
    assert [anomaly.op for anomaly in step.last_replay.allowed] == ["aten.log.default"]


def _fp16_scaler_loop(guarded_options, steps=6):
    """An fp16 autocast loop whose scaler starts far too high: its first steps overflow."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    x, y = torch.randn(32, 16), torch.randn(32, 1)

    def train_step(x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        return loss

    step = opwatch.guard(train_step, model, **guarded_options(scaler))
    for _ in range(steps):
        optimizer.zero_grad()
        step(x, y)
        scaler.step(optimizer)
        scaler.update()
    return step, scaler


def test_with_its_grad_scaler_the_overflow_steps_are_the_scalers_business():
    step, scaler = _fp16_scaler_loop(lambda scaler: {"scaler": scaler})
    assert scaler.get_scale() < 2.0**40  # the scaler did skip overflow steps
    assert step.calls == 6 and list(step.failures) == [] and step.last_replay is None


def test_without_its_grad_scaler_an_overflow_step_is_a_failure():
    with pytest.raises(opwatch.AnomalyError):
        _fp16_scaler_loop(lambda scaler: {})


def test_scaler_must_be_a_grad_scaler():
    with pytest.raises(TypeError, match="torch.amp.GradScaler"):
        opwatch.guard(lambda: None, nn.Linear(2, 2), scaler=object())


@pytest.mark.parametrize("dtype, bad", [(torch.bfloat16, float("nan")), (torch.float16, float("inf")), (torch.float16, -float("inf"))])
def test_the_fused_check_sees_nan_and_inf_in_low_precision_gradients_beside_unused_parameters(dtype, bad):
    torch.manual_seed(0)
    # A low-precision model whose last layer is unused: its gradients stay None.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.Linear(1, 1)).to(dtype)
    poison = [False]

    def train_step(x):
        loss = model[2](model[1](model[0](x))).float().pow(2).mean()
        loss.backward()
        if poison[0]:
            with torch.no_grad():
                model[0].weight.grad[1, 2] = bad  # a gradient gone bad in one spot
        return loss

    step = opwatch.guard(train_step, model, audit="never", on_failure="skip", repro=False)
    x = torch.randn(16, 4, dtype=dtype)
    assert torch.isfinite(step(x)) and model[3].weight.grad is None and not step.policy.verdict.check.by_device
    model.zero_grad(set_to_none=True)
    poison[0] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        assert step(x) is None  # caught: skipped, the gradients put back as the step found them
    assert step.skipped == 1 and all(p.grad is None for p in model.parameters())


def test_under_its_grad_scaler_a_nan_loss_is_still_caught():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1), nn.Linear(1, 1))  # the last one unused
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 16), torch.randn(32, 1)

    def train_step(x, y, bad=False):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model[2](model[1](model[0](x))), y)
        if bad:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        return loss

    step = opwatch.guard(train_step, model, scaler=scaler, audit="never", on_failure="skip", repro=False)
    assert torch.isfinite(step(x, y)) and model[3].weight.grad is None
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        assert step(x, y, bad=True) is None
    assert step.skipped == 1
