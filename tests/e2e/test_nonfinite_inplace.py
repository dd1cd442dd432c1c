"""A nan/inf made by an op that writes in place (``h.sqrt_()``, ``static.copy_(batch)``,
``p16.copy_(p32)``, ``ema.mul_(0.99)``): the op's ``self`` is its output, so a range read at
the check point is the value written. Each case, on a small training loop, must show the range
the input had before the write (the one the replay knew: the range of what last wrote it),
say so when that is not known, and give the cause that fits the op (``copy_`` does not read its
destination); each has a healthy twin that must report nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import opwatch
from opwatch.checks.nonfinite.cause import INPUT, MATH, PRECISION, UNKNOWN, WRITTEN, Cause
from opwatch.checks.nonfinite.rules import ValueRange
from opwatch.storage.jsonl import load
from support import SCENARIOS, assert_golden, needs_columns
from support.helpers import line_of as _line_of

import inplace as scenarios  # noqa: E402


def line_of(marker):
    return _line_of(marker, str(SCENARIOS / "inplace.py"))


def watched(program, *args):
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        program(*args)
    return w


def nonfinite(w):
    return [a for a in w.anomalies if a.kind in ("nan", "inf")]


def line(anomaly, start) -> str:
    (found,) = [text for text in anomaly.message.splitlines() if text.startswith(start)]
    return found


# -- h.sqrt_() of a negative finite activation ------------------------------------------------


@needs_columns
def test_sqrt_in_place_of_a_negative_activation_shows_the_range_before_the_write(tmp_path):
    w = watched(scenarios.train_sqrt_features)
    (anomaly,) = nonfinite(w)
    assert (anomaly.op, anomaly.lineno, anomaly.kind) == ("aten.sqrt_.default", line_of("# a square root in place"), "nan")
    facts = anomaly.finding.facts
    ((_, before),) = facts["input_ranges"]
    assert isinstance(before, ValueRange) and math.isfinite(before.low) and before.low < 0 < before.high
    assert facts["cause"] == Cause(MATH, "sqrt_negative")
    problem = line(anomaly, "  problem:")
    assert "made nan from finite inputs (input f32[4, 16] cpu, before sqrt wrote its result into it: min -" in problem
    assert "-> sqrt of a negative number is nan" in problem and "nan, max" not in problem
    assert line(anomaly, "  cause:") == "  cause:    undefined math: sqrt of a negative number is nan, in float64 too"
    assert_golden("message_inplace_sqrt.txt", anomaly.message + "\n")
    # Saved and read back, the message is rendered again the same (the written input is told
    # from the signature's idents).
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    (saved,) = [a for a in load(path).anomalies if a.kind == "nan"]
    assert saved.message == anomaly.message


def test_a_sqrt_in_place_of_positive_features_reports_nothing():
    w = watched(scenarios.train_sqrt_features, True)
    assert nonfinite(w) == []


def test_under_guard_the_replayed_step_shows_the_range_before_the_write_too():
    torch.manual_seed(0)
    model = scenarios.SqrtFeatures()
    x = torch.randn(4, 8)

    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    step = opwatch.guard(train_step, model, audit="never")
    with pytest.raises(opwatch.AnomalyError) as caught:
        step(x)
    anomaly = caught.value.anomaly
    assert anomaly.op == "aten.sqrt_.default"
    ((_, before),) = anomaly.finding.facts["input_ranges"]
    assert math.isfinite(before.low) and before.low < 0
    assert anomaly.finding.facts["cause"] == Cause(MATH, "sqrt_negative")


def test_sqrt_in_place_of_a_tensor_from_an_earlier_window_says_its_range_before_is_unknown():
    """The features were made before the last check point (a host read), whose ranges opwatch
    does not keep when all was finite: the range before the write is unknown, and the view's
    base, which holds the result now, is not taken for an input that already held nan."""
    torch.manual_seed(0)
    encode, head = nn.Linear(8, 16), nn.Linear(16, 1)
    optimizer = torch.optim.SGD([*encode.parameters(), *head.parameters()], lr=0.01)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(2):
            with torch.no_grad():
                features = encode(torch.randn(4, 8))
            print(f"features mean {features.mean().item():.3f}")  # a check point
            features[:, :8].sqrt_()  # compress the first half in place
            loss = head(features).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    anomaly = nonfinite(w)[0]
    assert anomaly.op == "aten.sqrt_.default"
    facts = anomaly.finding.facts
    ((_, before),) = facts["input_ranges"]
    assert before is None
    assert facts["cause"] is None or facts["cause"].kind not in (INPUT, UNKNOWN), facts["cause"]
    problem = line(anomaly, "  problem:")
    assert "made nan from finite inputs" in problem and "already held" not in anomaly.message
    assert "which sqrt wrote its result into: range before the write unknown (it held what aten.slice.Tensor at " in problem
    assert "min nan" not in problem


def test_a_write_into_a_view_makes_the_bases_range_unknown():
    """``h[:, 0].mul_(1e30)`` puts large values into ``h``: the range ``h`` had before (about 1)
    is stale, so the overflow of the next ``h.mul_`` gets no bound from it."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        with torch.no_grad():
            h = model(torch.randn(16, 8))
            h[:, 0].mul_(1e30)  # a scale column, finite
            h.mul_(1e10)  # overflows float32 in column 0
        print(h.sum().item())
    (anomaly,) = nonfinite(w)
    assert anomaly.op == "aten.mul_.Tensor" and anomaly.kind == "inf"
    ((_, before),) = anomaly.finding.facts["input_ranges"]
    assert before is None
    cause = anomaly.finding.facts["cause"]
    assert cause is None or cause.kind != PRECISION, cause
    assert "range before the write unknown" in anomaly.message


