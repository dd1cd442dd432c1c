"""The nan/inf rules in real training loops (issue 10): an nn.Module, an optimizer, several
steps, check points where a training script has them (``loss.item()``, the end of the block).

One section per rule, each with loops that must be flagged and loops that must not:

- GradScaler: overflowing scaled gradients that the scaler finds and skips are *contained*
  ("GradScaler skipped the step"), never anomalies, and never raise in ``strict()``; a
  non-finite value that reaches a parameter still is an anomaly;
- a backward that cleans up after itself (the 0/0 of ``vector_norm``'s backward at a zero row,
  overwritten with 0 at once) is no anomaly; ``sqrt``'s inf gradient at 0 that reaches
  ``.grad`` is;
- deliberate ``-inf`` constants in every form (index assignment, fills with a 0-dim tensor,
  ``full``, ``finfo.min`` masks that overflow in float16) are not anomalies;
- a write through a view (``h[:, 0].div_(d)``) is reported at the write, not at the next reader;
- outputs opwatch does not check (sparse) inherit their inputs' state: no second origin;
- reentrant checkpointing recomputes the forward: still one anomaly;
- nan born from a deliberate ``-inf`` (softmax over a fully masked row) is an origin, unless the
  program removes it before it matters;

and a healthy transformer block under ``strict()``, in float32 and under bfloat16 autocast.

The scenarios live in this file so that ``line_of`` can pin the reported line; the markers are
``# @name`` comments. Most rule tests watch only ``"nonfinite"`` (the dtype rules under
autocast are pinned in test_autocast.py); the main GradScaler loop and the healthy transformer
block run every check.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import opwatch

from support import helpers

HERE = os.path.abspath(__file__)
NONFINITE = ("nonfinite",)
NAN_INF = ("nan", "inf")
INIT_SCALE = 2.0**20  # too large for these float16 gradients: the first steps overflow


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def line_of(marker: str) -> int:
    """The line of this file that holds ``marker`` (exactly one)."""
    return helpers.line_of(marker, HERE)


def watched(scenario, *args, checks=NONFINITE, **kwargs):
    """Run ``scenario`` under ``watch()``; returns the watch and what the scenario returned."""
    w = opwatch.watch(checks=checks, warn=False, dump_on_error=False)
    with w:
        result = scenario(*args, **kwargs)
    return w, result


def strictly(scenario, *args, checks=NONFINITE, **kwargs):
    """Run ``scenario`` under ``strict()``; an ``AnomalyError`` fails the test, naming it."""
    w = opwatch.strict(checks=checks, warn=False, dump_on_error=False)
    try:
        with w:
            result = scenario(*args, **kwargs)
    except opwatch.AnomalyError as error:
        pytest.fail(f"strict() stopped the loop at {error.anomaly!r}:\n{error.anomaly.message}")
    return w, result


def places(w):
    """(kind, op, line, phase) of each nan/inf anomaly."""
    return [(a.kind, a.op, a.lineno, a.phase) for a in w.anomalies if a.kind in NAN_INF]


def assert_quiet(w):
    """No nan/inf anomaly; the message of each one found otherwise."""
    found = [a for a in w.anomalies if a.kind in NAN_INF]
    assert found == [], "\n\n".join(a.message for a in found)


def param_id(value) -> str:
    """Test ids: a function's name, a dtype's short name (``None``: no autocast, float32)."""
    if value is None:
        return "float32"
    return getattr(value, "__name__", None) or str(value).replace("torch.", "")


def all_finite(model) -> bool:
    return all(bool(p.isfinite().all()) for p in model.parameters())


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def changed(model, before) -> bool:
    return any(not torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before))


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, inputs=8, hidden=32, outputs=1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))

    def forward(self, x):
        return self.net(x)


class EncoderRegressor(nn.Module):
    """A small transformer block (``nn.TransformerEncoderLayer``, dropout on) between an input
    projection and a linear head: ``(batch, length, 8) -> (batch, 1)``."""

    def __init__(self, width=16, heads=2, dropout=0.1):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.block = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=dropout, batch_first=True)
        self.head = nn.Linear(width, 1)

    def forward(self, x, causal=None, padding=None):
        h = self.block(self.embed(x), src_mask=causal, src_key_padding_mask=padding, is_causal=causal is not None)
        return self.head(h).mean(1)


def regression_data(model_name):
    torch.manual_seed(1)
    if model_name == "mlp":
        return MLP(), torch.randn(32, 8) * 4, torch.randn(32, 1)
    return EncoderRegressor(), torch.randn(8, 6, 8) * 4, torch.randn(8, 1)


# --------------------------------------------------------------------------------------------
# 2. GradScaler: overflow in the scaled gradients is how the scaler finds its scale
# --------------------------------------------------------------------------------------------


def scaled_fp16_training(model, x, y, *, steps=9, clip=None, read_loss_after_backward=False):
    """The torch.amp recipe on the CPU: float16 autocast, a GradScaler whose first scales
    overflow the float16 gradients; it skips those steps and lowers the scale."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scales, losses = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)  # @scaled-loss
        scaler.scale(loss).backward()
        if read_loss_after_backward:
            losses.append(loss.item())  # a check point while the overflowed .grad is alive
        if clip is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        if not read_loss_after_backward:
            losses.append(loss.item())
    return scales, losses


