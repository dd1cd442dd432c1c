"""Causes of nan/inf origins on bugs from real reports (issue 39), each rule with code that must
show it and a healthy twin that must not:

- a token classifier whose batch has every label ignored (``ignore_index=-100``): nll_loss's
  mean is 0 / 0, said so, with no learning-rate fix;
- data holding nan that reached torch through ``torch.from_numpy`` / ``torch.tensor(array)`` /
  a DataLoader: cause ``input``, not ``deliberate``; a nan placeholder the program writes
  (``full(nan)``, ``x[i] = nan``) stays ``deliberate``;
- a checkpoint with nan weights: found where the weight first feeds an op, cause ``weights``,
  naming the parameter and that it came from the loaded state;
- underflow chains (a float32 Sinkhorn, a mixture density network): the op where the value went
  to 0 is named, cause ``precision``; the log-domain Sinkhorn reports nothing;
- a float16 VAE decoder whose convolution overflows: cause ``precision``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import opwatch
from opwatch.checks.nonfinite.cause import DELIBERATE, INPUT, MATH, PRECISION, WEIGHTS
from opwatch.storage.jsonl import load
from support.helpers import line_of


def nonfinite(w):
    return [a for a in w.anomalies if a.kind in ("nan", "inf")]


def cause_line(anomaly) -> str:
    (line,) = [line for line in anomaly.message.splitlines() if line.startswith("  cause:")]
    return line


def fix_line(anomaly) -> str:
    (line,) = [line for line in anomaly.message.splitlines() if line.startswith("  fix:")]
    return line


# --------------------------------------------------------------------------------------------
# every target ignored: nll_loss's mean is 0 / 0
# --------------------------------------------------------------------------------------------


class Tagger(nn.Module):
    """A token classifier (NER, part of speech): embeddings, a GRU, a linear head."""

    def __init__(self, vocab=50, dim=16, tags=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, tags)

    def forward(self, tokens):
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)


def train_tagger(batches):
    torch.manual_seed(0)
    model = Tagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = opwatch.watch(warn=False, dump_on_error=False)
    with w:
        for tokens, labels in batches:
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)  # marker: tagger loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w


def tagger_batches(labelled_last: bool):
    torch.manual_seed(1)
    tokens = torch.randint(1, 50, (4, 7))
    labels = torch.randint(0, 5, (4, 7))
    labels[:, 5:] = -100  # padding
    last = torch.full((4, 7), -100)  # a batch of prompts only: every label masked out
    if labelled_last:
        last[0, 0] = 2
    return [(tokens, labels), (tokens, last)]


def test_a_batch_whose_every_label_is_ignored_says_the_mean_divided_by_zero(tmp_path):
    w = train_tagger(tagger_batches(labelled_last=False))
    first, *_ = nonfinite(w)
    assert first.op == "aten.nll_loss_forward.default" and first.kind == "nan"
    assert first.lineno == line_of("marker: tagger loss", __file__)
    cause = first.finding.facts["cause"]
    assert cause.kind == MATH and cause.detail == "all_ignored" and cause.constant == -100
    assert cause_line(first) == "  cause:    undefined math: every target was ignore_index (-100): the mean divided a sum of 0 by a count of 0, 0 / 0 = nan"
    assert "learning rate" not in fix_line(first)
    assert "skip the loss of such a batch" in fix_line(first)
    w.export_jsonl(tmp_path / "tagger.jsonl")
    (loaded, *_) = [a for a in load(tmp_path / "tagger.jsonl").anomalies if a.kind == "nan"]
    assert loaded.finding.facts["cause"] == cause and cause_line(loaded) == cause_line(first)


def test_a_batch_with_one_label_left_reports_nothing():
    w = train_tagger(tagger_batches(labelled_last=True))
    assert w.anomalies == [], [a.message for a in w.anomalies]


def test_class_weights_of_zero_for_every_target_counted_are_named():
    torch.manual_seed(0)
    logits = torch.randn(6, 4, requires_grad=True)
    target = torch.tensor([1, 1, 3, -100, 3, 1])
    weight = torch.tensor([1.0, 0.0, 2.0, 0.0])  # classes 1 and 3 switched off
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        F.cross_entropy(logits, target, weight=weight, ignore_index=-100).backward()
    first, *_ = nonfinite(w)  # the loss was not kept: its backward is where the nan reached a .grad
    assert first.op == "aten.nll_loss_backward.default"
    assert first.finding.facts["cause"].detail == "zero_weight"
    assert "of a class of weight 0" in cause_line(first) and "learning rate" not in fix_line(first)
