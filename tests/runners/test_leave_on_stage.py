"""Where a failed step began, when no full watch saw it (``python -m opwatch --guard``): the
model the step called keeps, by weak reference, what it returned. A finite batch whose failure
did not recur used to be told only as "the gradients hold nan/inf"; what the model returned and
the loss say whether its forward made them, or what came after it (a bad label), or the
backward (``sqrt`` at 0). Nothing is read on a healthy step."""

from __future__ import annotations

import pytest

from support.helpers import guard_in_process

# A pair scorer: an embedding of each side, the distance between them, a head. BAD picks the
# failure at batch 4 (step 5): a nan label; a pair of equal samples (sqrt'(0) = inf in the
# backward only); a head written so large that exp overflows in the forward.
SCORER = """
import torch
from torch import nn
torch.manual_seed(0)
class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(1, 1)
    def forward(self, a, b):
        ea, eb = self.embed(a), self.embed(b)
        distance = ((ea - eb) ** 2).sum(-1, keepdim=True).sqrt()
        return self.head(distance).exp()
model = Scorer()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(8):
    a, b = torch.randn(16, 8), torch.randn(16, 8)
    target = torch.rand(16, 1)
    if step == 4 and BAD == "label": target[2] = float("nan")
    if step == 4 and BAD == "pair": b[5] = a[5]
    if step == 4 and BAD == "overflow":
        with torch.no_grad(): model.head.weight.fill_(1000.0)
    SCORE_AND_LOSS
    optimizer.zero_grad()
    loss.backward()
    AFTER_BACKWARD
    optimizer.step()
print("done")
"""
CALLED = f"Scorer (called at train.py:{SCORER.splitlines().index('    SCORE_AND_LOSS') + 1})"  # the line that calls the model
KEPT = "score = model(a, b)\n    loss = nn.functional.mse_loss(score, target)"


def scorer(bad: str, score_and_loss: str = KEPT, after_backward: str = "pass") -> str:
    return SCORER.replace("BAD", repr(bad)).replace("SCORE_AND_LOSS", score_and_loss).replace("AFTER_BACKWARD", after_backward)


@pytest.mark.parametrize("bad, where", [
    ("label", f"In this step the arguments of {CALLED} were finite, and so was what it returned; the loss backward() ran on "
              "was not: they came in after that call, with what the loss was computed from beside what it returned (the targets, "
              "another model's inputs, a mask, a weight), or from the loss's own math."),
    ("pair", "In this step the loss backward() ran on was finite: the backward made them (a derivative that is infinite where "
             "its function is finite: sqrt or a norm at 0"),
    ("overflow", f"In this step the arguments of {CALLED} were finite, and what it returned was not: an op of its forward "
                 "made them."),
])
def test_a_failed_step_says_where_it_began(tmp_path, capsys, monkeypatch, bad, where):
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, scorer(bad))
    assert status == 0 and "done" in out, err
    assert "optimizer step 5: the gradients about to be applied hold nan/inf" in err
    assert where in err


def test_the_where_is_in_the_jsonl_rows_and_the_report(tmp_path, capsys, monkeypatch):
    """The log's failure row carries it (``stage``), and the report's row of the guarded run says
    it where the origin is not named."""
    import json

    from opwatch.runners.cli import main
    from opwatch.runners.cli_report import run_report

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(scorer("label"))
    with pytest.warns(Warning):
        assert main(["--guard", "--jsonl", "run.jsonl", "train.py"]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    failures = [row for row in rows if row.get("stage") is not None]
    assert [(row["step"], row["stage"]) for row in failures] == [(5, "after_model")], rows
    assert run_report(["run.jsonl", "-o", "run.html"]) == 0
    page = (tmp_path / "run.html").read_text()
    assert "<td>not named; the arguments of the model were finite, and so was what it returned; the loss" in page


@pytest.mark.parametrize("score_and_loss, after_backward", [
    # What the model returned is not kept: it is gone by the check.
    ("loss = nn.functional.mse_loss(model(a, b), target)", "pass"),
    # Two calls (accumulated micro-batches): the first's output is gone.
    ("loss = (nn.functional.mse_loss(model(a[:8], b[:8]), target[:8]) + nn.functional.mse_loss(model(a[8:], b[8:]), target[8:])) / 2",
     "pass"),
    # Written in place after the backward: not what the model returned any more.
    (KEPT, "score.clamp_(max=1e4)"),
])
def test_without_what_the_model_returned_the_where_stays_open(tmp_path, capsys, monkeypatch, score_and_loss, after_backward):
    """What the model returned is not known: its forward or what came after it, the failure of a
    finite batch with a nan loss says, and not which (the Hugging Face Trainer's compute_loss
    drops the model's outputs before the step)."""
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, scorer("label", score_and_loss, after_backward))
    assert status == 0 and "done" in out, err
    assert "optimizer step 5: the gradients about to be applied hold nan/inf" in err
    assert (f"In this step the arguments of {CALLED} were finite, and the loss backward() ran on was not: its forward made them, "
            "or what the loss was computed from after it (the targets, a mask, a weight); what it returned was not kept to tell "
            "which.") in err
    assert "after that call" not in err


