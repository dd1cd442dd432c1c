"""A fused attention kernel's nan from scores past float32's precision (a diverged run).

When the weights feeding an attention diverge (too high a learning rate), its scores reach
1e10 and more, and the fused kernels (``F.scaled_dot_product_attention``'s flash and efficient
paths, ``nn.MultiheadAttention``'s fast path) make nan in backward: they recompute
exp(score - logsumexp) in float32, whose rounding of such a score is more than exp takes. The
mask has nothing to do with it (no mask, a -inf mask and a ``finfo.min`` mask all give it).
Before, the -inf mask case said "a masking -inf met another one or a 0" with the fix "mask with
torch.finfo(dtype).min", which changes nothing, and the others "not decided".

Must flag: a nanoGPT-style block (``is_causal=True``), a ``nn.MultiheadAttention`` with a
boolean causal mask and a Hugging Face Llama (grouped-query, a padded batch), each trained by
AdamW at a diverging learning rate. Must not: the same
models at a sane learning rate (silent), a float16 attention whose backward overflows from a
large output gradient while its scores are small (its own cause), a fully masked row in an
attention written by hand (still the mask).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opwatch
from opwatch.checks.nonfinite.cause import ATTENTION_SCORES, MATH, PRECISION
from opwatch.checks.nonfinite.rules import ValueRange, attention_scores
from opwatch.core.notation import TensorMeta

VOCAB, T, C = 64, 16, 32


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one qkv projection, ``is_causal=True``, no mask tensor."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, L, 4, C // 4).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # FUSED ATTENTION
        return self.c_proj(y.transpose(1, 2).reshape(B, L, C))


class MaskedSelfAttention(nn.Module):
    """``nn.MultiheadAttention`` with a boolean causal mask (made into a -inf mask)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(C, 4, batch_first=True)
        self.register_buffer("mask", torch.triu(torch.ones(T, T, dtype=torch.bool), 1))

    def forward(self, x):
        return self.attn(x, x, x, attn_mask=self.mask, need_weights=False)[0]


class TinyGPT(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, C)
        self.wpe = nn.Embedding(T, C)
        self.ln1 = nn.LayerNorm(C)
        self.attn = attention()
        self.ln2 = nn.LayerNorm(C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
        self.head = nn.Linear(C, VOCAB)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(T))
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return F.cross_entropy(self.head(x).view(-1, VOCAB), targets.view(-1))


