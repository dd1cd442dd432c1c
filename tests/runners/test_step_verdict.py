"""The verdict rides on what the step computed (opwatch.runners.step_verdict): counted, never
timed. On a healthy step that clips, the elements opwatch's own ops touch are at most 1% of the
gradient elements, no gradient is copied, and a DDP step meets no collective of opwatch's; a
failing step is still caught and skipped (a clip over nan, a GradScaler overflow, a nan loss
with finite gradients, a nan on one DDP rank, a fused optimizer handed the verdict)."""

from __future__ import annotations

import contextlib
import io
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import opwatch
from opwatch.runners import batches as batches_module
from opwatch.runners import leave_on as leave_on_module
from opwatch.runners import step_verdict
from opwatch.runners.leave_on import GradientsNotFinite, LeaveOn
from support import CountingMode, fsdp2_on_cpu, needs


class TinyGPT(nn.Module):
    """A nanoGPT-shaped model: embeddings, one attention block, an MLP, a tied head."""

    def __init__(self, vocab=64, width=32, context=16):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.attention = nn.MultiheadAttention(width, 4, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.bug = None

    def forward(self, idx, targets):
        steps = idx.shape[1]
        h = self.tokens(idx) + self.positions(torch.arange(steps))
        mask = torch.triu(torch.ones(steps, steps, dtype=torch.bool), 1)
        a = self.norm1(h)
        h = h + self.attention(a, a, a, attn_mask=mask, need_weights=False)[0]
        h = h + self.mlp(self.norm2(h))
        if self.bug == "nan":
            h = h + (h[..., :1] - 1e4).sqrt()  # BUG: nan on every token
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def batch(step, *, ignored=False):
    generator = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 64, (4, 16), generator=generator)
    targets = torch.randint(0, 64, (4, 16), generator=generator)
    return idx, torch.full_like(targets, -100) if ignored else targets


def gradient_elements(model) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


@contextlib.contextmanager
def opwatch_ops_visible(monkeypatch):
    """opwatch runs its own reads and reductions unseen by the program's dispatch modes: made
    visible here (the loss kept at backward(), the verdict's reads), so that the counting mode
    sees opwatch's ops too."""
    from opwatch.runners.policy import verdict as verdict_module

    def seen(function, *args):
        return function(*args)

    monkeypatch.setattr(batches_module, "no_python_dispatch", contextlib.nullcontext)
    monkeypatch.setattr(leave_on_module, "unseen_by_dispatch_modes", seen)
    monkeypatch.setattr(verdict_module, "unseen_by_dispatch_modes", seen)
    yield


def added_elements(plain: CountingMode, watched: CountingMode) -> dict:
    """``{op: elements}`` the watched steps' ops touched beyond the plain steps'."""
    before, after = plain.elements_by_op(), watched.elements_by_op()
    return {op: after.get(op, 0) - before.get(op, 0) for op in set(before) | set(after) if after.get(op, 0) != before.get(op, 0)}


def nanogpt_steps(model, optimizer, steps, *, first=1, clip=True, ignored_at=None):
    for step in range(first, first + steps):
        loss = model(*batch(step, ignored=step == ignored_at))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def training_state(model, optimizer) -> tuple:
    """The weights (copies) and each parameter's optimizer step count, as they are now."""
    return [parameter.detach().clone() for parameter in model.parameters()], [optimizer.state[parameter]["step"].item() for parameter in model.parameters()]


def same_training_state(now: tuple, before: tuple) -> bool:
    (weights, steps), (weights_before, steps_before) = now, before
    return all(torch.equal(a, b) for a, b in zip(weights, weights_before)) and steps == steps_before


def fresh(fused=False):
    torch.manual_seed(0)
    model = TinyGPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)


@pytest.fixture
def handed_off_on_the_cpu(monkeypatch):
    """The hand-off of a fused optimizer's verdict (``found_inf``, read a step late), which runs
    where a host read waits for the device (CUDA), exercised here on the CPU: no device counts
    as one whose reads cost nothing."""
    monkeypatch.setattr(step_verdict, "HOST_DEVICES", frozenset())


