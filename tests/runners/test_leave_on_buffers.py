"""A skipped step leaves the model as a run that never saw its batch: the weights, and the
buffers its forward wrote. A batch that holds nan fails its step and leave-on skips the update,
but BatchNorm's forward had already written its running mean and variance from that batch: nan.
Training went on finite (BatchNorm normalizes a training batch with its own statistics), the
summary said the weights were as they were, and the model in ``eval()`` returned nan everywhere.
The buffers a step writes are kept after each optimizer step and put back when a step does not
run (``opwatch.runners.written_buffers``)."""

from __future__ import annotations

import pytest

from support.helpers import guard_in_process

CONVNET = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                      nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(10):
    x, y = torch.randn(8, 3, 12, 12), torch.randint(0, 10, (8,))
    if step == BAD:
        if SKIP: continue  # the run that never saw the batch
        x[2, 1, 4, 4] = float("nan")  # a corrupt pixel
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.save(model.state_dict(), "model.pt")
model.eval()
print("eval finite:", bool(model(torch.randn(4, 3, 12, 12)).isfinite().all()))
"""


def convnet(bad: int, skip: bool) -> str:
    return CONVNET.replace("BAD", str(bad)).replace("SKIP", str(skip))


def _run(tmp_path, capsys, script, *options):
    import torch

    status, out, err = guard_in_process(tmp_path, capsys, script, *options)
    assert status == 0, err
    return out, err, torch.load(tmp_path / "model.pt")


@pytest.mark.parametrize("bad", [6, 0])
def test_a_skipped_bad_batch_leaves_batchnorm_as_a_run_that_never_saw_it(tmp_path, capsys, monkeypatch, bad):
    """At step 7, and at the run's first step (its buffers kept as the first forward found them)."""
    import torch

    monkeypatch.chdir(tmp_path)
    out, err, guarded = _run(tmp_path, capsys, convnet(bad, skip=False))
    assert f"optimizer step {bad + 1}: the gradients about to be applied hold nan/inf" in err
    assert "eval finite: True" in out
    _, _, never_saw = _run(tmp_path, capsys, convnet(bad, skip=True))
    assert guarded.keys() == never_saw.keys() and any("running_mean" in name for name in guarded)
    for name, value in guarded.items():
        assert torch.equal(value, never_saw[name]), name


def test_a_healthy_run_s_weights_and_buffers_are_the_plain_run_s(tmp_path, capsys, monkeypatch):
    import runpy

    import torch

    monkeypatch.chdir(tmp_path)
    _, err, guarded = _run(tmp_path, capsys, convnet(-1, skip=False))
    assert "0 failed" in err
    runpy.run_path(str(tmp_path / "train.py"), run_name="__main__")  # the same script, without opwatch
    plain = torch.load(tmp_path / "model.pt")
    for name, value in guarded.items():
        assert torch.equal(value, plain[name]), name


MOCO = """
import copy
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
class MoCo(nn.Module):
    def __init__(self, dim=16, size=256, momentum=0.99, temperature=0.1):
        super().__init__()
        self.size, self.momentum, self.temperature = size, momentum, temperature
        self.encoder_q = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, dim))
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for parameter in self.encoder_k.parameters():
            parameter.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, size), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))
    def forward(self, a, b):
        q = F.normalize(self.encoder_q(a), dim=1)
        with torch.no_grad():
            for p_q, p_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
                p_k.mul_(self.momentum).add_(p_q.detach(), alpha=1 - self.momentum)
            k = F.normalize(self.encoder_k(b), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone()], dim=1) / self.temperature
        with torch.no_grad():  # the keys go into the queue of negatives
            ptr = int(self.queue_ptr)
            self.queue[:, ptr:ptr + len(k)] = k.T
            self.queue_ptr[0] = (ptr + len(k)) % self.size
        return F.cross_entropy(logits, torch.zeros(len(a), dtype=torch.long))
model = MoCo()
optimizer = torch.optim.SGD(model.encoder_q.parameters(), lr=0.03, momentum=0.9)
for step in range(30):
    x = torch.randn(32, 32)
    a, b = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
    if step == BAD: b[5, 3] = float("nan")  # a corrupt view
    loss = model(a, b)
    optimizer.zero_grad(); loss.backward(); optimizer.step()
print("loss finite:", bool(loss.isfinite()), "queue finite:", bool(model.queue.isfinite().all()))
"""


@pytest.mark.parametrize("bad", [10, -1])
def test_moco_s_queue_of_negatives_is_put_back_with_its_skipped_step(tmp_path, capsys, monkeypatch, bad):
    """MoCo writes each batch's keys into a queue buffer by index assignment, and its key
    encoder's BatchNorm statistics: one corrupt view put nan into both, and the next 8 steps'
    losses read the nan keys until the queue came round (9 failed steps, each skipped). Its
    writes are put back with the skipped step now: 1 failed. Healthy, none."""
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, MOCO.replace("BAD", str(bad)))
    assert status == 0, err
    assert "loss finite: True queue finite: True" in out
    assert ("1 failed (the batch held nan/inf), 1 of them skipped" if bad >= 0 else "0 failed") in err


def test_lightning_s_guard_mode_puts_the_batchnorm_statistics_back(tmp_path):
    import torch
    from torch import nn

    from support import needs

    lightning = needs("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from opwatch.runners.lightning import OpwatchCallback

    class Net(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).squeeze(1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    x, y = torch.randn(160, 8), torch.randn(160)
    x[16 * 4 + 3, 2] = float("nan")  # batch 4
    model, callback = Net(), OpwatchCallback(mode="guard", warn=False)
    trainer = lightning.Trainer(max_epochs=1, accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=[callback],
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    assert (callback.runner.steps, callback.runner.failed, callback.runner.skipped) == (10, 1, 1)
    batchnorm = model.net[1]
    assert batchnorm.running_mean.isfinite().all() and batchnorm.running_var.isfinite().all()
    assert int(batchnorm.num_batches_tracked) == 9  # the skipped batch's count taken back too
