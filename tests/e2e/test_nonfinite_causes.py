"""A cause for every nan/inf origin (issue 30), on realistic code: each cause with a case that
must show it, and healthy training loops (float32, bfloat16 autocast, float16 + GradScaler)
that must report nothing.

- precision: a hand-written float16 RMSNorm whose ``x.pow(2)`` overflows (and whose
  ``rsqrt(inf) = 0`` then silently zeroes the tokens: reported, not contained); float16
  attention scores that overflow before the softmax;
- undefined math: ``log(0)`` in a hand-written negative log-likelihood;
- input: a batch holding nan, made by a DataLoader before the watch;
- weights: a Linear whose weight holds nan; a BatchNorm buffer holding nan is an input, named;
- unknown: an input made before the watch that is gone by the check point.

The cause is a fact of the finding (``facts["cause"]``), rendered as the message's ``cause:``
line, and survives the JSONL round trip.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opwatch
from opwatch.checks.nonfinite.cause import INPUT, MATH, PRECISION, UNKNOWN, WEIGHTS, Cause
from opwatch.storage.jsonl import load
from support.helpers import line_of


def watched(step, *args):
    w = opwatch.watch(warn=False, dump_on_error=False)
    with w:
        result = step(*args)
    return w, result


def nonfinite(w):
    return [a for a in w.anomalies if a.kind in ("nan", "inf")]


def cause_line(anomaly) -> str:
    (line,) = [line for line in anomaly.message.splitlines() if line.startswith("  cause:")]
    return line


class HandRMSNorm(nn.Module):
    """RMSNorm as often written by hand: the variance in the input's dtype (LlamaRMSNorm
    computes it in float32)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.norm = HandRMSNorm(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(self.norm(self.up(x)))


# --------------------------------------------------------------------------------------------
# precision
# --------------------------------------------------------------------------------------------


def test_a_float16_rmsnorm_written_by_hand_overflows_and_is_reported_though_rsqrt_absorbs_it():
    torch.manual_seed(0)
    block = Block().half()
    tokens = torch.randn(10, 16).half() * 400  # activations of several hundred: x.pow(2) passes 65504

    def forward(x):
        out = block(x)
        return out.float().sum().item()

    w, total = watched(forward, tokens)
    assert math.isfinite(total)  # nothing non-finite reached the result: the tokens were zeroed
    (anomaly,) = nonfinite(w)
    assert anomaly.op == "aten.pow.Tensor_Scalar" and anomaly.kind == "inf"
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == PRECISION and cause.dtype == torch.float16 and cause.wider == torch.float32
    assert cause.largest > torch.finfo(torch.float16).max
    assert anomaly.finding.facts["absorbed"] and not w.contained
    assert "precision: pow made inf in f16, but not in f32" in cause_line(anomaly)
    assert "LlamaRMSNorm" in anomaly.message and "absorbed" in anomaly.message
    absorbed_by = anomaly.finding.facts["absorbed_by"]
    assert absorbed_by is not None and absorbed_by.op.startswith("aten.rsqrt")
    assert f"a later op ({absorbed_by.op} at " in anomaly.message


def test_an_overflow_no_op_reads_is_not_reported_as_absorbed():
    """Weight norm computed on leftover memory, as in transformers' wav2vec2 tests (a model built
    on the meta device, ``to_empty()``, then ``_init_weights`` reads the weight-normed conv's
    ``weight`` before initialising its parts): the norm overflows, the computed weight is
    overwritten by ``init.normal_`` and no op reads the inf. Then the parts are initialised and
    the conv trains: nothing to report. The same overflow read by an op (rsqrt(inf) = 0, above)
    is reported."""
    torch.manual_seed(0)
    conv = nn.Conv1d(16, 8, 5)
    v = nn.Parameter(torch.full((8, 16, 5), 3e36))  # what the leftover memory held there
    g = nn.Parameter(torch.ones(1, 1, 5))
    optimizer = torch.optim.SGD([v, g, conv.bias], lr=0.01)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        weight = torch._weight_norm(v, g, dim=2)  # what reading a weight-normed conv's .weight computes
        nn.init.normal_(weight, std=0.02)  # the initialisation overwrites it; nothing reads the inf
        del weight
        w.check()  # a check point before the parts are initialised (a host read in between)
        with torch.no_grad():
            v.normal_()
        loss = F.conv1d(torch.randn(2, 16, 12), torch._weight_norm(v, g, dim=2), conv.bias).pow(2).mean()
        loss.backward()
        optimizer.step()
        loss.item()
    assert nonfinite(w) == [], [a.message for a in nonfinite(w)]
    assert [a.op for a in w.contained] == ["aten._weight_norm_interface.default"]


def test_the_same_rmsnorm_in_float32_reports_nothing():
    torch.manual_seed(0)
    block = Block()
    w, total = watched(lambda x: block(x).sum().item(), torch.randn(10, 16) * 400)
    assert math.isfinite(total) and w.anomalies == [] and w.contained == []


def test_float16_attention_scores_that_overflow_are_a_precision_cause():
    torch.manual_seed(0)
    q = torch.randn(2, 8, 32).half() * 60
    k = torch.randn(2, 8, 32).half() * 60
    v = torch.randn(2, 8, 32).half()

    def attention(q, k, v):
        scores = q @ k.transpose(-1, -2)  # not scaled by 1/sqrt(d): overflows float16
        return (scores.softmax(-1) @ v).float().mean().item()

    w, _ = watched(attention, q, k, v)
    first = nonfinite(w)[0]
    assert first.kind == "inf" and first.finding.facts["cause"].kind == PRECISION
    assert "precision:" in cause_line(first) and "made inf in f16" in cause_line(first)


def test_a_float16_softmax_written_by_hand_overflows_in_exp():
    torch.manual_seed(0)
    head = nn.Linear(16, 10).half()
    features = torch.randn(4, 16).half() * 20  # logits up to a few tens: exp(12) passes 65504

    def classify(x):
        logits = head(x)
        e = logits.exp()  # softmax by hand, without subtracting the max
        return (e / e.sum(-1, keepdim=True)).float().sum().item()

    w, _ = watched(classify, features)
    first = nonfinite(w)[0]
    assert first.op == "aten.exp.default"
    cause = first.finding.facts["cause"]
    assert cause.kind == PRECISION and cause.dtype == torch.float16 and cause.wider == torch.float32
    assert "subtract the max" in first.message


# --------------------------------------------------------------------------------------------
# undefined math
# --------------------------------------------------------------------------------------------


def test_log_of_zero_in_a_loss_is_undefined_math():
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    x = torch.randn(6, 8)
    target = torch.tensor([0, 0, 2, 0, 2, 1])
    with torch.no_grad():
        # Logits thousands apart: a softmax probability is 0 in float64 too (at a few hundred
        # apart it is not, and the cause is the softmax's underflow: see the in-place case below).
        model.weight[1] *= 4000

    def step():
        probs = model(x).softmax(-1)
        loss = -probs.gather(1, target[:, None]).log().mean()  # the likelihood by hand: log(p[target])
        loss.backward()
        return loss.item()

    w, _ = watched(step)
    first = nonfinite(w)[0]
    assert first.op == "aten.log.default"
    assert first.finding.facts["cause"] == Cause(MATH, "log_zero")
    assert cause_line(first) == "  cause:    undefined math: log(0) = -inf, in float64 too"


@pytest.mark.parametrize("first", [0.0, 0.1], ids=["a probability of 0", "healthy"])
def test_a_cache_that_starts_empty_keeps_the_range_of_what_is_joined_to_it(first):
    """A cache grown by ``torch.cat`` from an empty tensor (Hugging Face's DynamicCache does
    so in a training forward): the empty part holds no values, so the cat holds the range of
    what was joined, and log(0) of it is decided (it was "not decided": the empty tensor's
    range is never read, and it was gone by the check point)."""
    logits = torch.tensor([[first, 0.5, 0.2, 0.2]])

    def step():
        cache = torch.empty(0, 4)
        for _ in range(2):
            cache = torch.cat([cache, logits * 1.0])  # JOINED TO AN EMPTY CACHE
        return -cache.log().mean().item()

    w, loss = watched(step)
    if first:
        assert math.isfinite(loss) and w.anomalies == []
        return
    found = nonfinite(w)[0]
    assert found.op == "aten.log.default" and found.finding.facts["cause"] == Cause(MATH, "log_zero")
    assert "range unknown" not in found.message


def test_an_in_place_op_is_not_taken_for_an_input_that_already_held_its_result():
    """``log_`` writes its inf into its own input: that input is not one that held it."""
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    with torch.no_grad():
        model.weight[1] *= 400

    def step(x):
        probs = model(x).softmax(-1)
        return probs.log_().mean().item()  # in place: probs holds the -inf now

    w, _ = watched(step, torch.randn(6, 8))
    (anomaly,) = nonfinite(w)
    assert anomaly.op == "aten.log_.default"
    # Not "undefined math": the probability that is 0 underflowed in the float32 softmax, and
    # the chain run again in float64 is finite (issue 39).
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == PRECISION and cause.went.op == "aten._softmax.default" and cause.went_to == "0", anomaly.message


def test_the_causes_of_one_check_point_walk_the_live_objects_once(monkeypatch):
    """Finding a cause looks its tensors up among the live objects (the origin's inputs, then
    the ops before it that run again, then the module holding a weight): one walk of every
    object of the process serves them all."""
    import gc
    import types

    from opwatch.checks.nonfinite import cause as causes

    walks = []
    monkeypatch.setattr(causes, "gc", types.SimpleNamespace(get_objects=lambda: walks.append(1) or gc.get_objects()))
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    head = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[1] *= 400
        head.weight[0, 1] = float("nan")  # loaded from a broken checkpoint

    def step(x):
        probs = model(x).softmax(-1)
        underflowed = probs.log_().mean()  # the softmax's underflow: a chain run again
        return underflowed, head(torch.ones(3))  # a weight holding nan: its module named

    w, _ = watched(step, torch.randn(6, 8))
    kinds = sorted(anomaly.finding.facts["cause"].kind for anomaly in nonfinite(w))
    assert kinds == sorted([PRECISION, WEIGHTS]), [a.message for a in nonfinite(w)]
    assert len(walks) == 1


# --------------------------------------------------------------------------------------------
# an input, a parameter
# --------------------------------------------------------------------------------------------


def loader_with_a_nan():
    torch.manual_seed(0)
    features = torch.randn(32, 4)
    features[5, 2] = float("nan")  # a broken row in the data set
    return DataLoader(TensorDataset(features, torch.randn(32, 1)), batch_size=8)


def test_a_batch_holding_nan_from_the_data_loader_is_named_as_the_input():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    found = []
    for x, y in loader_with_a_nan():  # batches made outside the watch, as a trainer's are
        with opwatch.watch(warn=False, dump_on_error=False) as w:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        found.append(nonfinite(w))
    # One story per step, not one per op: the nan of the first batch, then the weights it poisoned
    # (its gradient went through the optimizer into every parameter).
    assert [len(anomalies) for anomalies in found] == [1, 1, 1, 1]
    assert [anomalies[0].finding.facts["cause"].kind for anomalies in found] == [INPUT, WEIGHTS, WEIGHTS, WEIGHTS]
    (anomaly,) = found[0]
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == INPUT and cause.held == "nan" and tuple(cause.tensor.shape) == (8, 4)
    assert cause.made.how == "before_watch"
    assert "from finite inputs" not in anomaly.message and "lower the learning rate" not in anomaly.message
    assert "input: input f32[8, 4] cpu already held nan when addmm ran" in cause_line(anomaly)
    assert "check the data" in anomaly.message


def test_a_label_holding_nan_that_the_step_only_reshapes_came_with_the_batch():
    """A regression step takes its labels out of the batch and squeezes them for the loss (a
    Hugging Face ``compute_loss``): the watch began after the batch was made, and the squeeze only
    moved the label's nan. Its cause named the squeeze as where the input was made ("made by
    aten.squeeze.dim"), so the guard's replay counted a bad batch as "nan/inf in the gradients";
    it came with the batch (``came_with``: input)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, labels = torch.randn(8, 4), torch.rand(8, 1)
    labels[3] = float("nan")  # one bad label, in the batch before the step
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        target = labels.squeeze(-1)
        loss = F.mse_loss(model(x).squeeze(-1), target)  # LABELS SQUEEZED
        loss.backward()
    (anomaly,) = nonfinite(w)
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == INPUT and cause.held == "nan" and cause.made.how == "before_watch"
    assert anomaly.came_with == "input"
    assert anomaly.lineno == line_of("LABELS SQUEEZED", __file__)
    assert "made by aten.squeeze" not in anomaly.message


def test_a_clean_loader_reports_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for x, y in data:
            F.mse_loss(model(x), y).backward()
    assert w.anomalies == [] and w.contained == []


def test_a_linear_whose_weight_holds_nan_is_named_as_the_weights(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[2].weight[1, 3] = float("nan")  # loaded from a broken checkpoint
    x = torch.randn(5, 4)
    w, _ = watched(lambda: model(x).sum().backward())
    (anomaly,) = nonfinite(w)
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == WEIGHTS and cause.held == "nan"
    assert cause.made.how == "parameter" and cause.made.name == "weight" and cause.made.cls == "Linear"
    assert "weights: parameter f32[2, 8] cpu already held nan" in cause_line(anomaly)
    assert "checkpoint" in anomaly.message
    # The cause is a fact: saved and read back, the message is rendered again the same.
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    (saved,) = [a for a in load(path).anomalies if a.kind in ("nan", "inf")]
    assert saved.finding.facts["cause"] == cause and isinstance(saved.finding.facts["cause"], Cause)
    assert saved.message == anomaly.message


def test_a_batchnorm_buffer_holding_nan_is_named_as_the_buffer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1)).eval()
    model[1].running_var[2] = float("nan")  # a running statistic updated from a bad batch
    w, _ = watched(lambda: model(torch.randn(5, 4)).sum().item())
    (anomaly,) = nonfinite(w)
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == INPUT and cause.made.how == "buffer" and cause.made.name == "running_var"
    assert "it is the buffer running_var of BatchNorm1d" in cause_line(anomaly)
    assert "running statistic" in anomaly.message


def test_an_input_made_before_the_watch_and_gone_by_the_check_point_was_checked_when_first_read():
    """Gradient accumulation watched as a whole, on the CPU (a host read there is no check
    point; the optimizer step is): the first micro-batch, made before the watch and holding nan,
    is gone when the step comes. It was checked when the first op read it, so the cause is
    known: the input, not the math, and no "range unknown"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pending = [torch.randn(8, 4) for _ in range(3)]
    pending[0][3, 1] = float("nan")
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        while pending:
            x = pending.pop(0)
            (model(x).pow(2).mean() / 3).backward()
        del x
        optimizer.step()
        optimizer.zero_grad()
    (anomaly,) = nonfinite(w)
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == INPUT and cause.held == "nan" and tuple(cause.tensor.shape) == (8, 4)
    assert anomaly.op == "aten.addmm.default"
    assert "from finite inputs" not in anomaly.message and "range unknown" not in anomaly.message
    assert "made before the watch" in cause_line(anomaly)


def _legacy_checkpoint(tmp_path, poisoned: bool) -> str:
    """A Linear's state dict saved in torch.save's legacy format (transformers' save/load tests
    use it): loading it builds each tensor with ``set_`` on a fresh storage, then reads the file
    into the storage with no op."""
    torch.manual_seed(0)
    source = nn.Linear(64, 32)
    if poisoned:
        with torch.no_grad():
            source.weight[3, 5] = float("nan")
    path = str(tmp_path / "legacy.bin")
    torch.save(source.state_dict(), path, _use_new_zipfile_serialization=False)
    return path


def _load_and_train(path):
    model = nn.Linear(64, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    garbage = [torch.full((64 * 32,), float("nan")) for _ in range(4)]  # freed memory holding nan
    del garbage
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        model.load_state_dict(torch.load(path, weights_only=True))  # LOAD
        loss = model(torch.randn(8, 64)).pow(2).mean()
        loss.backward()
        optimizer.step()
        loss.item()
    return w


def test_a_finite_legacy_checkpoint_is_not_read_before_its_bytes_are(tmp_path):
    """``set_`` makes no value: its storage is filled after it, with no op. What an op first reads
    of it is checked then (here the load's ``copy_`` into the parameters): finite, so nothing."""
    w = _load_and_train(_legacy_checkpoint(tmp_path, poisoned=False))
    assert nonfinite(w) == [] and w.contained == []


def test_a_legacy_checkpoint_holding_nan_is_found_where_the_weight_feeds_the_forward(tmp_path):
    """The load's ``copy_`` into the parameters writes the nan, but copies it from torch.load's
    tensors (made by ``set_``, filled with no op): no op made it, so the first op the weight
    feeds (the forward's ``addmm``) is the origin, its cause the weights, loaded; never "made
    nan from finite inputs" or "lower the learning rate" (issue 39 moved it from the load's
    ``copy_``, cause unknown)."""
    w = _load_and_train(_legacy_checkpoint(tmp_path, poisoned=True))
    first = nonfinite(w)[0]
    assert first.op == "aten.addmm.default" and first.record.lineno == line_of("# LOAD", __file__) + 1
    cause = first.finding.facts["cause"]
    assert cause.kind == WEIGHTS and cause.made.name == "weight", cause
    assert cause.loaded.op == "aten.copy_.default" and cause.loaded.lineno == line_of("# LOAD", __file__)
    assert "made nan from finite inputs" not in first.message and "learning rate" not in first.message
    assert "it came from the loaded state" in cause_line(first) and "the checkpoint holds nan" in first.message


def test_a_finite_input_made_before_the_watch_and_gone_gives_its_range_to_the_cause():
    """An fp16 activation made before the watch (finite, up to 300) and gone by the check point:
    its range was read when first seen, so the overflow of ``x * x`` is a precision cause with a
    bound, not "range unknown"."""
    pending = [torch.full((4, 8), 300.0, dtype=torch.float16)]
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        x = pending.pop()
        y = x * x  # 90000 > float16's 65504
        del x
        total = y.float().sum()
        total.item()
    (anomaly,) = nonfinite(w)
    cause = anomaly.finding.facts["cause"]
    assert anomaly.op == "aten.mul.Tensor"
    assert cause.kind == PRECISION and cause.wider == torch.float32, cause
    assert "range unknown" not in anomaly.message


def test_a_mask_buffer_holding_minus_inf_made_before_the_watch_stays_silent():
    """A causal mask registered as a buffer in ``__init__`` (before the watch) holds -inf on
    purpose: checked when first read, it counts as a constant, like ``masked_fill(-inf)``."""

    class MaskedAttention(nn.Module):
        def __init__(self, width=16, length=6):
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.out = nn.Linear(width, width)
            mask = torch.full((length, length), float("-inf")).triu(1)
            self.register_buffer("mask", mask)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            scores = q @ k.transpose(-2, -1) / 4 + self.mask
            return self.out(scores.softmax(-1) @ v)

    torch.manual_seed(0)
    model = MaskedAttention()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(3):
            loss = model(torch.randn(2, 6, 16)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        loss.item()
    assert nonfinite(w) == []


# --------------------------------------------------------------------------------------------
# healthy training: nothing
# --------------------------------------------------------------------------------------------


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def batches(count=4):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)) for _ in range(count)]


