"""On a CUDA device: the host syncs guard, leave-on and watch add to a training step, counted by
torch itself (``torch.cuda.set_sync_debug_mode("warn")`` warns at every synchronizing call),
and their findings on real CUDA kernels. Marked ``cuda``: skipped without a CUDA device
(tests/conftest.py); ``bench/gpu_check.sh`` runs them on a GPU machine."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import opwatch
from opwatch.runners.leave_on import LeaveOn
from support.helpers import line_of

from bench.gpu import SyncCount  # the bench's own counter: the figures it prints are the ones tested

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


class Regressor(nn.Module):
    """Linear, LayerNorm, ReLU, Linear on the GPU; ``bug`` switches on one bug."""

    def __init__(self, bug=None):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 1)
        self.bug = bug
        self.stray = torch.zeros(32)  # not a buffer: .cuda() leaves it on the CPU

    def forward(self, x):
        h = torch.relu(self.norm(self.fc1(x)))
        if self.bug == "device":
            h = h + self.stray  # BUG device: a CPU tensor meets the GPU's
        if self.bug == "scale":
            h = h / x[:, :1].abs().round()  # BUG inf: nan or inf in a row whose first feature rounds to 0
        if self.bug == "backward nan":
            h = h + (h * 0).sqrt()  # BUG backward: sqrt'(0) * 0 = nan; forward adds 0
        return self.fc2(h).squeeze(-1)


def setup(bug=None):
    torch.manual_seed(0)
    model = Regressor(bug).to(CUDA)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batches(count, size=16, first=2.0):
    """Batches on the GPU; every first feature is at least ``first`` in magnitude (scale bug off)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        x = torch.randn(size, 16, generator=generator)
        x[:, 0] = x[:, 0].sign() * (x[:, 0].abs() + first)
        yield x.to(CUDA), x.sum(-1).to(CUDA)


def forward_backward(model):
    def train_step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    return train_step


def test_a_healthy_guarded_step_syncs_once_and_trains_as_eager_does():
    model, optimizer = setup()
    reference, reference_optimizer = setup()
    step = opwatch.guard(forward_backward(model), model)  # the first call is the audit
    eager = forward_backward(reference)
    syncs = []
    for number, (x, y) in enumerate(batches(6)):
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.zero_grad(set_to_none=True)
        with SyncCount(CUDA) as counted:
            loss = step(x, y)
        syncs.append(counted.n)
        optimizer.step()
        assert torch.equal(loss, eager(x, y)), number
        reference_optimizer.step()
    assert syncs[1:] == [1] * 5  # the fused check's one host read; the loss on the GPU joins it
    assert step.audits == 1 and not step.failures and not step.anomalies
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_a_cuda_inf_is_replayed_and_named_with_its_line(tmp_path):
    model, optimizer = setup("scale")
    step = opwatch.guard(forward_backward(model), model, repro_dir=tmp_path)
    x, y = next(batches(1))
    optimizer.zero_grad(set_to_none=True)
    step(x, y)  # every first feature rounds away from 0: finite
    optimizer.step()
    x[3, 0] = 0.2  # rounds to 0
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad(set_to_none=True)
    with pytest.raises(opwatch.AnomalyError) as caught:
        step(x, y)
    anomaly = caught.value.anomaly
    assert anomaly.kind in ("nan", "inf") and anomaly.op == "aten.div.Tensor"  # 0/0 or h/0
    assert anomaly.lineno == line_of("# BUG inf", __file__)
    assert "cuda" in str(caught.value)
    assert all(p.grad is None for p in model.parameters())  # the optimizer never sees them
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_cpu_tensor_in_a_cuda_step_is_named_as_a_device_mix():
    model, _ = setup("device")
    x, y = next(batches(1))
    with pytest.raises(opwatch.AnomalyError) as caught:
        opwatch.guard(forward_backward(model), model, audit="never", repro=False)(x, y)
    anomaly = caught.value.anomaly
    assert (anomaly.kind, anomaly.op, anomaly.lineno) == ("device_mismatch", "aten.add.Tensor", line_of("# BUG device", __file__))
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_leave_on_checks_each_cuda_step_with_one_sync_and_names_a_nan_gradient():
    model, optimizer = setup()
    syncs = []
    with LeaveOn(audit="first") as run:
        for x, y in batches(5):
            with SyncCount(CUDA) as counted:
                optimizer.zero_grad(set_to_none=True)
                ((model(x) - y) ** 2).mean().backward()
                optimizer.step()
            syncs.append(counted.n)
    assert (run.steps, run.audited, run.failed) == (5, 1, 0)
    assert syncs[1:] == [1] * 4  # after the audited first step: the fused check's read

    model, optimizer = setup("backward nan")
    with pytest.warns(opwatch.OpwatchWarning, match="fc1.weight"):
        with LeaveOn(audit="manual") as run:  # no audit: the check alone must catch it
            run.know(model)  # the trainers' way to name the parameters
            for x, y in batches(2):
                optimizer.zero_grad(set_to_none=True)
                ((model(x) - y) ** 2).mean().backward()
                optimizer.step()
    assert run.failures[0].step == 1 and ("fc1.weight", "nan") in run.failures[0].parameters


