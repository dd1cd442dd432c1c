"""Fingerprints and ``opwatch.diff``.

The stories run each side in its own process (``python -m opwatch --fingerprints --jsonl``) and
compare the saved logs, as a user comparing two runs would: identical runs agree; an unseeded
dropout, a changed formula (forward, and in a custom backward) and a bf16 catastrophic
cancellation are named at their lines; an op inserted in one run is reported as such and the
alignment goes on past it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import opwatch
from opwatch.checks.fingerprints import FingerprintTracker
from opwatch.runners.cli_diff import run_diff
from support.helpers import line_of as _line_of

REPO = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO))

TRAIN = """\
import os
import torch
from torch import nn

SCALE = {scale}


class Half(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * {grad_scale}  # custom backward


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
{inserted}        h = nn.functional.dropout(h, 0.25, self.training)  # dropout
        h = Half.apply(h) * SCALE  # scaled
        return self.fc2(h)


torch.manual_seed(0)
model = Net()
x, y = torch.randn(32, 8), torch.randn(32, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(int(os.environ.get("DROPOUT_SEED", "1")))
for step in range(2):
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(float(loss))
"""

PRECISION = """\
import os
import torch

dtype = getattr(torch, os.environ["DTYPE"])
torch.manual_seed(0)
x = torch.randn(256).to(dtype)
h = torch.tanh(x * 0.75 + 0.1)
h = torch.sigmoid(h) * 2.0 - 1.0
h = h * h + 0.5 * h
big = h + 1000.0
d = big - 1000.0  # cancellation
out = (d * 3.0).exp()
print(float(out.float().sum()))
"""


def write(directory: Path, source: str, name: str = "train.py") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(source))
    return path


def train_script(directory: Path, *, scale="0.5", grad_scale="0.5", inserted="") -> Path:
    return write(directory, TRAIN.format(scale=scale, grad_scale=grad_scale, inserted=inserted))


def record(script: Path, log: Path, **env) -> Path:
    """Run ``script`` under ``python -m opwatch --fingerprints --jsonl log`` in its own process."""
    done = subprocess.run(
        [sys.executable, "-m", "opwatch", "--fingerprints", "--jsonl", str(log), str(script)],
        env={**ENV, **env}, cwd=script.parent, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return log


def line_of(path: Path, marker: str) -> int:
    return _line_of(marker, str(path))


# -- the stories, each side in its own process ----------------------------------------------------


def test_identical_runs_agree(tmp_path, capsys):
    script = train_script(tmp_path)
    a = record(script, tmp_path / "a.jsonl")
    b = record(script, tmp_path / "b.jsonl")
    result = opwatch.diff(a, b)
    assert result.agree and result.first is None
    assert result.compared > 50 and not result.only_in_a and not result.only_in_b
    assert "The runs agree" in str(result) and "compared bitwise" in str(result)
    assert run_diff([str(a), str(b)]) == 0


def test_unseeded_dropout_is_named_at_its_line(tmp_path, capsys):
    script = train_script(tmp_path)
    a = record(script, tmp_path / "a.jsonl", DROPOUT_SEED="1")
    b = record(script, tmp_path / "b.jsonl", DROPOUT_SEED="2")
    result = opwatch.diff(a, b)
    first = result.first
    assert first is not None and not result.agree
    assert "bernoulli" in first.a.op or "dropout" in first.a.op
    assert first.a.lineno == first.b.lineno == line_of(script, "# dropout")
    assert first.a.phase == "forward" and first.verdict == "made_here"
    text = str(result)
    assert f"train.py:{line_of(script, '# dropout')} in a" in text
    assert "this op made the difference" in text and "not seeded alike" in text
    # The CLI: exit status 1, the report and the aligned table.
    assert run_diff([str(a), str(b), "--context", "2"]) == 1
    out = capsys.readouterr().out
    assert "The runs first differ at aten.bernoulli" in out and "<- first difference" in out


def test_changed_formula_forward(tmp_path):
    script_a = train_script(tmp_path / "a", scale="0.5")
    script_b = train_script(tmp_path / "b", scale="0.25")
    result = opwatch.diff(record(script_a, tmp_path / "a.jsonl"), record(script_b, tmp_path / "b.jsonl"))
    first = result.first
    assert first.a.op == "aten.mul.Tensor" and first.a.phase == "forward"
    assert first.a.lineno == line_of(script_a, "# scaled") and first.verdict == "made_here"
    assert "Its other arguments differ: (other=0.5) in a, (other=0.25) in b." in str(result)
    assert not result.only_in_a and not result.only_in_b


def test_changed_formula_in_a_custom_backward(tmp_path):
    script_a = train_script(tmp_path / "a", grad_scale="0.5")
    script_b = train_script(tmp_path / "b", grad_scale="0.25")
    result = opwatch.diff(record(script_a, tmp_path / "a.jsonl"), record(script_b, tmp_path / "b.jsonl"))
    first = result.first
    assert first.a.phase == "backward" and first.a.op == "aten.mul.Tensor"
    assert first.a.lineno == line_of(script_a, "# custom backward")
    assert first.verdict == "made_here"  # the gradient flowing in still agreed
    # Every forward op before it agreed: the first difference is not in forward.
    before = result.pairs[: [pair[0] for pair in result.pairs].index(first.a)]
    assert any(a.phase == "forward" for a, _ in before)
    assert "backward" in str(result)


def test_an_op_inserted_in_one_run_is_reported_and_the_alignment_goes_on(tmp_path):
    script_a = train_script(tmp_path / "a")
    script_b = train_script(tmp_path / "b", inserted="        h = h * 1.0  # inserted\n")
    a, b = record(script_a, tmp_path / "a.jsonl"), record(script_b, tmp_path / "b.jsonl")
    result = opwatch.diff(a, b)
    inserted = line_of(script_b, "# inserted")
    # Once per step in forward, and its gradient in backward (at the same forward line).
    assert {record.lineno for record in result.only_in_b} == {inserted}
    assert len(result.only_in_b) == 4 and not result.only_in_a
    assert result.first is None and not result.agree  # h * 1.0 changed no value
    # Everything after it still lines up, although its lines moved by one.
    aligned = [(x, y) for x, y in result.pairs if x is not None and y is not None]
    assert len(aligned) == len(opwatch.load(a).records)
    assert any(y.lineno == x.lineno + 1 for x, y in aligned)
    assert "4 ops only in b: aten.mul.Tensor at " in str(result) and f"train.py:{inserted} (4 times)." in str(result)


@pytest.mark.thorough
def test_an_inserted_op_that_changes_values(tmp_path):
    script_a = train_script(tmp_path / "a")
    script_b = train_script(tmp_path / "b", inserted="        h = h * 2.0  # inserted\n")
    result = opwatch.diff(record(script_a, tmp_path / "a.jsonl"), record(script_b, tmp_path / "b.jsonl"))
    first = result.first
    # The first aligned op that differs reads the inserted op's output.
    assert first.verdict == "inputs_differ"
    assert any(state == "differed" and made_b is not None and made_b.lineno == line_of(script_b, "# inserted") for _, state, _, made_b in first.inputs)
    assert "already differed" in str(result)


def test_bf16_against_fp32_names_the_cancellation(tmp_path):
    script = write(tmp_path, PRECISION)
    a = record(script, tmp_path / "fp32.jsonl", DTYPE="float32")
    b = record(script, tmp_path / "bf16.jsonl", DTYPE="bfloat16")
    result = opwatch.diff(a, b)
    assert result.tolerance.reason == "dtypes" and result.tolerance.dtypes == ("bfloat16", "float32")
    first = result.first
    assert first.a.op == "aten.sub.Tensor" and first.a.lineno == line_of(script, "# cancellation")
    assert first.verdict == "made_here"
    text = str(result)
    assert "rtol=0.016" in text and "the default for bfloat16" in text
    # Bitwise, every op differs from the first on: the tolerance is what finds the cancellation.
    bitwise = opwatch.diff(a, b, rtol=0, atol=0)
    assert bitwise.first.a.lineno < line_of(script, "# cancellation")
    # A tolerance loose enough hides it.
    assert opwatch.diff(a, b, rtol=10.0).first is None


# -- in one process: options, errors, the tracker itself ----------------------------------------


def test_fingerprints_are_off_by_default_and_bind_nothing():
    x = torch.randn(4, 4)
    with opwatch.watch() as w:
        checks = w._interceptor._checks
        assert checks.prints is None and not any(isinstance(getattr(observe, "__self__", None), FingerprintTracker) for observe in checks.observers(torch.ops.aten.mul.Tensor))
        (x * 2).sum()
    assert w.fingerprints is None
    with pytest.raises(TypeError, match="fingerprints must be True or False"):
        opwatch.watch(fingerprints="yes")


def test_fingerprints_wait_for_the_check_point():
    x = torch.randn(64)
    with opwatch.watch(fingerprints=True) as w:
        y = torch.tanh(x).t()
        tracker = w._interceptor._checks.prints
        assert tracker.pending == 1 and not w.fingerprints  # queued on the device, not read
    records = {record.op: record.index for record in w.records}
    assert set(w.fingerprints) == {records["aten.tanh.default"]}  # the view (t) shares its input's values
    digest, total, norm, low, high = w.fingerprints[records["aten.tanh.default"]][0]
    expected = torch.tanh(x).double()
    assert total == pytest.approx(float(expected.sum())) and norm == pytest.approx(float(expected.norm()))
    assert (low, high) == (float(torch.tanh(x).min()), float(torch.tanh(x).max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool])
def test_the_hash_tells_simple_changes_apart(dtype):
    tracker = FingerprintTracker(None, {})

    def digest(tensor):
        return tracker._fingerprint(tensor, tensor.dtype, tensor.device)[0].item()

    torch.manual_seed(0)
    base = (torch.randn(1000) * 10).to(dtype) if dtype is not torch.bool else torch.rand(1000) > 0.5
    variants = [base.flip(0), base.roll(1)]
    swapped = base.clone()
    swapped[[3, 7]] = base[[7, 3]]
    variants.append(swapped)
    if dtype is torch.bool:
        flipped = base.clone()
        flipped[10] = ~flipped[10]
        variants.append(flipped)
    else:
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}.get(dtype)
        last_bit = base.clone()
        (last_bit.view(bits) if bits else last_bit)[5] ^= 1
        second = base.clone()  # +1, -2, +1 at three neighbours: missed by weights linear in the position
        raw = second.view(bits) if bits else second
        raw[20:23] += torch.tensor([1, -2, 1], dtype=raw.dtype)
        variants += [last_bit, second]
    assert all(not torch.equal(variant, base) for variant in variants)
    digests = [digest(variant) for variant in variants]
    assert digest(base.clone()) == digest(base) and digest(base[::2].contiguous()) == digest(base[::2])
    assert digest(base) not in digests and len(set(digests)) == len(digests)
    if dtype.is_floating_point:
        assert digest(torch.tensor([0.0], dtype=dtype)) != digest(torch.tensor([-0.0], dtype=dtype))


def test_fingerprints_survive_the_jsonl_round_trip(tmp_path):
    x = torch.tensor([1.0, float("inf"), 3.0])
    with opwatch.watch(fingerprints=True, warn=False) as w:
        (x * 2).exp()
    w.export_jsonl(tmp_path / "run.jsonl")
    saved = opwatch.load(tmp_path / "run.jsonl")
    assert saved.header["fingerprints"] is True and saved.header["version"] == opwatch.storage.jsonl.VERSION
    assert saved.fingerprints == w.fingerprints
    assert opwatch.diff(w, saved).agree


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(TypeError, match="must be an opwatch.Watch, a log read by opwatch.load or the path"):
        opwatch.diff(1, 2)
    with opwatch.watch() as plain:
        torch.ones(2) * 2
    with opwatch.watch(fingerprints=True) as printed:
        torch.ones(2) * 2
    with pytest.raises(ValueError, match="recorded without fingerprints.*--fingerprints"):
        opwatch.diff(plain, printed)
    with pytest.raises(ValueError, match="rtol must be a number of 0 or more"):
        opwatch.diff(printed, printed, rtol=-1)
    plain.export_jsonl(tmp_path / "plain.jsonl")
    assert run_diff([str(tmp_path / "plain.jsonl"), str(tmp_path / "plain.jsonl")]) == 2
    assert run_diff([str(tmp_path / "missing.jsonl"), str(tmp_path / "plain.jsonl")]) == 2
    with pytest.raises(SystemExit) as usage:
        run_diff([str(tmp_path / "plain.jsonl")])
    assert usage.value.code == 2
    with opwatch.watch(fingerprints=True) as running:
        with pytest.raises(ValueError, match="still running"):
            opwatch.diff(running, printed)


def test_the_table_shows_both_runs_side_by_side():
    def step(scale):
        x = torch.arange(8.0)
        with opwatch.watch(fingerprints=True) as w:
            y = x * 2.0
            z = y + scale
            (z * z).sum()
        return w

    result = opwatch.diff(step(1.0), step(2.0))
    table = result.table(context=1)
    assert "op in a" in table and "where in b" in table and "<- first difference" in table
    assert len(table.splitlines()) == 2 + 3
    assert "aten.add.Tensor" in str(result) and "other=1.0" in str(result)
    with pytest.raises(ValueError, match="context must be 0 or more"):
        result.table(context=-1)


def test_inputs_made_before_the_watch_are_named():
    def step(x):
        with opwatch.watch(fingerprints=True) as w:
            torch.tanh(x * 2.0).sum()
        return w

    torch.manual_seed(0)
    a = step(torch.randn(8))
    b = step(torch.randn(8))  # another draw, before the watch
    result = opwatch.diff(a, b)
    assert result.first.a.op == "aten.mul.Tensor" and result.first.verdict == "before_watch"
    assert "the inputs made before the watch differ" in str(result) and "Start the watch before they are made" in str(result)
    assert not result.first.whole_script
    same = torch.randn(8)
    assert opwatch.diff(step(same), step(same.clone())).agree


def test_under_the_cli_an_input_made_by_an_op_that_left_the_log_gets_true_advice(tmp_path):
    """python -m opwatch watches from the script's first line: "start the watch before they
    are made" is no advice there. An input made before the log's first op was made by an op
    that left the bounded log (10,000 ops): watch the step in both runs."""
    script = write(tmp_path, """\
        import os
        import torch

        torch.manual_seed(int(os.environ["DATA_SEED"]))
        x = torch.randn(8)
        count = torch.zeros(())
        for _ in range(10_001):  # more ops than the log keeps
            count.add_(1)
        y = torch.tanh(x * 2.0).sum()  # the op
        """)
    a = record(script, tmp_path / "a.jsonl", DATA_SEED="1")
    b = record(script, tmp_path / "b.jsonl", DATA_SEED="2")
    result = opwatch.diff(a, b)
    first = result.first
    assert first.a.op == "aten.mul.Tensor" and first.verdict == "before_watch"
    assert first.whole_script and first.log_cut
    text = str(result)
    assert "Start the watch before" not in text and "made before the watch" not in text
    assert "Its inputs were made by ops that left the bounded log (input 0 made before the log's first op; the watch ran from the script's first line" in text
    assert "Watch the step that differs in both runs" in text
    assert opwatch.diff(opwatch.load(a), opwatch.load(b)).first.whole_script  # read from the header


def test_a_loop_with_an_op_inserted_in_one_step_aligns_every_other_step():
    from opwatch.runners.divergence import _align

    # 2,500 steps of the same three ops: longest-block matching pairs them off by a step.
    a = ["mul", "tanh", "add"] * 2500
    b = a[:3001] + ["inserted"] + a[3001:]
    pairs = _align(a, b, a, b)
    assert [pair for pair in pairs if None in pair] == [(None, 3001)]
    assert all(i == j or j == i + 1 for i, j in pairs if None not in (i, j))


def test_the_cli_dispatches_diff(tmp_path, capsys):
    from opwatch.runners.cli import main

    x = torch.arange(4.0)
    for name, scale in (("a", 2.0), ("b", 3.0)):
        with opwatch.watch(fingerprints=True) as w:
            (x * scale).sum()
        w.export_jsonl(tmp_path / f"{name}.jsonl")
    assert main(["diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--context", "0"]) == 1
    assert "The runs first differ at aten.mul.Tensor" in capsys.readouterr().out
    assert main(["diff", str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl")]) == 0