# -- static_x.copy_(batch) from a batch holding nan -------------------------------------------


def test_a_batch_holding_nan_copied_into_a_static_buffer_names_the_batch_not_the_buffer():
    w = watched(scenarios.train_from_static_input, scenarios.loader_batches(poisoned=True))
    anomaly = nonfinite(w)[0]
    assert (anomaly.op, anomaly.lineno) == ("aten.copy_.default", line_of("# the batch into the static buffer"))
    facts = anomaly.finding.facts
    cause = facts["cause"]
    assert cause.kind == INPUT and cause.held == "nan" and cause.made.how == "before_watch"
    destination, source = facts["inputs"]
    assert cause.tensor.ident == source[3] != destination[3]
    problem = line(anomaly, "  problem:")
    assert "made nan from an input that already held nan" in problem
    assert "input f32[4, 8] cpu: the destination, overwritten: copy does not read it; input f32[4, 8] cpu: already held nan" in problem
    assert "min nan" not in problem


def test_clean_batches_copied_into_a_static_buffer_report_nothing():
    w = watched(scenarios.train_from_static_input, scenarios.loader_batches(poisoned=False))
    assert nonfinite(w) == []


# -- p16.copy_(p32): float32 masters beyond what float16 holds --------------------------------


def test_a_float16_copy_of_large_master_weights_is_a_precision_cause_bounded_by_the_source():
    w = watched(scenarios.train_half_copy_of_master_weights, 1e6)
    anomaly = nonfinite(w)[0]
    assert (anomaly.op, anomaly.lineno, anomaly.kind) == ("aten.copy_.default", line_of("# refresh the float16 copy"), "inf")
    (_, destination), (_, source) = anomaly.finding.facts["input_ranges"]
    assert destination is None or math.isfinite(destination.low) and math.isfinite(destination.high)  # never the inf written
    cause = anomaly.finding.facts["cause"]
    largest = max(abs(source.low), abs(source.high))
    assert cause.kind == PRECISION and cause.dtype == torch.float16 and cause.wider == torch.float32, cause
    assert cause.bound and cause.largest == largest > torch.finfo(torch.float16).max
    assert "in float64 too" not in anomaly.message and "the destination, overwritten" in anomaly.message


def test_float16_copies_of_master_weights_in_range_report_nothing():
    w = watched(scenarios.train_half_copy_of_master_weights, 1.0)
    assert nonfinite(w) == []


# -- ema.mul_(0.99) on a tensor made before the watch -----------------------------------------


