"""One guard, the same in every runner (issue 27): the same four bugs (a broadcast, a float64
upcast, a nan from the data, a nan from the math; tests/scenarios/on_failure_bugs.py) trained
through ``opwatch.guard``, the runner of ``python -m opwatch --guard`` (``LeaveOn``, as the
CLI enters it), Lightning and Hugging Face, with each ``on_failure``: the same findings, the
same final weights, finite unless ``"apply"``."""

from __future__ import annotations

import io
import warnings
from typing import NamedTuple

import pytest
import torch

import on_failure_bugs as bugs
import opwatch
from opwatch.runners.leave_on import GradientsNotFinite, LeaveOn
from support import needs
from support.helpers import line_of

SCENARIO = bugs.__file__
RUNNERS = ("guard", "leave_on", "lightning", "huggingface")


class Outcome(NamedTuple):
    found: list  # (kind, line) of what the audits found (device, dtype, broadcast)
    origin: tuple | None  # (kind, line) of the first nan/inf origin named
    raised: str | None  # the exception type the run stopped with
    weights: dict  # the final parameters of the Net, by name
    skipped: int  # optimizer steps that did not run
    told: str  # every warning's text


def at(anomaly) -> tuple:
    assert anomaly.filename == SCENARIO, anomaly.message
    return anomaly.kind, anomaly.lineno


def batches(bug):
    x, y, scale = bugs.data(bug)
    return [(x[i : i + bugs.BATCH], y[i : i + bugs.BATCH], scale[i : i + bugs.BATCH]) for i in range(0, len(x), bugs.BATCH)]


def weights_of(net) -> dict:
    return {name: parameter.detach().clone() for name, parameter in net.named_parameters()}


def run_guard(bug, on_failure):
    net = bugs.model(bug)
    optimizer = bugs.optimizer(net.parameters())

    def train_step(x, y, scale):
        loss = bugs.loss_of(net, x, y, scale)
        loss.backward()
        return loss

    step = opwatch.guard(train_step, net, on_failure=on_failure, repro=False)
    raised = None
    try:
        for x, y, scale in batches(bug):
            optimizer.zero_grad()
            step(x, y, scale)
            optimizer.step()
    except (opwatch.AnomalyError, RuntimeError) as error:
        raised = error
    origin = raised.anomaly if isinstance(raised, opwatch.AnomalyError) else (step.failures[0] if step.failures else None)
    return [at(anomaly) for anomaly in step.anomalies], origin, raised, net, step.skipped


def run_leave_on(bug, on_failure):
    net = bugs.model(bug)
    optimizer = bugs.optimizer(net.parameters())
    runner = LeaveOn(on_failure=on_failure, warn=False, file=io.StringIO())
    raised = None
    try:
        with runner:
            for x, y, scale in batches(bug):
                optimizer.zero_grad()
                bugs.loss_of(net, x, y, scale).backward()
                optimizer.step()
    except (opwatch.AnomalyError, GradientsNotFinite) as error:
        raised = error
    origin = raised.anomaly if isinstance(raised, opwatch.AnomalyError) else (runner.origins[0] if runner.origins else None)
    found = [at(anomaly) for anomaly in runner.watch.anomalies if anomaly.kind not in ("nan", "inf")]
    return found, origin, raised, net, runner.skipped


def run_lightning(bug, on_failure, tmp_path):
    lightning = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from opwatch.runners.lightning import OpwatchCallback

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = bugs.model(bug)

        def training_step(self, batch, batch_idx):
            return bugs.loss_of(self.net, *batch)

        def configure_optimizers(self):
            return bugs.optimizer(self.parameters())

    callback = OpwatchCallback(mode="guard", on_failure=on_failure, warn=False, log=False, file=io.StringIO())
    trainer = lightning.Trainer(
        max_steps=bugs.STEPS, accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=[callback],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module = Module()
    raised = None
    try:
        trainer.fit(module, DataLoader(TensorDataset(*bugs.data(bug)), batch_size=bugs.BATCH, shuffle=False))
    except (opwatch.AnomalyError, GradientsNotFinite) as error:
        raised = error
    runner = callback.runner
    origin = raised.anomaly if isinstance(raised, opwatch.AnomalyError) else (runner.origins[0] if runner.origins else None)
    found = [at(anomaly) for anomaly in callback.anomalies if anomaly.kind not in ("nan", "inf")]
    return found, origin, raised, module.net, runner.skipped


def run_huggingface(bug, on_failure, tmp_path):
    transformers = needs("transformers")
    needs("accelerate")
    from torch import nn
    from torch.utils.data import SequentialSampler

    from opwatch.runners.transformers import OpwatchCallback, guard_trainer

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = bugs.model(bug)

        def forward(self, x, y, scale):
            return {"loss": bugs.loss_of(self.net, x, y, scale)}

    x, y, scale = bugs.data(bug)
    dataset = [{"x": a, "y": b, "scale": c} for a, b, c in zip(x, y, scale)]
    model = Model()
    optimizer = bugs.optimizer(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=bugs.STEPS, per_device_train_batch_size=bugs.BATCH, max_grad_norm=0.0, logging_steps=100,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )
    callback = OpwatchCallback(mode="guard", on_failure=on_failure, warn=False, file=io.StringIO())
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback], optimizers=(optimizer, schedule))
    trainer._get_train_sampler = lambda *args, **kwargs: SequentialSampler(dataset)  # the others' order
    guarded = guard_trainer(trainer, repro=False)
    raised = None
    try:
        with callback:
            trainer.train()
    except (opwatch.AnomalyError, GradientsNotFinite) as error:
        raised = error
    origin = raised.anomaly if isinstance(raised, opwatch.AnomalyError) else (guarded.failures[0] if guarded.failures else None)
    found = [at(anomaly) for anomaly in callback.anomalies if anomaly.kind not in ("nan", "inf")]
    # one ledger: the callback's runner counts the batches guard skipped (and guard's own agree)
    assert callback.runner.skipped >= guarded.skipped
    return found, origin, raised, model.net, callback.runner.skipped


