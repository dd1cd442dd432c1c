"""Writes ``log_v4_rules.jsonl`` and ``goldens/load_v4_rules.txt``: one watch whose findings span
most rules (broadcast, device, dtype, accumulation, nan/inf with causes, fp16 headroom), saved by opwatch at format version 4 (commit 2c970a1, before the typed facts).

Kept to show how the fixture was made; run from ``tests/scenarios`` (so paths in the log are
short) as ``python ../unit/data/make_log_v4_rules.py``; the script's own path is renamed
``train.py`` in the log. Its output is committed: rerunning it
with a newer opwatch would write a newer log, not the old one the test must keep reading.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

import opwatch

HERE = pathlib.Path(__file__).resolve().parent


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 1)
        self.scale = torch.ones(1) * 0.5  # a plain tensor attribute

    def forward(self, x):
        probability = torch.sigmoid(self.score(x)).squeeze(-1) * (x[:, 0] > -10)
        return probability.log()  # log of a probability that can be 0


class Growing(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8).half()
        with torch.no_grad():
            self.up.weight.fill_(50.0)

    def forward(self, x):
        return self.up(x)  # activations near the float16 limit


def run():
    torch.manual_seed(0)
    model = Scorer()
    x = torch.randn(6, 4)
    x[2, 0] = -20.0  # this row's probability is masked to 0
    y = torch.randn(6, 1)
    with opwatch.watch(warn=False) as w:
        loss = -model(x).mean()  # -inf: log(0)
        loss.backward()
        pred = model.score(x)
        ((pred.squeeze(-1) - y) ** 2).mean()  # a broadcast
        noise = torch.zeros(6, 1, dtype=torch.float64)
        pred + noise  # a silent upcast to float64, made by a factory
        F.mse_loss(pred, y.double())  # a loss target of another dtype
        counts = torch.zeros(4, dtype=torch.float16)
        counts.add_(torch.ones(4))  # a float32 sum written into float16
        try:
            counts.index_add_(0, torch.tensor([0, 1]), torch.ones(2))  # a wider source
        except RuntimeError:
            pass
        Growing()(torch.rand(2, 8, dtype=torch.float16) * 40)  # near the float16 limit
        meta = nn.Linear(4, 4).to("meta")
        try:
            meta(torch.randn(2, 4, device="meta")) * torch.ones(4)  # a CPU tensor meets meta
        except RuntimeError:
            pass
        (torch.zeros(3) / torch.zeros(3)).sum()  # 0 / 0
    return w


def main():
    w = run()
    log = HERE / "log_v4_rules.jsonl"
    w.export_jsonl(log)
    log.write_text(log.read_text().replace(str(pathlib.Path(__file__)), "train.py").replace(__file__, "train.py"))
    saved = opwatch.load(log)
    text = saved.table(last=None) + "\n\n" + saved.summary() + "\n\n" + "\n\n".join(str(a) for a in saved.anomalies) + "\n"
    (HERE.parent.parent / "goldens" / "load_v4_rules.txt").write_text(text)
    print(sorted({a.finding.rule for a in saved.anomalies}), file=sys.stderr)


if __name__ == "__main__":
    main()