def assert_scaler_skipped_then_stepped(model, before, scales):
    # The scale really came down (steps were skipped) and settled (later steps were taken).
    assert scales[0] < INIT_SCALE and scales[-1] < scales[0], scales
    assert scales[-1] == scales[-2], f"the scale never settled: {scales}"
    assert changed(model, before), "no step was ever taken"
    assert all_finite(model)


def assert_contained_by_the_scaler(w):
    assert_quiet(w)
    assert w.contained, "the skipped overflows should be in w.contained"
    assert all(a.kind in NAN_INF for a in w.contained)
    assert all("GradScaler" in a.message for a in w.contained), [a.message for a in w.contained]


@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
def test_gradscaler_skipped_overflows_are_contained_and_strict_runs_to_the_end(model_name):
    model, x, y = regression_data(model_name)
    before = snapshot(model)
    w, (scales, losses) = strictly(scaled_fp16_training, model, x, y, checks=None)
    assert len(losses) == 9 and all(math.isfinite(loss) for loss in losses)
    assert_scaler_skipped_then_stepped(model, before, scales)
    assert_contained_by_the_scaler(w)


def test_gradscaler_with_unscale_and_grad_clipping_is_contained():
    """The usual recipe with clipping: ``unscale_`` finds the inf, ``clip_grad_norm_`` then
    multiplies the inf gradients by 0 (nan in ``.grad``), and ``step`` skips them."""
    model, x, y = regression_data("mlp")
    before = snapshot(model)
    w, (scales, _) = strictly(scaled_fp16_training, model, x, y, clip=1.0)
    assert_scaler_skipped_then_stepped(model, before, scales)
    assert_contained_by_the_scaler(w)


def test_gradscaler_overflow_read_on_the_host_before_the_scaler_step_is_not_an_anomaly():
    """``loss.item()`` between ``backward()`` and ``scaler.step()``: a check point while the
    overflowed gradients sit in ``.grad``, about to reach the scaler's check."""
    model, x, y = regression_data("mlp")
    before = snapshot(model)
    w, (scales, _) = strictly(scaled_fp16_training, model, x, y, read_loss_after_backward=True)
    assert_scaler_skipped_then_stepped(model, before, scales)
    assert_contained_by_the_scaler(w)


def forgot_the_scaler_step(model, x, y, steps=3):
    """The scaled gradients go straight to the optimizer: the overflow reaches the parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)  # @forgot-loss
        scaler.scale(loss).backward()
        optimizer.step()  # no scaler.step(optimizer): nothing checks or unscales the gradients
        loss.item()


def test_gradscaler_overflow_that_reaches_the_parameters_is_an_anomaly():
    model, x, y = regression_data("mlp")
    w, _ = watched(forgot_the_scaler_step, model, x, y)
    assert not all_finite(model)
    found = places(w)
    assert found, "the inf gradients reached the parameters"
    # The first inf: the float32 gradient cast back to float16 in the backward of .float().
    assert found[0][0] == "inf" and found[0][2:] == (line_of("# @forgot-loss"), "backward"), found
    assert w.anomalies[0].filename == HERE
    assert not any("GradScaler" in a.message for a in w.contained)


def test_gradscaler_overflow_that_reaches_the_parameters_raises_in_strict():
    model, x, y = regression_data("mlp")
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict(checks=NONFINITE, warn=False, dump_on_error=False):
            forgot_the_scaler_step(model, x, y)
    anomaly = raised.value.anomaly
    assert (anomaly.kind, anomaly.lineno, anomaly.phase) == ("inf", line_of("# @forgot-loss"), "backward")


def fp32_training_with_a_saturated_sigmoid(steps=3):
    """A hand-written binary cross-entropy: the sigmoid saturates to exactly 1.0 in float32 and
    ``(1 - p).log()`` is ``log(0)``. No scaler anywhere."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(16, 8) * 100
    y = (torch.rand(16, 1) > 0.5).float()
    for _ in range(steps):
        optimizer.zero_grad()
        p = torch.sigmoid(model(x))
        loss = -(y * p.log() + (1 - y) * (1 - p).log()).mean()  # @bce-by-hand
        loss.backward()
        optimizer.step()
        loss.item()