def test_on_the_cpu_a_fused_optimizer_s_step_is_decided_before_it_runs_with_no_flag_handed_over(monkeypatch):
    # A host read costs nothing on the CPU: the fused AdamW's failing step is told at its own
    # check and skipped by it (weights and step counts as they were), with no found_inf set
    # and no flag made to be read a step late.
    made = []
    original = step_verdict.DeferredFlag.__init__
    monkeypatch.setattr(step_verdict.DeferredFlag, "__init__", lambda flag: (made.append(flag), original(flag))[1])
    model, optimizer = fresh(fused=True)
    seen_found_inf = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen_found_inf.append(getattr(opt, "found_inf", None)))
    with told_run() as (run, caught):
        nanogpt_steps(model, optimizer, 2)
        before = training_state(model, optimizer)
        model.bug = "nan"
        nanogpt_steps(model, optimizer, 1, first=3)
        assert [failure.step for failure in run.failures] == [3] and run.skipped == 1  # decided at its own check
        assert same_training_state(training_state(model, optimizer), before)
        model.bug = None
        nanogpt_steps(model, optimizer, 2, first=4)
    assert made == [] and seen_found_inf == [None] * 5  # no step, the skipped one included, had a found_inf
    told = [str(w.message) for w in caught if "optimizer step 3" in str(w.message)]
    assert told and "told at step" not in told[0] and "found_inf" not in told[0]
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


# -- counted: what a healthy step adds ------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_leave_on_over_a_clipping_loop_touches_at_most_one_percent_of_the_gradients(monkeypatch, fused):
    model, optimizer = fresh(fused)
    reference, reference_optimizer = fresh(fused)
    with opwatch_ops_visible(monkeypatch), LeaveOn(audit="first", warn=False) as run:
        nanogpt_steps(model, optimizer, 1)  # the audit
        with CountingMode() as watched:
            nanogpt_steps(model, optimizer, 3, first=2)
    nanogpt_steps(reference, reference_optimizer, 1)
    with CountingMode() as plain:
        nanogpt_steps(reference, reference_optimizer, 3, first=2)
    added = added_elements(plain, watched)
    assert sum(added.values()) / 3 <= 0.01 * gradient_elements(model), added
    assert "aten._foreach_copy_.default" not in added and "aten._amp_foreach_non_finite_check_and_unscale_.default" not in added
    assert run.policy.verdict.source == step_verdict.CLIP and run.failed == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))  # bitwise the same training


def test_the_programs_own_dispatch_mode_sees_none_of_leave_on_s_ops_on_a_healthy_step(monkeypatch):
    # A profiler or FLOP counter of the program's (a dispatch mode around the loop) sees the
    # program's ops only: the loss kept at backward() and the verdict's reads stay out of it.
    def counted(visible: bool) -> CountingMode:
        model, optimizer = fresh()
        with contextlib.ExitStack() as stack:
            if visible:
                stack.enter_context(opwatch_ops_visible(monkeypatch))
            run = stack.enter_context(LeaveOn(audit="first", warn=False))
            nanogpt_steps(model, optimizer, 1)  # the audit
            with CountingMode() as counting:
                nanogpt_steps(model, optimizer, 2, first=2)
        assert run.ledger.steps == 3 and run.failed == 0
        return counting

    reference, reference_optimizer = fresh()
    nanogpt_steps(reference, reference_optimizer, 1)
    with CountingMode() as plain:
        nanogpt_steps(reference, reference_optimizer, 2, first=2)
    assert counted(visible=False).ops == plain.ops
    extra = counted(visible=True).ops  # the same count, with opwatch's own ops made visible: there they are
    with CountingMode() as one_detach:  # one Tensor.detach(): one aten.detach, two on torch 2.6
        torch.ones(1).detach()
    per_detach = one_detach.ops.count("aten.detach.default")
    assert extra.count("aten.detach.default") == plain.ops.count("aten.detach.default") + 2 * per_detach  # a loss a step
    assert extra.count("aten._local_scalar_dense.default") >= plain.ops.count("aten._local_scalar_dense.default") + 4  # norm, loss