@pytest.mark.parametrize("mode", ["float32", "bfloat16 autocast", "float16 + GradScaler"])
def test_a_healthy_training_loop_reports_nothing(mode):
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if mode.startswith("float16") else None
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for x, y in batches():
            if mode == "bfloat16 autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
            elif scaler is not None:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
            else:
                loss = F.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad()
            assert math.isfinite(loss.item())
    assert nonfinite(w) == []


# -- losses whose nan/inf has a cause of their own ---------------------------------------------------


class TinySpeechModel(nn.Module):
    """A convolutional encoder that halves the frames twice, then a CTC head (wav2vec2-style)."""

    def __init__(self, features=8, vocab=6):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv1d(features, 16, 3, stride=2, padding=1), nn.GELU(), nn.Conv1d(16, 16, 3, stride=2, padding=1), nn.GELU())
        self.head = nn.Linear(16, vocab)

    def forward(self, audio):  # (batch, features, frames) -> (frames / 4, batch, vocab) log-probabilities
        return self.head(self.encoder(audio).transpose(1, 2)).log_softmax(-1).transpose(0, 1)


def _ctc_training(frames, target_length, zero_infinity=False, steps=2):
    torch.manual_seed(0)
    model = TinySpeechModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = nn.CTCLoss(zero_infinity=zero_infinity)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(steps):
            audio = torch.randn(2, 8, frames)
            log_probs = model(audio)
            targets = torch.randint(1, 6, (2, target_length))
            input_lengths = torch.full((2,), log_probs.shape[0], dtype=torch.long)
            loss = criterion(log_probs, targets, input_lengths, torch.full((2,), target_length, dtype=torch.long))  # CTC LOSS
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w