def test_forward_inf_in_a_plain_fp32_loop_is_an_anomaly():
    w, _ = watched(fp32_training_with_a_saturated_sigmoid)
    found = places(w)
    assert found and found[0] == ("inf", "aten.log.default", line_of("# @bce-by-hand"), "forward"), found
    assert not any("GradScaler" in a.message for a in w.contained)


# --------------------------------------------------------------------------------------------
# 3. A backward that cleans up after itself
# --------------------------------------------------------------------------------------------


def normalize_loss(h, targets):
    return (1 - (F.normalize(h, dim=-1) * F.normalize(targets, dim=-1)).sum(-1)).mean()


def cosine_loss(h, targets):
    return (1 - F.cosine_similarity(h, targets, dim=-1)).mean()


def norm_penalty_loss(h, targets):
    return F.mse_loss(h, targets) + 0.01 * torch.linalg.vector_norm(h, dim=-1).mean()


def sqrt_penalty_loss(h, targets):
    norm = (h * h).sum(-1).sqrt()  # @sqrt-norm: its gradient at a zero row is inf
    return F.mse_loss(h, targets) + 0.01 * norm.mean()


def embedding_training(loss_fn, steps=4):
    """Embeddings of a padded batch: the padding rows are exactly zero, so every norm of them
    is 0 and its backward computes 0/0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(6, 8)
    targets = torch.randn(6, 16)
    keep = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])[:, None]  # the last two rows are padding
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        h = model(x) * keep
        loss = loss_fn(h, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("loss_fn", [normalize_loss, cosine_loss, norm_penalty_loss], ids=["normalize", "cosine_similarity", "vector_norm"])
def test_norm_backward_at_a_zero_row_cleans_up_after_itself(loss_fn):
    w, (model, losses) = watched(embedding_training, loss_fn)
    assert all(math.isfinite(loss) for loss in losses) and all_finite(model)  # torch's own result
    assert_quiet(w)


def test_norm_backward_at_a_zero_row_runs_to_the_end_in_strict():
    _, (model, _) = strictly(embedding_training, normalize_loss)
    assert all_finite(model)


def test_sqrt_gradient_at_zero_that_reaches_grad_is_an_anomaly():
    w, (model, _) = watched(embedding_training, sqrt_penalty_loss)
    assert not all_finite(model)
    found = places(w)
    assert found and found[0] == ("inf", found[0][1], line_of("# @sqrt-norm"), "backward"), found
    assert w.anomalies[0].filename == HERE


# --------------------------------------------------------------------------------------------
# 4. and 8. Attention masks: deliberate constants, and nan born from them
# --------------------------------------------------------------------------------------------


def scores_of(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def blocked(pad):
    """(batch, length, length): True where query i may not see key j (the future, padding)."""
    length = pad.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    return causal | pad[:, None, :]


# Per step: the scores of each step are masked in place or with a fresh mask.


def attend_setitem(q, k, v, pad, bias):
    scores = scores_of(q, k)
    scores[blocked(pad)] = float("-inf")
    return scores.softmax(-1) @ v


def attend_masked_fill_tensor(q, k, v, pad, bias):
    scores = scores_of(q, k)
    scores.masked_fill_(blocked(pad), torch.tensor(float("-inf")))
    return scores.softmax(-1) @ v


def attend_finfo16_sum(q, k, v, pad, bias):
    """float16 masks of ``finfo(float16).min`` added to float16 scores: the sum overflows."""
    scores = scores_of(q, k)
    minimum = torch.finfo(scores.dtype).min
    length = scores.shape[-1]
    causal = torch.full((length, length), minimum, dtype=scores.dtype).triu(1)
    padding = torch.zeros(pad.shape, dtype=scores.dtype).masked_fill(pad, minimum)[:, None, :]
    return (scores + causal + padding).softmax(-1) @ v


def attend_finfo32_where(q, k, v, pad, bias):
    """``finfo(float32).min`` put into float16 scores: it becomes -inf."""
    scores = scores_of(q, k)
    scores = torch.where(blocked(pad), torch.finfo(torch.float32).min, scores)
    return scores.softmax(-1) @ v


def attend_with_bias(q, k, v, pad, bias):
    return (scores_of(q, k) + bias).softmax(-1) @ v


# Made once before training and kept alive as a buffer, so that the -inf they hold is alive at
# every check point. (``masked_fill(mask, finfo(float32).min)`` on a float16 tensor is not
# among them: torch 2.13 refuses it, "value cannot be converted to type c10::Half without
# overflow"; the where / setitem / cast forms below are what programs write instead.)


def bias_setitem(pad):
    mask = blocked(pad)
    bias = torch.zeros(mask.shape)
    bias[mask] = float("-inf")
    return bias


def bias_masked_fill_tensor(pad):
    mask = blocked(pad)
    return torch.zeros(mask.shape).masked_fill_(mask, torch.tensor(float("-inf")))


def bias_fill_views(pad):
    """Row by row, with ``fill_`` of a 0-dim tensor on views."""
    neg_inf = torch.tensor(float("-inf"))
    batch, length = pad.shape
    bias = torch.zeros(batch, length, length)
    for i in range(length - 1):
        bias[:, i, i + 1 :].fill_(neg_inf)
    for b, n in enumerate((~pad).sum(-1).tolist()):
        bias[b, :, n:].fill_(neg_inf)
    return bias


def bias_full(pad):
    length = pad.shape[-1]
    causal = torch.full((length, length), float("-inf")).triu(1)
    padding = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))[:, None, :]
    return causal + padding


def bias_finfo16_sum(pad):
    """Where a key is both in the future and padding, ``min + min`` overflows to -inf."""
    minimum = torch.finfo(torch.float16).min
    length = pad.shape[-1]
    causal = torch.full((length, length), minimum, dtype=torch.float16).triu(1)
    padding = torch.zeros(pad.shape, dtype=torch.float16).masked_fill(pad, minimum)[:, None, :]
    return causal + padding


def bias_finfo32_where(pad):
    mask = blocked(pad)
    return torch.where(mask, torch.finfo(torch.float32).min, torch.zeros(mask.shape, dtype=torch.float16))


def bias_finfo32_setitem(pad):
    mask = blocked(pad)
    bias = torch.zeros(mask.shape, dtype=torch.float16)
    bias[mask] = torch.finfo(torch.float32).min
    return bias


def bias_finfo32_cast(pad):
    """The transformers pattern: made in float32 with ``finfo(float32).min``, then cast to
    the model's dtype, where it becomes -inf."""
    mask = blocked(pad)
    return torch.zeros(mask.shape).masked_fill(mask, torch.finfo(torch.float32).min).to(torch.float16)