def test_no_where_is_told_when_neither_the_loss_nor_what_the_model_returned_is_known(tmp_path, capsys, monkeypatch):
    """``torch.autograd.backward(loss)`` keeps no loss (only ``Tensor.backward`` is followed) and
    the model's output is not kept: nothing says where the failure began."""
    monkeypatch.chdir(tmp_path)
    script = scorer("label", "loss = nn.functional.mse_loss(model(a, b), target)").replace(
        "    loss.backward()\n", "    torch.autograd.backward(loss)\n")
    assert "torch.autograd.backward(loss)" in script
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "done" in out, err
    assert "optimizer step 5: the gradients about to be applied hold nan/inf" in err
    assert "In this step" not in err


def test_a_healthy_run_reads_nothing_and_says_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, scorer(""))
    assert status == 0 and "done" in out and "opwatch: no anomalies." in out + err, err
    assert "opwatch guard: 8 optimizer steps ran, 1 audited under a full watch, 0 failed." in err


def test_raise_says_where_the_failure_that_did_not_recur_began(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, scorer("label"), "--on-failure", "raise")
    assert status == 1, err
    assert ("GradientsNotFinite: opwatch: optimizer step 5: the gradients held nan/inf: embed.0.weight (nan), embed.0.bias (nan), "
            "head.weight (nan), head.bias (nan); in that step the arguments of the model were finite, and so was what it "
            "returned; the loss backward() ran on was not") in err
    assert "did not recur: step 6 ran under a full watch" in err


@pytest.mark.parametrize("bad", ["label", "sample"])
def test_a_run_the_clip_stops_on_nan_gradients_says_what_its_last_ops_left(tmp_path, capsys, monkeypatch, bad):
    """``clip_grad_norm_(..., error_if_nonfinite=True)`` raises before the optimizer step, so no
    check of leave-on's saw the failing batch: it said only that the run ended with ops no check
    saw. What they left is read at the run's end: a bad sample is the batch; a nan label came in
    after the model's call."""
    monkeypatch.chdir(tmp_path)
    script = scorer("", after_backward="torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)")
    corrupt = {"label": 'target[2] = float("nan")', "sample": 'a[3, 1] = float("nan")'}[bad]
    script = script.replace("    target = torch.rand(16, 1)\n", f"    target = torch.rand(16, 1)\n    if step == 4: {corrupt}\n")
    line = script.splitlines().index("    score = model(a, b)") + 1  # the model's call
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 1 and "The total norm of order 2.0 for gradients from `parameters` is non-finite" in err, err
    assert ("opwatch guard: the run ended before opwatch judged its last ops: the model ran forward after optimizer step 4 and no "
            "optimizer step followed (a script that stops on a nan loss ends so), so no check saw them; what they left: ") in err
    if bad == "label":
        assert (f"what they left: the arguments of Scorer (called at train.py:{line}) were finite, and so was what it returned; "
                "the loss backward() ran on was not: they came in after that call") in err
    else:
        assert ("what they left: the batch held nan before the model ran: Scorer's argument 0 (f32[16, 8] cpu) held nan when it "
                f"entered the model at train.py:{line}, so no op of the model made it: it came in with the batch") in err