def test_without_a_clip_leave_on_makes_its_own_fused_pass():
    """The case that keeps its pass: the loop reduced nothing that covers the gradients."""
    model, optimizer = fresh()
    with LeaveOn(audit="manual", warn=False) as run:
        nanogpt_steps(model, optimizer, 1, clip=False)
        with CountingMode() as watched:
            nanogpt_steps(model, optimizer, 1, first=2, clip=False)
    assert run.policy.verdict.source == step_verdict.FUSED_PASS
    # its ops run with Python dispatch off: the counting mode sees none of them, the program's only
    assert watched.count("aten._amp_foreach_non_finite_check_and_unscale_.default") == 0


def test_a_clip_over_only_some_parameters_does_not_stand_for_the_others():
    model, optimizer = fresh()
    with LeaveOn(audit="manual", warn=False) as run:
        loss = model(*batch(1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.mlp.parameters(), 1.0)  # the MLP's only
        optimizer.step()
    assert run.policy.verdict.source == step_verdict.FUSED_PASS


def test_the_clip_wrap_is_scoped_and_sees_a_clip_imported_before_the_run():
    from torch.nn.utils import clip_grad_norm_  # bound before the run: the wrap is of the function it calls

    home = torch.nn.utils.clip_grad._get_total_norm
    model, optimizer = fresh()
    with LeaveOn(audit="manual", warn=False) as run:
        assert torch.nn.utils.clip_grad._get_total_norm is not home
        model(*batch(1)).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    assert torch.nn.utils.clip_grad._get_total_norm is home  # restored on exit
    assert run.policy.verdict.source == step_verdict.CLIP


def test_guard_over_a_clipping_step_copies_no_gradient_and_runs_no_pass_over_them():
    model, optimizer = fresh()

    def train_step(idx, targets):
        loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    guarded = opwatch.guard(train_step, model, audit="never")
    reference, _ = fresh()

    def plain_step(idx, targets):
        loss = reference(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        return loss

    guarded(*batch(1))
    model.zero_grad(set_to_none=True)
    with CountingMode() as watched:
        for step in (2, 3):
            guarded(*batch(step))  # accumulating onto the first: no copy of the gradients kept
    with CountingMode() as plain:
        plain_step(*batch(1))
        for step in (2, 3):
            plain_step(*batch(step))
    added = added_elements(plain, watched)
    assert "aten._foreach_copy_.default" not in added
    assert "aten._amp_foreach_non_finite_check_and_unscale_.default" not in added
    assert max(added.values(), default=0) <= 0.01 * gradient_elements(model), added
    assert guarded.policy.verdict.source == step_verdict.CLIP


# -- must flag: a failing step is still caught and skipped ---------------------------------------


@contextlib.contextmanager
def told_run():
    """A manual-audit leave-on run that skips failing steps, with every warning it gives
    recorded: ``(run, caught)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with LeaveOn(audit="manual", on_failure="skip", warn=False) as run:
            yield run, caught


def test_a_clip_over_nan_gradients_fails_the_step_and_skips_it():
    model, optimizer = fresh()
    with told_run() as (run, caught):
        nanogpt_steps(model, optimizer, 2)
        before = [parameter.detach().clone() for parameter in model.parameters()]
        model.bug = "nan"
        nanogpt_steps(model, optimizer, 1, first=3)
        after_failure = [parameter.detach().clone() for parameter in model.parameters()]
        model.bug = None
        nanogpt_steps(model, optimizer, 1, first=4)
    assert [failure.step for failure in run.failures] == [3] and run.skipped == 1
    assert run.policy.verdict.source == step_verdict.CLIP
    assert all(torch.equal(a, b) for a, b in zip(before, after_failure))  # the weights as they were
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
    assert any("optimizer step 3: the gradients about to be applied hold nan/inf" in str(w.message) for w in caught)


def test_a_nan_loss_with_finite_gradients_fails_its_step():
    model, optimizer = fresh()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with LeaveOn(audit="manual", on_failure="skip", warn=False) as run:
            nanogpt_steps(model, optimizer, 3, ignored_at=2)  # every label ignored: 0/0
    assert [(failure.step, failure.cause, failure.loss) for failure in run.failures] == [(2, "loss", "nan")]


def test_a_grad_scaler_overflow_is_the_scaler_s_and_its_unscale_decides_healthy_steps():
    model, optimizer = fresh()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with LeaveOn(audit="manual", on_failure="skip", warn=False) as run:
        for step in (1, 2, 3):
            loss = model(*batch(step))
            scaled = scaler.scale(loss * (1e38 if step == 2 else 1.0))  # step 2 overflows
            scaled.backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    assert run.steps == 2 and run.failed == 0  # the scaler skipped step 2 itself: it never reached the hooks
    assert run.policy.verdict.source == step_verdict.SCALER
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def layer_wise_trust_ratio(model, broken=False):
    """LARS's layer-wise scaling, written into the gradients after the clip: each by its
    parameter's norm over its own; ``broken``: over a norm that came out 0 (inf everywhere)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.grad.mul_(parameter.norm() / (parameter.grad.norm() * (0.0 if broken else 1.0)))  # THE TRUST RATIO


@pytest.mark.parametrize("scaled", [False, True], ids=["clip", "grad-scaler-and-clip"])
def test_a_write_into_the_gradients_after_the_program_s_own_check_is_checked(scaled):
    """The clip's norm (and GradScaler's unscale_) checked the gradients; a layer-wise trust
    ratio then wrote inf into them. Both checks spoke for values that were no more: the step
    passed, the optimizer applied inf, and the next step said an earlier step "wrote them from
    finite gradients". A gradient written since the program's check (its version counter moved,
    but for the clip's own multiplication) is checked by leave-on's own fused pass; a loop that
    writes nothing after its check keeps the check that costs nothing."""
    model, optimizer = fresh()
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)
    with told_run() as (run, caught):
        for step in (1, 2, 3, 4):
            scaler.scale(model(*batch(step))).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step == 4:
                before = [parameter.detach().clone() for parameter in model.parameters()]
            layer_wise_trust_ratio(model, broken=step == 4)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    assert [failure.step for failure in run.failures] == [4] and run.skipped == 1
    assert run.policy.verdict.source == step_verdict.FUSED_PASS  # the writes after the check: its own pass
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the weights as they were
    told = [str(warning.message) for warning in caught]
    assert any("optimizer step 4: the gradients about to be applied hold nan/inf" in message for message in told), told
    assert not any("from finite gradients" in message for message in told), told


@pytest.mark.usefixtures("handed_off_on_the_cpu")
def test_a_fused_optimizer_gets_the_verdict_as_found_inf_and_skips_the_failing_step_on_the_device():
    model, optimizer = fresh(fused=True)
    with told_run() as (run, caught):
        nanogpt_steps(model, optimizer, 2)
        before = training_state(model, optimizer)
        model.bug = "nan"
        nanogpt_steps(model, optimizer, 1, first=3)
        assert run.ledger.failed == 0  # the flag is read at the next step (or at a read of the counts)
        assert not hasattr(optimizer, "found_inf")  # GradScaler's contract: for one step only
        assert same_training_state(training_state(model, optimizer), before)  # skipped on the device
        model.bug = None
        nanogpt_steps(model, optimizer, 2, first=4)
    assert [failure.step for failure in run.failures] == [3] and run.skipped == 1
    assert any(str(w.message).startswith("opwatch: optimizer step 3: its gradients held nan/inf (and the loss backward() ran on was nan). "
                                         "The fused optimizer got the verdict as found_inf") and "told at step 4" in str(w.message)
               for w in caught)
    assert run.audited == 1  # step 5 ran under the full watch, to name a failure that recurs
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


@pytest.mark.usefixtures("handed_off_on_the_cpu")
def test_a_fused_optimizer_s_last_failing_step_is_told_when_the_run_ends_and_raise_raises_before_the_next_step():
    model, optimizer = fresh(fused=True)
    with told_run() as (run, caught):
        model.bug = "nan"
        nanogpt_steps(model, optimizer, 1)
    assert run.failed == 1 and any("told at the end of the run" in str(w.message) for w in caught)

    model, optimizer = fresh(fused=True)
    with pytest.raises(GradientsNotFinite, match="optimizer step 1: .* held nan/inf") as raised:
        with LeaveOn(audit="manual", on_failure="raise", warn=False):
            model.bug = "nan"
            nanogpt_steps(model, optimizer, 1)
            start = [parameter.detach().clone() for parameter in model.parameters()]
            model.bug = None
            nanogpt_steps(model, optimizer, 1, first=2)
    assert raised.value.step == 1
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))  # step 2 never ran


