"""A batch that fails once, finite when it enters the model: a speech clip cut shorter than its
transcript, whose CTC loss is inf (no alignment fits). ``--guard`` skips its step and the re-check
of the next step passes: no op of the failing step ever ran under a watch, and no step of a
script's loop can run again on that batch. The summary used to end at "no op was named ..."; it
says where the op is named: the same script under a full watch (same seeds, same batches), which
does name it, or ``opwatch.guard`` around the step. A bad batch told as such (cause ``input``)
needs no such line."""

from __future__ import annotations

from opwatch.runners.cli import main
from support.helpers import guard_in_process, line_of

CTC = """
import torch
from torch import nn
torch.manual_seed(0)
rnn = nn.GRU(16, 32)
proj = nn.Linear(32, 10)
optimizer = torch.optim.Adam([*rnn.parameters(), *proj.parameters()], lr=1e-3)
ctc = nn.CTCLoss(blank=0)
for step in range(10):
    x = torch.randn(20, 4, 16)
    input_lengths = torch.full((4,), 20, dtype=torch.long)
    target_lengths = torch.randint(3, 8, (4,))
    if step == 4: input_lengths[2] = CUT  # a clip cut short
    targets = torch.randint(1, 10, (int(target_lengths.sum()),))
    out, _ = rnn(x)
    loss = ctc(proj(out).log_softmax(-1), targets, input_lengths, target_lengths)  # CTC LOSS
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("done")
"""


def test_a_one_off_batch_is_named_by_the_command_the_summary_gives(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, CTC.replace("CUT", "4"))
    assert status == 0 and "done" in out, err
    assert "optimizer step 5: the gradients about to be applied hold nan/inf" in err
    assert "the failure of step 5 did not recur: step 6 ran under a full watch and its gradients were finite." in err
    assert ("opwatch: no op was named in the fully watched steps, but 1 optimizer step failed (see the guard's line below). A batch "
            "that fails once passes the re-check of the step after it; its op is named where that batch runs again under a full "
            "watch: python -m opwatch train.py (with the same seeds and data order), or opwatch.guard(train_step, model) around the "
            "step, which replays a failing batch.") in err
    status = main(["train.py"])  # the command it gives
    out, err = capsys.readouterr()
    assert status == 0 and "done" in out
    assert f"inf in aten._ctc_loss.Tensor at train.py:{line_of('# CTC LOSS', tmp_path / 'train.py')}, module CTCLoss (forward)" in out + err


def test_a_healthy_run_and_a_bad_batch_told_as_such_give_no_command(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, CTC.replace("CUT", "20"))
    assert status == 0 and "opwatch: no anomalies." in err and "0 failed" in err and "runs again" not in err
    script = CTC.replace("CUT", "20").replace("    targets = ", '    if step == 4: x[0, 1, 3] = float("nan")  # a bad sample\n    targets = ')
    status, out, err = guard_in_process(tmp_path, capsys, script)
    assert status == 0 and "cause: input: the batch held nan before the model ran" in err
    assert "opwatch: no op was named in the fully watched steps, but 1 optimizer step failed (see the guard's line below)." in err
    assert "runs again" not in err


def test_strict_raises_did_not_recur_with_the_command_that_names_the_batch(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = guard_in_process(tmp_path, capsys, CTC.replace("CUT", "4"), "--strict")
    assert status == 1 and "done" not in out
    assert "GradientsNotFinite: opwatch: optimizer step 5: " in err and "did not recur: step 6 ran under a full watch" in err
    assert ("Its op is named where that batch runs again under a full watch: python -m opwatch --strict train.py (with the same "
            "seeds and data order), or opwatch.guard(train_step, model) around the step, which replays a failing batch.") in err
