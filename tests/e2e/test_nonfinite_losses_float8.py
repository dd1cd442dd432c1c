"""Issue 30, item 2: a masking constant that becomes the loss, and nan/inf inside float8 tensors,
on realistic training code.

- A classifier whose logits are masked to the classes allowed for each sample
  (``masked_fill(~allowed, -inf)``) and trained with ``cross_entropy(..., label_smoothing=0.1)``:
  label smoothing averages the log-probabilities of every class, masked ones too, so the loss is
  +inf. Reported at the reduction inside cross_entropy that took the masked entries in
  (``aten.sum.dim_IntList``, on the cross_entropy line). Not reported: the same mask without
  smoothing, smoothing over the allowed classes only, a causal attention mask with -inf before
  softmax, masked max pooling and a masked logsumexp (NT-Xent) loss.
- A fake-quantised linear layer (per-token float8_e4m3fn scales, the values cast back to float32
  for the matmul): a padding token's all-zero embedding makes its scale 0, and ``x / scale`` is
  0 / 0 = nan, which the float8 tensor carries. Reported at the division, not at the cast back.
  Not reported: the same layer with its scale clamped away from 0, and float8_e5m2 fake-quantised
  values in range.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

import opwatch
from opwatch.checks.nonfinite.cause import DELIBERATE, MATH, PRECISION
from opwatch.core.finite import CHECKED_DTYPES, FusedFiniteCheck, finite_by_device, nonfinite_kind
from opwatch.storage.jsonl import load

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def nonfinite(w):
    return [a for a in w.anomalies if a.kind in ("nan", "inf")]


def line_of(function, marker: str) -> int:
    """The line of ``function``'s source that holds ``marker``."""
    lines, first = inspect.getsourcelines(function)
    (number,) = [first + offset for offset, line in enumerate(lines) if marker in line and "line_of(" not in line]
    return number


def cause_line(anomaly) -> str:
    (line,) = [line for line in anomaly.message.splitlines() if line.startswith("  cause:")]
    return line


# --------------------------------------------------------------------------------------------
# a masking constant that becomes the loss
# --------------------------------------------------------------------------------------------

CLASSES = 6


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, CLASSES))

    def forward(self, x):
        return self.body(x)