# -- a late verdict is settled before anything reads the counts ---------------------------------


class Scalars:
    """A SummaryWriter's ``add_scalar``, kept: ``{tag: [(step, value)]}``."""

    def __init__(self):
        self.written: dict = {}

    def add_scalar(self, tag, value, step):
        self.written.setdefault(tag, []).append((step, value))

    def close(self):
        pass


@pytest.mark.usefixtures("handed_off_on_the_cpu")
def test_a_fused_optimizer_s_failing_last_step_is_in_the_counts_logged_after_it_and_in_the_run_s_summary():
    from opwatch.runners.tensorboard import OptimizerStepCounts

    model, optimizer = fresh(fused=True)
    scalars, out = Scalars(), io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with LeaveOn(audit="manual", on_failure="skip", warn=False, file=out) as run, OptimizerStepCounts(scalars, run) as counts:
            nanogpt_steps(model, optimizer, 2)
            model.bug = "nan"
            nanogpt_steps(model, optimizer, 1, first=3)  # the last step fails; its flag is on the device
        counts.close()
    assert scalars.written["opwatch/failed"] == [(1, 0), (2, 0), (3, 1)]  # the counts logged after step 3 hold it
    assert scalars.written["opwatch/skipped"][-1] == (3, 1)
    assert [failure.step for failure in run.failures] == [3] and "3 optimizer steps ran, 0 audited under a full watch, 1 failed" in run.summary()
    told = [str(w.message) for w in caught if "optimizer step 3" in str(w.message)]
    assert len(told) == 1 and "told when the run's counts were read after step 3" in told[0]  # once, at the first read


