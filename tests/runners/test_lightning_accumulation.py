"""Lightning's guard mode with gradient accumulation (``accumulate_grad_batches``): the audit of
the first batch goes on through the batches Lightning accumulates, to the optimizer step that
applies them, as its docstring says, as the command line's and the Hugging Face Trainer's do. It
ended with the first batch: "4 optimizer steps ran, 0 audited", and no watch saw an optimizer
step, the clip, or the batches after the first."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from support import needs
from support.helpers import line_of


class PlainAdam(torch.optim.Optimizer):
    """Adam as a paper writes it, without the epsilon: a parameter whose gradient is 0 (an
    embedding row no token of the batches used) gets 0 / 0 = nan."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                state = self.state[parameter]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(parameter), torch.zeros_like(parameter)
                m, v = state["m"], state["v"]
                m.mul_(beta1).add_(parameter.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(parameter.grad, parameter.grad, value=1 - beta2)
                parameter.sub_(group["lr"] * m / v.sqrt())  # the plain Adam update
        return loss


def fit_tagger(tmp_path, optimizer):
    """A token tagger (an embedding of 100 rows, of which the data uses 50) fitted one epoch of
    8 batches, 2 accumulated per optimizer step, under guard mode: the callback."""
    lightning = needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    class Tagger(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(100, 16)
            self.out = nn.Linear(16, 4)

        def training_step(self, batch, index):
            tokens, tags = batch
            return nn.functional.cross_entropy(self.out(self.embedding(tokens)).flatten(0, 1), tags.flatten())

        def configure_optimizers(self):
            return optimizer(self.parameters())

    torch.manual_seed(0)
    tokens, tags = torch.randint(0, 50, (128, 12)), torch.randint(0, 4, (128, 12))
    callback = OpwatchCallback(mode="guard", file=io.StringIO())
    trainer = lightning.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], accumulate_grad_batches=2)
    model = Tagger()
    trainer.fit(model, DataLoader(TensorDataset(tokens, tags), batch_size=16))
    return callback, model


def test_the_audit_watches_the_first_optimizer_step_after_its_accumulated_batches(tmp_path):
    callback, _ = fit_tagger(tmp_path, PlainAdam)
    (anomaly,) = callback.anomalies
    assert (anomaly.kind, anomaly.op, anomaly.lineno) == ("nan", "aten.div.Tensor", line_of("# the plain Adam update", __file__))
    assert "0 / 0 = nan" in anomaly.message
    assert callback.runner.ledger.counts() == {"steps": 4, "audited": 1, "failed": 0, "skipped": 0}


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.SGD], ids=["Adam", "SGD"])
def test_a_healthy_accumulated_run_is_silent_with_its_first_step_audited(tmp_path, optimizer):
    callback, model = fit_tagger(tmp_path, lambda parameters: optimizer(parameters, lr=1e-3))
    assert callback.anomalies == []
    assert callback.runner.ledger.counts() == {"steps": 4, "audited": 1, "failed": 0, "skipped": 0}
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_a_one_off_bad_label_s_summary_names_the_watch_mode_that_names_it(tmp_path):
    """One label of one accumulated batch is nan: the step fails and is skipped, the re-check of
    the next step passes, and Lightning runs no accumulated batch again. The summary says what
    names it: watch mode, which does (the label is data: mse_loss is given the nan)."""
    lightning = needs("lightning")
    from opwatch.runners.lightning import OpwatchCallback

    class Regressor(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

        def training_step(self, batch, index):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).squeeze(-1), y)  # the regression loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    def fit(callback):
        torch.manual_seed(0)
        x = torch.randn(16 * 24, 8)
        y = x.sum(-1)
        y[16 * 9 + 3] = float("nan")  # batch 9: the second of optimizer step 5's four
        trainer = lightning.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], accumulate_grad_batches=4)
        trainer.fit(Regressor(), DataLoader(TensorDataset(x, y), batch_size=16))
        return callback

    guarded = fit(OpwatchCallback(mode="guard", file=io.StringIO(), warn=False))
    assert guarded.runner.ledger.counts() == {"steps": 6, "audited": 2, "failed": 1, "skipped": 1}
    assert ("A batch that fails once passes the re-check of the step after it; a step that accumulates gradients, or steps its "
            "optimizers by hand, is not run again: OpwatchCallback() (mode \"watch\") names its op where that batch runs again under a "
            "full watch (with the same seeds and data order).") in guarded.runner.watch_summary()
    watched = fit(OpwatchCallback(file=io.StringIO(), warn=False))
    (anomaly,) = watched.anomalies
    assert (anomaly.kind, anomaly.op, anomaly.lineno) == ("nan", "aten.mse_loss.default", line_of("# the regression loss", __file__))
