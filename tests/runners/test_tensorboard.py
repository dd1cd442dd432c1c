"""opwatch's counts where people look: TensorBoard, from each runner (a Lightning
``TensorBoardLogger``, the Hugging Face ``report_to=["tensorboard"]`` integration, a
``SummaryWriter`` in a plain script, ``python -m opwatch --tensorboard DIR``). Each test reads
the event files back with the ``tensorboard`` package and compares them with the watch's own
counts (``Watch.counts``): a run with a real broadcast bug counts it, a healthy run counts 0."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import warnings

import pytest
import torch

import opwatch
from support import hf_models, needs
from support.helpers import fp16_regression_script, line_of
from support.trainers import STEPS, broadcast_loss, lightning_fit, matched_loss, transformers_train

pytest.importorskip("tensorboard")

def read_scalars(root) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] of the one TensorBoard log (a folder of event files) under
    ``root``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = {path.parent for path in root.rglob("events.out.tfevents.*")}
    assert len(folders) == 1, folders
    events = EventAccumulator(str(folders.pop()))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def values(scalars, tag) -> list[float]:
    return [value for _, value in scalars[tag]]


def assert_counts_are(scalars, counts, prefix="opwatch/"):
    """The last value of each of opwatch's tags is the watch's count; a kind never found has no
    tag."""
    kinds = {kind: count for kind, count in counts.items() if kind != "contained"}
    assert values(scalars, prefix + "anomalies")[-1] == sum(kinds.values())
    for kind, count in kinds.items():
        if count:
            assert values(scalars, f"{prefix}anomalies/{kind}")[-1] == count
        else:
            assert f"{prefix}anomalies/{kind}" not in scalars
    assert values(scalars, prefix + "contained")[-1] == counts["contained"]


# -- the metrics, from the watch's counts -----------------------------------------------------


def test_metrics_are_the_watch_counts_by_kind():
    from opwatch.runners.trainers import metrics

    model = torch.nn.Linear(2, 1)
    with opwatch.watch(warn=False) as w:
        for _ in range(2):
            x, target = torch.randn(4, 2), torch.randn(4)
            broadcast_loss(model(x), target).backward()
        torch.log(torch.zeros(1)).sum().item()  # -inf, read on the host: an anomaly
    assert w.counts["broadcast"] == 2 and w.counts["inf"] == 1
    assert w.counts["device_mismatch"] == 0 and set(w.counts) == {*opwatch.KINDS, "contained"}
    # The total, a tag for each kind found (in the order of opwatch.KINDS), the contained origins.
    assert metrics(w) == {"opwatch/anomalies": 3, "opwatch/anomalies/broadcast": 2, "opwatch/anomalies/inf": 1, "opwatch/contained": 0}
    assert list(metrics(w)) == ["opwatch/anomalies", "opwatch/anomalies/broadcast", "opwatch/anomalies/inf", "opwatch/contained"]
    assert len(w.anomalies) == 3
    with pytest.raises(TypeError, match="takes an opwatch.Watch, a LeaveOn or an OpwatchCallback, got str"):
        metrics("run.jsonl")


def test_counts_keep_what_max_records_drops():
    model = torch.nn.Linear(2, 1)
    with opwatch.watch(warn=False, max_records=2) as w:
        for _ in range(5):
            broadcast_loss(model(torch.randn(4, 2)), torch.randn(4))
    assert len(w.anomalies) == 2 and w.counts["broadcast"] == 5


# -- a plain script: log_counts into a SummaryWriter -------------------------------------------


def test_log_counts_into_a_summary_writer(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from opwatch.runners.tensorboard import log_counts

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = SummaryWriter(tmp_path)
    with opwatch.watch(warn=False) as w:
        for step in range(STEPS):
            x, target = torch.randn(4, 2), torch.randn(4)
            loss = broadcast_loss(model(x), target) if step else matched_loss(model(x), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            log_counts(writer, w, step)
    writer.close()
    scalars = read_scalars(tmp_path)
    # A kind's tag begins with its first anomaly; the total is there from the start.
    assert scalars["opwatch/anomalies"] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert scalars["opwatch/anomalies/broadcast"] == [(1, 1.0), (2, 2.0)]
    assert_counts_are(scalars, w.counts)
    with pytest.raises(TypeError, match="writer must be a SummaryWriter"):
        log_counts(str(tmp_path), w, 0)
    with pytest.raises(TypeError, match="step must be an int"):
        log_counts(writer, w, 1.5)


def test_a_writer_that_fails_is_told_once_and_the_program_goes_on():
    from opwatch.runners.tensorboard import OptimizerStepCounts

    class FullDisk:
        def add_scalar(self, tag, value, step):
            raise OSError("No space left on device")

        def close(self):
            raise AssertionError("not called after a failure")

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch(warn=False) as w, OptimizerStepCounts(FullDisk(), w) as counts:
            for _ in range(STEPS):
                model(torch.randn(4, 2)).sum().backward()
                optimizer.step()  # @step
        counts.close()
    told = [warning for warning in caught if issubclass(warning.category, opwatch.OpwatchWarning)]
    assert [str(warning.message) for warning in told] == ["opwatch could not write its counts to TensorBoard and stops writing them: OSError: No space left on device"]
    # At the program's line that ran the step, not in torch/optim/optimizer.py.
    assert (told[0].filename, told[0].lineno) == (__file__, line_of("# @step", __file__))
    assert counts.steps == STEPS


# -- Lightning: the trainer's TensorBoardLogger ------------------------------------------------


@pytest.mark.parametrize("loss", [broadcast_loss, matched_loss], ids=["broadcast", "healthy"])
def test_lightning_counts_reach_the_tensorboard_logger(tmp_path, loss):
    needs("lightning")
    from lightning.pytorch.loggers import TensorBoardLogger

    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback(file=io.StringIO(), warn=False)
    lightning_fit(tmp_path, callback, loss=loss, logger=TensorBoardLogger(tmp_path))
    scalars = read_scalars(tmp_path)
    broadcasts = callback.watch.counts["broadcast"]
    assert broadcasts == (STEPS if loss is broadcast_loss else 0)
    # The running count after each batch (at Lightning's steps 0, 1, 2), and the final count at
    # the end of fit (at the global step).
    expected = [(step, float(step + 1 if broadcasts else 0)) for step in range(STEPS)]
    expected.append((STEPS, float(broadcasts)))
    assert scalars["opwatch/anomalies"] == expected
    assert scalars.get("opwatch/anomalies/broadcast", []) == (expected if broadcasts else [])
    assert_counts_are(scalars, callback.watch.counts)


def test_lightning_logs_the_final_counts_when_the_last_batches_were_not_logged(tmp_path):
    needs("lightning")
    from lightning.pytorch.loggers import TensorBoardLogger

    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback(file=io.StringIO(), warn=False)
    lightning_fit(tmp_path, callback, logger=TensorBoardLogger(tmp_path), log_every_n_steps=2)
    scalars = read_scalars(tmp_path)
    # Lightning sends the second batch's log (at its step 1: 2 anomalies then) and not the
    # third's; the final count arrives with the end of fit, at the global step.
    assert scalars["opwatch/anomalies/broadcast"] == [(1, 2.0), (STEPS, 3.0)]
    assert_counts_are(scalars, callback.watch.counts)


def test_lightning_guard_mode_logs_steps_audits_and_failures(tmp_path):
    needs("lightning")
    from lightning.pytorch.loggers import TensorBoardLogger

    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback(mode="guard", file=io.StringIO(), warn=False)
    lightning_fit(tmp_path, callback, logger=TensorBoardLogger(tmp_path))
    scalars = read_scalars(tmp_path)
    # The first batch is audited (its broadcast found once); the others run unwatched.
    # (each batch's, then the end of fit's)
    assert values(scalars, "opwatch/steps") == [1.0, 2.0, 3.0, 3.0] and callback.runner.steps == STEPS
    assert values(scalars, "opwatch/audited") == [1.0, 1.0, 1.0, 1.0] and callback.runner.audited == 1
    assert values(scalars, "opwatch/failed") == [0.0, 0.0, 0.0, 0.0]
    assert values(scalars, "opwatch/anomalies/broadcast") == [1.0, 1.0, 1.0, 1.0]
    assert_counts_are(scalars, callback.watch.counts)


# -- Hugging Face: report_to=["tensorboard"] ---------------------------------------------------


def test_transformers_counts_reach_the_report_to_tensorboard(tmp_path):
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback

    callback = OpwatchCallback(file=io.StringIO(), warn=False)
    trainer = transformers_train(tmp_path, callback, report_to=["tensorboard"])
    # The integration came first; the callback moved itself in front of it when training began.
    names = [type(item).__name__ for item in trainer.callback_handler.callbacks]
    assert names[0] == "OpwatchCallback" and "TensorBoardCallback" in names
    scalars = read_scalars(tmp_path)
    # The Trainer's TensorBoard integration files every training log under train/: one per
    # step (logging_steps=1), and the end-of-training log (train_runtime, ...) at the last step.
    steps = [(step, float(step)) for step in range(1, STEPS + 1)]
    assert scalars["train/opwatch/anomalies/broadcast"] == scalars["train/opwatch/anomalies"] == [*steps, steps[-1]]
    assert_counts_are(scalars, callback.watch.counts, prefix="train/opwatch/")
    assert len(scalars["train/loss"]) == STEPS  # the Trainer's own logs are untouched


def test_transformers_healthy_tiny_model_logs_zero(tmp_path):
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback

    model, inputs = hf_models.build("bert", "sdpa")
    rows = [{name: value[row] for name, value in inputs.items()} for row in range(hf_models.BATCH)]
    callback = OpwatchCallback(file=io.StringIO(), warn=False)
    transformers_train(tmp_path, callback, steps=1, model=model, dataset=rows, batch_size=hf_models.BATCH, report_to=["tensorboard"])
    scalars = read_scalars(tmp_path)
    assert callback.watch.counts == dict.fromkeys([*opwatch.KINDS, "contained"], 0)
    assert len(callback.watch.records) > 100  # the step was watched
    assert scalars["train/opwatch/anomalies"] == [(1, 0.0), (1, 0.0)]  # the step's log, the end-of-training log
    assert_counts_are(scalars, callback.watch.counts, prefix="train/opwatch/")


# -- python -m opwatch --tensorboard DIR ---------------------------------------------------------

TRAIN_SCRIPT = """\
import torch

torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({steps}):
    x, target = torch.randn(4, 2), torch.randn(4)
    pred = model(x){fix}
    loss = ((target - pred) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def run_cli(tmp_path, script, *options, capsys=None):
    """``python -m opwatch [options] --tensorboard DIR script``: in this process (``main()``,
    stderr read from ``capsys``), or in a subprocess without ``capsys``; returns the scalars
    written and the stderr."""
    path = tmp_path / "train.py"
    path.write_text(script)
    argv = [*options, "--tensorboard", str(tmp_path / "tb"), str(path)]
    if capsys is None:
        result = subprocess.run([sys.executable, "-m", "opwatch", *argv], capture_output=True, text=True, timeout=120)
        status, stderr = result.returncode, result.stderr
    else:
        from opwatch.runners.cli import main

        status, stderr = main(argv), capsys.readouterr().err
    assert status == 0, stderr
    return read_scalars(tmp_path / "tb"), stderr


@pytest.mark.parametrize("fix", ["", ".squeeze(-1)"], ids=["broadcast", "healthy"])
def test_cli_writes_the_counts_at_each_optimizer_step(tmp_path, fix, capsys):
    script = TRAIN_SCRIPT.format(steps=STEPS, fix=fix)
    # The real command once; main() in this process for the healthy run.
    scalars, stderr = run_cli(tmp_path, script, capsys=capsys if fix else None)
    expected = [(step, 0.0 if fix else float(step)) for step in range(1, STEPS + 1)]
    assert scalars["opwatch/anomalies"] == expected
    if fix:
        assert set(scalars) == {"opwatch/anomalies", "opwatch/contained"}
    else:
        assert set(scalars) == {"opwatch/anomalies", "opwatch/anomalies/broadcast", "opwatch/contained"}
        assert scalars["opwatch/anomalies/broadcast"] == expected
    # The same count the summary gives.
    assert stderr.startswith("opwatch: no anomalies" if fix else f"opwatch: {STEPS} anomalies at 1 place:")


def test_cli_guard_writes_steps_audits_and_failures(tmp_path, capsys):
    scalars, _ = run_cli(tmp_path, TRAIN_SCRIPT.format(steps=STEPS, fix=""), "--guard", capsys=capsys)
    assert values(scalars, "opwatch/steps") == [1.0, 2.0, 3.0]
    assert values(scalars, "opwatch/audited") == [1.0, 1.0, 1.0]
    assert values(scalars, "opwatch/failed") == [0.0, 0.0, 0.0]
    assert values(scalars, "opwatch/anomalies/broadcast") == [1.0, 1.0, 1.0]


def test_cli_writes_the_final_counts_of_a_script_without_an_optimizer(tmp_path, capsys):
    script = "import torch\nprint(float(torch.log(torch.zeros(2)).sum()))\n"
    scalars, _ = run_cli(tmp_path, script, capsys=capsys)
    assert scalars["opwatch/anomalies/inf"] == [(0, 1.0)] and scalars["opwatch/anomalies"] == [(0, 1.0)]


def test_cli_without_tensorboard_installed_is_a_usage_error(tmp_path, monkeypatch, capsys):
    import importlib.util

    from opwatch.runners.cli import main

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "tensorboard" else real(name, *args))
    with pytest.raises(SystemExit) as exited:
        main(["--tensorboard", str(tmp_path / "tb"), str(script)])
    assert exited.value.code == 2
    assert "--tensorboard needs the tensorboard package: pip install tensorboard" in capsys.readouterr().err
    assert not (tmp_path / "tb").exists()