def attend_overflowing_scores(q, k, v, pad, bias):
    scores = scores_of(q, k) / 1e-5  # @temperature: a temperature of 1e-5 overflows float16
    scores = scores.masked_fill(blocked(pad), float("-inf"))
    return scores.softmax(-1) @ v


def attend_fully_masked(q, k, v, pad, bias):
    scores = scores_of(q, k).masked_fill(blocked(pad), float("-inf"))
    probs = scores.softmax(-1)  # @fully-masked-softmax
    return probs @ v


def attend_nan_to_num(q, k, v, pad, bias):
    scores = scores_of(q, k).masked_fill(blocked(pad), float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1))
    return probs @ v


def attend_where_fully_masked(q, k, v, pad, bias):
    mask = blocked(pad)
    scores = scores_of(q, k).masked_fill(mask, float("-inf"))
    probs = scores.softmax(-1)
    probs = torch.where(mask.all(-1, keepdim=True), 0.0, probs)
    return probs @ v


def attend_sdpa(q, k, v, pad, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked(pad))


class MaskedAttention(nn.Module):
    """Single-head causal self-attention over padded sequences; ``attend`` is the masking
    recipe under test, ``bias`` an additive mask made once (a buffer)."""

    def __init__(self, attend, bias=None, width=16):
        super().__init__()
        self.attend = attend
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("bias", bias)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(self.dropout(self.attend(q, k, v, pad, self.bias)))


