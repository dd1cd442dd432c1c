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
from support import needs, trainers
from support.trainers import (
    STEPS, broadcast_loss, lightning_fit, lightning_module, lightning_trainer, matched_loss, regression_loader,
    transformers_train,
)


def assert_closed(watch):
    """The callback left its watch: ops run now are not recorded."""
    count = len(watch.records)
    torch.ones(2) + 1
    assert len(watch.records) == count


def assert_one_broadcast_per_step(callback, phases=("forward", "backward", "optimizer")):
    assert len(callback.anomalies) == STEPS
    for anomaly in callback.anomalies:
        assert (anomaly.kind, anomaly.op, anomaly.filename, anomaly.phase) == ("broadcast", "aten.sub.Tensor", trainers.__file__, "forward")
        assert "(target - pred)" in anomaly.message
    assert {record.phase for record in callback.watch.records} == set(phases)


# -- Lightning --------------------------------------------------------------------------------


def test_lightning_fit(tmp_path):
    needs("lightning")
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
    needs("lightning")
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


def _fit_with_validation(tmp_path, callback, eval_loss):
    """A healthy fit of 3 batches with 2 validation batches (Lightning's sanity check of 2
    first, then one validation at the end of the epoch)."""
    trainer = lightning_trainer(tmp_path, callback, num_sanity_val_steps=2)
    trainer.fit(lightning_module(matched_loss, eval_loss), regression_loader(), regression_loader(8))
    return trainer


def _csv_rows(trainer):
    with open(f"{trainer.logger.log_dir}/metrics.csv") as metrics:
        return list(csv.DictReader(metrics))


def test_lightning_validation_step_is_watched_and_counted_apart(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(file=out, warn=False)
    trainer = _fit_with_validation(tmp_path, callback, broadcast_loss)

    assert callback.anomalies == [] and set(callback.watches) == {"train", "validation"}
    validation = callback.watches["validation"]
    assert len(validation.anomalies) == 4  # 2 batches of the sanity check, 2 of the epoch's end
    for anomaly in validation.anomalies:
        assert (anomaly.kind, anomaly.op, anomaly.filename, anomaly.phase) == ("broadcast", "aten.sub.Tensor", trainers.__file__, "forward")
        assert anomaly.lineno == trainers.broadcast_loss.__code__.co_firstlineno + 1
        assert "(target - pred)" in anomaly.message
    assert_closed(validation)
    # The summaries: training's, then validation's, named.
    training, _, rest = out.getvalue().partition("\n")
    assert training == "opwatch: no anomalies."
    assert rest.startswith("opwatch (validation): 4 anomalies at 1 place:")
    # The counts apart: training's stay 0, validation's under its own name.
    rows = _csv_rows(trainer)
    assert {float(row["opwatch/anomalies"]) for row in rows if row["opwatch/anomalies"]} == {0.0}
    validation_counts = [float(row["opwatch/validation/anomalies"]) for row in rows if row.get("opwatch/validation/anomalies")]
    assert validation_counts[-1] == 4.0 and float(rows[-1]["opwatch/validation/anomalies/broadcast"]) == 4.0


def test_lightning_healthy_validation_reports_nothing(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(file=out, warn=False)
    trainer = _fit_with_validation(tmp_path, callback, matched_loss)

    validation = callback.watches["validation"]
    assert callback.anomalies == [] and validation.anomalies == [] and validation.contained == []
    assert any(record.op == "aten.addmm.default" for record in validation.records)  # it was watched
    assert out.getvalue() == "opwatch: no anomalies.\nopwatch (validation): no anomalies.\n"
    assert {float(row["opwatch/validation/anomalies"]) for row in _csv_rows(trainer) if row.get("opwatch/validation/anomalies")} == {0.0}


def test_lightning_test_and_predict_are_watched_alone(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(file=out, warn=False)
    trainer = lightning_trainer(tmp_path, callback)
    model = lightning_module(matched_loss, broadcast_loss)
    trainer.test(model, regression_loader(8))
    trainer.predict(model, regression_loader(4))

    assert callback.anomalies == [] and set(callback.watches) == {"train", "test", "predict"}
    assert [a.kind for a in callback.watches["test"].anomalies] == ["broadcast"] * 2
    assert [a.kind for a in callback.watches["predict"].anomalies] == ["broadcast"]
    test, predict = out.getvalue().split("\nopwatch (predict)")
    assert test.startswith("opwatch (test): 2 anomalies at 1 place:")
    assert predict.startswith(": 1 anomaly at 1 place:")
    assert float(_csv_rows(trainer)[-1]["opwatch/test/anomalies"]) == 2.0


def test_lightning_strict_stops_in_validation(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(strict=True, file=out, warn=False, last=3)
    with pytest.raises(opwatch.AnomalyError) as raised:
        _fit_with_validation(tmp_path, callback, broadcast_loss)
    assert raised.value.anomaly is callback.watches["validation"].anomalies[0]
    assert callback.watch.records == []  # the sanity check runs before any training batch
    assert_closed(callback.watches["validation"])


def test_lightning_guard_mode_watches_no_validation_batch(tmp_path):
    needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(mode="guard", file=out, warn=False)
    _fit_with_validation(tmp_path, callback, broadcast_loss)
    assert set(callback.watches) == {"train"} and callback.anomalies == []
    assert "validation" not in out.getvalue() and callback.runner.steps == STEPS


# -- Hugging Face transformers ------------------------------------------------------------------


def test_transformers_train(tmp_path):
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback

    out = io.StringIO()
    callback = OpwatchCallback(file=out, warn=False)
    trainer = transformers_train(tmp_path, callback)

    assert_one_broadcast_per_step(callback, phases=("forward", "backward", "clipping", "optimizer"))  # the Trainer clips (max_grad_norm)
    assert_closed(callback.watch)
    ops = [record.op for record in callback.watch.records]
    assert ops.count("aten.addmm.default") == STEPS
    assert ops.index("aten.addmm.default") < ops.index("aten.mm.default") < ops.index("aten._fused_adamw_.default")
    assert out.getvalue() == callback.watch.summary() + "\n"
    steps = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["opwatch/anomalies"] for log in steps] == [1, 2, 3]
    assert all(log["opwatch/contained"] == 0 for log in steps)


def test_transformers_strict_stops_at_the_first_anomaly(tmp_path):
    needs("transformers")
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


def test_transformers_evaluation_is_watched_by_a_watch_around_it(tmp_path):
    """The callback cannot watch evaluation (no hook before a prediction step): the way the
    docs give, a watch around ``trainer.evaluate()``, finds its broadcast; healthy, nothing."""
    needs("transformers")
    from opwatch.runners.transformers import OpwatchCallback

    callback = OpwatchCallback(file=io.StringIO(), warn=False)
    trainer = transformers_train(tmp_path, callback, loss=trainers.matched_loss)
    dataset = trainer.train_dataset
    with opwatch.watch(warn=False) as healthy:
        trainer.evaluate(eval_dataset=dataset)
    assert healthy.anomalies == [] and any(record.op == "aten.addmm.default" for record in healthy.records)
    trainer.model.loss = trainers.broadcast_loss
    with opwatch.watch(warn=False) as evaluation:
        trainer.evaluate(eval_dataset=dataset)
    assert {(a.kind, a.filename, a.phase) for a in evaluation.anomalies} == {("broadcast", trainers.__file__, "forward")}
    assert callback.anomalies == []  # training's count is apart