def run(runner, bug, on_failure, tmp_path) -> Outcome:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if runner == "guard":
            found, origin, raised, net, skipped = run_guard(bug, on_failure)
        elif runner == "leave_on":
            found, origin, raised, net, skipped = run_leave_on(bug, on_failure)
        elif runner == "lightning":
            found, origin, raised, net, skipped = run_lightning(bug, on_failure, tmp_path)
        else:
            found, origin, raised, net, skipped = run_huggingface(bug, on_failure, tmp_path)
    told = "\n".join(str(warning.message) for warning in caught if issubclass(warning.category, opwatch.OpwatchWarning))
    return Outcome(sorted(set(found)), None if origin is None else at(origin), type(raised).__name__ if raised else None, weights_of(net), skipped, told)


def same_weights(outcomes: dict) -> None:
    first, *others = outcomes
    for other in others:
        for name, value in outcomes[first].weights.items():
            torch.testing.assert_close(outcomes[other].weights[name], value, msg=f"{other} vs {first}: {name}")


@pytest.mark.parametrize("bug, kind, marker", [("broadcast", "broadcast", "LOSS"), ("float64", "dtype_mismatch", "LOSS")])
def test_a_silent_bug_is_found_by_every_runner_and_trains_the_same(bug, kind, marker, tmp_path):
    outcomes = {runner: run(runner, bug, None if runner != "guard" else "raise", tmp_path) for runner in RUNNERS}
    for runner, outcome in outcomes.items():
        assert outcome.found == [(kind, line_of(marker, SCENARIO))], (runner, outcome)
        assert outcome.origin is None and outcome.raised is None and outcome.skipped == 0, (runner, outcome)
    same_weights(outcomes)
    assert all(bool(torch.isfinite(value).all()) for value in outcomes["guard"].weights.values())


NAN_BUGS = [("data", "inf", "DATA"), ("math", "inf", "MATH")]  # sqrt backward: 0.5 / sqrt(0) = inf, then nan


@pytest.mark.parametrize("bug, kind, marker", NAN_BUGS)
def test_skip_names_the_origin_skips_both_bad_steps_and_keeps_the_weights_finite(bug, kind, marker, tmp_path):
    outcomes = {runner: run(runner, bug, "skip", tmp_path) for runner in RUNNERS}
    for runner, outcome in outcomes.items():
        assert outcome.origin == (kind, line_of(marker, SCENARIO)), (runner, outcome)
        assert outcome.raised is None and outcome.skipped == len(bugs.BAD_STEPS), (runner, outcome)
        assert all(bool(torch.isfinite(value).all()) for value in outcome.weights.values()), runner
        assert "weights hold" not in outcome.told and "min nan" not in outcome.told, (runner, outcome.told)
    same_weights(outcomes)
    # Skipping is not zeroing: momentum and weight decay would move the weights at a zeroed step.
    clean = run("guard", "broadcast", "skip", tmp_path)  # any other bug's weights differ
    assert any(not torch.equal(clean.weights[name], value) for name, value in outcomes["guard"].weights.items())


@pytest.mark.parametrize("bug, kind, marker", NAN_BUGS)
def test_raise_stops_with_the_origin_before_the_optimizer_applies_it(bug, kind, marker, tmp_path):
    outcomes = {runner: run(runner, bug, "raise", tmp_path) for runner in RUNNERS}
    for runner, outcome in outcomes.items():
        assert outcome.raised == "AnomalyError" and outcome.origin == (kind, line_of(marker, SCENARIO)), (runner, outcome)
        assert all(bool(torch.isfinite(value).all()) for value in outcome.weights.values()), runner
    same_weights(outcomes)  # the steps before the first bad one, in every runner


@pytest.mark.parametrize("bug, kind, marker", NAN_BUGS)
def test_apply_lets_the_nan_in_and_says_since_when_instead_of_a_false_origin(bug, kind, marker, tmp_path):
    outcomes = {runner: run(runner, bug, "apply", tmp_path) for runner in RUNNERS}
    for runner, outcome in outcomes.items():
        assert outcome.raised is None and outcome.skipped == 0, (runner, outcome)
        assert not all(bool(torch.isfinite(value).all()) for value in outcome.weights.values()), runner
        # Whoever names an origin names the true one, never an op that reads the nan weights.
        assert outcome.origin in (None, (kind, line_of(marker, SCENARIO))), (runner, outcome)
        assert "min nan" not in outcome.told, (runner, outcome.told)
    for runner in ("guard", "lightning", "huggingface"):  # they replay the failing batch itself
        assert outcomes[runner].origin == (kind, line_of(marker, SCENARIO)), runner
    assert f"the weights hold nan since optimizer step {bugs.BAD_STEPS[0]}" in outcomes["leave_on"].told
    assert f"the weights hold nan since optimizer step {bugs.BAD_STEPS[0]}" in outcomes["lightning"].told
    assert f"weights hold nan/inf since call {bugs.BAD_STEPS[0]}" in outcomes["guard"].told
