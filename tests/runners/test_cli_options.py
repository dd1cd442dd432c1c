"""The CLI's own options beyond ``--strict``/``--last``: ``--allow`` and ``--pdb``, run in a
subprocess on a generated training script."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from support.helpers import opwatch_frames

REPO = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO))

SCRIPT = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 3), torch.randn(8)


def step():
    optimizer.zero_grad()
    prediction = model(x)
    loss = ((y - prediction) ** 2).mean()  # line 13: the broadcast
    loss.backward()
    optimizer.step()
    return loss.item()


for _ in range(3):
    print(f"loss {step():.3f}")
"""


def run(tmp_path, *options, stdin=None):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    return subprocess.run(
        [sys.executable, "-m", "opwatch", *options, "train.py"], input=stdin, capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=300
    )


def test_allow_accepts_the_known_anomaly_even_in_strict_mode(tmp_path):
    flagged = run(tmp_path, "--strict")
    assert flagged.returncode == 1 and "AnomalyError: broadcast in aten.sub.Tensor at train.py:13" in flagged.stderr
    allowed = run(tmp_path, "--strict", "--allow", "kind=broadcast,where=train.py:13")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.count("loss ") == 3
    assert "opwatch: no anomalies." in allowed.stderr and "3 finding(s) matched an --allow entry" in allowed.stderr


def test_allow_entries_that_do_not_match_leave_the_anomaly(tmp_path):
    result = run(tmp_path, "--strict", "--allow", "kind=nan", "--allow", "where=train.py:14")
    assert result.returncode == 1 and "AnomalyError" in result.stderr


def test_a_bad_allow_is_a_usage_error_naming_the_fields(tmp_path):
    result = run(tmp_path, "--allow", "line=13")
    assert result.returncode == 2
    assert "unknown Allow field(s) 'line'; the fields are 'kind', 'op', 'module', 'where'" in result.stderr


def test_pdb_opens_post_mortem_in_the_users_frame_of_the_failing_op(tmp_path):
    result = run(tmp_path, "--strict", "--pdb", stdin="p prediction.shape\np y.shape\nq\n")
    assert f"opwatch: post-mortem in {tmp_path / 'train.py'}:13" in result.stderr
    assert f"> {tmp_path / 'train.py'}(13)step()" in result.stdout
    assert "torch.Size([8, 1])" in result.stdout and "torch.Size([8])" in result.stdout
    assert opwatch_frames(result.stdout.split("(Pdb)")[0]) == []  # not in opwatch's or torch's frames
    assert result.returncode == 1


def test_without_pdb_nothing_waits_for_input(tmp_path):
    result = run(tmp_path, "--strict", stdin="")
    assert "(Pdb)" not in result.stdout and result.returncode == 1
