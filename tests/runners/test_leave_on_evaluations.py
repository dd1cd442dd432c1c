"""Leave-on over a run that evaluates: the model's calls with gradients off are checked at their
output (``opwatch.runners.evaluations``), read at the next optimizer step's check or the run's
end, told once per line: a corrupted validation record (``val loss nan`` at every evaluation)
was seen by no check before, since no gradient holds it."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import opwatch
from opwatch.runners.cli import main

TRAIN_AND_VALIDATE = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
weights = torch.randn(8)
train = [torch.randn(16, 8) for _ in range(6)]
validation = [torch.randn(16, 8) for _ in range(3)]
{corrupt}
for epoch in range(2):
    model.train()
    for x in train:
        loss = (model(x).squeeze(-1) - x @ weights).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        total = sum((model(x).squeeze(-1) - x @ weights).pow(2).mean() for x in validation)  # the validation pass
    print(f"epoch {{epoch}} val loss {{total.item() / len(validation):.4f}}")
"""


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # lines are shown relative to the working directory: train.py:20


def run_guard(tmp_path, capsys, script, *options):
    path = tmp_path / "train.py"
    path.write_text(script)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        status = main(["--guard", *options, str(path)])
    told = [str(warning.message) for warning in caught if issubclass(warning.category, opwatch.OpwatchWarning)]
    return status, capsys.readouterr(), told, caught


def test_a_corrupted_validation_record_is_told_at_its_line_as_the_batch_s(tmp_path, capsys):
    from opwatch.render.html import guard_section
    from opwatch.storage.jsonl import load

    script = TRAIN_AND_VALIDATE.format(corrupt='validation[1][3, 5] = float("nan")  # a corrupted record')
    status, out, told, caught = run_guard(tmp_path, capsys, script, "--jsonl", str(tmp_path / "run.jsonl"))
    assert status == 0 and out.out.count("val loss nan") == 2  # training goes on: no step failed
    assert told == [
        "opwatch: a call of Sequential with gradients off (an evaluation) at train.py:20, after optimizer step 6, returned nan: its "
        "argument 0 (f32[16, 8] cpu) held nan when it entered the model (cause: input), so no op of the model made it: it came in with the batch "
        "(the lines that made it, or what they read: a file, a sample). No gradient holds it: training goes on, and what the "
        "evaluation computes from it (a validation loss) is nan."
    ]  # told once, for both evaluations
    warning = next(warning for warning in caught if issubclass(warning.category, opwatch.OpwatchWarning))
    assert (warning.filename, warning.lineno) == (str(tmp_path / "train.py"), 20)  # at the evaluation's line
    assert ("opwatch: no anomalies in the fully watched steps, but 2 calls with gradients off (evaluations) returned nan (see the "
            "guard's line below).") in out.err
    assert ("opwatch guard: 12 optimizer steps ran, 1 audited under a full watch, 0 failed; 2 calls with gradients off (evaluations) "
            "returned nan, from their batch.") in out.err
    saved = load(tmp_path / "run.jsonl").guard
    assert saved["evaluations_nan"] == 2
    assert "0 of them skipped; 2 calls with gradients off (evaluations) returned nan.</p>" in guard_section(saved)  # the report says it too


def test_a_clean_validation_set_is_silent(tmp_path, capsys):
    status, out, told, _ = run_guard(tmp_path, capsys, TRAIN_AND_VALIDATE.format(corrupt=""))
    assert status == 0 and told == [] and "gradients off" not in out.err
    assert "opwatch: no anomalies.\n" in out.err and "12 optimizer steps ran, 1 audited under a full watch, 0 failed." in out.err


def test_a_validation_batch_of_one_row_whose_per_batch_std_is_nan_is_the_model_s(tmp_path, capsys):
    """The model standardizes each batch by its own std: a last validation batch of one row has
    an unbiased std of 0 / 0 = nan, from finite data."""
    script = TRAIN_AND_VALIDATE.format(corrupt="validation.append(torch.randn(1, 8))  # the last, short batch").replace(
        "model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))",
        "class Standardized(nn.Sequential):\n"
        "    def forward(self, x):\n"
        "        return super().forward((x - x.mean(0)) / x.std(0))\n"
        "model = Standardized(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))")
    status, out, told, _ = run_guard(tmp_path, capsys, script)
    assert status == 0 and len(told) == 1
    assert told[0].startswith("opwatch: a call of Standardized with gradients off (an evaluation) at train.py:23, after optimizer "
                              "step 6, returned nan from finite arguments: an op of the model made it; a full watch names it: "
                              "python -m opwatch ")
    assert "2 calls with gradients off (evaluations) returned nan." in out.err