def test_a_clip_shorter_than_its_transcript_makes_ctc_inf_with_its_own_cause():
    w = _ctc_training(frames=16, target_length=9)  # 4 encoder frames for 9 labels
    (origin, *_) = nonfinite(w)
    assert (origin.kind, origin.op, origin.lineno) == ("inf", "aten._ctc_loss.Tensor", line_of("# CTC LOSS", __file__))
    assert origin.finding.facts["cause"] == Cause(MATH, "ctc_no_alignment")
    assert cause_line(origin) == (
        "  cause:    undefined math: CTC's loss is inf for a sample no alignment fits: its input is shorter than its target "
        "(plus one step between each pair of repeated labels), in float64 too"
    )
    assert "  fix:      pass zero_infinity=True to ctc_loss (nn.CTCLoss(zero_infinity=True))" in origin.message


@pytest.mark.parametrize("frames, target_length, zero_infinity", [(64, 9, False), (16, 9, True)])
def test_ctc_with_room_for_the_transcript_or_zero_infinity_reports_nothing(frames, target_length, zero_infinity):
    assert nonfinite(_ctc_training(frames, target_length, zero_infinity=zero_infinity)) == []


def _token_loss_training(labels_of, clamp):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 20))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for step in range(3):
            tokens = torch.randint(0, 20, (4, 6))
            labels = labels_of(step, tokens)
            logits = model(tokens)
            summed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            count = (labels != -100).sum()
            loss = summed / (count.clamp_min(1) if clamp else count)  # MEAN OVER LABELS
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w


