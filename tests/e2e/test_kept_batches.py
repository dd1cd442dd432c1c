"""A nan the program wrote into data it keeps, a table with missing values loaded once, and a bad
micro-batch under gradient accumulation: data kept across steps, told by when it does harm.

- Under a watch, a dataset made up front whose one sample the program overwrote with nan (a
  corrupted record, a missing value written as nan) reached the loss only when its batch came,
  optimizer steps later. The optimizer step's check point had judged the nan, alive and
  unused, as a placeholder, so its spread was followed to an origin already dismissed: no
  anomaly at all, on a run whose loss ended nan. The write is now named when the nan reaches
  the gradients, however many steps later; kept unused, or selected out of the loss, it stays
  silent.
- Data that came into torch holding nan (``torch.from_numpy`` of a table with missing values,
  loaded once) was an anomaly at the first optimizer step merely for being alive, though the
  loop left the incomplete rows out or filled them: a false alarm on healthy code. It now waits
  while alive and is named where it came in once it reaches the gradients, a parameter or a host
  read.
- Left on (the leave-on runner, the trainers' guard), a step that accumulates gradients over
  several micro-batches kept only the last one's batch to read after a failed check: a bad
  earlier micro-batch was "nan/inf in the gradients" with no op named. Each earlier
  micro-batch's floating arguments now leave their (min, max) on their device, read only when
  the step fails.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opwatch
from opwatch.checks.nonfinite.cause import DATA, DELIBERATE, INPUT
from opwatch.runners.leave_on import LeaveOn
from support.helpers import line_of


class Classifier(nn.Module):
    """A small tabular classifier: two GELU blocks with layer norm."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x))


def train_on_kept_dataset(*, corrupt: int | None, select_valid: bool = False, used_batches: int = 8, accumulate: int = 1):
    """A dataset made up front under a watch (features and labels for 10 batches of 8), one
    sample of batch ``corrupt`` overwritten with nan; AdamW with ``clip_grad_norm_``, one
    optimizer step every ``accumulate`` batches, over the first ``used_batches`` batches.
    ``select_valid``: the loss takes the rows that hold no nan only."""
    torch.manual_seed(0)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        model = Classifier()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        features = [torch.randn(8, 16) for _ in range(10)]
        labels = [torch.randint(0, 4, (8,)) for _ in range(10)]
        if corrupt is not None:
            features[corrupt][3, 5] = float("nan")  # A CORRUPTED RECORD
        losses = []
        for number in range(used_batches):
            x, y = features[number], labels[number]
            if select_valid:
                valid = ~x.isnan().any(1)
                x, y = x[valid], y[valid]
            loss = F.cross_entropy(model(x), y) / accumulate
            loss.backward()
            losses.append(loss.detach())
            if (number + 1) % accumulate == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    return w, model, losses


def nonfinite(w):
    return [a for a in w.anomalies if a.kind in ("nan", "inf")]


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_nan_written_into_a_kept_batch_is_named_at_the_write_when_the_batch_comes(accumulate):
    w, model, losses = train_on_kept_dataset(corrupt=4, accumulate=accumulate)
    assert math.isnan(losses[4].item()) and all(math.isfinite(loss.item()) for loss in losses[:4])  # the premise: four steps' worth before it
    (found,) = nonfinite(w)
    assert (found.op, found.lineno) == ("aten.lift_fresh.default", line_of("# A CORRUPTED RECORD", __file__)), found.message
    cause = found.finding.facts["cause"]
    assert (cause.kind, cause.detail) == (DELIBERATE, "nan_constant")
    assert "and it reached the loss, aten.nll_loss_forward.default at " in found.message
    assert "it reached a .grad" in found.message


def test_a_kept_nan_selected_out_of_the_loss_or_never_used_reports_nothing():
    w, model, losses = train_on_kept_dataset(corrupt=4, select_valid=True)
    assert nonfinite(w) == [], [a.message for a in w.anomalies]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    w, model, _ = train_on_kept_dataset(corrupt=9, used_batches=8)  # a held-out batch, never fed
    assert nonfinite(w) == [], [a.message for a in w.anomalies]
    w, _, _ = train_on_kept_dataset(corrupt=None)
    assert w.anomalies == []


# -- a table with missing values, loaded once -------------------------------------------------


