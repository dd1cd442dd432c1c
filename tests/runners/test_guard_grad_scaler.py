"""``opwatch.guard(step, model, scaler=scaler)`` in a float16 loop: the guarded call runs the
forward and ``scaler.scale(loss).backward()``; ``scaler.step(optimizer)`` and ``scaler.update()``
run after it, outside the guard.

- A call the guard skips (``on_failure="skip"``) leaves its gradients to the scaler, filled with
  nan: ``scaler.step()`` skips the update as for an overflow. Before, the ``.grad`` were dropped
  and ``scaler.step()`` raised ``AssertionError: No inf checks were recorded for this optimizer``.
- The steps GradScaler skips are counted (seen at the next call: an optimizer it unscaled did
  not step), and a run it skips for good is stopped (``RunStuck``) after a full watch of one
  more call names the op. Before, only the returned loss was checked under a scaler, and a run
  whose gradients were nan at every step went on, silent, with its scale falling to 1e-13.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import opwatch
from opwatch.runners.leave_on import RunStuck
from support.helpers import line_of


def _mlp(fused=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)


def regression_loop(guard_options, *, steps=8, bad_at=None, enabled=True, accumulate=1, fused=False):
    """An fp16 autocast regression loop with GradScaler; the batch of step ``bad_at`` holds a nan
    (a corrupted record). ``guard_options``: ``opwatch.guard``'s, or ``None`` for the program
    alone; ``fused``: a fused AdamW, which GradScaler hands ``found_inf`` (it skips inside its
    kernel). Returns the guarded step, the scaler, and each step's parameters and scale."""
    model, optimizer = _mlp(fused)
    scaler = torch.amp.GradScaler("cpu", enabled=enabled)

    def train_step(x, y):
        with torch.autocast("cpu", dtype=torch.float16, enabled=enabled):
            loss = nn.functional.mse_loss(model(x).squeeze(-1), y) / accumulate
        scaler.scale(loss).backward()
        return loss.detach()

    step = train_step if guard_options is None else opwatch.guard(train_step, model, scaler=scaler, **guard_options)
    after = []
    for index in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulate):
            x = torch.randn(32, 16)
            if index == bad_at:
                x[3, 5] = float("nan")
            step(x, x.sum(-1))
        scaler.step(optimizer)
        scaler.update()
        after.append(([parameter.detach().clone() for parameter in model.parameters()], scaler.get_scale()))
    return step, scaler, after


def _same(one, other) -> bool:
    (parameters, scale), (other_parameters, other_scale) = one, other
    return scale == other_scale and all(torch.equal(a, b) for a, b in zip(parameters, other_parameters))


def _skips(scaler) -> int:
    """The steps GradScaler skipped, from its scale (halved at each; no growth in a short run)."""
    return round(math.log2(2.0**16 / scaler.get_scale()))


def test_a_call_the_guard_skips_leaves_its_gradients_to_grad_scaler_and_the_loop_goes_on():
    """The bad batch's step is skipped by GradScaler as the program alone skips it (its nan
    reaches the gradients): the guarded run is the program's, step by step, scale included."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        step, scaler, guarded = regression_loop({"on_failure": "skip", "repro": False}, bad_at=3)
    _, _, plain = regression_loop(None, bad_at=3)
    assert step.skipped == 1 and step.calls == 8
    assert all(map(_same, guarded, plain))
    (before, _), (at, _), (next_one, _) = guarded[2:5]
    assert all(map(torch.equal, before, at)) and not all(map(torch.equal, at, next_one))  # it moved nothing; the next step trains
    assert step.ledger.scaler_skipped == _skips(scaler) - 1  # the guard's own skip is counted once, as a failure
    assert any("opwatch.guard skipped a step" in str(warning.message) and "nan" in str(warning.message) for warning in caught)


def test_a_disabled_scaler_calls_the_step_with_the_gradients_dropped():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", opwatch.OpwatchWarning)
        step, scaler, after = regression_loop({"on_failure": "skip", "repro": False}, bad_at=3, enabled=False)
    (before, _), (at, _), (next_one, _) = after[2:5]
    assert step.skipped == 1 and all(map(torch.equal, before, at)) and not all(map(torch.equal, at, next_one))


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_a_healthy_run_counts_each_overflow_skip_and_equals_the_unguarded_one(fused):
    """A fused optimizer's overflow skips happen inside its kernel: counted all the same (they
    were not: its step is called)."""
    step, scaler, guarded = regression_loop({}, steps=6, fused=fused)
    _, _, plain = regression_loop(None, steps=6, fused=fused)
    assert all(map(_same, guarded, plain))
    assert step.ledger.scaler_skipped == _skips(scaler) and step.ledger.failed == 0


def test_with_gradient_accumulation_the_calls_between_steps_are_not_skips():
    step, scaler, _ = regression_loop({}, steps=4, accumulate=3)
    assert step.calls == 12 and step.ledger.scaler_skipped == _skips(scaler)


def test_the_overflow_skips_while_the_scale_finds_its_level_are_counted_and_never_stop_the_run():
    model, optimizer = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # far too high: its first steps overflow
    x = torch.randn(32, 16)

    def train_step(x):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).squeeze(-1), x.sum(-1))
        scaler.scale(loss).backward()
        return loss.detach()

    step = opwatch.guard(train_step, model, scaler=scaler, max_failed_in_a_row=3)
    for _ in range(40):
        optimizer.zero_grad()
        step(x)
        scaler.step(optimizer)
        scaler.update()
    ledger = step.ledger
    assert ledger.scaler_skipped >= 3 and ledger.scaler_in_a_row == 0 and ledger.failed == 0 and scaler.get_scale() >= 1


def metric_learning_step(encoder, scaler):
    """Pairwise distances of the embeddings, each one's distance to itself (0) masked out by a
    multiplication: sqrt's backward at 0 is 0 / 0 = nan, the loss finite."""

    def train_step(x, labels):
        with torch.autocast("cpu", dtype=torch.float16):
            emb = encoder(x).float()
        dist = ((emb[:, None] - emb[None]) ** 2).sum(-1).sqrt()  # the pairwise distances
        same = (labels[:, None] == labels[None]).float()
        loss = (same * (1 - torch.eye(len(x))) * dist).mean() + ((1 - same) * torch.relu(1 - dist)).mean()
        scaler.scale(loss).backward()
        return loss.detach()

    return train_step


