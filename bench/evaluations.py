"""What leave-on's check of evaluation calls costs an evaluation pass.

    python -m bench.evaluations            # 15 rounds
    python -m bench.evaluations --quick    # 5 rounds

Leave-on (``python -m opwatch --guard``, the trainers' guard mode) hooks the model's forward and,
for each call with gradients off, keeps the (min, max) of every floating tensor the call
returned and of every floating argument, on the device (``opwatch.runners.evaluations``); the
next optimizer step's check reads them all at once. This times one evaluation pass (``batches``
calls under ``torch.no_grad()``, then the read) with the hook against the same pass without it,
in one process, one thread, the two interleaved round by round (A B, B A, ...); the figure is
the median of the per-round ratios, CPU time. Workloads: the tiny Hugging Face GPT-2 of
``bench.run`` (logits of a 1000-word vocabulary: the largest output per input of the three), the
``bench.run`` MLP classifier on a float batch, and the conv net on images.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from opwatch.runners.evaluations import EvaluationCalls


def _gpt2(batch=4, seq=32):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, lambda: model(input_ids=ids, labels=ids)


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).eval()
    x = torch.randn(64, 128)
    return model, lambda: model(x)


def _conv():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(32 * 8 * 8, 10)).eval()
    x = torch.randn(16, 3, 32, 32)
    return model, lambda: model(x)


WORKLOADS = {"gpt2": _gpt2, "mlp": _mlp, "conv": _conv}


def _pass(call, batches: int, calls: EvaluationCalls | None) -> float:
    start = time.process_time()
    with torch.no_grad():
        for _ in range(batches):
            call()
    if calls is not None:
        assert calls.read() == []  # the read the next optimizer step's check makes
    return time.process_time() - start


def bench(name: str, rounds: int, batches: int) -> str:
    model, call = WORKLOADS[name]()
    calls = EvaluationCalls(lambda: False, lambda: 0, lambda: None)
    plain, checked = [], []
    _pass(call, batches, None)  # warm up
    for round_ in range(rounds):
        order = ((plain, None), (checked, calls)) if round_ % 2 == 0 else ((checked, calls), (plain, None))
        for times, kept in order:
            if kept is not None:
                kept.watch(model)
            times.append(_pass(call, batches, kept))
            if kept is not None:
                kept.unwatch()
    ratios = [b / a for a, b in zip(plain, checked)]
    return (f"  {name:5s} evaluation pass of {batches} calls: median {statistics.median(checked) * 1e3 / batches:.3f} ms/call checked, "
            f"{statistics.median(plain) * 1e3 / batches:.3f} ms/call plain: paired {statistics.median(ratios):.3f}x "
            f"(per-round ratios {min(ratios):.3f}..{max(ratios):.3f})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.evaluations", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 15")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 5 if options.quick else 15
    print(f"leave-on's check of evaluation calls, {rounds} interleaved rounds, CPU time, one thread:")
    for name in WORKLOADS:
        print(bench(name, rounds, batches=50), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
