"""A failure that recurs at a steady interval is watched at its next turn (``--guard``): the
smaller last batch of each epoch, standardised over a batch of one, fails every epoch; the
re-check of the step after it passes, so before, no op was ever named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from opwatch.runners.policy.turns import FailureTurns
from support.helpers import line_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 33 samples in batches of 8: five optimizer steps an epoch, the fifth a batch of one.
LAST_BATCH_OF_ONE = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(33, 8), torch.randn(33, 1))
loader = DataLoader(data, batch_size=8, shuffle=True, drop_last=DROP_LAST)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for epoch in range(4):
    for x, y in loader:
        x = (x - x.mean(0)) / x.std(0)  # STANDARDISE the batch
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print("weights finite:", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
"""

# The same loop, fed by hand: a sample of zeros at steps 5 and 10 only, scaled inside the model.
TWO_GLITCHES = """\
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x / x.abs().amax(dim=1, keepdim=True))  # SCALE each sample to [-1, 1]


torch.manual_seed(0)
model = Scaled()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, 21):
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    if step in (5, 10):
        x[0] = 0.0  # two glitches, 5 steps apart; none after
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


# A GPT-2 from a small config, trained on token ids; every 4th batch is all prompt: every label
# ignored, so the loss is 0 / 0 (its gradients are zero, finite).
EMPTY_TARGETS = """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, 17):
    ids = torch.randint(0, 100, (4, 16))
    labels = ids.clone()
    if EVERY and step % EVERY == 0:
        labels[:] = -100  # a batch of prompts only
    model(input_ids=ids, labels=labels).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
"""


def run_guard(tmp_path, script):
    (tmp_path / "train.py").write_text(script)
    return subprocess.run([sys.executable, "-W", "ignore::UserWarning:torch", "-m", "opwatch", "--guard", "train.py"],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)


def test_a_last_batch_of_one_that_fails_every_epoch_is_named_at_its_third_turn(tmp_path):
    script = LAST_BATCH_OF_ONE.replace("DROP_LAST", "False")
    result = run_guard(tmp_path, script)
    assert result.returncode == 0 and "weights finite: True" in result.stdout, result.stderr
    held = "the batch held nan before the model ran: Sequential's argument 0 (f32[1, 8] cpu)"
    assert f"optimizer step 5: the gradients about to be applied hold nan/inf" in result.stderr, result.stderr
    assert result.stderr.count(held) == 2, result.stderr  # steps 5 and 10, each re-checked by a step that passed
    line = line_of("STANDARDISE", tmp_path / "train.py")
    assert (f"the failure of steps 5 and 10 recurred at step 15, its next turn (every 5 steps, watched fully): nan first made by "
            f"aten.std.correction at train.py:{line} (forward).") in result.stderr, result.stderr
    # The summary shows the op with its cause and fix, and counts the turn among the audits.
    assert "nan in aten.std.correction at train.py" in result.stderr
    assert "fix:      reduce over more values than the correction (a last batch of one: DataLoader(..., drop_last=True))" in result.stderr
    assert "opwatch guard: 20 optimizer steps ran, 4 audited under a full watch, 4 failed" in result.stderr, result.stderr


def test_the_same_run_without_its_last_batch_watches_no_turn(tmp_path):
    result = run_guard(tmp_path, LAST_BATCH_OF_ONE.replace("DROP_LAST", "True"))
    assert result.returncode == 0 and "weights finite: True" in result.stdout, result.stderr
    assert "turn" not in result.stderr and "OpwatchWarning" not in result.stderr, result.stderr
    assert "opwatch guard: 16 optimizer steps ran, 1 audited under a full watch, 0 failed" in result.stderr, result.stderr


def test_two_glitches_five_steps_apart_watch_the_turn_after_them_and_say_it_passed(tmp_path):
    result = run_guard(tmp_path, TWO_GLITCHES)
    assert result.returncode == 0, result.stderr
    assert "optimizer step 5: the gradients about to be applied hold nan/inf" in result.stderr, result.stderr
    assert "the failure of step 5 did not recur: step 6 ran under a full watch" in result.stderr
    assert ("the failure of steps 5 and 10 did not recur at step 15, its next turn (every 5 steps): it ran under a full watch "
            "and its gradients were finite.") in result.stderr, result.stderr
    assert "recurred" not in result.stderr
    # One turn, then none: steps 1, 6, 11 and 15 audited.
    assert "opwatch guard: 20 optimizer steps ran, 4 audited under a full watch, 2 failed" in result.stderr, result.stderr


@pytest.mark.parametrize("every", [4, 0])
def test_a_gpt2_batch_with_every_label_ignored_each_4_steps_is_named_at_its_turn(tmp_path, every):
    result = run_guard(tmp_path, EMPTY_TARGETS.replace("EVERY", str(every)))
    assert result.returncode == 0, result.stderr
    if not every:  # the same training with targets in every batch: nothing fails, no turn
        assert "OpwatchWarning" not in result.stderr and "turn" not in result.stderr, result.stderr
        assert "opwatch guard: 16 optimizer steps ran, 1 audited under a full watch, 0 failed" in result.stderr, result.stderr
        return
    assert "optimizer step 4: the loss backward() ran on is nan while the gradients about to be applied are finite" in result.stderr
    assert ("the failure of steps 4 and 8 recurred at step 12, its next turn (every 4 steps, watched fully): nan first made by "
            "aten.nll_loss_forward.default at ") in result.stderr, result.stderr
    assert "cause:    undefined math: every target was ignore_index (-100)" in result.stderr
    assert "opwatch guard: 16 optimizer steps ran, 4 audited under a full watch, 4 failed (a loss not finite), 4 of them skipped." in result.stderr


def test_turns_come_from_two_unnamed_failures_of_one_cause_two_or_more_steps_apart():
    turns = FailureTurns()
    turns.failed(5, "input")
    assert turns.turn is None  # one failure has no interval
    turns.failed(10, "input")
    assert (turns.turn, turns.every, turns.before) == (15, 5, 5)
    assert [turns.due(step) for step in (11, 12, 13)] == [None, None, None]
    assert turns.due(14) == 10 and turns.due(14) is None  # given once

    turns.failed(20, "gradients")  # another cause: no interval
    assert turns.turn is None
    turns.failed(21, "gradients")  # the step after: its re-check's, not a turn
    assert turns.turn is None
    turns.failed(24, "gradients")
    assert turns.turn == 27
    turns.named()  # a watch named the origin
    assert turns.turn is None and turns.due(26) is None
    turns.failed(30, "gradients")
    assert turns.turn is None


@pytest.mark.parametrize("late", [False, True])
def test_a_turn_missed_is_not_given_later(late):
    turns = FailureTurns()
    turns.failed(3, "loss")
    turns.failed(6, "loss")
    if late:  # the step before the turn was not seen (another audit ran): the turn passes
        assert turns.due(9) is None and turns.turn is None
    else:
        assert turns.due(8) == 6
