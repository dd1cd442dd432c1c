"""One run ledger (issue 37): a stuck run stops, a nan loss with finite gradients fails its step,
and every count (summary, metrics, ``.anomalies``) reads the same facts; on realistic loops
(a numpy-fed loop, a nanoGPT-style transformer with AdamW and clipping, the Hugging Face
Trainer on a tiny GPT-2, Lightning) through the runners they concern."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opwatch
from opwatch.runners.leave_on import LeaveOn, RunStuck
from support.helpers import line_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUMPY_LOOP = """\
import os
import numpy as np
import torch

BLOW_AT = int(os.environ.get("BLOW_AT", "-1"))  # the step whose learning rate blows the weights up
NAN_AT = int(os.environ.get("NAN_AT", "-1"))  # the step whose numpy batch holds a nan
WRITE_AT = int(os.environ.get("WRITE_AT", "-1"))  # the step after which the program writes an inf weight
torch.manual_seed(0)
rng = np.random.default_rng(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(os.environ.get("STEPS", "60"))):
    xs = rng.standard_normal((32, 8)).astype(np.float32)
    if step == NAN_AT:
        xs[3, 2] = np.nan
    x = torch.from_numpy(xs)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))  # LOSS LINE: x enters the model here
    optimizer.zero_grad()
    loss.backward()
    for group in optimizer.param_groups:
        group["lr"] = 1e36 if step == BLOW_AT else 0.01
    optimizer.step()
    if step == WRITE_AT:
        with torch.no_grad():
            model[2].weight[0, 3] = float("inf")