def fit_on_a_table(missing: str):
    """A numpy table of readings with missing values (nan), loaded once into torch under a watch;
    each batch of 32 rows is a regression step. ``missing``: ``"drop"`` leaves the rows with a
    missing value out, ``"fill"`` fills them with 0, ``"leak"`` feeds them as they are."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((256, 9)).astype(np.float32)
    table[rng.random((256, 9)) < 0.02] = np.nan  # missing readings
    torch.manual_seed(0)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        data = torch.from_numpy(table)  # THE TABLE
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for epoch in range(2):
            for start in range(0, 256, 32):
                batch = data[start : start + 32]
                if missing == "drop":
                    batch = batch[~batch.isnan().any(1)]
                elif missing == "fill":
                    batch = batch.nan_to_num(0.0)
                loss = F.mse_loss(model(batch[:, :8]), batch[:, 8:])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return w, model


@pytest.mark.parametrize("missing", ["drop", "fill"])
def test_a_table_with_missing_values_the_loop_leaves_out_or_fills_reports_nothing(missing):
    w, model = fit_on_a_table(missing)
    assert w.anomalies == [], [a.message for a in w.anomalies]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_table_with_missing_values_fed_as_they_are_is_named_where_it_came_in():
    w, _ = fit_on_a_table("leak")
    (found,) = nonfinite(w)
    assert (found.op, found.lineno) == ("aten.lift_fresh.default", line_of("# THE TABLE", __file__)), found.message
    cause = found.finding.facts["cause"]
    assert (cause.kind, cause.detail) == (INPUT, DATA)


# -- left on: accumulated micro-batches -------------------------------------------------------


def accumulated_run(*, bad_micro_batch: int | None, accumulate: int = 4, steps: int = 6, blow_at: int | None = None):
    """The leave-on runner over a loop that accumulates ``accumulate`` micro-batches per
    optimizer step (AdamW, ``clip_grad_norm_``); the micro-batch numbered ``bad_micro_batch``
    (counted over the run) holds a nan; ``blow_at``: the optimizer step whose learning rate
    blows the weights up (finite batches, bad gradients after)."""
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = LeaveOn(on_failure="skip", max_failed_in_a_row=None)
    with warnings.catch_warnings(record=True) as told, runner:
        warnings.simplefilter("always")
        for number in range(steps * accumulate):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            if number == bad_micro_batch:
                x[2, 7] = float("nan")
            loss = F.cross_entropy(model(x), y) / accumulate  # THE MODEL'S CALL
            loss.backward()
            if (number + 1) % accumulate == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if number // accumulate == blow_at:
                    for group in optimizer.param_groups:
                        group["lr"] = 1e30
                optimizer.step()
                optimizer.zero_grad()
    return runner, model, [str(warning.message) for warning in told if issubclass(warning.category, opwatch.OpwatchWarning)]


@pytest.mark.parametrize("position", [0, 3])
def test_left_on_a_bad_micro_batch_is_named_with_its_call_in_the_step(position):
    runner, model, told = accumulated_run(bad_micro_batch=3 * 4 + position)  # optimizer step 4, micro-batch position + 1
    (failure,) = runner.failures
    assert failure.cause == "input" and failure.step == 4
    (text,) = [line for line in told if "optimizer step 4:" in line]
    line = line_of("# THE MODEL'S CALL", __file__)
    assert ("cause: input: the batch held nan before the model ran: Classifier's argument 0 (f32[8, 16] cpu) held nan when it entered "
            "the model at ") in text, text
    assert f"test_kept_batches.py:{line} (call {position + 1} of the 4 the model ran since the last optimizer step), so no op" in text, text
    (row,) = runner.ledger.rows()
    assert row["batch"]["call"] == [position + 1, 4] and row["batch"]["argument"] == ["argument 0", "float32", [8, 16], "cpu"], row
    assert all(torch.isfinite(p).all() for p in model.parameters())  # skipped: the weights stayed clean


def test_left_on_healthy_accumulation_and_a_failure_of_finite_batches_blame_no_batch():
    runner, _, told = accumulated_run(bad_micro_batch=None)
    assert runner.failures == [] and told == []
    runner, _, told = accumulated_run(bad_micro_batch=None, blow_at=2)
    assert runner.failures and all(failure.cause != "input" for failure in runner.failures), told
    assert not any("the batch held" in text for text in told)
