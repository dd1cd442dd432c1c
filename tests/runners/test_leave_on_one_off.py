"""A batch that fails once, finite when it enters the model: a speech clip cut shorter than its
transcript, whose CTC loss is inf (no alignment fits). ``--guard`` skips its step and the re-check
of the next step passes: no op of the failing step ever ran under a watch, and no step of a
script's loop can run again on that batch. The summary used to end at "no op was named ..."; it
says where the op is named: the same script under a full watch (same seeds, same batches), which
does name it, or ``opwatch.guard`` around the step. A bad batch told as such (cause ``input``)
needs no such line."""

from __future__ import annotations

import io
import warnings

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


def fit_gpt2_with_an_ignored_sample(tmp_path, guarded: bool):
    """The Hugging Face Trainer's guard mode on a tiny GPT-2 (bfloat16 on the CPU), one sample
    at a time, sample 37 with every label ignored (-100): its loss is 0 / 0. Returns the
    callback, after ``guard_trainer(trainer)`` too with ``guarded``."""
    import torch

    from support import needs

    transformers = needs("transformers")
    needs("accelerate")
    from opwatch.runners.transformers import OpwatchCallback, guard_trainer

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                                                                 bos_token_id=0, eos_token_id=0))
    data = []
    for number in range(64):
        ids = torch.randint(0, 100, (16,))
        data.append({"input_ids": ids, "labels": torch.full_like(ids, -100) if number == 37 else ids.clone()})
    callback = OpwatchCallback(mode="guard", file=io.StringIO())
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=64, per_device_train_batch_size=1, learning_rate=1e-3,
                                          logging_steps=100, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, bf16=True,
                                          seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    if guarded:
        guard_trainer(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with callback:
            trainer.train()
    return callback


def test_the_trainer_s_summary_names_what_replays_a_one_off_batch_and_it_names_its_op(tmp_path):
    """The callback alone runs no failing batch again: its summary used to end at "no op was
    named ..."; it names guard_trainer, which replays the batch and names the loss's 0 / 0."""
    callback = fit_gpt2_with_an_ignored_sample(tmp_path, guarded=False)
    assert callback.runner.ledger.counts()["failed"] == 1
    assert callback.runner.watch_summary().startswith(
        "opwatch: no op was named in the fully watched steps, but 1 optimizer step failed (see the guard's line below). A batch that "
        "fails once passes the re-check of the step after it; the callback alone does not run it again: guard_trainer(trainer) "
        "(opwatch.runners.transformers) replays a failing batch from its start under a full watch, which names its op.")
    guarded = fit_gpt2_with_an_ignored_sample(tmp_path, guarded=True)
    summary = guarded.runner.watch_summary()
    assert "the first origin a replay named: nan first made by aten.div.Tensor at transformers/" in summary, summary
    assert "guard_trainer(trainer)" not in summary