def train(attention, lr, steps=4):
    """AdamW with gradient clipping, as nanoGPT trains; the first step whose gradients are not
    finite ends the run. Returns the watch and the steps run."""
    torch.manual_seed(0)
    model = TinyGPT(attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    w = opwatch.watch(warn=False, dump_on_error=False)
    ran = 0
    with w:
        for _ in range(steps):
            idx, targets = torch.randint(0, VOCAB, (8, T)), torch.randint(0, VOCAB, (8, T))
            optimizer.zero_grad(set_to_none=True)
            model(idx, targets).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            ran += 1
            if not math.isfinite(norm.item()):
                break
            optimizer.step()
    return w, ran


def nonfinite(w):
    return [a for a in w.anomalies if a.kind in ("nan", "inf")]


def line(anomaly, label):
    (found,) = [text for text in anomaly.message.splitlines() if text.startswith(f"  {label}:")]
    return found


@pytest.mark.parametrize("attention", [CausalSelfAttention, MaskedSelfAttention], ids=["is_causal", "bool mask"])
def test_a_diverged_run_s_attention_nan_is_its_scores_not_its_mask(attention):
    w, ran = train(attention, lr=1e3)
    assert ran == 2  # the first step blows the weights up; the second one's backward makes nan
    first = nonfinite(w)[0]
    assert first.kind == "nan" and first.op.startswith("aten._scaled_dot_product_flash_attention_for_cpu_backward")
    cause = first.finding.facts["cause"]
    assert (cause.kind, cause.detail, cause.dtype, cause.bound) == (PRECISION, ATTENTION_SCORES, torch.float32, True)
    assert cause.largest > 1e12, cause
    told = line(first, "cause")
    assert told.startswith("  cause:    precision: the attention scores (query @ key.T * scale)") and "can reach" in told
    assert "head dim 8" in told and "past about 7.4e+08" in told
    assert ("with or without the mask" in told) is (attention is MaskedSelfAttention)
    fix = line(first, "fix")
    assert "learning rate" in fix and "QK-norm" in fix and "finfo(dtype).min instead" not in fix
    assert "masking -inf met" not in first.message


@pytest.mark.parametrize("attention", [CausalSelfAttention, MaskedSelfAttention], ids=["is_causal", "bool mask"])
def test_the_same_models_at_a_sane_learning_rate_report_nothing(attention):
    w, ran = train(attention, lr=3e-4, steps=6)
    assert ran == 6 and w.anomalies == [] and w.contained == []


def test_a_diverged_hugging_face_llama_s_attention_nan_is_its_scores():
    """Llama from a small config, grouped-query attention (its keys repeated) and a padded
    batch (a finfo.min / -inf mask), trained by AdamW at a diverging learning rate. Its
    DynamicCache joins the keys to an empty tensor (``torch.cat``), which must not lose their
    range."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=C, intermediate_size=2 * C, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e3)

    def step():
        ids = torch.randint(0, VOCAB, (4, T))
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # a left-padded row
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    step()  # the weights blow up
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        step()
    first = nonfinite(w)[0]
    assert first.kind == "nan" and "_scaled_dot_product_flash_attention_for_cpu_backward" in first.op
    cause = first.finding.facts["cause"]
    assert (cause.kind, cause.detail) == (PRECISION, ATTENTION_SCORES), cause
    assert "masking -inf met" not in first.message and "QK-norm" in line(first, "fix")


def test_a_float16_attention_backward_that_overflows_from_its_gradient_keeps_its_own_cause():
    """Small scores, an output gradient near float16's top: the value gradient's sum over the
    queries passes 65504 (as a GradScaler's first scales do); not the scores."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, T, 8).half().requires_grad_() for _ in range(3))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out.float() * 3e4).sum().backward()

    with opwatch.watch(warn=False, dump_on_error=False) as w:
        step()
    first = nonfinite(w)[0]
    assert first.kind == "inf" and "flash_attention_for_cpu_backward" in first.op
    cause = first.finding.facts["cause"]
    assert cause is None or cause.detail != ATTENTION_SCORES, cause
    assert "attention scores" not in first.message and "QK-norm" not in first.message


def test_a_fully_masked_row_in_an_attention_written_by_hand_is_still_the_mask():
    torch.manual_seed(0)
    query = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        mask = torch.full((4, 4), float("-inf")).triu(1)
        mask[2] = float("-inf")  # every key of query 2 masked
        ((query(x) @ x.T + mask).softmax(-1) @ x).sum().backward()
    first = nonfinite(w)[0]
    cause = first.finding.facts["cause"]
    assert first.op == "aten._softmax.default" and (cause.kind, cause.detail) == (MATH, "masked"), cause


def _ranges(query, key, head_dim=8, dtype=torch.float32):
    """A backward op's floating inputs: the output's gradient, query, key, value."""
    meta = TensorMeta((2, 4, T, head_dim), dtype, torch.device("cpu"), 0)
    return [(meta, ValueRange(-1.0, 1.0)), (meta, ValueRange(-query, query)), (meta, ValueRange(-key, key)), (meta, ValueRange(-1.0, 1.0))]


def test_the_bound_passes_the_limit_only_past_float32_s_precision():
    name = "_scaled_dot_product_flash_attention_backward"
    # 8 * 1e4 * 1e4 / sqrt(8) = 2.8e8: below 88.7 / 2**-23 = 7.4e8.
    assert attention_scores(name, _ranges(1e4, 1e4)) is None
    scores = attention_scores(name, _ranges(3e4, 3e4))
    assert scores is not None and scores.head_dim == 8 and scores.dtype == torch.float32 and scores.query == 3e4
    assert scores.bound == pytest.approx(8 * 3e4 * 3e4 / math.sqrt(8)) and scores.limit == pytest.approx(7.44e8, rel=1e-2)
    assert attention_scores(name, _ranges(3e4, 3e4), scale=1e-3) is None  # the op's own scale counts
    assert attention_scores(name, _ranges(3e4, 3e4, dtype=torch.float64)) is None  # float64 rounds finely enough
    # The forward keeps a running max of the scores: no claim there; nor for other ops.
    assert attention_scores("_scaled_dot_product_flash_attention", _ranges(3e4, 3e4)) is None
    assert attention_scores("mm", _ranges(3e4, 3e4)) is None
    unknown = _ranges(3e4, 3e4)
    unknown[2] = (unknown[2][0], None)
    assert attention_scores(name, unknown) is None
    assert attention_scores(name, []) is None