print("weights finite:", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
"""


def run_cli(tmp_path, *options, **env):
    (tmp_path / "train.py").write_text(NUMPY_LOOP)
    return subprocess.run([sys.executable, "-m", "opwatch", *options, "train.py"], capture_output=True, text=True, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env), timeout=300)


# -- a stuck run stops ------------------------------------------------------------------------


def test_a_step_a_fused_kernel_skipped_is_taken_off_the_steps_and_grad_scaler_s_streak_goes_on():
    """A fused optimizer's step is counted when it runs; its kernel's skip (GradScaler's
    found_inf, read a step later) makes it one of GradScaler's skips, as an unfused optimizer's."""
    from opwatch.runners.ledger import RunLedger

    ledger = RunLedger()
    ledger.step(audited=True)  # healthy: GradScaler's streak ends
    ledger.step(audited=True)
    ledger.skipped_in_kernel(0.5, 1.0)
    ledger.step(audited=False)
    ledger.skipped_in_kernel(0.25, 0.5)
    assert (ledger.steps, ledger.audited, ledger.scaler_skipped, ledger.scaler_in_a_row, ledger.scaler_streak_after) == (1, 1, 2, 2, 1)
    assert (ledger.scale, ledger.skipped_at_scale) == (0.25, 0.5) and ledger.stuck_in_scaler_skips(2) and not ledger.stuck_in_scaler_skips(3)
    ledger.step(audited=False)  # one that ran ends the streak
    assert (ledger.steps, ledger.scaler_in_a_row) == (2, 0)


def test_cli_guard_stops_a_run_whose_every_step_fails_and_names_the_first_failure(tmp_path):
    result = run_cli(tmp_path, "--guard", BLOW_AT="10")
    assert result.returncode == 1, result.stderr
    assert "RunStuck: opwatch: the run is stuck: 10 optimizer steps in a row failed (steps 12 to 21), none of them applied" in result.stderr
    assert f"first made by aten.mse_loss.default at train.py:{line_of('LOSS LINE', tmp_path / 'train.py')} (forward)" in result.stderr
    assert "21 optimizer steps ran" in result.stderr and "opwatch: no anomalies." not in result.stderr
    # opwatch stopped the run on purpose: its message, no Python traceback; the CLI's flag, not the keyword
    assert "Traceback" not in result.stderr and "--max-failed-steps N (0: never stop) sets that limit" in result.stderr


@pytest.mark.thorough
def test_cli_guard_max_failed_steps_sets_the_limit_and_zero_never_stops(tmp_path):
    three = run_cli(tmp_path, "--guard", "--max-failed-steps", "3", BLOW_AT="10")
    assert three.returncode == 1 and "3 optimizer steps in a row failed (steps 12 to 14)" in three.stderr, three.stderr
    never = run_cli(tmp_path, "--guard", "--max-failed-steps", "0", BLOW_AT="10")
    assert never.returncode == 0, never.stderr
    assert "60 optimizer steps ran" in never.stderr and "49 failed" in never.stderr and "RunStuck" not in never.stderr


def test_cli_guard_a_one_batch_glitch_is_not_a_stuck_run_and_its_batch_is_named(tmp_path):
    result = run_cli(tmp_path, "--guard", "--max-failed-steps", "2", NAN_AT="5")
    assert result.returncode == 0, result.stderr
    assert "weights finite: True" in result.stdout
    line = line_of("LOSS LINE", tmp_path / "train.py")
    assert ("optimizer step 6: the gradients about to be applied hold nan/inf: 0.weight (nan), 0.bias (nan), 2.weight (nan), 2.bias (nan). "
            "cause: input: the batch held nan before the model ran: Sequential's argument 0 (f32[32, 8] cpu) held nan when it entered "
            f"the model at train.py:{line}") in result.stderr, result.stderr
    assert "did not recur" not in result.stderr  # a bad batch told as such: the quiet re-check is no news
    assert "1 failed (the batch held nan/inf), 1 of them skipped" in result.stderr and "RunStuck" not in result.stderr  # never "(nan/inf in the gradients)" for a bad batch
    # a failed step is never summed up as "no anomalies"
    assert "opwatch: no anomalies." not in result.stderr
    assert "opwatch: no op was named in the fully watched steps, but 1 optimizer step failed" in result.stderr


def test_cli_guard_strict_names_the_bad_batch_and_the_next_command(tmp_path):
    result = run_cli(tmp_path, "--guard", "--strict", NAN_AT="5")
    assert result.returncode == 1
    line = line_of("LOSS LINE", tmp_path / "train.py")
    assert (f"GradientsNotFinite: opwatch: optimizer step 6: the gradients about to be applied hold nan/inf: 0.weight (nan), 0.bias (nan), "
            f"2.weight (nan), 2.bias (nan). cause: input: the batch held nan before the model ran") in result.stderr, result.stderr
    assert f"entered the model at train.py:{line}" in result.stderr
    assert "To see the ops that made the batch, if torch made it: python -m opwatch --strict train.py" in result.stderr
    assert "6 optimizer steps ran, 1 audited under a full watch, 1 failed (the batch held nan/inf), 1 of them skipped" in result.stderr


def test_a_failure_of_finite_inputs_is_not_blamed_on_the_batch(tmp_path):
    result = run_cli(tmp_path, "--guard", "--max-failed-steps", "3", BLOW_AT="10")
    assert "cause: input" not in result.stderr and "3 optimizer steps in a row failed" in result.stderr, result.stderr


def test_max_failed_steps_needs_guard_and_the_keyword_is_checked(tmp_path):
    result = run_cli(tmp_path, "--max-failed-steps", "3")
    assert result.returncode == 2 and "--max-failed-steps says when --guard stops a run" in result.stderr
    with pytest.raises(ValueError, match="max_failed_in_a_row must be an int of at least 1 or None"):
        LeaveOn(max_failed_in_a_row=0)


# -- a nanoGPT-style transformer with AdamW and clipping ----------------------------------------


class TinyGPT(nn.Module):
    """One causal self-attention block (nanoGPT's shape), tied embedding and head."""

    def __init__(self, vocab=48, width=32, heads=4, length=16):
        super().__init__()
        self.heads = heads
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.norm1, self.norm2, self.norm_f = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids, targets):
        batch, length = ids.shape
        x = self.tokens(ids) + self.positions(torch.arange(length))
        q, k, v = self.attention(self.norm1(x)).split(x.shape[-1], dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, -1)
        x = x + self.projection(y)
        x = x + self.mlp(self.norm2(x))
        logits = self.head(self.norm_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)  # GPT LOSS


def gpt_run(runner, *, steps=12, ignored_at=-1, blow_at=-1):
    """nanoGPT's loop: AdamW with weight decay, clip_grad_norm_; ``ignored_at``: the step whose
    every target is -100 (the loss 0/0 = nan, the gradients zero); ``blow_at``: a step whose
    learning rate writes huge weights."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    kept = {}
    with runner:
        runner.know(model)
        for step in range(steps):
            ids = torch.randint(0, 48, (4, 16))
            targets = torch.roll(ids, -1, dims=1)
            if step == ignored_at:
                targets[:] = -100
            loss = model(ids, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in optimizer.param_groups:
                group["lr"] = 1e30 if step == blow_at else 1e-3
            if step == ignored_at:
                kept = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
            optimizer.step()
            if step == ignored_at:
                kept = {name: torch.equal(kept[name], parameter) for name, parameter in model.named_parameters()}
    return model, kept


def test_a_nan_loss_with_finite_gradients_fails_its_step_and_the_step_is_skipped():
    runner = LeaveOn(warn=False, file=io.StringIO(), audit="manual")
    with pytest.warns(opwatch.OpwatchWarning, match=r"optimizer step 4: the loss backward\(\) ran on is nan while the gradients"):
        model, unchanged = gpt_run(runner, ignored_at=3)
    assert (runner.failed, runner.skipped) == (1, 1)
    failure = runner.failures[0]
    assert (failure.step, failure.cause, failure.loss, failure.parameters, failure.action) == (4, "loss", "nan", [], "skipped")
    assert all(unchanged.values())  # AdamW's decay and momentum did not move the weights at the skipped step
    assert "1 failed (a loss not finite), 1 of them skipped" in runner.summary()  # not "in the gradients, or in the loss for 1 of them"


@pytest.mark.parametrize("causes, why", [
    ({"loss": 4}, "a loss not finite"),  # every one a loss (a batch whose every label is ignored, each epoch)
    ({"gradients": 2, "loss": 1}, "nan/inf in the gradients, or in the loss for 1 of them"),
    ({"gradients": 3}, "nan/inf in the gradients"),
    ({"input": 1, "loss": 2}, "the batch held nan/inf: 1; a loss not finite: 2"),
])
def test_the_summary_line_gives_each_mix_of_causes_its_words(causes, why):
    from opwatch.render.leave_on import summary

    failed = sum(causes.values())
    assert summary(16, 4, failed, True, failed, causes=causes) == (
        f"opwatch guard: 16 optimizer steps ran, 4 audited under a full watch, {failed} failed ({why}), {failed} of them skipped.")


class _ProgramsFunctionMode(torch.overrides.TorchFunctionMode):
    """A function mode of the program's own (a tracer, a FLOP counter) around its loop."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def gpt_loop_with_its_own_skip(runner, *, ignored_at, micro_batches=1, steps=8):
    """nanoGPT's loop that skips a step itself when its loss is not finite (``zero_grad`` at the
    next iteration drops that backward's gradients), with ``micro_batches`` backward calls per
    step; the micro-batch ``ignored_at`` (counted over the run) has every target -100."""
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    skipped = 0
    with runner:
        runner.know(model)
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            finite = True
            for micro in range(micro_batches):
                ids = torch.randint(0, 48, (4, 16))
                targets = torch.roll(ids, -1, dims=1)
                if step * micro_batches + micro == ignored_at:
                    targets[:] = -100
                loss = model(ids, targets) / micro_batches
                loss.backward()
                finite = finite and bool(torch.isfinite(loss))
            if micro_batches == 1 and not finite:
                skipped += 1
                continue  # the program's own guard: this step's gradients are dropped at the next zero_grad
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    return skipped


def test_a_step_the_program_skipped_itself_leaves_no_loss_to_the_next_step():
    """The loop skips its step when the loss is nan (every target ignored at step 3) and drops
    those gradients at the next ``zero_grad``. The next step is healthy, but leave-on kept the
    skipped step's nan loss with its own and failed it: "optimizer step 4: the loss backward()
    ran on is nan while the gradients about to be applied are finite", skipping a good update.
    A backward whose gradients the program dropped leaves no loss to the step now."""
    runner = LeaveOn(warn=False, file=io.StringIO())
    with warnings.catch_warnings():
        warnings.simplefilter("error", opwatch.OpwatchWarning)
        assert gpt_loop_with_its_own_skip(runner, ignored_at=3) == 1
    assert (runner.steps, runner.failed, runner.skipped) == (7, 0, 0) and runner.ledger.clean


def test_an_accumulated_micro_batch_s_nan_loss_still_fails_its_step():
    """Gradient accumulation keeps each micro-batch's gradients (no ``zero_grad`` between): the
    nan loss of micro-batch 1 of step 3 (every target ignored) still fails that step."""
    runner = LeaveOn(warn=False, file=io.StringIO())
    with pytest.warns(opwatch.OpwatchWarning, match=r"optimizer step 3: the loss backward\(\) ran on is nan while the gradients"):
        gpt_loop_with_its_own_skip(runner, ignored_at=2 * 2 + 1, micro_batches=2)
    assert (runner.steps, runner.failed) == (8, 1) and runner.failures[0].cause == "loss"


def test_under_the_program_s_own_function_mode_each_backward_keeps_its_loss_once():
    # torch's Tensor.backward hands the call to a function mode as Tensor.backward, which is
    # leave-on's wrapper again: the loss was kept twice (and the cap on kept losses halved).
    torch.manual_seed(0)
    model = TinyGPT()
    ids = torch.randint(0, 48, (4, 16))
    runner = LeaveOn(warn=False, file=io.StringIO(), audit="manual")
    with runner, _ProgramsFunctionMode():
        for _ in range(2):  # two backward() calls before one step: gradient accumulation
            model(ids, torch.roll(ids, -1, dims=1)).backward()
        assert len(runner._losses) == 2
    runner = LeaveOn(warn=False, file=io.StringIO(), audit="manual")
    with pytest.warns(opwatch.OpwatchWarning, match=r"optimizer step 4: the loss backward\(\) ran on is nan"), _ProgramsFunctionMode():
        gpt_run(runner, ignored_at=3)  # and a nan loss still fails its step there
    assert (runner.failed, runner.skipped) == (1, 1)


def test_a_healthy_gpt_run_with_clipping_fails_no_step():
    runner = LeaveOn(warn=False, file=io.StringIO(), audit="manual")
    with warnings.catch_warnings():
        warnings.simplefilter("error", opwatch.OpwatchWarning)
        gpt_run(runner)
    assert (runner.steps, runner.failed, runner.skipped) == (12, 0, 0) and runner.ledger.clean
    assert torch.Tensor.backward.__name__ == "backward" and not hasattr(torch.Tensor.backward, "__wrapped__")  # put back


def test_a_blown_up_gpt_run_stops_after_max_failed_in_a_row():
    runner = LeaveOn(warn=False, file=io.StringIO(), audit="manual", max_failed_in_a_row=4)
    with warnings.catch_warnings(), pytest.raises(RunStuck) as stuck:
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        gpt_run(runner, steps=30, blow_at=5)
    assert stuck.value.failed_in_a_row == 4 and runner.failed == 4
    assert f"4 optimizer steps in a row failed (steps {stuck.value.step} to {stuck.value.step + 3})" in str(stuck.value)


# -- the trainers read the ledger ---------------------------------------------------------------


def test_hf_guard_mode_counts_a_nan_loss_of_ignored_labels_on_a_tiny_gpt2(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from opwatch.runners.transformers import OpwatchCallback

    def train(ignored):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
        rows = []
        for index in range(6):
            ids = torch.randint(0, 64, (8,))
            rows.append({"input_ids": ids, "labels": torch.full_like(ids, -100) if index in ignored else ids.clone()})
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=6, logging_steps=1, report_to=[], save_strategy="no",
            use_cpu=True, disable_tqdm=True, logging_nan_inf_filter=False, dataloader_num_workers=0)
        callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", opwatch.OpwatchWarning)
            with callback:
                trainer.train()
        logged = [entry for entry in trainer.state.log_history if "opwatch/failed" in entry]
        return callback, logged[-1]

    callback, last = train(ignored={2})
    assert (callback.runner.failed, callback.runner.skipped) == (1, 1) and callback.runner.failures[0].cause == "loss"
    assert (last["opwatch/failed"], last["opwatch/skipped"]) == (1, 1)
    # The last step's: the counts logged after it hold the failure, and the re-check armed after
    # it ends with the training loop: the Trainer's wrap-up (averaging the nan loss it carries)
    # is no step, and names no origin.
    callback, last = train(ignored={5})
    assert (callback.runner.failed, last["opwatch/failed"], last["opwatch/skipped"]) == (1, 1, 1)
    assert callback.anomalies == [] and last["opwatch/anomalies"] == 0 and not callback.runner.auditing
    callback, last = train(ignored=set())
    assert (callback.runner.failed, last["opwatch/failed"], last["opwatch/skipped"]) == (0, 0, 0)


def test_lightning_guard_puts_the_replayed_origin_in_callback_anomalies(tmp_path):
    from opwatch.runners.lightning import OpwatchCallback
    from opwatch.runners.trainers import metrics
    from test_leave_on import lightning_guard

    callback = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        lightning_guard(tmp_path, callback, nan_at=2, steps=4)
    assert [(anomaly.kind, anomaly.op) for anomaly in callback.anomalies] == [("inf", "aten.div.Tensor")]
    assert callback.runner.failures[0].origin is callback.anomalies[0]
    assert metrics(callback)["opwatch/anomalies"] == 1 and metrics(callback)["opwatch/failed"] == 1
    healthy = OpwatchCallback(mode="guard", warn=False, file=io.StringIO())
    lightning_guard(tmp_path, healthy, steps=4)
    assert healthy.anomalies == [] and metrics(healthy)["opwatch/anomalies"] == 0


# -- guard() writes the same facts ----------------------------------------------------------------


def test_guard_skip_keeps_each_failed_call_in_its_ledger_with_its_origin():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(x):
        loss = F.mse_loss(model(x).squeeze(-1), x.sum(-1).log())  # LOG LINE: a negative sum makes nan
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, on_failure="skip")
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        for index in range(6):
            x = torch.rand(8, 4, generator=generator) + (-5.0 if index == 3 else 0.0)
            optimizer.zero_grad()
            step(x)
            optimizer.step()
    ledger = step.ledger
    assert (ledger.steps, ledger.failed, ledger.skipped, step.skipped) == (6, 1, 1, 1)
    row = ledger.rows()[0]
    assert (row["step"], row["cause"], row["action"], row["origin"]["kind"]) == (4, "gradients", "skipped", "nan")
    assert row["origin"]["where"].endswith(f":{line_of('LOG LINE', __file__)}")
    assert ledger.failures[0].origin is step.failures[0]
    assert not math.isnan(sum(float(p.sum()) for p in model.parameters()))