def attention_training(attend, make_bias=None, *, lengths=(6, 4, 5, 6), dtype=None, steps=3):
    """A few AdamW steps of a masked attention layer; ``dtype``: a CPU autocast dtype."""
    torch.manual_seed(0)
    length = max(max(lengths), 1)
    pad = torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]
    model = MaskedAttention(attend, make_bias(pad) if make_bias else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(len(lengths), length, 16)
    y = torch.randn(len(lengths), length, 16)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(x, pad)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


PER_STEP = [
    (attend_setitem, None),
    (attend_masked_fill_tensor, None),
    (attend_finfo16_sum, torch.float16),
    (attend_finfo32_where, torch.float16),
]
MADE_ONCE = [
    (bias_setitem, None),
    (bias_masked_fill_tensor, None),
    (bias_fill_views, None),
    (bias_full, None),
    (bias_finfo16_sum, torch.float16),
    (bias_finfo32_where, torch.float16),
    (bias_finfo32_setitem, torch.float16),
    (bias_finfo32_cast, torch.float16),
]


def _refuses_overflowing_scalars() -> bool:
    """Whether this torch refuses a Python scalar that overflows a float16 tensor it is put into
    (``torch.where(mask, finfo(f32).min, f16)``, ``bias[mask] = finfo(f32).min``: torch 2.6
    raises "value cannot be converted to type at::Half without overflow"; newer torch writes
    -inf)."""
    try:
        torch.where(torch.tensor([True]), torch.finfo(torch.float32).min, torch.zeros(1, dtype=torch.float16))
    except RuntimeError:
        return True
    return False


REFUSES_OVERFLOWING_SCALARS = _refuses_overflowing_scalars()
# The scenarios that put finfo(float32).min into float16 as a Python scalar.
_OVERFLOWING_SCALAR_SCENARIOS = ("attend_finfo32_where", "bias_finfo32_where", "bias_finfo32_setitem")


def _skip_where_torch_refuses_the_program(scenario, dtype) -> None:
    if REFUSES_OVERFLOWING_SCALARS and dtype == torch.float16 and scenario.__name__ in _OVERFLOWING_SCALAR_SCENARIOS:
        pytest.skip(f"torch {torch.__version__} refuses {scenario.__name__}'s float32 minimum in float16: the program raises, watched or not")


@pytest.mark.parametrize("attend, dtype", PER_STEP, ids=param_id)
def test_deliberate_masks_applied_each_step_are_not_anomalies(attend, dtype):
    _skip_where_torch_refuses_the_program(attend, dtype)
    w, (model, losses) = watched(attention_training, attend, dtype=dtype)
    assert all(math.isfinite(loss) for loss in losses) and all_finite(model)
    assert_quiet(w)


@pytest.mark.parametrize("make_bias, dtype", MADE_ONCE, ids=param_id)
def test_deliberate_masks_made_once_and_kept_alive_are_not_anomalies(make_bias, dtype):
    _skip_where_torch_refuses_the_program(make_bias, dtype)
    w, (model, losses) = watched(attention_training, attend_with_bias, make_bias, dtype=dtype)
    assert model.bias.isneginf().any()  # the scenario is what it claims: the mask holds -inf
    assert all(math.isfinite(loss) for loss in losses) and all_finite(model)
    assert_quiet(w)


def test_fp16_masks_made_on_purpose_really_hold_neg_inf():
    """The scenarios above are what they claim: the float16 masks overflow to -inf."""
    minimum16 = torch.finfo(torch.float16).min
    both = torch.tensor([minimum16], dtype=torch.float16) + torch.tensor([minimum16], dtype=torch.float16)
    assert both.item() == float("-inf")
    scores = torch.zeros(2, dtype=torch.float16)
    if REFUSES_OVERFLOWING_SCALARS:
        with pytest.raises(RuntimeError, match="without overflow"):
            torch.where(torch.tensor([True, False]), torch.finfo(torch.float32).min, scores)
    else:
        assert torch.where(torch.tensor([True, False]), torch.finfo(torch.float32).min, scores)[0].item() == float("-inf")
    assert torch.tensor(torch.finfo(torch.float32).min).to(torch.float16).item() == float("-inf")


def test_deliberate_masks_run_to_the_end_in_strict():
    strictly(attention_training, attend_with_bias, bias_full)
    strictly(attention_training, attend_with_bias, bias_finfo32_cast, dtype=torch.float16)


def test_overflowing_float16_scores_are_an_anomaly_at_the_scores():
    w, _ = watched(attention_training, attend_overflowing_scores, dtype=torch.float16)
    found = places(w)
    assert found and found[0][0] == "inf" and found[0][2:] == (line_of("# @temperature"), "forward"), found
    assert w.anomalies[0].filename == HERE


def test_softmax_over_a_fully_masked_row_is_a_nan_origin():
    # The second sequence is all padding: every one of its rows is fully masked.
    w, (_, losses) = watched(attention_training, attend_fully_masked, lengths=(6, 0, 5, 6))
    assert all(math.isnan(loss) for loss in losses)
    found = places(w)
    assert found and found[0] == ("nan", "aten._softmax.default", line_of("# @fully-masked-softmax"), "forward"), found
    assert w.anomalies[0].filename == HERE


def test_softmax_over_a_fully_masked_row_raises_in_strict():
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict(checks=NONFINITE, warn=False, dump_on_error=False):
            attention_training(attend_fully_masked, lengths=(6, 0, 5, 6))
    anomaly = raised.value.anomaly
    assert (anomaly.kind, anomaly.lineno) == ("nan", line_of("# @fully-masked-softmax"))


@pytest.mark.parametrize("attend", [attend_nan_to_num, attend_where_fully_masked, attend_sdpa], ids=lambda f: f.__name__)
def test_nan_of_a_fully_masked_row_removed_before_it_matters_is_not_an_anomaly(attend):
    w, (model, losses) = watched(attention_training, attend, lengths=(6, 0, 5, 6))
    assert all(math.isfinite(loss) for loss in losses) and all_finite(model)  # torch's own result
    assert_quiet(w)


def test_sdpa_gives_zeros_for_a_fully_masked_row():
    """What torch 2.13 does on the CPU, that the sdpa case above relies on."""
    q, k, v = torch.randn(3, 1, 4, 8).unbind(0)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[0, 1], torch.zeros(8))


