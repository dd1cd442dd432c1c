"""One step policy (issue 37): the verdict seam, the one poisoned-weights check, "written by the
program" and the stuck-run stop, the same through ``opwatch.guard`` (a call wrapper) and
leave-on (optimizer hooks), on a numpy-fed training loop."""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opwatch
from opwatch.runners.leave_on import LeaveOn
from opwatch.runners.policy import ProgramWrites, RunStuck, StepPolicy, StepVerdict


def numpy_loop(*, steps=30, blow_at=-1, blow_lr=1e38, write_at=-1, nan_at=-1):
    """A numpy-fed regression loop: its model, optimizer and batches (built lazily)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def batches():
        for step in range(steps):
            xs = rng.standard_normal((32, 8)).astype(np.float32)
            if step == nan_at:
                xs[3, 2] = np.nan
            yield step, torch.from_numpy(xs)

    def after_step(step):
        for group in optimizer.param_groups:  # the next step's learning rate
            group["lr"] = blow_lr if step + 1 == blow_at else 0.01
        if step == write_at:
            with torch.no_grad():
                model[2].weight[0, 3] = float("inf")

    return model, optimizer, batches, after_step


def guarded_run(*, compiled_update=False, **loop):
    model, optimizer, batches, after_step = numpy_loop(**loop)
    update = torch.compile(optimizer.step) if compiled_update else optimizer.step

    def train_step(x):
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, on_failure="skip", repro=False)
    for number, x in batches():
        optimizer.zero_grad()
        step(x)
        update()
        after_step(number)
    return step


def test_the_verdict_seam_answers_finite_and_which_parameters_are_bad():
    model = nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    verdict = StepVerdict()
    named = list(model.named_parameters())
    grads = [param.grad for _, param in named]
    assert verdict.finite(grads, [torch.tensor(1.0)])
    assert not verdict.finite(grads, [torch.tensor(float("nan"))])  # a nan loss with finite gradients
    assert verdict.bad_gradients(named) == [] and verdict.loss_kind([torch.tensor(float("inf"))]) == "inf"
    model.bias.grad[0] = float("nan")
    assert not verdict.finite(grads) and verdict.bad_gradients(named) == [("bias", "nan")]


def test_program_writes_tell_the_program_from_the_optimizer():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e38)
    writes = ProgramWrites()
    assert writes.by_program([model.weight])  # no optimizer step ran yet: an init or a load wrote it
    model(torch.randn(3, 4)).pow(2).sum().backward()
    optimizer.step()
    writes.stepped(optimizer)
    assert not writes.by_program([model.weight])  # as the optimizer step left it
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    assert writes.by_program([model.weight])


def test_program_writes_keep_no_model_alive_once_its_optimizer_is_gone():
    # A long run makes optimizers and drops them (a trainer per fold, a restart): what the
    # steps left behind goes with each optimizer, its parameters with it.
    writes = ProgramWrites()
    models = []
    for _ in range(3):
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).pow(2).sum().backward()
        optimizer.step()
        writes.stepped(optimizer)
        writes.stepped(optimizer)  # the next step: the same entry, written again
        models.append(weakref.ref(model.weight))
        del model, optimizer
    gc.collect()
    assert [weight() for weight in models] == [None] * 3
    survivor = nn.Linear(4, 2)
    kept = torch.optim.SGD(survivor.parameters(), lr=0.1)
    writes.stepped(kept)
    assert not writes.by_program([survivor.weight])


def test_the_policy_stops_a_stuck_run_and_names_its_first_failure():
    policy = StepPolicy(on_failure="skip", max_failed_in_a_row=3)
    for step in (1, 2):
        assert policy.act(policy.ledger.fail(step, [("w", "nan")]))
        policy.stop_when_stuck(policy.ledger.latest)
    policy.ledger.passed(3)  # a healthy step ends the streak
    for step in (4, 5):
        policy.act(policy.ledger.fail(step, [("w", "nan")]))
        policy.stop_when_stuck(policy.ledger.latest)
    with pytest.raises(RunStuck) as stuck:
        failure = policy.ledger.fail(6, [("w", "nan")])
        policy.act(failure)
        policy.stop_when_stuck(failure)
    assert stuck.value.step == 4 and stuck.value.failed_in_a_row == 3 and policy.ledger.failures[-1].action == "raised" and policy.ledger.skipped == 5
    assert str(stuck.value).startswith("opwatch: the run is stuck: 3 optimizer steps in a row failed (steps 4 to 6)")
    with pytest.raises(ValueError, match="max_failed_in_a_row"):
        StepPolicy(on_failure="skip", max_failed_in_a_row=0)


def test_guard_names_weights_the_program_wrote():
    with pytest.warns(opwatch.OpwatchWarning) as told, pytest.raises(RunStuck):
        guarded_run(write_at=4)
    text = next(str(warning.message) for warning in told if "weights already hold" in str(warning.message))
    assert "They were written by the program, not by the optimizer" in text and "learning rate" not in text


def test_guard_stops_the_stuck_run_of_a_blown_up_learning_rate():
    # lr 1e38 makes the weights huge (finite): every later step's gradients overflow, and skip
    # keeps the weights as they were, so every call fails.
    with pytest.warns(opwatch.OpwatchWarning) as told, pytest.raises(RunStuck) as stuck:
        guarded_run(blow_at=5)
    assert str(stuck.value).startswith("opwatch: the run is stuck: 10 guarded calls in a row failed (steps 7 to 16)")
    assert stuck.value.failed_in_a_row == 10 and not any("written by the program" in str(warning.message) for warning in told)


def test_guard_names_weights_the_optimizer_wrote():
    # lr 3e38 (near float32's largest) makes the optimizer write inf/nan weights from finite gradients.
    with pytest.warns(opwatch.OpwatchWarning) as told, pytest.raises(RunStuck):
        guarded_run(blow_at=5, blow_lr=3e38)
    text = next(str(warning.message) for warning in told if "weights already hold" in str(warning.message))
    assert "written by the program" not in text and "learning rate too large" in text


@pytest.mark.parametrize("write_at, blow_at, by_program", [(4, -1, True), (-1, 5, False)])
def test_a_compiled_optimizer_step_still_tells_who_wrote_the_weights(write_at, blow_at, by_program):
    # torch.compile(optimizer.step): Dynamo traces torch's step wrapper and its hooks; opwatch's
    # hook runs as Python there (a graph break), so each step's counters are read for real.
    with pytest.warns(opwatch.OpwatchWarning) as told, pytest.raises(RunStuck):
        guarded_run(write_at=write_at, blow_at=blow_at, blow_lr=3e38, compiled_update=True)
    text = next(str(warning.message) for warning in told if "weights already hold" in str(warning.message))
    assert ("written by the program" in text) == by_program


def test_guards_that_come_and_go_leave_torchs_optimizer_hooks_as_the_first_one_left_them():
    # One hook for the process, never one a guard removes when collected: the collector runs at
    # any moment, a compilation included, and Dynamo guards the keys of the hooks dict a
    # compiled step iterates (torch 2.14 failed building those guards: KeyError).
    from torch.optim.optimizer import _global_optimizer_post_hooks

    step = guarded_run(steps=3)
    hooks = list(_global_optimizer_post_hooks)
    del step
    gc.collect()
    assert list(_global_optimizer_post_hooks) == hooks
    with pytest.warns(opwatch.OpwatchWarning) as told, pytest.raises(RunStuck):
        guarded_run(write_at=4)  # a later guard still follows the steps
    assert list(_global_optimizer_post_hooks) == hooks
    assert any("written by the program" in str(warning.message) for warning in told)


def test_guard_runs_on_after_one_bad_batch():
    with pytest.warns(opwatch.OpwatchWarning):
        step = guarded_run(nan_at=4)
    assert step.ledger.failed == 1 and step.ledger.skipped == 1 and step.ledger.steps == 30
    assert all(torch.isfinite(param).all() for param in step._snapshots.params)


def test_a_healthy_guarded_run_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = guarded_run()
    assert step.ledger.clean and step.ledger.steps == 30


@pytest.mark.parametrize("write_at, by_program", [(4, True), (-1, False)])
def test_leave_on_tells_who_wrote_the_weights(write_at, by_program):
    model, optimizer, batches, after_step = numpy_loop(write_at=write_at, blow_at=-1 if by_program else 5, blow_lr=3e38, steps=12)
    runner = LeaveOn(on_failure="skip", max_failed_in_a_row=None)
    with pytest.warns(opwatch.OpwatchWarning) as told, runner:
        for number, x in batches():
            loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            after_step(number)
    text = next(str(warning.message) for warning in told if "weights hold" in str(warning.message))
    assert ("written by the program" in text) == by_program
    assert runner.failures[0].cause == "weights" and runner.poisoned_since is not None


# -- a nanoGPT-style transformer (AdamW, clip_grad_norm_) through opwatch.guard -------------------


def guarded_gpt(*, steps, blow_at=-1):
    from test_run_ledger import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def train_step(ids, targets):
        loss = model(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    step = opwatch.guard(train_step, model, on_failure="skip", repro=False, max_failed_in_a_row=4)
    for number in range(steps):
        ids = torch.randint(0, 48, (4, 16))
        optimizer.zero_grad(set_to_none=True)
        step(ids, torch.roll(ids, -1, dims=1))
        for group in optimizer.param_groups:
            group["lr"] = 1e30 if number == blow_at else 1e-3
        optimizer.step()
    return step


def test_a_blown_up_guarded_gpt_run_stops_and_names_its_first_failure():
    with warnings.catch_warnings(), pytest.raises(RunStuck) as stuck:
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        guarded_gpt(steps=30, blow_at=5)
    assert stuck.value.failed_in_a_row == 4
    assert f"4 guarded calls in a row failed (steps {stuck.value.step} to {stuck.value.step + 3})" in str(stuck.value)
    assert "max_failed_in_a_row=N (None: never stop) sets that limit" in str(stuck.value)  # the Python keyword, not the CLI flag


def test_a_healthy_guarded_gpt_run_with_clipping_fails_no_call():
    with warnings.catch_warnings():
        warnings.simplefilter("error", opwatch.OpwatchWarning)
        step = guarded_gpt(steps=8)
    assert step.ledger.clean and step.ledger.steps == 8 and step.skipped == 0


# -- what the summary and the messages say --------------------------------------------------------


def test_the_summary_names_each_cause_and_never_a_bad_batch_as_gradients():
    from opwatch.render.leave_on import summary

    assert summary(6, 1, 1, True, 1, causes={"input": 1}).endswith("1 failed (the batch held nan/inf), 1 of them skipped.")
    mixed = summary(22, 1, 10, True, 1, causes={"input": 1, "weights": 9})
    assert "10 failed (the batch held nan/inf: 1; the weights already held nan/inf: 9)" in mixed and "in the gradients" not in mixed
    # gradients alone read as before (the goldens)
    assert summary(30, 2, 2, True, 2, causes={"gradients": 2}).endswith("2 failed (nan/inf in the gradients), 2 of them skipped.")


def test_the_guard_result_types_are_read_by_attribute():
    from opwatch.render.guard import failure_text
    from opwatch.render.guard_facts import BadGrads, NotFinite, Returned, Unnamed
    from opwatch.runners.guarded.check import not_finite

    model = nn.Linear(3, 1)
    model.weight.grad = torch.full((1, 3), float("nan"))
    found = not_finite(torch.tensor(float("inf")), list(model.parameters()), {})
    assert found.returned == (Returned("inf", "returned", "tensor"),)
    assert found.grads == (BadGrads("nan", (Unnamed(0, ((1, 3), torch.float32, torch.device("cpu"), 0)),)),)
    assert isinstance(found, NotFinite)
    assert failure_text(found) == "the check after it found inf in the returned tensor and nan in the .grad of 1 parameter(s): parameter 0 (f32[1, 3] cpu)"


# -- gradient clipping's and the optimizer's ops have their own phase ----------------------------


def test_clipping_and_the_optimizer_step_have_their_own_phase_in_a_gpt_step():
    from test_run_ledger import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ids = torch.randint(0, 48, (4, 16))
    original = torch.nn.utils.clip_grad_norm_
    with opwatch.watch() as watched:
        loss = model(ids, torch.roll(ids, -1, dims=1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model(ids, torch.roll(ids, -1, dims=1))  # the next forward is forward again
    phases = [record.phase for record in watched.records]
    assert {"forward", "backward", "clipping", "optimizer"} <= set(phases)
    assert phases[-1] == "forward" and phases.index("clipping") < phases.index("optimizer")
    clipping = [record.op for record in watched.records if record.phase == "clipping"]
    assert any("norm" in op for op in clipping)
    # nothing of it outlives the watch
    assert torch.nn.utils.clip_grad_norm_ is original


def test_an_inf_the_optimizer_step_makes_is_labelled_optimizer_not_forward():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=3e38)  # the update overflows float32
    model(torch.randn(8, 4)).pow(2).sum().backward()
    with opwatch.watch(warn=False) as watched:
        optimizer.step()
    made = [anomaly for anomaly in watched.anomalies if anomaly.kind in ("nan", "inf")]
    assert made and made[0].phase == "optimizer" and "(optimizer)" in str(made[0]).splitlines()[0]


def test_what_a_nan_came_in_with_travels_to_the_other_ranks_and_each_counts_the_same_cause():
    """In a job, a rank whose full watch found no origin of its own tells the failure with the
    rank that made it (an exchanged ``RankAnomaly``). That anomaly now carries what its own rank
    found it came in with, so every rank's ledger makes a bad batch's cause ``input`` alike
    (Lightning's replay on 2 DDP ranks counted ``input`` on rank 1, ``gradients`` on rank 0)."""
    import json

    from opwatch.findings.ranks import decode, encode
    from opwatch.runners.ledger import RunLedger

    batch = torch.randn(8, 4)
    batch[2, 1] = float("nan")  # a batch made before the watch, holding nan
    layer = nn.Linear(4, 2)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        layer(batch).sum().backward()
    (anomaly,) = [found for found in w.anomalies if found.kind == "nan"]
    assert anomaly.came_with == "input"
    (carried,) = decode(encode([anomaly], rank=1, world=2))
    assert (carried.rank, carried.op, carried.came_with) == (1, anomaly.op, "input")
    ledger = RunLedger()
    failure = ledger.fail(3, [("weight", "nan")])
    ledger.explain(failure, carried)
    assert failure.cause == "input" and ledger.rows()[0]["origin"]["came_with"] == "input"
    # An entry of an opwatch without the field still reads, with nothing to tell.
    payload = json.loads(encode([anomaly], rank=1, world=2))
    del payload["anomalies"][0]["came_with"]
    (older,) = decode(json.dumps(payload).encode("utf-8"))
    assert older.came_with is None
    ledger = RunLedger()
    failure = ledger.fail(3, [("weight", "nan")])
    ledger.explain(failure, older)
    assert failure.cause == "gradients"