def test_a_model_that_takes_nan_on_purpose_and_a_masked_minus_inf_output_are_silent(tmp_path, capsys):
    """A tabular model that reads missing values as nan (replaced, with an indicator, inside the
    model) in training and validation alike; its evaluation returns log-probabilities with the
    classes it rules out at -inf."""
    script = """\
import torch
from torch import nn

torch.manual_seed(0)


class Tabular(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        missing = torch.isnan(x)
        logits = self.net(torch.cat([torch.nan_to_num(x), missing.float()], dim=-1))
        if not self.training:  # class 3 is never valid at inference
            logits = logits.masked_fill(torch.tensor([False, False, False, True]), float("-inf"))
        return logits.log_softmax(-1)


model = Tabular()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    model.train()
    for _ in range(5):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        x[torch.rand(16, 8) < 0.2] = float("nan")  # missing values
        loss = nn.functional.nll_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        x = torch.randn(16, 8)
        x[torch.rand(16, 8) < 0.2] = float("nan")
        print("accuracy", (model(x).argmax(-1) == torch.randint(0, 3, (16,))).float().mean().item())
"""
    status, out, told, _ = run_guard(tmp_path, capsys, script)
    assert status == 0 and told == [] and "gradients off" not in out.err and "0 failed." in out.err


def test_a_bad_validation_batch_is_not_the_failing_training_step_s_batch():
    """An evaluation between two steps fed the model a nan record; the next training step fails
    on a training batch of its own: the step's cause names the training batch's line."""
    from opwatch.runners.leave_on import LeaveOn

    model, optimizer = small_regressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        with LeaveOn(on_failure="skip", max_failed_in_a_row=None, file=io.StringIO()) as run:
            for step in range(4):
                x = torch.randn(4, 8)
                if step == 3:
                    with torch.no_grad():
                        bad = torch.randn(4, 8)
                        bad[0, 0] = float("nan")
                        model(bad)  # a validation batch
                    x[1, 1] = float("inf")  # the training batch
                loss = model(x).pow(2).mean()  # the training forward
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    messages = [str(warning.message) for warning in caught if issubclass(warning.category, opwatch.OpwatchWarning)]
    assert run.ledger.failed == 1 and run.ledger.failures[0].cause == "input" and run.ledger.evaluations_nan == 1
    step_told = next(message for message in messages if "optimizer step 4" in message)
    assert "held inf when it entered the model" in step_told and "argument 0 (f32[4, 8] cpu) held inf" in step_told
    assert any("with gradients off (an evaluation)" in message and "held nan" in message for message in messages)


