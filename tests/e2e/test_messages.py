"""Messages that are right on realistic training code (issue 20, items 8-11): where an odd
tensor came from in the user's words, the inputs' ranges at a nan/inf origin, a fix that fits
each cause, and a loss function's broadcast counted once per step."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opwatch
from opwatch.checks.nonfinite.rules import ValueRange
from opwatch.render.messages import explain
from support.helpers import line_of


def watched(program, **options):
    options.setdefault("warn", False)
    options.setdefault("dump_on_error", False)
    with opwatch.watch(**options) as w:
        program()
    return w


# -- a loss function's broadcast: once per step ----------------------------------------------


def train_regressor(loss_fn, steps=8, flat_target=False, **loss_options):
    """A small regressor whose (B, 1) prediction meets a (B,) target in ``loss_fn`` (the bug),
    or a target of the same shape (``flat_target``: the fix, ``pred.squeeze(-1)``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x, y = torch.randn(16, 4), torch.randn(16)
        pred = model(x)
        if flat_target:
            pred = pred.squeeze(-1)
        loss = loss_fn(pred, y, **loss_options)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


LOSSES = [F.smooth_l1_loss, F.mse_loss, F.l1_loss, F.huber_loss]


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("loss_fn", LOSSES, ids=lambda fn: fn.__name__)
def test_a_broadcast_inside_a_loss_function_is_one_anomaly_per_step(loss_fn):
    w = watched(lambda: train_regressor(loss_fn, steps=8))
    found = [a for a in w.anomalies if a.kind == "broadcast"]
    assert len(found) == 8, [(a.index, a.op) for a in found]
    assert {a.finding.rule for a in found} == {"broadcast.tensors"}
    # one place, at the loss call, each the second expand of one broadcast_tensors call
    assert len({(a.filename, a.lineno) for a in found}) == 1
    assert all(a.finding.facts["result"] == (16, 16) for a in found)


def _kl_div(pred, target):
    return F.kl_div(pred, target, reduction="batchmean")


def _gaussian_nll(pred, target):
    return F.gaussian_nll_loss(pred, target, torch.ones(target.shape[0]))


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("loss_fn", [_kl_div, F.poisson_nll_loss, _gaussian_nll], ids=lambda fn: fn.__name__)
def test_losses_that_broadcast_in_a_pointwise_op_are_also_one_anomaly_per_step(loss_fn):
    w = watched(lambda: train_regressor(loss_fn, steps=4))
    found = [a for a in w.anomalies if a.kind == "broadcast"]
    assert len(found) == 4 and {a.finding.rule for a in found} == {"broadcast.implicit"}


@pytest.mark.parametrize("loss_fn", [F.binary_cross_entropy_with_logits, F.soft_margin_loss], ids=lambda fn: fn.__name__)
def test_losses_that_refuse_other_shapes_raise_torchs_own_error_and_report_no_broadcast(loss_fn):
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        with pytest.raises((ValueError, RuntimeError)):
            train_regressor(loss_fn, steps=1)
    assert [a for a in w.anomalies if a.kind == "broadcast"] == []


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_loss_broadcast_once_per_step_also_with_reduction_sum_and_under_bf16_autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = watched(lambda: train_regressor(F.mse_loss, steps=5, reduction="sum"))
    assert len([a for a in w.anomalies if a.kind == "broadcast"]) == 5


@pytest.mark.parametrize("loss_fn", LOSSES, ids=lambda fn: fn.__name__)
def test_a_loss_on_shapes_that_agree_is_quiet_over_steps(loss_fn):
    with opwatch.strict(dump_on_error=False) as w:
        train_regressor(loss_fn, steps=8, flat_target=True)
    assert w.anomalies == []


def test_two_losses_on_one_line_with_agreeing_shapes_pair_no_expands_across_calls():
    """Two broadcast_tensors calls on one line, one step after another, with every expand a
    no-op on its own: no expand of one call pairs with an expand of the next."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with opwatch.strict(dump_on_error=False) as w:
        for _ in range(4):
            out = model(torch.randn(8, 4))
            loss = F.mse_loss(out[:, 0], torch.zeros(8)) + F.l1_loss(out[:, 1], torch.ones(8))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert w.anomalies == []


# -- each nan/inf explanation's fix fits its cause ---------------------------------------------


class Scorer(nn.Module):
    """A small MLP head whose raw output feeds a numerically fragile loss term."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x)


def _log_of_a_linear_output(safe):
    out = SCORER_OUT[0]
    return (F.softplus(out) + 1e-6).log() if safe else out.log()  # a "rate" that can go negative


def _sqrt_of_a_variance(safe):
    out = SCORER_OUT[0]
    variance = (out**2).mean(-1) - out.mean(-1) ** 2 - 0.5  # an estimate that can dip below 0
    return variance.clamp_min(0).add(1e-6).sqrt() if safe else variance.sqrt()


def _acos_of_a_cosine(safe):
    out = SCORER_OUT[0]
    cosine = F.normalize(out, dim=-1) @ F.normalize(out, dim=-1).T * 1.001  # rounds past 1
    return cosine.clamp(-1 + 1e-6, 1 - 1e-6).acos() if safe else cosine.acos()


def _exp_of_large_logits(safe):
    logits = SCORER_OUT[0] * 200.0
    return logits.softmax(-1) if safe else logits.exp() / logits.exp().sum(-1, keepdim=True)


def _log_of_a_masked_probability(safe):
    probability = torch.sigmoid(SCORER_OUT[0]) * (SCORER_OUT[0] > 0)
    return probability.clamp_min(1e-6).log() if safe else probability.log()


SCORER_OUT: list = [None]


def train_scorer(term, safe=False, steps=3):
    torch.manual_seed(0)
    model = Scorer()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        SCORER_OUT[0] = model(torch.randn(8, 4))
        loss = term(safe).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    SCORER_OUT[0] = None
    return losses


# term, kind, op, words of the reason, words of the fix, words that belong to another cause
TERMS = [
    (_log_of_a_linear_output, "nan", "aten.log.default", "log of a negative number is nan", "must be positive", "log(0)"),
    (_log_of_a_masked_probability, "inf", "aten.log.default", "log(0) = -inf", "clamp_min(eps).log()", "negative"),
    (_sqrt_of_a_variance, "nan", "aten.sqrt.default", "sqrt of a negative number is nan", "clamp_min(0).sqrt()", "log"),
    (_acos_of_a_cosine, "nan", "aten.acos.default", "acos of a value outside [-1, 1] is nan", "x.clamp(-1, 1)", "overflow"),
    (_exp_of_large_logits, "inf", "aten.exp.default", "exp overflows f32 above 88.72", "subtract the max", "negative"),
]


@pytest.mark.parametrize("term, kind, op, reason, fix_words, wrong", TERMS, ids=[t[0].__name__ for t in TERMS])
def test_a_nan_or_inf_in_a_training_loss_is_explained_by_its_own_cause(term, kind, op, reason, fix_words, wrong):
    w = watched(lambda: train_scorer(term))
    anomaly = next(a for a in w.anomalies if a.kind in ("nan", "inf"))
    assert (anomaly.kind, anomaly.op, anomaly.phase) == (kind, op, "forward")
    problem, _, fix = explain(anomaly.finding)
    assert f"-> {reason}" in problem, problem
    assert fix_words in fix and wrong not in fix, fix


@pytest.mark.parametrize("term", [t[0] for t in TERMS], ids=[t[0].__name__ for t in TERMS])
def test_the_fixed_training_loss_is_quiet(term):
    with opwatch.strict(dump_on_error=False) as w:
        losses = train_scorer(term, safe=True)
    assert w.anomalies == [] and all(map(lambda value: value == value and abs(value) != float("inf"), losses))


# -- where the odd tensor came from, in the user's words ---------------------------------------


class Head(nn.Module):
    def __init__(self, class_weights):
        super().__init__()
        self.proj = nn.Linear(16, 3)
        self.register_buffer("class_w", class_weights)

    def forward(self, h):
        return self.proj(h)


class SeqClassifier(nn.Module):
    """Token embeddings, mean-pooled, and a head that holds per-class loss weights."""

    def __init__(self, class_weights):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.head = Head(class_weights)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))

    def weighted_loss(self, logits, labels):
        per_example = F.cross_entropy(logits, labels, reduction="none")
        return (per_example * self.head.class_w[labels]).mean()  # weighted inside the model