def test_watch_checks_a_healthy_cuda_step_with_at_most_one_sync_and_names_a_nan_origin():
    model, _ = setup()
    x, y = next(batches(1))
    with opwatch.watch() as w:
        ((model(x) - y) ** 2).mean().backward()
        with SyncCount(CUDA) as counted:
            w.check()  # a check point: the nan/inf flags read at most once
    assert counted.n <= 1 and not w.anomalies

    model, _ = setup("backward nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        with opwatch.watch() as w:
            ((model(x) - y) ** 2).mean().backward()
            found = w.check()
    assert found and found[0].kind in ("nan", "inf") and found[0].lineno == line_of("# BUG backward", __file__)


def test_a_compiled_cuda_step_under_guard_stays_compiled_and_syncs_once():
    model, optimizer = setup()
    compiled = torch.compile(model)
    outputs = []

    def train_step(x, y):
        out = compiled(x)
        outputs.append(type(out.grad_fn).__name__)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, audit="never")
    syncs = []
    for x, y in batches(4):
        optimizer.zero_grad(set_to_none=True)
        with SyncCount(CUDA) as counted:
            step(x, y)
        syncs.append(counted.n)
        optimizer.step()
    assert syncs[1:] == [1] * 3
    assert outputs == ["CompiledFunctionBackward"] * 4


def test_leave_on_with_a_fused_adamw_and_a_clip_adds_no_sync_to_a_healthy_step_and_still_skips_a_nan_one():
    """The verdict rides on the clip's norm and goes to the fused AdamW as found_inf (as
    GradScaler hands it): no host read on a healthy step; a failing one is skipped on the device
    and told at the next step, from a flag copied to pinned memory without blocking."""
    torch.manual_seed(0)
    model = Regressor().to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    syncs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with LeaveOn(audit="first") as run:
            for step, (x, y) in enumerate(batches(6), start=1):
                model.bug = "backward nan" if step == 4 else None
                if step == 4:
                    before = [parameter.detach().clone() for parameter in model.parameters()]
                with SyncCount(CUDA) as counted:
                    optimizer.zero_grad(set_to_none=True)
                    ((model(x) - y) ** 2).mean().backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                syncs.append(counted.n)
                if step == 4:
                    torch.cuda.synchronize()
                    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # skipped on the device
    assert syncs[1:4] == [0, 0, 0]  # after the audited first step: nothing added to the program's own syncs
    assert [failure.step for failure in run.failures] == [4] and run.policy.verdict.source == "clip"
    assert any("optimizer step 4:" in str(w.message) and "told at step 5" in str(w.message) for w in caught)


def test_reading_the_counts_every_step_of_a_fused_run_adds_no_sync_and_the_run_s_end_counts_its_last_step():
    """A log of the counts after every step (a trainer's) takes in the flags the device has
    finished, never waiting for it; the run's end waits for the last one."""
    from opwatch.runners.trainers import metrics

    torch.manual_seed(0)
    model = Regressor().to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    syncs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        with LeaveOn(audit="first") as run:
            for step, (x, y) in enumerate(batches(6), start=1):
                model.bug = "backward nan" if step == 6 else None  # the last step fails
                with SyncCount(CUDA) as counted:
                    optimizer.zero_grad(set_to_none=True)
                    ((model(x) - y) ** 2).mean().backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    metrics(run)  # a log of every step
                syncs.append(counted.n)
    assert syncs[1:] == [0] * 5  # after the audited first step
    assert [failure.step for failure in run.failures] == [6] and "1 failed" in run.summary()