def test_hf_trainer_guard_mode_tells_an_evaluation_whose_batch_held_nan(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from opwatch.runners.transformers import OpwatchCallback
    from support.trainers import _Regression, matched_loss, regression_data

    x, y = regression_data(16)
    train = [{"x": a, "labels": b} for a, b in zip(x[:12], y[:12])]
    evaluation = [{"x": a.clone(), "labels": b} for a, b in zip(x[12:], y[12:])]
    evaluation[2]["x"][1] = float("nan")  # a corrupted validation record
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                                          learning_rate=0.01, eval_strategy="steps", eval_steps=2, logging_steps=1, save_strategy="no",
                                          report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    trainer = transformers.Trainer(model=_Regression(matched_loss), args=args, train_dataset=train, eval_dataset=evaluation,
                                   callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        with callback:
            trainer.train()
    told = [str(warning.message) for warning in caught if "gradients off" in str(warning.message)]
    assert callback.runner.failed == 0 and callback.runner.ledger.evaluations_nan == 2  # the evaluations after steps 2 and 3
    logged = [entry["opwatch/evaluations_nan"] for entry in trainer.state.log_history if "opwatch/evaluations_nan" in entry]
    assert logged[0] == 0 and logged[-1] >= 1  # the step after an evaluation logs what it returned
    assert len(told) == 1 and "a call of _Regression with gradients off (an evaluation)" in told[0]
    assert "its x (f32[4, 2] cpu) held nan when it entered the model (cause: input)" in told[0]


@pytest.mark.parametrize("corrupt", [True, False], ids=["corrupted", "clean"])
def test_lightning_guard_mode_checks_the_evaluations_of_a_module_whose_steps_call_an_inner_one(tmp_path, corrupt):
    """The support module's steps call ``self.layer(x)``, never the LightningModule itself: the
    batch and evaluation hooks went on the LightningModule (the trainer's model), which no call
    reached, and a corrupted validation record was never told. They go on the first module the
    audit saw called."""
    from torch.utils.data import DataLoader, TensorDataset

    from opwatch.runners.lightning import OpwatchCallback
    from support.trainers import lightning_module, lightning_trainer, matched_loss, regression_data, regression_loader

    x, y = regression_data(8)
    if corrupt:
        x[5, 1] = float("nan")  # a corrupted validation record
    callback = OpwatchCallback(mode="guard", file=io.StringIO())
    trainer = lightning_trainer(tmp_path, callback, steps=3, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        trainer.fit(lightning_module(matched_loss, eval_loss=matched_loss), regression_loader(), DataLoader(TensorDataset(x, y), batch_size=4))
    told = [str(warning.message) for warning in caught if issubclass(warning.category, opwatch.OpwatchWarning)]
    assert callback.runner.ledger.failed == 0 and callback.runner.ledger.evaluations_nan == int(corrupt)
    if corrupt:
        (message,) = told
        assert "a call of Linear with gradients off (an evaluation)" in message
        assert "its argument 0 (f32[4, 2] cpu) held nan when it entered the model (cause: input)" in message
    else:
        assert told == []


# The DDP evaluation, in a process of its own: a process group of one rank, DDP around the
# model, two steps (the first is leave-on's audit), an evaluation through the wrapper and one
# around it, two more steps. It prints what the run counted and told, as JSON.
DDP_EVALUATION = """
import datetime, io, json, os, sys, warnings
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import opwatch
from opwatch.runners.leave_on import LeaveOn

def train_two_steps(model, optimizer):
    for _ in range(2):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", opwatch.OpwatchWarning)
    with LeaveOn(file=io.StringIO()) as run:
        train_two_steps(model, optimizer)
        with torch.no_grad():
            clean = model(torch.randn(4, 8))  # through the wrapper: checked as before
            bad = torch.randn(4, 8)
            bad[2, 3] = float("nan")
            model.module(bad)  # the evaluation, around the wrapper
        train_two_steps(model, optimizer)
told = [str(warning.message) for warning in caught if "gradients off" in str(warning.message)]
print(json.dumps({"clean": bool(torch.isfinite(clean).all()), "evaluations_nan": run.ledger.evaluations_nan, "failed": run.ledger.failed,
                  "told": told}), flush=True)
os._exit(0)  # no teardown: freeing the DDP model may wait on gloo's worker thread (see the test)
"""


def test_an_evaluation_through_ddp_s_module_is_checked(tmp_path):
    """DDP evaluation through ``model.module`` (the wrapped model, called without the wrapper):
    the hooks went on the wrapper, which that call never reaches. They go on the module it wraps,
    which every call reaches, the wrapper's own included. In a process of its own, bounded: in
    the test's process, freeing the DDP model once hung (gloo's worker thread, dropping the
    audit's all-reduce, waited for the GIL that the thread joining it held)."""
    import json
    import subprocess
    import sys

    (tmp_path / "evaluate.py").write_text(DDP_EVALUATION)
    result = subprocess.run([sys.executable, "evaluate.py", str(tmp_path / "store")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["clean"] and found["evaluations_nan"] == 1 and found["failed"] == 0
    (told,) = found["told"]
    assert "a call of Sequential with gradients off" in told and "held nan when it entered the model" in told


def test_an_evaluation_after_the_weights_took_nan_names_the_weights():
    """``on_failure="apply"``: a corrupted record's nan gradients were applied, and every
    evaluation after returns nan from finite arguments. Each was told as "an op of the model made
    it; a full watch names it", beside the failure that said the weights hold nan; it names them."""
    from opwatch.runners.leave_on import LeaveOn

    model, optimizer = small_regressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        with LeaveOn(on_failure="apply", max_failed_in_a_row=None, file=io.StringIO()) as run:
            train_two_steps(model, optimizer, 8)
            x = torch.randn(4, 8)
            x[1, 2] = float("nan")  # a corrupted training record
            model(x).pow(2).mean().backward()
            optimizer.step()  # step 3, applied
            with torch.no_grad():
                model(torch.randn(4, 8))  # the validation pass
            train_two_steps(model, optimizer, 8)
    told = [str(warning.message) for warning in caught if "gradients off" in str(warning.message)]
    assert run.ledger.poisoned_since == 3 and run.ledger.evaluations_nan == 1 and len(told) == 1, told
    assert ("returned nan from finite arguments: the weights hold nan/inf since optimizer step 3 (told then), and every call of "
            "the model reads them") in told[0]


def small_regressor(wrap=lambda model: model):
    """An 8-16-1 MLP (``wrap``ped: a DDP module) and its SGD optimizer, seeded."""
    torch.manual_seed(0)
    model = wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_two_steps(model, optimizer, features, batch=4):
    """Two optimizer steps: the first is leave-on's audit, after which it hooks the model."""
    for _ in range(2):
        loss = model(torch.randn(batch, features)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_a_long_evaluation_pass_is_read_every_so_many_calls(monkeypatch):
    """Memory stays bounded: past the most calls kept, they are read at once and told."""
    from opwatch.runners import evaluations
    from opwatch.runners.leave_on import LeaveOn

    monkeypatch.setattr(evaluations, "_MAX_KEPT", 3)
    model, optimizer = small_regressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        with LeaveOn(file=io.StringIO()) as run:
            train_two_steps(model, optimizer, 8)
            with torch.no_grad():
                for index in range(10):
                    x = torch.randn(4, 8)
                    if index == 5:
                        x[0, 0] = float("nan")
                    model(x)
                    # calls 4 to 6 (the 6th holds nan) are read when the 7th comes: told then
                    assert run.ledger.evaluations_nan == (1 if index >= 6 else 0)
    assert run.ledger.evaluations_nan == 1
    assert sum("with gradients off" in str(warning.message) for warning in caught) == 1


def test_the_cost_benchmark_runs_a_checked_and_a_plain_pass():
    """``python -m bench.evaluations`` (its figures are in docs/cost.md): one short round."""
    from bench.evaluations import bench

    line = bench("mlp", rounds=2, batches=3)
    assert line.startswith("  mlp   evaluation pass of 3 calls: median ") and " paired " in line


def test_an_output_the_check_cannot_read_stops_the_check_not_the_evaluation():
    """A model that returns a kind of tensor the check does not read (a nested tensor, whose
    aminmax raises): told once, the evaluation goes on, the next calls are not checked."""
    from opwatch.runners.leave_on import LeaveOn

    class Ragged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def forward(self, x):
            out = self.layer(x)
            if torch.is_grad_enabled():
                return out
            return torch.nested.nested_tensor([out[0, :2], out[1]])  # rows of their own lengths

    torch.manual_seed(0)
    model = Ragged()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        with LeaveOn(file=io.StringIO()) as run:
            train_two_steps(model, optimizer, 4, batch=2)
            with torch.no_grad():
                outputs = [model(torch.randn(2, 4)) for _ in range(3)]
    assert len(outputs) == 3 and run.ledger.evaluations_nan == 0
    told = [str(warning.message) for warning in caught if "could not check" in str(warning.message)]
    assert len(told) == 1 and told[0].startswith("opwatch could not check what the model returned with gradients off (")


DISTILLATION = """\
import torch
from torch import nn
torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
student = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
for step in range(8):
    x = torch.randn(32, 16)
    if step == {corrupt_at}: x[4, 2] = float("nan")  # a corrupt sample
    with torch.no_grad():
        soft = teacher(x).softmax(-1)  # the frozen teacher, called first
    logits = student(x)  # STUDENT CALL
    loss = nn.functional.kl_div(logits.log_softmax(-1), soft, reduction="batchmean")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("done")
"""


@pytest.mark.parametrize("corrupt_at", [-1, 3])
def test_a_distillation_s_frozen_teacher_is_neither_the_model_nor_an_evaluation(tmp_path, capsys, monkeypatch, corrupt_at):
    """Knowledge distillation calls the frozen teacher first, under ``torch.no_grad()``. The
    batch hook took it for the model: its calls were told as evaluations ("a call of Sequential
    with gradients off (an evaluation) ... returned nan ... No gradient holds it: training goes
    on") and counted in the summary, and the student's bad batch was a plain "nan/inf in the
    gradients". The hooked model is the first one the optimizer trains: the student."""
    from support.helpers import guard_in_process, line_of

    monkeypatch.chdir(tmp_path)
    script = DISTILLATION.format(corrupt_at=corrupt_at)
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "done" in out, err
    assert "gradients off" not in err and "evaluation" not in err
    if corrupt_at < 0:
        assert "opwatch guard: 8 optimizer steps ran, 1 audited under a full watch, 0 failed." in err
        return
    (tmp_path / "copy.py").write_text(script)
    called = line_of("STUDENT CALL", str(tmp_path / "copy.py"))
    assert f"optimizer step 4: the gradients about to be applied hold nan/inf: 0.weight (Sequential at train.py:{called}) (nan)" in err
    assert ("cause: input: the batch held nan before the model ran: Sequential's argument 0 (f32[32, 16] cpu) held nan when it "
            f"entered the model at train.py:{called}") in err
    assert "opwatch guard: 8 optimizer steps ran, 2 audited under a full watch, 1 failed (the batch held nan/inf), 1 of them skipped." in err