def _all_ignored_at_step_1(step, tokens):
    return torch.full_like(tokens, -100) if step == 1 else tokens


def test_a_batch_whose_labels_are_all_ignored_divides_zero_by_a_zero_count():
    (origin, *_) = nonfinite(_token_loss_training(_all_ignored_at_step_1, clamp=False))
    assert (origin.kind, origin.op, origin.lineno) == ("nan", "aten.div.Tensor", line_of("# MEAN OVER LABELS", __file__))
    assert ("  fix:      0 / 0 = nan: the divisor is a count (an integer tensor) that is 0, a batch with nothing to count "
            "(every label ignored, an empty mask): skip such batches, or divide by count.clamp_min(1)") in origin.message


def test_the_count_clamped_or_labels_present_report_nothing():
    assert nonfinite(_token_loss_training(_all_ignored_at_step_1, clamp=True)) == []
    assert nonfinite(_token_loss_training(lambda step, tokens: tokens, clamp=False)) == []


def test_a_float_divisor_of_zero_keeps_the_epsilon_fix():
    """A masked mean whose float mask is all zeros: a float divisor, not a count."""
    values, mask = torch.randn(4, 5), torch.zeros(4, 5)
    w, pooled = watched(lambda: (values * mask).sum(1) / mask.sum(1))
    (origin, *_) = nonfinite(w)
    assert origin.op == "aten.div.Tensor" and not torch.isfinite(pooled).any()
    assert "  fix:      0 / 0 = nan: add an epsilon to the denominator" in origin.message


