"""What leaving opwatch on costs, in the runners people use (issue 18, item 5).

    python -m bench.leave_on            # 600-step script, 5 interleaved repeats each; trainers 1000 steps
    python -m bench.leave_on --quick    # 600-step script, 3 repeats; trainers 300 steps
    python -m bench.leave_on --only cli --only cli_batchnorm --only lightning --only hf

Every figure is CPU time (user + system, the process's or the child's), and every ratio is
taken within this one run, the contenders interleaved (A B A B ...), so that a noisy machine
shifts both alike:

- cli: ``python -m opwatch --guard train.py`` against ``python train.py`` on a 600-step
  training script (an MLP, Adam, a ``loss.item()`` every 50 steps), start-up included: each
  run is a fresh process (``OMP_NUM_THREADS=1``), timed by ``RUSAGE_CHILDREN``.
- cli_batchnorm: the same on a small conv net with two BatchNorms, whose running statistics
  leave-on keeps after each optimizer step (to put them back at a skipped step).
- lightning: ``Trainer.fit`` with ``OpwatchCallback(mode="guard")`` against the same fit with
  no callback (in this process, both warmed up by a 5-step fit first: imports are not timed).
  The guarded fit audits its first batch (one fully watched step, a few eager steps' worth):
  enough steps that it is amortised as in a real run (300 with ``--quick``, 1000 without).
- hf: ``transformers.Trainer.train`` with ``OpwatchCallback(mode="guard")`` against the same
  train with no callback (in this process).

Targets (issue 18): cli <= 1.10x, lightning <= 1.10x, hf <= 1.10x.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 1.10

SCRIPT = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 64), torch.randn(64, 1)
for step in range({steps}):
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    if step % 50 == 0:
        loss.item()
"""


# A small conv net with BatchNorm: each step's forward writes its running statistics, which
# leave-on keeps after every optimizer step (one _foreach_copy_) to put them back at a skip.
SCRIPT_BATCHNORM = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                      nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
for step in range({steps}):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if step % 50 == 0:
        loss.item()
"""


def child_cpu(command: list[str], cwd: str) -> float:
    """CPU seconds (user + system) of one run of ``command`` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # One intra-op thread: idle OpenMP workers spin, and their spinning would count as CPU time.
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def interleaved(runs: dict, repeats: int) -> dict:
    """``{name: [seconds, ...]}``: each run of ``runs`` once per round, in turn."""
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run())
    return times


def ratio_line(what: str, times: dict, base: str, other: str) -> str:
    # The median of per-round ratios, as bench.timing.paired_ratio takes them: each round's two
    # runs ran side by side, so a machine that speeds up or slows down over the rounds (warm-up,
    # other jobs) shifts both alike.
    pairs = [b / a for a, b in zip(times[base], times[other])]
    ratio = statistics.median(pairs)
    verdict = "PASS" if ratio <= TARGET else "FAIL"
    return (
        f"  {verdict}  {what}: median {statistics.median(times[other]):.3f}s / {statistics.median(times[base]):.3f}s CPU, "
        f"paired {ratio:.3f}x (per-round ratios {', '.join(f'{p:.3f}' for p in pairs)}; target <= {TARGET}x)"
    )


def bench_cli(steps: int, repeats: int, template: str = SCRIPT, what: str = "") -> str:
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "train.py"), "w") as script:
            script.write(template.format(steps=steps))
        python = [sys.executable]
        runs = {
            "python": lambda: child_cpu(python + ["train.py"], folder),
            "opwatch --guard": lambda: child_cpu(python + ["-m", "opwatch", "--guard", "train.py"], folder),
        }
        child_cpu(python + ["train.py"], folder)  # warm the file cache
        times = interleaved(runs, repeats)
    return ratio_line(f"python -m opwatch --guard vs python, {steps}-step {what}script, start-up included", times, "python", "opwatch --guard")


def _cpu(run) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def lightning_fit(steps: int, callback):
    import lightning
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64 * steps, 64), torch.randn(64 * steps, 1))
    trainer = lightning.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, callbacks=[callback] if callback else [], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tempfile.gettempdir(),
    )
    trainer.fit(Model(), DataLoader(data, batch_size=64))


def bench_lightning(steps: int, repeats: int) -> str:
    from opwatch.runners.lightning import OpwatchCallback

    lightning_fit(5, None)  # imports and first-call costs out of the timings, both sides
    lightning_fit(5, OpwatchCallback(mode="guard", log=False, file=open(os.devnull, "w")))
    runs = {
        "fit": lambda: _cpu(lambda: lightning_fit(steps, None)),
        "fit guard": lambda: _cpu(lambda: lightning_fit(steps, OpwatchCallback(mode="guard", log=False, file=open(os.devnull, "w")))),
    }
    times = interleaved(runs, repeats)
    return ratio_line(f"Lightning fit, OpwatchCallback(mode='guard') vs none, {steps} steps", times, "fit", "fit guard")


def hf_train(steps: int, callback, folder: str):
    import torch
    import transformers

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))

        def forward(self, x, labels=None):
            pred = self.net(x)
            return {"loss": ((pred - labels) ** 2).mean(), "logits": pred}

    torch.manual_seed(0)
    x, y = torch.randn(64 * steps, 64), torch.randn(64 * steps, 1)
    args = transformers.TrainingArguments(
        output_dir=folder, max_steps=steps, per_device_train_batch_size=64, learning_rate=1e-3, logging_steps=10**9,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )
    data = [{"x": a, "labels": b} for a, b in zip(x, y)]
    transformers.Trainer(model=Model(), args=args, train_dataset=data, callbacks=[callback] if callback else []).train()


def bench_hf(steps: int, repeats: int) -> str:
    import transformers

    from opwatch.runners.transformers import OpwatchCallback

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as folder:
        hf_train(5, None, folder)  # imports and first-call costs out of the timings, both sides
        hf_train(5, OpwatchCallback(mode="guard", file=open(os.devnull, "w")), folder)
        runs = {
            "train": lambda: _cpu(lambda: hf_train(steps, None, folder)),
            "train guard": lambda: _cpu(lambda: hf_train(steps, OpwatchCallback(mode="guard", file=open(os.devnull, "w")), folder)),
        }
        times = interleaved(runs, repeats)
    return ratio_line(f"Hugging Face train, OpwatchCallback(mode='guard') vs none, {steps} steps", times, "train", "train guard")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.leave_on", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and trainer steps")
    parser.add_argument("--only", action="append", choices=("cli", "cli_batchnorm", "lightning", "hf"), help="run only these (repeatable)")
    options = parser.parse_args(argv)
    which = options.only or ["cli", "cli_batchnorm", "lightning", "hf"]
    repeats = 3 if options.quick else 5
    trainer_steps = 300 if options.quick else 1000
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)
    print(f"leave-on bench: torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"{repeats} interleaved repeats, CPU time, torch threads 1 in-process", flush=True)
    benches = {"cli": lambda: bench_cli(600, repeats), "cli_batchnorm": lambda: bench_cli(600, repeats, SCRIPT_BATCHNORM, "BatchNorm conv net "),
               "lightning": lambda: bench_lightning(trainer_steps, repeats), "hf": lambda: bench_hf(trainer_steps, repeats)}
    for name in which:
        try:
            print(benches[name](), flush=True)
        except ImportError as error:
            print(f"  skipped {name}: {error}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