# -- the saved run keeps the guard's story ------------------------------------------------------


def test_jsonl_of_a_guard_run_keeps_each_failed_step_and_the_report_marks_it(tmp_path):
    from opwatch.storage.jsonl import load

    result = run_cli(tmp_path, "--guard", "--jsonl", "run.jsonl", STEPS="12", NAN_AT="5")
    assert result.returncode == 0, result.stderr
    log = load(tmp_path / "run.jsonl")
    assert {name: log.guard[name] for name in ("steps", "failed", "skipped")} == {"steps": 12, "failed": 1, "skipped": 1}
    (row,) = log.guard["failures"]
    assert (row["step"], row["cause"], row["action"]) == (6, "input", "skipped") and ["0.weight", "nan"] in row["parameters"]
    line = line_of("LOSS LINE", tmp_path / "train.py")
    # which batch, and where it entered the model: kept by the ledger, not only in the warning
    assert row["batch"] == {"model": "Sequential", "argument": ["argument 0", "float32", [32, 8], "cpu"], "kind": "nan",
                            "where": f"train.py:{line}", "call": None, "rank": None}, row
    report = subprocess.run([sys.executable, "-m", "opwatch", "report", "run.jsonl", "-o", "run.html"], capture_output=True, text=True,
                            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "run.html").read_text()
    assert '<section id="guard">' in page and "<td>6</td><td>input</td><td>skipped</td>" in page
    assert f"<td>the batch held nan when it entered the model: Sequential&#x27;s argument 0 (f32[32, 8] cpu) at train.py:{line}</td>" in page
    assert page.count('class="failed"') == 1 and "step 6: 1 failed" in page