# -- a nan the program wrote itself ---------------------------------------------------------------


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(x)


def _missing_targets_training(loss_of, steps=3, guarded=False):
    """Multi-target regression where some targets are missing: the step marks them with nan
    (``torch.where(observed, y, nan)``), logs the loss with ``.item()`` (a check point between
    forward and backward), then steps."""
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logged = []

    def step(x, y, observed):
        y = torch.where(observed, y, torch.nan)  # MISSING AS NAN
        loss = loss_of(model(x), y, observed)
        logged.append(loss.item())
        loss.backward()
        return loss

    run = opwatch.guard(step, model, repro=False) if guarded else step
    with opwatch.watch(warn=False, dump_on_error=False) if not guarded else _no_watch() as w:
        for _ in range(steps):
            x, y = torch.randn(16, 6), torch.randn(16, 3)
            observed = torch.rand(16, 3) > 0.2
            optimizer.zero_grad()
            run(x, y, observed)
            optimizer.step()
    return w, run


class _no_watch:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _mse_everywhere(pred, y, observed):
    return F.mse_loss(pred, y)


def _nanmean(pred, y, observed):
    return ((pred - y) ** 2).nanmean()


def _mse_observed(pred, y, observed):
    return F.mse_loss(pred[observed], y[observed])


def test_a_nan_written_as_a_missing_target_is_named_where_it_was_written():
    w, _ = _missing_targets_training(_mse_everywhere)
    found = nonfinite(w)
    assert [(a.op, a.lineno) for a in found] == [("aten.scalar_tensor.default", line_of("# MISSING AS NAN", __file__))], [a.message for a in found]
    (origin,) = found
    assert "  problem:  the program wrote nan here (aten.scalar_tensor" in origin.message
    assert "and it reached the loss, aten.mse_loss.default at " in origin.message
    assert cause_line(origin) == "  cause:    deliberate: the program wrote this nan itself (scalar_tensor of a nan constant): no op made it; it reached the loss"
    assert "select the valid entries first (pred[valid], target[valid])" in origin.message