def batches(count=3):
    """Samples whose target is one of the classes allowed for them (two classes are never
    allowed for the first half of a batch: a per-sample label space)."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        x = torch.randn(8, 12, generator=generator)
        allowed = torch.ones(8, CLASSES, dtype=torch.bool)
        allowed[:4, 4:] = False
        target = torch.randint(0, 4, (8,), generator=generator)
        out.append((x, allowed, target))
    return out


def masked_loss(logits, allowed, target, smoothing, fill):
    return F.cross_entropy(logits.masked_fill(~allowed, fill), target, label_smoothing=smoothing)  # the loss


def allowed_smoothing_loss(logits, allowed, target, smoothing):
    """Label smoothing over the allowed classes only: what the fix says."""
    logp = logits.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    soft = allowed * (smoothing / allowed.sum(-1, keepdim=True)) + (1 - smoothing) * F.one_hot(target, CLASSES)
    return -(soft * logp.masked_fill(~allowed, 0)).sum(-1).mean()


def train(loss_fn, *, read=True, steps=3):
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for x, allowed, target in batches(steps):
            loss = loss_fn(model(x), allowed, target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if read:
                seen.append(loss.item())  # logged
    return w, seen


def test_label_smoothing_over_classes_masked_with_minus_inf_is_reported_at_the_reduction_inside_cross_entropy(tmp_path):
    w, seen = train(lambda logits, allowed, target: masked_loss(logits, allowed, target, 0.1, float("-inf")))
    assert seen == [math.inf] * 3  # the bug: the logged loss is inf at every step
    found = nonfinite(w)  # one per step, as every origin read at every step
    assert len(found) == 3 and len({a.where for a in found}) == 1
    anomaly = found[0]
    assert anomaly.kind == "inf" and anomaly.op == "aten.sum.dim_IntList" and anomaly.phase == "forward"
    assert anomaly.record.lineno == line_of(masked_loss, "# the loss")
    facts = anomaly.finding.facts
    assert facts["from_deliberate"] and facts["cause"].kind == DELIBERATE
    assert facts["loss"] is not None and facts["loss_kind"] == "inf"
    assert "a masking constant reached the loss" in anomaly.message
    assert "deliberate:" in cause_line(anomaly) and "sum adds them into its result" in cause_line(anomaly)
    assert "label_smoothing" in anomaly.message and "smooth over the allowed classes only" in anomaly.message
    assert w.contained == []
    # The facts survive the JSONL round trip, and the message is made again the same.
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    saved = [a for a in load(path).anomalies if a.kind == "inf"]
    assert [a.message for a in saved] == [a.message for a in found]


def test_the_same_loss_is_reported_when_it_is_not_read_but_backward_runs_on_it():
    w, _ = train(lambda logits, allowed, target: masked_loss(logits, allowed, target, 0.1, float("-inf")), read=False)
    found = nonfinite(w)
    assert len(found) == 3
    anomaly = found[0]
    assert anomaly.op == "aten.sum.dim_IntList" and anomaly.finding.facts["cause"].kind == DELIBERATE


def test_a_finfo_min_mask_with_label_smoothing_overflows_the_sum_and_is_reported_too():
    fill = torch.finfo(torch.float32).min
    w, seen = train(lambda logits, allowed, target: masked_loss(logits, allowed, target, 0.1, fill))
    assert seen == [math.inf] * 3
    anomaly, *_ = nonfinite(w)
    assert anomaly.kind == "inf" and anomaly.op == "aten.sum.dim_IntList"
    assert anomaly.record.lineno == line_of(masked_loss, "# the loss")
    assert anomaly.finding.facts["cause"].kind == DELIBERATE


def test_a_target_whose_class_is_masked_is_reported_at_nll_loss():
    """Without smoothing, a sample whose target is among its masked classes: -log(0) = inf."""

    def loss_fn(logits, allowed, target):
        target = target.clone()
        target[0] = CLASSES - 1  # a label outside the sample's label space
        return masked_loss(logits, allowed, target, 0.0, float("-inf"))

    w, seen = train(loss_fn)
    assert seen == [math.inf] * 3
    anomaly, *_ = nonfinite(w)
    assert anomaly.kind == "inf" and anomaly.op == "aten.nll_loss_forward.default"
    assert anomaly.record.lineno == line_of(masked_loss, "# the loss")
    assert "a target is a masked class" in cause_line(anomaly)
    assert "keep each sample's target among its allowed classes" in anomaly.message


def test_the_same_mask_without_label_smoothing_reports_nothing():
    w, seen = train(lambda logits, allowed, target: masked_loss(logits, allowed, target, 0.0, float("-inf")))
    assert all(math.isfinite(value) for value in seen)
    assert nonfinite(w) == [] and w.contained == []


def test_label_smoothing_over_the_allowed_classes_only_reports_nothing():
    w, seen = train(lambda logits, allowed, target: allowed_smoothing_loss(logits, allowed, target, 0.1))
    assert all(math.isfinite(value) for value in seen)
    assert nonfinite(w) == [] and w.contained == []


class CausalLM(nn.Module):
    """A one-block decoder whose causal mask holds -inf, softmax after it."""

    def __init__(self, vocab=20, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        size = tokens.shape[1]
        causal = torch.ones(size, size, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(causal, float("-inf"))
        return self.out(scores.softmax(-1) @ v + h)


def test_a_causal_attention_mask_with_minus_inf_before_softmax_reports_nothing():
    torch.manual_seed(0)
    model = CausalLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 20, (4, 9))
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(3):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 20), tokens[:, 1:].reshape(-1), label_smoothing=0.1)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert math.isfinite(loss.item())
    assert nonfinite(w) == [] and w.contained == []


def test_masked_max_pooling_and_a_masked_logsumexp_loss_report_nothing():
    """Padding masked with -inf before a max over the sequence, and NT-Xent (SimCLR), whose
    logsumexp leaves out each sample's similarity to itself (masked with -inf)."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1)
    x = torch.randn(6, 5, 8)
    padding = torch.zeros(6, 5, 1, dtype=torch.bool)
    padding[:, 3:] = True
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(3):
            pooled = encoder(x).masked_fill(padding, float("-inf")).max(dim=1).values
            views = torch.cat([pooled, pooled + 0.01 * torch.randn_like(pooled)])
            z = F.normalize(views, dim=-1)
            sim = (z @ z.T / 0.5).masked_fill(torch.eye(12, dtype=torch.bool), float("-inf"))
            positives = torch.cat([torch.arange(6, 12), torch.arange(0, 6)])
            loss = (torch.logsumexp(sim, dim=-1) - sim[torch.arange(12), positives]).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert math.isfinite(loss.item())
    assert nonfinite(w) == [] and w.contained == []