@pytest.mark.usefixtures("handed_off_on_the_cpu")
def test_a_read_of_the_counts_never_raises_the_step_after_it_does_before_it_runs():
    model, optimizer = fresh(fused=True)
    with pytest.raises(GradientsNotFinite, match="optimizer step 1: its gradients held nan/inf") as raised:
        with LeaveOn(audit="manual", on_failure="raise", warn=False) as run:
            model.bug = "nan"
            nanogpt_steps(model, optimizer, 1)
            assert (run.failed, run.skipped) == (1, 1)  # counted at the read, raised at the next check
            start = [parameter.detach().clone() for parameter in model.parameters()]
            model.bug = None
            nanogpt_steps(model, optimizer, 1, first=2)
    assert raised.value.step == 1 and run.failures[0].action == "raised"
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))  # step 2 never ran


@pytest.mark.usefixtures("handed_off_on_the_cpu")
def test_a_stuck_run_found_at_a_read_stops_at_the_next_step_s_check():
    from opwatch.runners.leave_on import RunStuck

    model, optimizer = fresh(fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        with pytest.raises(RunStuck) as stuck:
            with LeaveOn(audit="manual", on_failure="skip", warn=False, max_failed_in_a_row=2) as run:
                model.bug = "nan"
                for step in (1, 2):
                    nanogpt_steps(model, optimizer, 1, first=step)
                    assert run.failed == step  # each read counts the step just skipped on the device; none raises
                start = [parameter.detach().clone() for parameter in model.parameters()]
                model.bug = None
                nanogpt_steps(model, optimizer, 1, first=3)
    assert stuck.value.step == 1 and stuck.value.failed_in_a_row == 2
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))  # step 3 never ran


