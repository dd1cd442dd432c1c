"""GradScaler skips a step whose loss was not finite before it was scaled, as it skips one
whose scaled gradients overflowed: a float16 run's corrupt batch, or a batch that makes its
loss 0/0, was counted as "overflows of its scaled gradients" beside "opwatch: no anomalies.".
No scale mends such a loss: the guard tells the first of a streak of skips, with the batch when
it held nan/inf, and the summary counts them apart (``python -m opwatch --guard``)."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import opwatch
from support import needs
from support.helpers import guard_in_process, line_of

# A float16 classifier on the CPU with a real GradScaler. BAD: the step whose batch is bad.
FP16 = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
for step in range(30):
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    keep = torch.ones(32)
    if step == BAD: BATCH  # the bad batch
    with torch.autocast("cpu", dtype=torch.float16):
        per_sample = nn.functional.cross_entropy(model(x), y, reduction="none")
    loss = (per_sample * keep).sum() / keep.sum()  # the mean over the samples kept
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("weights finite:", all(bool(p.isfinite().all()) for p in model.parameters()))
"""


def fp16(bad=-1, batch="pass", init_scale="2.0 ** 16") -> str:
    return FP16.replace("INIT_SCALE", init_scale).replace("BAD", str(bad)).replace("BATCH", batch)


def test_a_corrupt_sample_in_a_float16_run_is_told_with_its_batch_not_counted_as_an_overflow(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = fp16(bad=6, batch='x[7, 3] = float("nan")')
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "weights finite: True" in out, err
    fed = line_of("per_sample = ", tmp_path / "train.py")
    assert ("opwatch: GradScaler skipped the optimizer step after optimizer step 6: the loss backward() "
            "ran on held nan before GradScaler scaled it, which no scale mends (its skips are for gradients that overflow once scaled). "
            f"cause: input: Sequential's argument 0 (f32[32, 16] cpu) held nan when it entered the model at train.py:{fed} (call 1 of the 2 "
            "the model ran since the last optimizer step), so no op of the model made it: it came in with the batch") in err
    assert ("opwatch: no op was named in the fully watched steps, but GradScaler skipped 1 optimizer step on a loss that was not finite "
            "before it was scaled (see the guard's line below).") in err
    assert ("opwatch guard: 29 optimizer steps ran, 1 audited under a full watch, 0 failed; GradScaler skipped 1 more (the loss was not "
            "finite before it was scaled).") in err
    assert "no anomalies" not in err and "overflows" not in err


def test_a_batch_whose_every_sample_is_masked_out_is_told_with_the_command_that_names_its_op(tmp_path, capsys, monkeypatch):
    """Every sample of one batch dropped: the mean over none is 0/0, nan in the loss and in
    every gradient; the batch itself was finite."""
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, fp16(bad=9, batch="keep.zero_()"))
    assert status == 0 and "weights finite: True" in out, err
    assert ("opwatch: GradScaler skipped the optimizer step after optimizer step 9: the loss backward() ran on held nan before GradScaler "
            "scaled it, which no scale mends (its skips are for gradients that overflow once scaled); the batch was finite when it entered "
            "the model, so an op of the step made it; to name the op that made it, run the step where it fails under a full watch: "
            "python -m opwatch train.py (with the same seeds and data order)") in err
    assert "GradScaler skipped 1 more (the loss was not finite before it was scaled)." in err
    from opwatch.runners.cli import main  # noqa: PLC0415

    assert main(["train.py"]) == 0  # the command it names
    assert "nan in aten.div.Tensor at train.py:" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [-1, 3], ids=["healthy", "bad batch in the audit"])
def test_overflows_while_the_scale_finds_its_level_stay_overflows(tmp_path, capsys, monkeypatch, bad):
    """A first scale of 2**40 overflows the float16 gradients of the first 22 steps, which
    GradScaler skips while its scale falls: overflows, no warning. A corrupt sample among them
    runs under the first audit, whose watch names it; the summary counts it apart."""
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, fp16(bad=bad, batch='x[7, 3] = float("nan")', init_scale="2.0 ** 40"))
    assert status == 0 and "weights finite: True" in out, err
    assert "before GradScaler scaled it" not in err
    if bad < 0:
        assert "opwatch: no anomalies." in err
        assert "opwatch guard: 8 optimizer steps ran, 1 audited under a full watch, 0 failed; GradScaler skipped 22 more (overflows of its scaled gradients)." in err
        return
    assert "nan in aten.lift_fresh.default at train.py:" in err  # the audit's watch: the program wrote it
    assert ("GradScaler skipped 22 more (21 overflows of its scaled gradients, 1 on a loss not finite before it was scaled).") in err


def test_lightning_16_mixed_tells_a_corrupt_sample_s_skip_and_its_metric_counts_it(tmp_path):
    """Lightning's guard mode under ``precision="16-mixed"`` with a GradScaler (Lightning makes
    one on a GPU; here the CPU's, given to its plugin): a corrupt sample in one batch."""
    from torch.utils.data import DataLoader, TensorDataset

    lightning = needs("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from opwatch.runners.lightning import OpwatchCallback

    class Classifier(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))

        def training_step(self, batch, index):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    x, y = torch.randn(320, 16), torch.randint(0, 4, (320,))
    x[6 * 32 + 7, 3] = float("nan")  # one corrupt sample, in batch 6
    callback = OpwatchCallback(mode="guard", file=io.StringIO())
    trainer = lightning.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                                plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    model = Classifier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=32))
    told = [str(warning.message) for warning in caught if "GradScaler skipped" in str(warning.message)]
    assert len(told) == 1 and "the loss backward() ran on held nan before GradScaler scaled it" in told[0], told
    assert "cause: input: Sequential's argument 0 (f32[32, 16] cpu) held nan when it entered the model" in told[0]
    ledger = callback.runner.ledger
    assert (ledger.steps, ledger.failed, ledger.scaler_skipped, ledger.scaler_skipped_loss) == (9, 0, 1, 1)
    assert trainer.callback_metrics["opwatch/scaler_skipped_loss"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