# --------------------------------------------------------------------------------------------
# 5. Writes through views
# --------------------------------------------------------------------------------------------


def column_scaled_training(counts, *, inplace, steps=3):
    """The first output column is divided by a per-row count, written back through a view."""
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(5, 8)
    y = torch.randn(5, 4)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        h = model(x)
        if inplace:
            h[:, 0].div_(counts)  # @view-div-inplace
        else:
            h[:, 0] = h[:, 0] / counts  # @view-div-assign
        loss = (h - y).pow(2).mean()  # @view-reader
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


ZERO_COUNT = torch.tensor([3.0, 0.0, 2.0, 1.0, 4.0])


@pytest.mark.parametrize("inplace", [True, False], ids=["div_", "assign"])
def test_inf_written_through_a_view_is_reported_at_the_write(inplace):
    write = line_of("# @view-div-inplace") if inplace else line_of("# @view-div-assign")
    w, _ = watched(column_scaled_training, ZERO_COUNT, inplace=inplace)
    found = places(w)
    assert found, "the division by a zero count made inf"
    assert found[0][0] == "inf" and found[0][2:] == (write, "forward"), found
    reader = line_of("# @view-reader")
    assert {line for _, _, line, _ in found} == {write}, f"reported away from the write (the reader is line {reader}): {found}"
    assert all(a.filename == HERE for a in w.anomalies)


@pytest.mark.parametrize("inplace", [True, False], ids=["div_", "assign"])
def test_finite_writes_through_a_view_are_not_anomalies(inplace):
    w, (model, losses) = watched(column_scaled_training, ZERO_COUNT.clamp_min(1.0), inplace=inplace)
    assert all(math.isfinite(loss) for loss in losses) and all_finite(model)
    assert_quiet(w)


# --------------------------------------------------------------------------------------------
# 6. Outputs opwatch does not check inherit their inputs' state
# --------------------------------------------------------------------------------------------