def test_a_nan_left_out_of_the_loss_by_nanmean_still_reaches_the_gradients():
    found = nonfinite(_missing_targets_training(_nanmean, steps=1)[0])  # (the next steps' weights hold nan)
    assert [(a.op, a.lineno) for a in found] == [("aten.scalar_tensor.default", line_of("# MISSING AS NAN", __file__))]
    assert "it reached the gradients (the loss itself is finite" in found[0].message


def test_guard_replays_the_missing_target_to_where_it_was_written_not_to_a_backward_op():
    with pytest.raises(opwatch.AnomalyError) as raised:
        _missing_targets_training(_mse_everywhere, guarded=True)
    anomaly = raised.value.anomaly
    assert (anomaly.op, anomaly.lineno) == ("aten.scalar_tensor.default", line_of("# MISSING AS NAN", __file__)), anomaly.message


def test_missing_targets_selected_out_and_nan_placeholders_never_used_report_nothing():
    assert nonfinite(_missing_targets_training(_mse_observed)[0]) == []
    scores = torch.full((5,), float("nan"))  # a metric table, filled as batches come
    with opwatch.watch(warn=False) as w:
        table = torch.full((8,), torch.nan)
        for i in range(5):
            table[i] = scores.nan_to_num(0.5)[i] * 2
        mean = torch.nanmean(table)
        listed = table.tolist()
    assert nonfinite(w) == [] and math.isfinite(mean.item()) and math.isnan(listed[-1])