@pytest.mark.parametrize("on_failure, fused", [("raise", False), ("skip", False), ("skip", True)])
def test_a_run_grad_scaler_skips_for_good_is_stopped_with_the_op_named(on_failure, fused):
    """With a fused AdamW the run went on to its end, silent, its scale at 5.7e-14: GradScaler
    called every step, and the kernel skipped it."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    step = opwatch.guard(metric_learning_step(encoder, scaler), encoder, scaler=scaler, on_failure=on_failure)
    with pytest.raises(RunStuck) as stuck:
        for _ in range(60):
            optimizer.zero_grad()
            step(torch.randn(32, 16), torch.randint(0, 4, (32,)))
            scaler.step(optimizer)
            scaler.update()
    # 65536 halved at each skip: the 18th ran at 0.5, the first below 1; the 19th call is watched
    assert step.calls == 19 and step.ledger.scaler_skipped == 18 and step.ledger.failed == 0
    line = line_of("# the pairwise distances", __file__)
    text = str(stuck.value)
    assert text.startswith("opwatch: the run is stuck: GradScaler skipped the optimizer step of 18 guarded calls in a row "
                           "(calls 1 to 18), and its scale fell to 0.25: below 1 it scales the loss down")
    assert (f"what the calls returned was finite, and their gradients are GradScaler's to check; a full watch of the call after "
            f"them names it: nan first made by aten.div.Tensor at ") in text
    assert f"test_guard_grad_scaler.py:{line} (backward). opwatch stops a run once 10 steps in a row were skipped" in text
    assert "max_failed_in_a_row=N (None: never stop) sets that limit." in text
    note = "\n".join(getattr(stuck.value, "__notes__", ()))
    assert "cause:    undefined math: the divisor holds 0, and so does the dividend: 0 / 0 = nan" in note
    assert "fix:      the gradient of sqrt at 0 is inf: clamp the input" in note


def test_never_stopping_the_run_counts_every_skip():
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    step = opwatch.guard(metric_learning_step(encoder, scaler), encoder, scaler=scaler, max_failed_in_a_row=None)
    for _ in range(30):
        optimizer.zero_grad()
        step(torch.randn(32, 16), torch.randint(0, 4, (32,)))
        scaler.step(optimizer)
        scaler.update()
    assert step.ledger.scaler_skipped == 29 and step.ledger.scaler_in_a_row == 29  # the 30th is seen at a next call


def test_with_two_optimizers_one_grad_scaler_skips_is_counted_though_the_other_steps():
    """Two optimizers under one scaler (a GAN's, or a learned margin's own): GradScaler skips
    each one whose gradients are not finite; the encoder's skip is counted though the margin's
    optimizer steps at every call."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    margin = nn.Parameter(torch.ones(()))
    optimizers = torch.optim.AdamW(encoder.parameters(), lr=1e-3), torch.optim.SGD([margin], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scaled = metric_learning_step(encoder, scaler)

    def train_step(x, labels):
        loss = scaled(x, labels)
        scaler.scale(margin * loss.new_ones(())).backward()  # the margin's finite gradient
        return loss

    step = opwatch.guard(train_step, [*encoder.parameters(), margin], scaler=scaler, max_failed_in_a_row=None)
    for _ in range(12):
        for optimizer in optimizers:
            optimizer.zero_grad()
        step(torch.randn(32, 16), torch.randint(0, 4, (32,)))
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
    assert margin.item() != 1.0  # its optimizer stepped
    assert step.ledger.scaler_skipped == 11 and step.ledger.scaler_in_a_row == 11