@pytest.mark.usefixtures("handed_off_on_the_cpu")
def test_a_healthy_fused_run_reads_each_step_s_flag_once_however_often_its_counts_are_read(monkeypatch):
    from opwatch.runners.trainers import metrics

    reads = []
    original = step_verdict.DeferredFlag.read

    def counted(flag, *, wait=True):
        reads.append(flag.pending)
        return original(flag, wait=wait)

    monkeypatch.setattr(step_verdict.DeferredFlag, "read", counted)
    model, optimizer = fresh(fused=True)
    with LeaveOn(audit="manual", warn=False) as run:
        for step in range(1, 6):
            nanogpt_steps(model, optimizer, 1, first=step)
            assert metrics(run)["opwatch/failed"] == 0 and run.failed == 0  # a log and a read after every step
    assert reads.count(True) == 5 and run.steps == 5  # one flag read a step: at the first read after it


class _Unfinished:
    """A CUDA event the device has not reached: ``query()`` is false until ``synchronize()``."""

    def __init__(self):
        self.waited = 0

    def query(self):
        return False

    def synchronize(self):
        self.waited += 1


def test_a_read_during_the_run_never_waits_for_the_device_the_run_s_end_does():
    flag = step_verdict.DeferredFlag()
    flag.hand(torch.tensor([1.0, 0.0]))
    flag._event = event = _Unfinished()  # as on a GPU whose step is still running
    assert flag.read(wait=False) is None and flag.pending and event.waited == 0
    assert flag.read() == (True, False) and event.waited == 1 and not flag.pending