class MaskedPoolingHead(nn.Module):
    """Padding masked with -inf, then a Linear: the bug is the order (mask, then project)."""

    def __init__(self, project_before_masking: bool):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.project = nn.Linear(16, 4)
        self.project_before_masking = project_before_masking

    def forward(self, x, padding):
        h = self.encoder(x)
        if self.project_before_masking:
            return self.project(h).masked_fill(padding, float("-inf")).max(dim=1).values
        return self.project(h.masked_fill(padding, float("-inf"))).max(dim=1).values  # MASK INTO LINEAR


def _train_pooling_head(model):
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = torch.randn(6, 5, 8), torch.randint(0, 4, (6,))
    padding = torch.zeros(6, 5, 1, dtype=torch.bool)
    padding[:, 3:] = True
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(2):
            loss = F.cross_entropy(model(x, padding), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss.item()
    return w


def test_a_minus_inf_mask_fed_into_a_linear_is_the_math_of_the_mask_not_an_input_that_held_inf():
    """The nan made by the Linear from the masked -inf (-inf * w of both signs, summed) is a
    cause of the masking constant's math, with a fix for a matmul; not "input already held inf,
    check the data"."""
    torch.manual_seed(0)
    w = _train_pooling_head(MaskedPoolingHead(project_before_masking=False))
    first = nonfinite(w)[0]
    assert first.kind == "nan" and first.op == "aten.addmm.default"
    assert first.record.lineno == line_of(MaskedPoolingHead.forward, "MASK INTO LINEAR")
    cause = first.finding.facts["cause"]
    assert cause.kind == MATH and cause.detail == "masked", cause
    assert "before a matmul or Linear" in first.message and "check the data" not in first.message


def test_the_same_mask_applied_after_the_linear_reports_nothing():
    torch.manual_seed(0)
    w = _train_pooling_head(MaskedPoolingHead(project_before_masking=True))
    assert nonfinite(w) == [] and w.contained == []


# --------------------------------------------------------------------------------------------
# float8
# --------------------------------------------------------------------------------------------


def quantize(x, dtype, clamp):
    """Per-token fake quantisation: values scaled into the float8 range, cast, cast back."""
    amax = x.abs().amax(-1, keepdim=True)
    if clamp:
        amax = amax.clamp_min(1e-12)
    scale = amax / torch.finfo(dtype).max
    q = (x / scale).to(dtype)  # quantise
    return q.to(x.dtype) * scale  # dequantise


class FakeQuantLinear(nn.Linear):
    """A linear layer trained with float8 fake quantisation of its input and weight, the
    gradient passed straight through."""

    def __init__(self, *args, dtype=E4M3, clamp=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.qdtype, self.clamp = dtype, clamp

    def forward(self, x):
        xq = x + (quantize(x, self.qdtype, self.clamp) - x).detach()
        wq = self.weight + (quantize(self.weight, self.qdtype, True) - self.weight).detach()
        return F.linear(xq, wq, self.bias)


class TokenClassifier(nn.Module):
    def __init__(self, dtype=E4M3, clamp=False):
        super().__init__()
        self.embed = nn.Embedding(30, 16, padding_idx=0)  # the padding token embeds to zeros
        self.proj = FakeQuantLinear(16, 16, dtype=dtype, clamp=clamp)
        self.head = nn.Linear(16, 5)

    def forward(self, tokens):
        return self.head(F.gelu(self.proj(self.embed(tokens))))


def train_quantized(dtype=E4M3, clamp=False):
    torch.manual_seed(0)
    model = TokenClassifier(dtype, clamp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(1, 30, (4, 7))
    tokens[:, 5:] = 0  # padded
    labels = torch.randint(0, 5, (4, 7))
    seen = []
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(2):
            loss = F.cross_entropy(model(tokens).reshape(-1, 5), labels.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append(loss.item())
    return w, seen


def test_a_padding_token_quantised_to_float8_is_reported_at_the_zero_over_zero_not_at_the_cast_back():
    w, seen = train_quantized()
    assert math.isnan(seen[0])
    (anomaly,) = nonfinite(w)[:1]
    assert anomaly.kind == "nan" and anomaly.op == "aten.div.Tensor" and anomaly.phase == "forward"
    assert anomaly.record.lineno == line_of(quantize, "# quantise")
    facts = anomaly.finding.facts
    assert facts["cause"].kind == MATH and facts["cause"].detail == "div_zero_zero"
    assert "made nan from finite inputs" in anomaly.message
    # The float8 tensor carried it: the casts are its spread, never an origin of their own.
    assert all(a.op != "aten._to_copy.default" for a in nonfinite(w))
    assert facts["spread"] > 2


def test_the_same_layer_with_its_scale_clamped_reports_nothing():
    w, seen = train_quantized(clamp=True)
    assert all(math.isfinite(value) for value in seen)
    assert nonfinite(w) == [] and w.contained == []


def test_float8_e5m2_values_in_range_report_nothing():
    w, seen = train_quantized(E5M2, clamp=True)
    assert all(math.isfinite(value) for value in seen)
    assert nonfinite(w) == [] and w.contained == []


def test_an_unscaled_cast_that_overflows_float8_e5m2_is_reported_at_the_cast():
    """Activations cast to float8_e5m2 with no scale: beyond 57344 they become inf."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8) * 3e5
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        h = layer(x)
        q = h.to(E5M2)  # no scale
        out = q.to(torch.float32).relu().sum()
        out.item()
    (anomaly,) = nonfinite(w)
    assert anomaly.kind == "inf" and anomaly.op == "aten._to_copy.default"
    assert anomaly.record.lineno == line_of(test_an_unscaled_cast_that_overflows_float8_e5m2_is_reported_at_the_cast, "q = h.to(")
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == PRECISION and cause.dtype == E5M2
    assert "float8_e5m2" in cause_line(anomaly)
    assert "scale the values into the float8_e5m2 range before the cast" in anomaly.message


def test_the_finite_checks_read_float8_tensors():
    """guard's and leave-on's check (GradScaler's kernel does not take float8: the check falls
    back to one group per device), and the reading of a tensor's kind."""
    nan8 = torch.tensor([1.0, float("nan"), 2.0]).to(E4M3)
    inf8 = torch.tensor([1.0, float("inf")]).to(E5M2)
    fine8 = torch.tensor([1.0, -448.0]).to(E4M3)
    assert {E4M3, E5M2} <= CHECKED_DTYPES
    assert nonfinite_kind(nan8) == "nan" and nonfinite_kind(inf8) == "inf" and nonfinite_kind(fine8) is None
    assert not finite_by_device([torch.ones(3), nan8]) and finite_by_device([torch.ones(3), fine8])
    check = FusedFiniteCheck()
    assert check([torch.ones(3)], [fine8])
    assert not check([torch.ones(3)], [inf8])
    assert not check([nan8]) and check([fine8]) and check([torch.ones(2)])
    assert not check([torch.tensor([float("inf")])])  # the fallback still finds a float32 inf
