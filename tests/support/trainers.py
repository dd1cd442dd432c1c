"""Real trainer runs for the callbacks' tests: a Lightning fit and a Hugging Face
``Trainer.train()`` of a linear regression whose loss (``broadcast_loss``) broadcasts a ``(4,)``
target against a ``(4, 1)`` prediction, or with a loss passed in; each a few steps."""

from __future__ import annotations

import pytest
import torch

from . import needs

STEPS = 3


def regression_data(count=4 * STEPS):
    torch.manual_seed(0)
    x = torch.randn(count, 2)
    return x, x @ torch.tensor([1.0, 2.0]) + 3.0


def broadcast_loss(pred, target):
    return ((target - pred) ** 2).mean()  # (4,) - (4, 1): a (4, 4) loss


def matched_loss(pred, target):
    return ((target - pred.squeeze(-1)) ** 2).mean()  # (4,) - (4,): the fix


def lightning_module(loss=broadcast_loss, eval_loss=None):
    """The regression as a ``LightningModule``; with ``eval_loss``, its ``validation_step``,
    ``test_step`` and ``predict_step`` (which returns the loss) compute it."""
    lightning = needs("lightning")

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            x, target = batch
            return loss(self.layer(x), target)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    if eval_loss is not None:

        def evaluation_step(self, batch, batch_idx):
            x, target = batch
            return eval_loss(self.layer(x), target)

        Regression.validation_step = Regression.test_step = Regression.predict_step = evaluation_step
    return Regression()


def lightning_trainer(tmp_path, callback, steps=STEPS, *, logger=None, log_every_n_steps=1, **options):
    """A ``lightning.Trainer`` on the CPU for ``steps`` batches, logging every
    ``log_every_n_steps`` to ``logger`` (a ``CSVLogger`` in ``tmp_path`` by default)."""
    lightning = needs("lightning")
    from lightning.pytorch.loggers import CSVLogger

    return lightning.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=logger if logger is not None else CSVLogger(tmp_path),
        default_root_dir=tmp_path,
        log_every_n_steps=log_every_n_steps,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def regression_loader(count=4 * STEPS):
    """The regression's data in batches of 4."""
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(*regression_data(count)), batch_size=4)


def lightning_fit(tmp_path, callback, steps=STEPS, *, loss=broadcast_loss, logger=None, log_every_n_steps=1):
    """``lightning.Trainer.fit`` for ``steps`` batches of 4, logging every ``log_every_n_steps``
    to ``logger`` (a ``CSVLogger`` in ``tmp_path`` by default)."""
    trainer = lightning_trainer(tmp_path, callback, steps, logger=logger, log_every_n_steps=log_every_n_steps)
    trainer.fit(lightning_module(loss), regression_loader())
    return trainer


class _Regression(torch.nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.loss = loss

    def forward(self, x, labels=None):
        pred = self.layer(x)
        return {"loss": self.loss(pred, labels), "logits": pred}


def transformers_train(tmp_path, callback, steps=STEPS, *, model=None, dataset=None, batch_size=4, report_to=(), loss=broadcast_loss):
    """``transformers.Trainer.train`` for ``steps`` steps (of the regression, or of ``model``
    on ``dataset``), logging every step, inside ``with callback:``; ``report_to`` names the
    integrations (TensorBoard's log goes under ``tmp_path / "runs"``)."""
    transformers = needs("transformers")
    needs("accelerate")

    if model is None:
        x, y = regression_data()
        model, dataset = _Regression(loss), [{"x": a, "labels": b} for a, b in zip(x, y)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=0.01,
        optim="adamw_torch_fused",
        logging_steps=1,
        save_strategy="no",
        report_to=list(report_to),
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])
    with callback:
        trainer.train()
    return trainer
