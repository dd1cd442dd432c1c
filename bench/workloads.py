"""Benchmark workloads.

Each workload is a *factory*: calling it builds a model, an optimizer and fixed
inputs, and returns a zero-argument ``step()`` callable that runs one full
training step (zero_grad, forward, loss, backward, optimizer step).  Building
happens outside any contender, so only the steps themselves are measured.

All workloads are CPU-only (``transformer_parts`` takes a device), deterministic (fixed seeds) and need no network:
the GPT-2 model is built from a tiny ``GPT2Config`` with random weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

Step = Callable[[], None]


@dataclass(frozen=True)
class Workload:
    """A named step factory plus a one-line description for the report."""

    name: str
    description: str
    factory: Callable[[], Step]


def _training_step(model: nn.Module, loss_fn: Callable[[], torch.Tensor],
                   lr: float = 1e-3) -> Step:
    """Wrap a model and a loss closure into a plain SGD training step.

    SGD (no momentum) keeps the optimizer's share of the op count small and
    the parameters from drifting far from their initial values, so every step
    does the same work however many steps a benchmark runs.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()

    return step


def transformer_step(d_model: int = 32, nhead: int = 4, dim_feedforward: int | None = None,
                     batch: int = 8, seq: int = 16, num_layers: int = 2) -> Step:
    """A 2-layer ``nn.TransformerEncoder`` regression step.

    Dropout is off: the step is then deterministic, and at d_model 32 it is
    about 300 ATen ops (forward, backward and SGD update), the size of step
    the overhead targets are stated for.
    """
    model, x, target = _encoder(d_model, nhead, dim_feedforward, batch, seq, num_layers)
    return _training_step(model, lambda: nn.functional.mse_loss(model(x), target))


def _encoder(d_model: int, nhead: int, dim_feedforward: int | None, batch: int, seq: int,
             num_layers: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The seeded encoder (dropout off, training mode), its input and its target, on the CPU."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=d_model, nhead=nhead,
        dim_feedforward=dim_feedforward or 2 * d_model,
        dropout=0.0, batch_first=True,
    )
    model = nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False)
    model.train()
    x = torch.randn(batch, seq, d_model)
    target = torch.randn(batch, seq, d_model)
    return model, x, target


@dataclass
class TrainParts:
    """A training step taken apart, for benches that wrap its pieces (``bench.gpu``): the model,
    its SGD optimizer, and ``loss(module)``, the loss of the fixed batch through ``module`` (the
    model itself, or a ``torch.compile`` of it)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[nn.Module], torch.Tensor]


def transformer_parts(d_model: int = 32, nhead: int = 4, dim_feedforward: int | None = None,
                      batch: int = 8, seq: int = 16, num_layers: int = 2, device: str = "cpu",
                      autocast: torch.dtype | None = None, lr: float = 1e-3) -> TrainParts:
    """:func:`transformer_step`'s model and batch (the same seeded values) on ``device``; with
    ``autocast`` (e.g. ``torch.bfloat16``) the forward runs under ``torch.autocast`` and the loss
    is taken in float32, as mixed-precision training does."""
    model, x, target = _encoder(d_model, nhead, dim_feedforward, batch, seq, num_layers)
    model.to(device)
    x, target = x.to(device), target.to(device)
    device_type = torch.device(device).type

    def loss(module: nn.Module) -> torch.Tensor:
        if autocast is None:
            out = module(x)
        else:
            with torch.autocast(device_type=device_type, dtype=autocast):
                out = module(x)
        parts.last_grad_fn = type(out.grad_fn).__name__
        return nn.functional.mse_loss(out.float(), target)

    parts = TrainParts(model, torch.optim.SGD(model.parameters(), lr=lr), loss)
    return parts


def transformer32_step() -> Step:
    """The headline workload: d_model 32, small activations, op-overhead bound."""
    return transformer_step(d_model=32, nhead=4, batch=8, seq=16)


def transformer256_step() -> Step:
    """Same encoder at d_model 256: large tensors, so per-element costs show."""
    return transformer_step(d_model=256, nhead=8, dim_feedforward=1024, batch=8, seq=32)


def mlp_step(width: int = 256, depth: int = 3, batch: int = 64, n_in: int = 128,
             n_classes: int = 10) -> Step:
    """A plain ReLU MLP classifier step."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    n = n_in
    for _ in range(depth):
        layers += [nn.Linear(n, width), nn.ReLU()]
        n = width
    layers.append(nn.Linear(n, n_classes))
    model = nn.Sequential(*layers)
    x = torch.randn(batch, n_in)
    y = torch.randint(0, n_classes, (batch,))
    return _training_step(model, lambda: nn.functional.cross_entropy(model(x), y))


def conv_step(batch: int = 16) -> Step:
    """A small conv net (conv-bn-relu-pool x2, linear head) on 3x32x32 images."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    return _training_step(model, lambda: nn.functional.cross_entropy(model(x), y))


def gpt2_step(batch: int = 4, seq: int = 32) -> Step:
    """A tiny Hugging Face GPT-2 language-model step (random weights, no download)."""
    # Belt and braces: nothing here should touch the network, but make sure.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return _training_step(model, lambda: model(input_ids=ids, labels=ids).loss)


def tiny_step() -> Step:
    """A very small step (a few dozen ops) for the long-running memory loops."""
    return mlp_step(width=16, depth=1, batch=4, n_in=8, n_classes=4)


WORKLOADS: dict[str, Workload] = {
    w.name: w for w in [
        Workload("tfm32", "2-layer TransformerEncoder, d_model 32, B8 S16", transformer32_step),
        Workload("tfm256", "2-layer TransformerEncoder, d_model 256, B8 S32", transformer256_step),
        Workload("mlp", "MLP 128-256-256-256-10, batch 64", mlp_step),
        Workload("conv", "conv-bn-relu-pool x2 + linear, 16x3x32x32", conv_step),
        Workload("gpt2", "HF GPT-2 tiny (2 layers, n_embd 32), B4 S32", gpt2_step),
    ]
}


def add_paired_options(parser, *, workloads: str, target_seconds: float) -> None:
    """The options of a harness that times contenders side by side on several workloads:
    ``--workloads`` (comma-separated names), ``--rounds`` and ``--target-seconds``."""
    parser.add_argument("--workloads", default=workloads, help="comma-separated workload names")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per workload (default 15)")
    parser.add_argument("--target-seconds", type=float, default=target_seconds, help=f"seconds per timed block (default {target_seconds})")


def chosen_workloads(parser, names: str) -> list[str]:
    """The workload names of ``--workloads``; an unknown one ends the run with the known ones."""
    chosen = names.split(",")
    unknown = [name for name in chosen if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    return chosen