@pytest.mark.usefixtures("handed_off_on_the_cpu")
def test_lightning_guard_with_a_fused_adamw_counts_a_failing_last_step_in_its_logged_metrics_and_summary(tmp_path, monkeypatch):
    import csv

    lightning = needs("lightning")
    from torch.utils.data import DataLoader

    from opwatch.runners.lightning import OpwatchCallback
    from support.trainers import lightning_trainer

    class GPT(lightning.LightningModule):
        def __init__(self, nan_at):
            super().__init__()
            torch.manual_seed(0)
            self.gpt, self.nan_at = TinyGPT(), nan_at

        def training_step(self, batch, batch_idx):
            self.gpt.bug = "nan" if self.global_step + 1 == self.nan_at else None
            return self.gpt(*batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def fit(folder, nan_at):
        out = io.StringIO()
        callback = OpwatchCallback(mode="guard", warn=False, file=out)
        trainer = lightning_trainer(folder, callback, 4, gradient_clip_val=1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", opwatch.OpwatchWarning)
            trainer.fit(GPT(nan_at), DataLoader([batch(step) for step in range(1, 5)], batch_size=None))
        with open(next(folder.rglob("metrics.csv"))) as rows:
            logged = [(int(row["step"]), float(row["opwatch/failed"])) for row in csv.DictReader(rows) if row.get("opwatch/failed")]
        return callback, logged, out.getvalue()

    callback, logged, out = fit(tmp_path / "last", nan_at=4)
    assert callback.runner.policy.verdict.source == step_verdict.CLIP and [failure.step for failure in callback.runner.failures] == [4]
    # The last batch's own log (Lightning's step 3) holds it, as the final counts at the end of fit (step 4) do.
    assert logged[-2:] == [(3, 1.0), (4, 1.0)] and all(value == 0.0 for _, value in logged[:-2])
    assert "4 optimizer steps ran, 1 audited under a full watch, 1 failed" in out
    handed, reads = [], []
    hand, read = step_verdict.DeferredFlag.hand, step_verdict.DeferredFlag.read
    monkeypatch.setattr(step_verdict.DeferredFlag, "hand", lambda flag, value: (handed.append(1), hand(flag, value))[1])
    monkeypatch.setattr(step_verdict.DeferredFlag, "read", lambda flag, *, wait=True: (reads.append(flag.pending), read(flag, wait=wait))[1])
    callback, logged, out = fit(tmp_path / "healthy", nan_at=0)
    assert callback.runner.failed == 0 and {value for _, value in logged} == {0.0} and ", 0 failed" in out
    assert len(handed) == 3 and reads.count(True) == 3  # steps 2 to 4 (1 is audited): each flag read once, however often logged


def test_device_flag_is_the_verdict_without_a_host_read():
    """The flag handed to a fused optimizer: set by a nan gradient, a nan loss or a nan clip
    norm, made with no _local_scalar_dense (on CUDA: no sync)."""
    reductions = step_verdict.StepReductions()
    verdict = step_verdict.VerdictFromStep(reductions)
    grads = [torch.ones(3), torch.ones(2, 2)]
    with CountingMode() as counted:
        flags = [verdict.device_flag(grads, [torch.tensor(1.0)]), verdict.device_flag(grads, [torch.tensor(math.nan)]),
                 verdict.device_flag([torch.ones(3), torch.tensor([1.0, math.inf])], [torch.tensor(1.0)])]
    assert counted.count("aten._local_scalar_dense.default") == 0
    assert [flag.found_inf.item() for flag in flags] == [0.0, 1.0, 1.0]
    assert [flag.parts.tolist() for flag in flags] == [[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]]  # gradients, losses
    other = torch.tensor([1.0, math.nan])
    with reductions:
        torch.nn.utils.get_total_norm([other])
    assert verdict.device_flag([torch.ones(1)], []).found_inf.item() == 0.0  # a norm that covers other tensors stands for nothing here
    assert verdict.device_flag([other], []).found_inf.item() == 1.0 and verdict.source == step_verdict.CLIP


def test_norm_types_that_do_not_carry_nan_are_not_kept():
    reductions = step_verdict.StepReductions()
    grad = torch.tensor([1.0, math.nan])
    with reductions:
        torch.nn.utils.get_total_norm([grad], norm_type=0)
        torch.nn.utils.get_total_norm([grad], norm_type=-math.inf)
        assert reductions.norm_covering([grad]) is None
        torch.nn.utils.get_total_norm([grad], norm_type=math.inf)
    assert reductions.norm_covering([grad]) is not None


# -- DDP on 2 gloo ranks: no collective of opwatch's on a healthy step ------------------------------

ddp = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory):
    import dist_step_verdict
    from support.distributed import spawn

    # torch 2.6 cannot run FSDP2 on the CPU (support.fsdp2_on_cpu): one FSDP2 case failing would
    # fail the DDP tests too, so its FSDP2 cases are neither run nor tested there.
    fsdp2 = [] if fsdp2_on_cpu.args[0] else ["fsdp2_leave_on", "fsdp2_plain", "fsdp2_no_clip"]
    return spawn(dist_step_verdict.worker, 2, ["leave_on_healthy", "leave_on_nan", "leave_on_loss_nan", "guard_healthy", *fsdp2],
                 tmp_path_factory.mktemp("step_verdict_ranks"), timeout=180.0)


@ddp
def test_ddp_healthy_steps_meet_no_collective_of_opwatch_s(ddp_ranks):
    for rank in (0, 1):
        healthy = ddp_ranks[rank]["leave_on_healthy"]
        assert healthy["collectives"][1:] == [0] * 5, healthy  # step 1 makes opwatch's flag group, once
        assert healthy["failed"] == [] and healthy["source"] == "clip"
        guarded = ddp_ranks[rank]["guard_healthy"]
        assert guarded["collectives"][1:] == [0] * 3, guarded
        assert guarded["source"] == "clip"
    assert ddp_ranks[0]["guard_healthy"]["weights"] == ddp_ranks[1]["guard_healthy"]["weights"]


@ddp
def test_ddp_a_nan_on_one_rank_is_caught_on_both_and_both_skip_it(ddp_ranks):
    zero, one = ddp_ranks[0]["leave_on_nan"], ddp_ranks[1]["leave_on_nan"]
    for result in (zero, one):
        assert result["failed"] == [3] and result["skipped"] == 1
        assert result["collectives"][2] >= 1  # the which-rank question, asked after the failure only
        assert result["collectives"][1] == 0 and result["collectives"][3:] == [0, 0, 0]
    assert zero["weights"] == one["weights"]  # every rank skipped alike: no drift
    assert all(math.isfinite(weight) for weight in zero["weights"])


@ddp
def test_ddp_a_nan_loss_on_one_rank_with_finite_reduced_gradients_is_told_there_and_applied_alike(ddp_ranks):
    zero, one = ddp_ranks[0]["leave_on_loss_nan"], ddp_ranks[1]["leave_on_loss_nan"]
    assert zero["failed"] == one["failed"] == []
    assert any(text.startswith("opwatch (rank 1): optimizer step 3: the loss backward() ran on is nan on this rank") for text in one["warned"])
    assert not any("optimizer step 3" in text for text in zero["warned"])
    assert zero["weights"] == one["weights"]
    assert zero["collectives"][1:] == one["collectives"][1:] == [0] * 5


@ddp
@fsdp2_on_cpu
def test_fsdp2_the_clip_s_own_all_reduce_of_the_norm_carries_the_verdict_no_collective_of_opwatch_s(ddp_ranks):
    plain = ddp_ranks[0]["fsdp2_plain"]["collectives"]
    assert plain[1:] == [1] * 5  # the program's own: the clip reduces its norm across the ranks once a step
    zero, one = ddp_ranks[0]["fsdp2_leave_on"], ddp_ranks[1]["fsdp2_leave_on"]
    for result in (zero, one):
        assert result["failed"] == [3] and result["skipped"] == 1 and result["source"] == "clip"
        assert result["collectives"][1] == plain[1] and result["collectives"][3:] == plain[3:]  # none added on a healthy step
        assert result["collectives"][2] > plain[2]  # the which-rank question, after the failure only
        assert result["norms"][:2] == ddp_ranks[0]["fsdp2_plain"]["norms"][:2]  # the same norms, bit for bit, before the nan
    assert zero["weights"] == one["weights"] and all(math.isfinite(weight) for weight in zero["weights"])


@ddp
@fsdp2_on_cpu
def test_fsdp2_without_a_clip_one_small_all_reduce_a_step_decides(ddp_ranks):
    zero, one = ddp_ranks[0]["fsdp2_no_clip"], ddp_ranks[1]["fsdp2_no_clip"]
    for result in (zero, one):
        assert result["failed"] == [3] and result["skipped"] == 1 and result["source"] == "fused pass"
        assert result["collectives"][1] == 1 and result["collectives"][3:] == [1, 1, 1]  # opwatch's one flag a step
    assert zero["weights"] == one["weights"] and all(math.isfinite(weight) for weight in zero["weights"])


def test_leave_on_over_accumulated_micro_batches_adds_one_reduction_per_earlier_batch_and_no_host_read(monkeypatch):
    """What the batch check costs on a healthy step that accumulates 4 micro-batches and clips:
    counted with opwatch's own ops made visible, against the same steps unguarded. Each call of
    the model but the last adds one aminmax (and the stack of its two values) of its one floating
    argument; no host read beyond the verdict's, no copy of a batch."""
    tolist = torch.Tensor.tolist
    host_reads = []  # Tensor.tolist() calls, which dispatch no op on the CPU

    def counted_tolist(tensor):
        host_reads.append(tensor.numel())
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def run(guarded: bool) -> CountingMode:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(16)]

        def steps(numbers):
            for number in numbers:
                x, y = batches[number]
                (F.cross_entropy(model(x), y) / 4).backward()
                if number % 4 == 3:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()

        with contextlib.ExitStack() as stack:
            if guarded:
                stack.enter_context(opwatch_ops_visible(monkeypatch))
                stack.enter_context(LeaveOn(audit="first", warn=False))
            steps(range(4))  # the audit (guarded), or the same step plain
            host_reads.clear()
            with CountingMode() as counting:
                steps(range(4, 16))  # three healthy steps of four micro-batches
            counting.tolist = list(host_reads)
        return counting

    plain, guarded = run(False), run(True)
    added = {op: guarded.count(op) - plain.count(op) for op in set(guarded.ops)}
    assert added.get("aten.aminmax.default", 0) == 3 * 3  # three earlier micro-batches a step, three steps
    assert added.get("aten.stack.default", 0) == 3 * 3
    assert added.get("aten.clone.default", 0) == 0 and added.get("aten.copy_.default", 0) == 0  # no batch copied
    # Host reads: the verdict's alone, the clip's norm and each micro-batch's loss, a step.
    assert added.get("aten._local_scalar_dense.default", 0) == 3 * (1 + 4)
    assert guarded.tolist == plain.tolist == []  # and no Tensor.tolist(): the extremes wait on their device