def test_jsonl_of_a_plain_watch_has_no_guard_story(tmp_path):
    from opwatch.storage.jsonl import load

    result = run_cli(tmp_path, "--jsonl", "run.jsonl", STEPS="3")
    assert result.returncode == 0, result.stderr
    log = load(tmp_path / "run.jsonl")
    assert log.guard is None
    from opwatch.render.html import render_report

    assert '<section id="guard">' not in render_report(log)


# -- weights the program wrote ------------------------------------------------------------------


def test_cli_guard_names_a_weight_the_program_wrote_between_two_optimizer_steps(tmp_path):
    result = run_cli(tmp_path, "--guard", STEPS="12", WRITE_AT="4")
    assert result.returncode == 0, result.stderr
    assert ("the weights hold inf before optimizer step 6: 2.weight (inf). They were written by the program between optimizer steps 5 "
            "and 6, not by the optimizer") in result.stderr
    assert "learning rate" not in result.stderr and "masking" not in result.stderr


def test_a_weight_the_optimizer_wrote_from_finite_gradients_is_not_blamed_on_the_program():
    runner = LeaveOn(warn=False, file=io.StringIO(), audit="manual")
    with pytest.warns(opwatch.OpwatchWarning) as told, pytest.raises(RunStuck):
        gpt_run(runner, steps=30, blow_at=5)  # AdamW with lr 1e30 writes huge weights, then inf
    text = "\n".join(str(warning.message) for warning in told)
    assert "written by the program" not in text
    assert "An earlier optimizer step wrote them from finite gradients" in text or "weights hold" not in text


