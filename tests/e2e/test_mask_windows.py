"""A check point whose window's only non-finite values are an attention mask's infs, absorbed by
the softmax (every Hugging Face model's step: the SDPA path adds a mask holding ``-inf``) is
judged as a window with no flag, without replaying the window's ops
(``Origins.only_absorbed_constants``). Healthy steps of a real model must report nothing and
take that way; a real origin in the same window (the likelihood computed by hand from the masked
probabilities) must still be found, at its line, by the replay."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opwatch
from opwatch.checks.nonfinite.replay import Origins
from support.helpers import line_of

transformers = pytest.importorskip("transformers")
HERE = os.path.abspath(__file__)


@pytest.fixture
def replays(monkeypatch):
    """Counts of the check points judged without a replay, and of the replays. Every window
    judged without one is replayed all the same, apart (a fresh ``Origins`` on the same log and
    sentinels): that replay must find no origin and carry nothing on."""
    counts = {"absorbed": 0, "replayed": 0}
    absorbed, replay = Origins.only_absorbed_constants, Origins.replay

    def counting_absorbed(self, window, flags):
        found = absorbed(self, window, flags)
        if found:
            apart = Origins(self._log)
            apart.sentinels = dict(self.sentinels)
            assert replay(apart, window, flags) == [] and apart.carry == {}, "a window judged without a replay held an origin"
        counts["absorbed"] += found
        return found

    def counting_replay(self, window, flags, reading=(), roots=()):
        counts["replayed"] += 1
        return replay(self, window, flags, reading, roots)

    monkeypatch.setattr(Origins, "only_absorbed_constants", counting_absorbed)
    monkeypatch.setattr(Origins, "replay", counting_replay)
    return counts


def _gpt2():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=200, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def test_healthy_gpt2_steps_with_padding_report_nothing_and_replay_no_window(replays):
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 200, (4, 16))
    attention_mask = torch.ones(4, 16, dtype=torch.long)
    attention_mask[1, 10:] = 0  # a padded sequence
    losses = []
    with opwatch.watch(warn=False) as w:
        for _ in range(3):
            loss = model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # a host read: a check point each step
    assert w.anomalies == [] and w.contained == []
    assert replays["absorbed"] >= 3 and replays["replayed"] == 0, replays


class MaskedSelfAttention(nn.Module):
    """nanoGPT's causal self-attention, the mask written with masked_fill(-inf)."""

    def __init__(self, dim=16, heads=2, seq=8):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads
        self.register_buffer("causal", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def probabilities(self, x):
        batch, seq, dim = x.shape
        q, k, _ = self.qkv(x).split(dim, dim=2)
        q = q.view(batch, seq, self.heads, -1).transpose(1, 2)
        k = k.view(batch, seq, self.heads, -1).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / (dim // self.heads) ** 0.5
        scores = scores.masked_fill(~self.causal[:seq, :seq], float("-inf"))
        return scores.softmax(-1)


def test_a_log_of_the_masked_probabilities_is_found_beside_the_mask(replays):
    torch.manual_seed(0)
    attention = MaskedSelfAttention()
    x = torch.randn(2, 8, 16)
    target = torch.softmax(torch.randn(2, 2, 8, 8), -1)

    def step():
        probs = attention.probabilities(x)
        # the cross-entropy by hand: log(p) of the masked probabilities is -inf, and 0 * -inf nan
        loss = -(target * probs.log()).sum(-1).mean()
        loss.backward()
        return loss.item()

    with opwatch.watch(warn=False, dump_on_error=False) as w:
        step()
    first = [a for a in w.anomalies if a.kind in ("nan", "inf")][0]
    assert (first.op, first.lineno, first.phase) == ("aten.log.default", line_of("(target * probs.log())", HERE), "forward")
    assert replays["replayed"] >= 1


def test_healthy_masked_attention_steps_report_nothing(replays):
    torch.manual_seed(0)
    attention = MaskedSelfAttention()
    optimizer = torch.optim.SGD(attention.parameters(), lr=0.1)
    x = torch.randn(2, 8, 16)
    target = torch.softmax(torch.randn(2, 2, 8, 8), -1)
    with opwatch.watch(warn=False) as w:
        for _ in range(3):
            loss = F.kl_div(attention.probabilities(x).clamp_min(1e-9).log(), target, reduction="batchmean")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss.item()
    assert w.anomalies == []
    assert replays["absorbed"] >= 3 and replays["replayed"] == 0, replays