def train_classifier(class_weights, steps=3, inside=False):
    import numpy as np

    torch.manual_seed(0)
    model = SeqClassifier(class_weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        tokens, labels = torch.randint(0, 20, (8, 5)), torch.randint(0, 3, (8,))
        logits = model(tokens)
        if inside:
            loss = model.weighted_loss(logits, labels)
        else:
            per_example = F.cross_entropy(logits, labels, reduction="none")
            loss = (per_example * model.head.class_w[labels]).mean()  # the weighted loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del np


def _float64_weights():
    import numpy as np

    return torch.from_numpy(np.array([1.0, 2.0, 0.5]))  # float64, as numpy makes it


@pytest.mark.parametrize("inside", [False, True], ids=["training_loop", "model_method"])
def test_an_indexed_float64_buffer_is_named_as_the_module_buffer(inside):
    w = watched(lambda: train_classifier(_float64_weights(), inside=inside))
    found = [a for a in w.anomalies if a.kind == "dtype_mismatch"]
    assert len(found) == 3  # once per step
    made = found[0].finding.made
    assert made[0].how == "made_by" and made[0].place.op == "aten.index.Tensor"
    assert made[0].detail == ("from_module", "buffer", "Head", "class_w", "head")
    assert "Where the odd one came from: f64[8] cpu: taken from the buffer class_w of Head (head) by aten.index.Tensor at " in found[0].message
    assert "lift_fresh" not in found[0].message


def test_float32_class_weights_are_quiet():
    with opwatch.strict(dump_on_error=False) as w:
        train_classifier(_float64_weights().float())
    assert w.anomalies == []


def _numpy_targets(make):
    """A regression loop whose targets come from numpy through ``make`` (float64)."""
    import numpy as np

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    table = np.linspace(0.0, 1.0, 16).reshape(2, 8)
    for _ in range(2):
        target = make(np, table)
        loss = ((model(torch.randn(8, 4)).squeeze(-1) - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("make, words", [
    (lambda np, table: torch.from_numpy(table[0]), "made by torch.from_numpy(table[0]) at "),
    (lambda np, table: torch.tensor(table[0]), "made by torch.tensor(table[0]) at "),
    (lambda np, table: torch.as_tensor(table)[1], "made by torch.as_tensor(table) at "),
], ids=["from_numpy", "tensor", "as_tensor_then_indexed"])
def test_numpy_data_is_named_by_the_users_call(make, words):
    w = watched(lambda: _numpy_targets(make))
    found = [a for a in w.anomalies if a.kind == "dtype_mismatch"]
    assert found, w.anomalies
    message = found[0].message
    assert words in message and "(Python or NumPy data entering torch)" in message, message
    assert "aten.lift_fresh" not in message
    if "as_tensor" in words:
        assert ", then taken by aten.select.int at " in message


def test_a_cast_of_numpy_data_is_where_the_odd_tensor_was_made():
    """``torch.from_numpy(a).double()``: the cast made the float64 tensor, not the numpy data."""
    w = watched(lambda: _numpy_targets(lambda np, table: torch.from_numpy(table[0].astype(np.float32)).double()))
    message = next(a for a in w.anomalies if a.kind == "dtype_mismatch").message
    assert "made by aten._to_copy at " in message and "Python or NumPy data" not in message


def test_the_new_provenance_facts_survive_the_jsonl_round_trip(tmp_path):
    """An export of the runs above reads back (``opwatch.load``) to the same messages."""
    w = watched(lambda: (train_classifier(_float64_weights(), steps=1), _numpy_targets(lambda np, table: torch.as_tensor(table)[1])))
    assert {made[0].detail.how for made in (a.finding.made for a in w.anomalies if a.finding.made)} >= {"from_module", "python_data"}
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    saved = opwatch.load(path)
    assert [str(a) for a in saved.anomalies] == [str(a) for a in w.anomalies]


# -- the inputs' ranges at a nan/inf origin ----------------------------------------------------


class PriorMixer(nn.Module):
    """Class probabilities mixed with a learned prior that is only moved (repeat, cat, a
    slice) before its log: one prior entry is 0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.prior = nn.Parameter(torch.tensor([0.5, 0.0, 0.25]))

    def forward(self, x):
        p = torch.softmax(self.fc(x), -1)
        prior = self.prior.repeat(x.shape[0], 1)  # a copy of the prior per row
        mixed = torch.cat([p, prior], -1)[:, 3:]  # moved, not computed
        return -(mixed.log() + p.log()).mean()  # log of the mixed prior


def _prior_model():
    torch.manual_seed(0)
    model = PriorMixer()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _health(message):
    return message.split("made inf from finite inputs (", 1)[1].split("); by the check point", 1)[0]


def test_the_range_of_an_input_only_moved_from_a_parameter_is_known():
    model, optimizer = _prior_model()
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(2):
            optimizer.zero_grad()
            loss = model(torch.randn(8, 4))
            loss.backward()
            optimizer.step()
    forward = next(a for a in w.anomalies if a.phase == "forward")
    assert forward.op == "aten.log.default"
    health = _health(forward.message)
    assert "range unknown" not in health
    assert "values taken from a range of min 0, max " in health and health.endswith("-> log(0) = -inf")
    (_, value_range), = forward.finding.facts["input_ranges"]
    assert value_range.low == 0.0 and value_range.within  # a bound, said as such


def test_guard_replay_knows_every_range():
    model, optimizer = _prior_model()

    def train_step(x):
        loss = model(x)
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, audit="never", repro=False)
    optimizer.zero_grad()
    with pytest.raises(opwatch.AnomalyError) as caught:
        step(torch.randn(8, 4))
    replayed = [a for a in step.last_replay.anomalies if a.kind in ("nan", "inf")]
    assert replayed and all("range unknown" not in a.message for a in replayed), [a.message for a in replayed]
    assert "-> log(0) = -inf" in str(caught.value)


def test_an_input_made_before_the_last_check_point_keeps_its_range():
    """log(0) in forward, read by .item(), then the inf of its gradient in backward: the
    divisor was made a check point earlier (the demo's story 3)."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(2):
            likelihood = torch.sigmoid(model(torch.randn(6, 6))) * torch.tensor([0.0, 1.0, 1.0, 1.0])
            target = -likelihood.log().mean()
            target.item()  # a check point between forward and backward
            optimizer.zero_grad()
            target.backward()
            optimizer.step()
    backward = next(a for a in w.anomalies if a.phase == "backward")
    assert backward.op == "aten.div.Tensor"
    health = _health(backward.message)
    assert "range unknown" not in health and "-> the divisor holds 0: x / 0 = inf" in health


def test_an_input_made_before_the_watch_and_dead_by_the_check_point_was_read_when_first_seen():
    """A tensor made before the watch is checked when an op first reads it: its range is known
    though it is gone by the check point, and none is made up."""
    x = torch.tensor([0.0, 2.0])
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        y = x.log()
        del x
        y.sum().item()
    (anomaly,) = w.anomalies
    assert "range unknown" not in anomaly.message
    ((_, value),) = anomaly.finding.facts["input_ranges"]
    assert (value.low, value.high) == (0.0, 2.0)
    assert "log(0) = -inf" in anomaly.message


def _log_of_a_sum_made_at_a_check_point(max_records):
    """``log(zeros + 0)`` with its ``add`` the last op of a window (every ``max_records`` ops
    is a check point, which finds that window finite and keeps no range): the sum is made on
    the same line inside the watch, and dead by the next check point."""
    with opwatch.watch(warn=False, dump_on_error=False, max_records=max_records) as w:
        for _ in range(3):  # 6 ops: aten.ones and aten.add
            torch.ones(2) + 1
        y = torch.log(torch.zeros(3) + 0)  # @same-line
        y.sum().item()
    (anomaly,) = w.anomalies
    return w, anomaly


def test_an_input_made_on_the_same_line_in_the_watch_is_not_said_made_before_it(tmp_path):
    w, anomaly = _log_of_a_sum_made_at_a_check_point(8)
    line = line_of("# @same-line", __file__)
    assert anomaly.op == "aten.log.default" and anomaly.lineno == line
    health = _health(anomaly.message)
    assert "before the watch" not in health
    assert health.startswith("input f32[3] cpu: range unknown (made by aten.add.Tensor at ")
    assert health.endswith(f"test_messages.py:{line}; its range was not kept, and it was no longer alive at the check point)")
    (made,) = anomaly.finding.facts["input_made"]
    assert (made.op, made.lineno) == ("aten.add.Tensor", line)
    # A saved log says the same.
    w.export_jsonl(tmp_path / "run.jsonl")
    (saved,) = opwatch.load(tmp_path / "run.jsonl").anomalies
    assert saved.message == anomaly.message


def test_an_input_whose_maker_left_the_log_is_said_so():
    _, anomaly = _log_of_a_sum_made_at_a_check_point(2)  # the log keeps 2 ops: the add is gone
    assert "range unknown (made by an op that has left the bounded log (max_records); no longer alive)" in anomaly.message
    assert anomaly.finding.facts["input_made"] == ("left_log",)


def test_healthy_training_with_moved_tensors_stays_quiet():
    model, optimizer = _prior_model()
    with torch.no_grad():
        model.prior.fill_(0.3)
    with opwatch.strict(dump_on_error=False) as w:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).backward()
            optimizer.step()
    assert w.anomalies == []


def test_ranges_and_bounds_survive_the_jsonl_round_trip(tmp_path):
    model, optimizer = _prior_model()
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        optimizer.zero_grad()
        model(torch.randn(8, 4)).backward()
    assert any(value.within for a in w.anomalies for _, value in a.finding.facts.get("input_ranges", ()) if value)
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    loaded = opwatch.load(path).anomalies
    assert [str(a) for a in loaded] == [str(a) for a in w.anomalies]
    assert {type(value) for a in loaded for _, value in a.finding.facts.get("input_ranges", ())} <= {ValueRange, type(None)}
    # A log written before ranges were tagged holds (min, max) and (min, max, "within") lists.
    untagged = tmp_path / "untagged.jsonl"
    untagged.write_text("".join(json.dumps(_untag_ranges(json.loads(line))) + "\n" for line in path.read_text().splitlines()))
    assert "value_range" not in untagged.read_text()
    assert [str(a) for a in opwatch.load(untagged).anomalies] == [str(a) for a in w.anomalies]


def _untag_ranges(value):
    if isinstance(value, dict) and set(value) == {"value_range"}:
        low, high, within = value["value_range"]
        return [low, high, "within"] if within else [low, high]
    if isinstance(value, dict):
        return {key: _untag_ranges(item) for key, item in value.items()}
    return [_untag_ranges(item) for item in value] if isinstance(value, list) else value


def test_a_buffer_replaced_between_steps_is_still_named_and_a_computed_tensor_is_not():
    torch.manual_seed(0)
    model = SeqClassifier(_float64_weights())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for step in range(3):
            if step == 1:
                model.head.class_w = _float64_weights() * 2.0  # a new buffer object, made in the watch
            tokens, labels = torch.randint(0, 20, (8, 5)), torch.randint(0, 3, (8,))
            logits = model(tokens)
            per_example = F.cross_entropy(logits, labels, reduction="none")
            if step == 2:
                weights = model.head.class_w[labels] * 0.5  # computed from the buffer: made by the mul
            else:
                weights = model.head.class_w[labels]
            loss = (per_example * weights).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    made = [a.finding.made[0] for a in w.anomalies if a.kind == "dtype_mismatch"]
    assert len(made) == 3
    assert made[0].detail == made[1].detail == ("from_module", "buffer", "Head", "class_w", "head")
    assert made[2].place.op == "aten.mul.Tensor" and made[2].detail is None


def test_an_input_alive_with_nan_at_the_check_point_is_not_said_dead():
    """A weight poisoned before the watch: still alive when the origin is reported, its values
    unreadable (nan); the message does not say it died, it says what the weight held (the
    weights cause, opwatch.checks.nonfinite.cause)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.bias[0] = float("nan")  # before the watch
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        model(torch.randn(5, 4)).sum().item()
    (anomaly,) = [a for a in w.anomalies if a.op == "aten.addmm.default"]
    assert "input f32[3] cpu: already held nan;" in anomaly.message
    assert "cause:    weights: parameter f32[3] cpu already held nan when addmm ran; it is the parameter bias of Linear" in anomaly.message
    assert "no longer alive" not in anomaly.message and "range unknown" not in anomaly.message
    assert anomaly.finding.facts["input_made"] == ("before_watch", None, None)
    assert anomaly.finding.facts["input_alive"] == (True, False, False)