def test_an_inf_weight_before_the_first_step_is_the_programs():
    torch.manual_seed(0)
    model = TinyGPT()
    with torch.no_grad():
        model.mlp[0].weight[0, 0] = float("inf")  # a bad init
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = LeaveOn(warn=False, file=io.StringIO(), audit="manual")
    ids = torch.randint(0, 48, (4, 16))
    with runner, pytest.warns(opwatch.OpwatchWarning, match="written by the program before the first optimizer step, not by the optimizer"):
        runner.know(model)
        model(ids, torch.roll(ids, -1, dims=1)).backward()
        optimizer.step()
    assert runner.failures[0].cause == "weights"


# -- what the command line says beside the summary -------------------------------------------------

COMPILED_LOOP = """\
import os
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
step_model = torch.compile(model) if os.environ.get("COMPILE") == "1" else model
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    x = torch.randn(32, 8)
    loss = torch.nn.functional.mse_loss(step_model(x), x.sum(1, keepdim=True))  # COMPILED CALL
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
"""


@pytest.mark.parametrize("compiled", [True, False])
def test_cli_says_when_compiled_code_ran_uncompiled(tmp_path, compiled):
    (tmp_path / "train.py").write_text(COMPILED_LOOP)
    result = subprocess.run([sys.executable, "-m", "opwatch", "train.py"], capture_output=True, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=ROOT, COMPILE="1" if compiled else "0"), timeout=300)
    assert result.returncode == 0, result.stderr
    told = f"opwatch ran compiled code uncompiled under this watch: Sequential (compiled module, train.py:{line_of('COMPILED CALL', tmp_path / 'train.py')}): 3 calls"
    assert (told in result.stderr) == compiled, result.stderr
    assert "Watch." not in result.stderr  # no sentence points a command-line user at a Python object


def test_a_script_that_stops_on_its_own_after_a_bad_batch_is_not_told_twice(tmp_path):
    script = NUMPY_LOOP.replace("    optimizer.step()\n", "    optimizer.step()\n    if step == NAN_AT:\n        break\n")
    (tmp_path / "train.py").write_text(script)
    result = subprocess.run([sys.executable, "-m", "opwatch", "--guard", "train.py"], capture_output=True, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=ROOT, NAN_AT="5"), timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("cause: input: the batch held nan") == 1
    assert "the program's loop ended before another optimizer step" not in result.stderr  # the batch was named already