def graph_training(counts, *, smooth, steps=3):
    """Node features from event counts, stored sparse and back; one round of neighbour
    aggregation with a sparse adjacency, then an MLP."""
    torch.manual_seed(0)
    if smooth:
        features = counts.log1p()
    else:
        features = counts.log()  # @log-counts: a node with no events gets -inf
    features = features.to_sparse().to_dense()  # @sparse-round-trip
    nodes = counts.shape[0]
    ring = torch.arange(nodes)
    neighbours = torch.stack([ring, (ring + 1) % nodes])
    adjacency = torch.sparse_coo_tensor(neighbours, torch.full((nodes,), 0.5), (nodes, nodes), check_invariants=True)
    model = MLP(counts.shape[1], 16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    y = torch.randn(nodes, 1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        h = features + torch.sparse.mm(adjacency, features)
        loss = F.mse_loss(model(h), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


COUNTS = torch.tensor([[3.0, 1.0, 2.0, 5.0], [1.0, 0.0, 4.0, 2.0], [2.0, 2.0, 1.0, 1.0], [6.0, 3.0, 2.0, 1.0]])


def test_sparse_round_trip_after_an_inf_origin_is_not_a_second_origin():
    w, _ = watched(graph_training, COUNTS, smooth=False)
    assert places(w) == [("inf", "aten.log.default", line_of("# @log-counts"), "forward")]


def test_sparse_round_trip_of_the_inf_alone_is_one_origin():
    with opwatch.watch(checks=NONFINITE, warn=False, dump_on_error=False) as w:
        features = COUNTS.log()  # @lone-log
        dense = features.to_sparse().to_dense()
        dense.sum().item()
    assert places(w) == [("inf", "aten.log.default", line_of("# @lone-log"), "forward")]


def test_sparse_round_trip_of_finite_features_is_not_an_anomaly():
    w, (model, losses) = watched(graph_training, COUNTS, smooth=True)
    assert all(math.isfinite(loss) for loss in losses) and all_finite(model)
    assert_quiet(w)


# --------------------------------------------------------------------------------------------
# 7. Reentrant activation checkpointing
# --------------------------------------------------------------------------------------------


class CheckpointedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def block(self, h):
        z = self.fc(h)
        return torch.log1p(z.exp())  # @ckpt-softplus: a softplus by hand, exp overflows past 88

    def forward(self, x):
        h = checkpoint(self.block, self.inp(x), use_reentrant=True)
        return self.head(h)


def checkpointed_training(outlier_step=None, steps=4):
    torch.manual_seed(0)
    model = CheckpointedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [torch.randn(8, 4) for _ in range(steps)]
    y = torch.randn(8, 1)
    losses = []
    for step, x in enumerate(batches):
        if step == outlier_step:
            x = x * 100
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def test_inf_inside_a_reentrant_checkpoint_is_one_anomaly_not_two():
    w, (_, losses) = watched(checkpointed_training, outlier_step=1)
    assert not math.isfinite(losses[1])
    assert places(w) == [("inf", "aten.exp.default", line_of("# @ckpt-softplus"), "forward")]


def test_healthy_reentrant_checkpoint_training_runs_to_the_end_in_strict():
    _, (model, losses) = strictly(checkpointed_training)
    assert all(math.isfinite(loss) for loss in losses) and all_finite(model)


# --------------------------------------------------------------------------------------------
# overall: a healthy transformer block, every check on
# --------------------------------------------------------------------------------------------


def transformer_training(dtype=None, steps=5):
    torch.manual_seed(0)
    model = EncoderRegressor(width=32, heads=4, dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 7, 8)
    y = torch.randn(4, 1)
    causal = nn.Transformer.generate_square_subsequent_mask(7)  # -inf above the diagonal
    padded = torch.arange(7)[None, :] >= torch.tensor([7, 5, 6, 3])[:, None]
    padding = torch.zeros(padded.shape).masked_fill(padded, float("-inf"))  # float, like causal
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(x, causal, padding)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "bfloat16-autocast"])
def test_healthy_transformer_block_training_is_quiet_in_strict(dtype):
    w, (model, losses) = strictly(transformer_training, dtype, checks=None)
    assert len(losses) == 5 and all(math.isfinite(loss) for loss in losses) and all_finite(model)
    assert w.anomalies == []