@pytest.mark.parametrize("poisoned", [True, False])
def test_an_ema_made_before_the_watch_and_updated_in_place(poisoned, tmp_path):
    """Holding nan (loaded so): ``mul_`` reads values no watched op read before, and it writes
    over them: whether they held the nan cannot be told, and the message says so rather than
    "made nan from finite inputs". Clean: nothing."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ema = model.weight.detach().clone()
    if poisoned:
        ema[1, 2] = float("nan")
    w = watched(scenarios.train_with_ema, model, ema)
    if not poisoned:
        assert nonfinite(w) == []
        return
    anomaly = nonfinite(w)[0]
    assert (anomaly.op, anomaly.lineno) == ("aten.mul_.Tensor", line_of("# the EMA update"))
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == UNKNOWN and cause.detail == WRITTEN and cause.made.how == "before_watch"
    problem = line(anomaly, "  problem:")
    assert "from inputs not all known to be finite" in problem and "min nan" not in problem
    assert "range before the write unknown (made before the watch)" in problem
    assert line(anomaly, "  cause:") == (
        "  cause:    unknown: input f32[4, 8] cpu was made before the watch, and mul wrote its result into it in place: "
        "its values before the write were never read, so whether it already held nan cannot be told"
    )
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    (saved,) = [a for a in load(path).anomalies if a.kind == "nan"]
    assert saved.finding.facts["cause"] == cause and saved.message == anomaly.message


# -- views of a tensor written in place -------------------------------------------------------


@pytest.mark.parametrize("written", [True, False])
def test_a_view_taken_before_its_base_is_scaled_in_place_does_not_keep_the_old_range(written):
    """``flat = h.view(-1)`` keeps the range ``h`` had (about 1); ``h.mul_(1e30)`` then changes
    ``flat``'s values too, so the overflow of ``flat * 1e10`` is shown with what ``flat`` held
    when it was read (about 1e30), not the range from before the write. Without the write, the
    range carried through the view is kept."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        with torch.no_grad():
            h = model(torch.randn(16, 8))
            flat = h.view(-1)
            if written:
                h.mul_(1e30)  # a scale applied in place, after the view was taken
            else:
                h = h * 1e30  # a new tensor: flat keeps its values
            y = flat * (1e10 if written else 1e40)
        print(y.sum().item())
    anomaly = nonfinite(w)[0]
    assert anomaly.op == "aten.mul.Tensor" and anomaly.kind == "inf"
    ((_, read),) = anomaly.finding.facts["input_ranges"]
    largest = max(abs(read.low), abs(read.high))
    assert (1e29 < largest < 1e31) if written else (0.1 < largest < 10), read
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == PRECISION and cause.wider == torch.float64 and 1e39 < cause.largest < 1e41, cause


def test_a_buffer_reused_in_place_after_the_origin_read_it_is_not_read_for_its_values(tmp_path):
    """A float16 activation buffer made before a check point, read through a view by the op that
    overflows, then zeroed in place for reuse: what it holds at the check point is not what the
    op read, so the cause is not decided from it ("reaches 0 in magnitude") and the message says
    why the range is unknown."""
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        buffer = torch.ones(4, 8, dtype=torch.float16) * 300
        tokens = buffer.view(-1)
        print(tokens.float().mean().item())  # a check point: all finite, ranges not kept
        energy = tokens * tokens  # 90000 > float16's 65504
        buffer.zero_()  # reused for the next micro-batch
        print(energy.float().sum().item())
    (anomaly,) = nonfinite(w)
    assert anomaly.op == "aten.mul.Tensor"
    facts = anomaly.finding.facts
    assert [value_range for _, value_range in facts["input_ranges"]] == [None, None]
    assert list(facts["input_alive"]) == [WRITTEN, WRITTEN]
    assert facts["cause"] is None or facts["cause"].kind != PRECISION, facts["cause"]
    assert "min 0, max 0" not in anomaly.message
    assert "(or a tensor sharing its storage) was written in place after this op read it" in anomaly.message
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    (saved,) = [a for a in load(path).anomalies if a.kind == "inf"]
    assert list(saved.finding.facts["input_alive"]) == [WRITTEN, WRITTEN] and saved.message == anomaly.message
