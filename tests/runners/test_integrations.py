"""The trainer callbacks, end to end with the real frameworks: a Lightning fit and a Hugging Face
``Trainer.train()`` whose loss broadcasts a ``(4,)`` target against a ``(4, 1)`` prediction
(``support.trainers``)."""

from __future__ import annotations

import csv
import io
import subprocess
import sys

import pytest
import torch

import opwatch
from support import trainers
from support.trainers import STEPS, lightning_fit, transformers_train


def assert_closed(watch):
    """The callback left its watch: ops run now are not recorded."""
    count = len(watch.records)
    torch.ones(2) + 1
    assert len(watch.records) == count


def assert_one_broadcast_per_step(callback, phases=("forward", "backward")):
    assert len(callback.anomalies) == STEPS
    for anomaly in callback.anomalies:
        assert (anomaly.kind, anomaly.op, anomaly.filename, anomaly.phase) == ("broadcast", "aten.sub.Tensor", trainers.__file__, "forward")
        assert "(target - pred)" in anomaly.message
    assert {record.phase for record in callback.watch.records} == set(phases)


# -- Lightning --------------------------------------------------------------------------------


def test_lightning_fit(tmp_path):
    from opwatch.runners.lightning import OpwatchCallback

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
    # each batch's, then the end of fit's
    assert [float(row["opwatch/anomalies"]) for row in rows] == [1.0, 2.0, 3.0, 3.0]
    assert [float(row["opwatch/contained"]) for row in rows] == [0.0, 0.0, 0.0, 0.0]


def test_lightning_strict_stops_at_the_first_anomaly(tmp_path):
    from opwatch.runners.lightning import OpwatchCallback

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


def test_transformers_train(tmp_path):
    from opwatch.runners.transformers import OpwatchCallback

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
    from opwatch.runners.transformers import OpwatchCallback

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
        "import opwatch.runners.lightning, opwatch.runners.transformers, opwatch.runners.tensorboard\n"
        "print('lightning' in sys.modules, 'pytorch_lightning' in sys.modules, 'transformers' in sys.modules,\n"
        "      'tensorboard' in sys.modules, 'torch.utils.tensorboard' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False"] * 5, result.stderr
