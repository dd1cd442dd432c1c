"""Lightning's guard mode across ranks, for tests/runners/test_leave_on_distributed.py:
``OpwatchCallback(mode="guard")`` on a 2-rank DDP fit on the CPU (gloo), run as

    torchrun --standalone --nproc-per-node 2 dist_lightning_guard.py

Batch 3 makes nan on rank 1 only (DDP's all-reduce carries it into every rank's gradients).
Every rank replays the batch together; the origin is exchanged, so rank 0's warning names
rank 1's op and line (its own replay made nothing).
"""

import sys
from datetime import timedelta

import lightning
import torch

from opwatch.runners.lightning import OpwatchCallback


class Model(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        shift = 100.0 if self.global_rank == 1 and batch_idx == 2 else 0.0
        return (self.net(x) + 5 - shift).sqrt().mean()  # nan on rank 1, batch 3

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out_dir):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    callback = OpwatchCallback(mode="guard", on_failure=sys.argv[2] if len(sys.argv) > 2 else "skip")
    strategy = lightning.pytorch.strategies.DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=30))
    trainer = lightning.Trainer(max_steps=5, accelerator="cpu", devices=2, strategy=strategy, callbacks=[callback], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), loader)
    runner = callback.runner
    print(f"rank {trainer.global_rank}: steps {runner.steps} failed {runner.failed} skipped {runner.skipped}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