FUSED_SCRIPT = """\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
for step in range(1, 4):
    x, target = torch.randn(4, 2), torch.randn(4)
    loss = ((target - model(x).squeeze(-1)) ** 2).mean()
    if step == 3:
        loss = loss * float("nan")  # the last step fails: its verdict goes to the fused AdamW as found_inf
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
"""


def test_cli_guard_counts_a_fused_optimizer_s_failing_last_step_in_the_logged_counts_and_the_summary(tmp_path, capsys):
    scalars, stderr = run_cli(tmp_path, FUSED_SCRIPT, "--guard", capsys=capsys)
    assert values(scalars, "opwatch/failed") == [0.0, 0.0, 1.0]  # the counts written after step 3 hold it
    assert values(scalars, "opwatch/skipped")[-1] == 1.0
    assert "3 optimizer steps ran, 1 audited under a full watch, 1 failed" in stderr


GRAD_SCALER_SCRIPT = fp16_regression_script("torch.optim.SGD(model.parameters(), lr=1e-3)", "2.0**20", 12)


def test_cli_guard_logs_the_steps_grad_scaler_skipped_as_the_summary_counts_them(tmp_path, capsys):
    """GradScaler's skips never call the optimizer: they are none of the steps counted, and
    their own count is logged with the others, as the summary says it."""
    scalars, stderr = run_cli(tmp_path, GRAD_SCALER_SCRIPT, "--guard", capsys=capsys)
    told = re.search(r"opwatch guard: (\d+) optimizer steps ran, 1 audited under a full watch, 0 failed; GradScaler skipped (\d+) more", stderr)
    assert told is not None, stderr
    steps, skipped = int(told[1]), int(told[2])
    assert steps + skipped == 12 and skipped >= 2
    assert values(scalars, "opwatch/steps")[-1] == steps and values(scalars, "opwatch/scaler_skipped")[-1] == skipped
    assert values(scalars, "opwatch/failed")[-1] == 0 and values(scalars, "opwatch/skipped")[-1] == 0
