"""The trainer callbacks, end to end with the real frameworks: a Lightning fit and a Hugging Face
``Trainer.train()`` whose loss broadcasts a ``(4,)`` target against a ``(4, 1)`` prediction."""

from __future__ import annotations

import csv
import io
import subprocess
import sys

import pytest
import torch

import opwatch

STEPS = 3


def regression_data(count=4 * STEPS):
    torch.manual_seed(0)
    x = torch.randn(count, 2)
    return x, x @ torch.tensor([1.0, 2.0]) + 3.0


def broadcast_loss(pred, target):
    return ((target - pred) ** 2).mean()  # (4,) - (4, 1): a (4, 4) loss


def assert_closed(watch):
    """The callback left its watch: ops run now are not recorded."""
    count = len(watch.records)
    torch.ones(2) + 1
    assert len(watch.records) == count


def assert_one_broadcast_per_step(callback, phases=("forward", "backward")):
    assert len(callback.anomalies) == STEPS
    for anomaly in callback.anomalies:
        assert (anomaly.kind, anomaly.op, anomaly.filename, anomaly.phase) == ("broadcast", "aten.sub.Tensor", __file__, "forward")
        assert "(target - pred)" in anomaly.message
    assert {record.phase for record in callback.watch.records} == set(phases)


# -- Lightning --------------------------------------------------------------------------------


def lightning_fit(tmp_path, callback, steps=STEPS):
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            x, target = batch
            return broadcast_loss(self.layer(x), target)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = lightning.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(TensorDataset(*regression_data()), batch_size=4))
    return trainer


def test_lightning_fit(tmp_path):
    from opwatch.integrations.lightning import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(file=out, warn=False)
    trainer = lightning_fit(tmp_path, callback)

    assert_one_broadcast_per_step(callback)
    assert_closed(callback.watch)
    # Each batch's watch covers the forward, the backward and the optimizer step.
    ops = [record.op for record in callback.watch.records]
    assert ops.count("aten.addmm.default") == STEPS and "aten.mm.default" in ops
    assert ops.index("aten.addmm.default") < ops.index("aten.mm.default") < ops.index("aten.add_.Tensor")
    # The summary at the end of fit, and the running counts in the trainer's logger.
    assert out.getvalue() == callback.watch.summary() + "\n"
    assert out.getvalue().startswith("opwatch: 3 anomalies at 1 place:")
    with open(f"{trainer.logger.log_dir}/metrics.csv") as metrics:
        rows = list(csv.DictReader(metrics))
    assert [float(row["opwatch/anomalies"]) for row in rows] == [1.0, 2.0, 3.0]
    assert [float(row["opwatch/contained"]) for row in rows] == [0.0, 0.0, 0.0]


def test_lightning_strict_stops_at_the_first_anomaly(tmp_path):
    from opwatch.integrations.lightning import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(strict=True, file=out, warn=False, last=3)
    with pytest.raises(opwatch.AnomalyError) as raised:
        lightning_fit(tmp_path, callback)
    assert raised.value.anomaly is callback.anomalies[0] and len(callback.anomalies) == 1
    assert raised.value.anomaly.kind == "broadcast"
    assert all(record.phase == "forward" for record in callback.watch.records)  # stopped before backward
    assert out.getvalue().startswith("opwatch: the watched block raised AnomalyError; the last 3 ops:")
    assert_closed(callback.watch)


# -- Hugging Face transformers ------------------------------------------------------------------


def transformers_train(tmp_path, callback, steps=STEPS):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def forward(self, x, labels=None):
            pred = self.layer(x)
            return {"loss": broadcast_loss(pred, labels), "logits": pred}

    x, y = regression_data()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=0.01,
        optim="adamw_torch_fused",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(
        model=Regression(), args=args, train_dataset=[{"x": a, "labels": b} for a, b in zip(x, y)], callbacks=[callback]
    )
    with callback:
        trainer.train()
    return trainer


def test_transformers_train(tmp_path):
    from opwatch.integrations.transformers import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(file=out, warn=False)
    trainer = transformers_train(tmp_path, callback)

    assert_one_broadcast_per_step(callback)
    assert_closed(callback.watch)
    ops = [record.op for record in callback.watch.records]
    assert ops.count("aten.addmm.default") == STEPS
    assert ops.index("aten.addmm.default") < ops.index("aten.mm.default") < ops.index("aten._fused_adamw_.default")
    assert out.getvalue() == callback.watch.summary() + "\n"
    steps = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["opwatch/anomalies"] for log in steps] == [1, 2, 3]
    assert all(log["opwatch/contained"] == 0 for log in steps)


def test_transformers_strict_stops_at_the_first_anomaly(tmp_path):
    from opwatch.integrations.transformers import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(strict=True, file=out, warn=False)
    with pytest.raises(opwatch.AnomalyError) as raised:
        transformers_train(tmp_path, callback)
    assert raised.value.anomaly is callback.anomalies[0] and len(callback.anomalies) == 1
    assert all(record.phase == "forward" for record in callback.watch.records)
    # Leaving `with callback:` closed the step's watch and printed its dump.
    assert out.getvalue().startswith("opwatch: the watched block raised AnomalyError; the last ")
    assert_closed(callback.watch)


def test_frameworks_are_imported_only_when_used():
    code = (
        "import sys\n"
        "import opwatch.integrations.lightning, opwatch.integrations.transformers\n"
        "print('lightning' in sys.modules, 'pytorch_lightning' in sys.modules, 'transformers' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "False", "False"], result.stderr
