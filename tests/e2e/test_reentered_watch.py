"""A watch re-entered step after step (the trainers' callbacks do it): where a tensor came from.

The batch of a step is made between two blocks of the watch, outside its ops (a DataLoader's
collate). CPython gives a new object the address of one just freed, so the batch often takes the
id of a tensor an op of an earlier step output and that died since (a gradient freed by
``zero_grad``, a view of a weight): the log still holds that op under the batch's id. Its cause
must say the batch was made outside the watch, not name that op (it named ``aten._fused_adamw_``
for a bad batch in the Hugging Face Trainer's default setup). A tensor an op of an earlier block
made, and that is still alive, keeps its maker, also when a block in between never read it.

The same holds where a dtype finding says where its odd operand came from: a float64 batch a
collate forgot to cast, which took the id of an older float32 output, was made outside the watch.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import torch
from torch import nn

import opwatch
from opwatch.checks.nonfinite.tracker import _KNOWN_START
from support import needs
from support.helpers import line_of

def cause_line(anomaly) -> str:
    (line,) = [line for line in anomaly.message.splitlines() if line.startswith("  cause:")]
    return line


def train_with_a_watch_per_step(corrupt: bool, steps=40):
    """A training loop whose watch is re-entered for each step, its batch stacked from samples
    between two blocks (as a collate does). With ``corrupt``, one feature of the first batch
    that took the id of a tensor an earlier step's op output (the premise: a few steps in ten
    do) is nan, as a corrupted sample would make it; the loop ends the step after it. Returns the
    watch and that step, or None."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3, fused=True)
    w = opwatch.watch(warn=False, dump_on_error=False)
    corrupted = None
    for step in range(steps):
        if corrupted is not None and step > corrupted + 1:
            break  # the corrupted step and the one after it
        batch = torch.stack([torch.randn(16, 32) for _ in range(4)])
        if corrupt and corrupted is None and any(meta.ident == id(batch) for record in w.records for meta in record.outputs or ()):
            batch[1, 3, 5] = float("nan")
            corrupted = step
        with w:
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return w, corrupted


def test_a_bad_batch_made_between_two_steps_is_data_though_its_id_was_an_older_tensors():
    w, corrupted = train_with_a_watch_per_step(corrupt=True)
    assert corrupted is not None, "premise: a batch took the id of a tensor an earlier step's op output"
    (first, *_) = [a for a in w.anomalies if a.kind == "nan"]
    cause = first.finding.facts["cause"]
    assert cause.kind == "input" and cause.made.how == "before_watch", cause
    line = cause_line(first)
    assert "made before the watch" in line and "made by" not in line, line


def test_the_same_loop_with_finite_batches_reports_nothing():
    w, _ = train_with_a_watch_per_step(corrupt=False)
    assert w.anomalies == []


def test_a_bad_batch_in_the_hugging_face_trainer_is_data_not_the_fused_optimizer(tmp_path):
    transformers = needs("transformers")
    from transformers.utils import logging as hf_logging

    from opwatch.runners.transformers import OpwatchCallback

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True,
    )
    model = transformers.MixtralForCausalLM(config)

    class Embedded(torch.utils.data.Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            features = torch.randn(16, 32) * 0.1
            if i in (20, 21):
                features[3, 5] = float("nan")  # two corrupted samples, in the sixth batch of 4
            return {"inputs_embeds": features, "labels": torch.randint(0, 256, (16,))}

    callback = OpwatchCallback(warn=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=10, per_device_train_batch_size=4, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, bf16=True, logging_steps=5, max_grad_norm=1.0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Embedded(), callbacks=[callback])
    with callback:
        trainer.train()
    first = next(a for a in callback.anomalies if a.kind == "nan")
    line = cause_line(first)
    assert "made before the watch" in line and "made by" not in line, line


def test_a_tensor_an_earlier_step_made_keeps_its_maker_across_a_block_that_never_read_it():
    """An auxiliary loss on every other step reads a statistic cached at the first step; its
    standard deviation over one sample is nan. The nan is made at the first step, and read again
    two blocks later: its maker is named there."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    w = opwatch.watch(warn=False, dump_on_error=False)
    cached = None
    for step in range(3):
        batch, target = torch.randn(8, 4), torch.randn(8, 1)
        with w:
            if cached is None:
                calibration = torch.randn(1, 4)
                cached = (calibration - calibration.mean(0)) / calibration.std(0)  # one sample: std is nan
            loss = (model(batch) - target).pow(2).mean()
            if step == 2:
                loss = loss + 0.0 * (model(cached) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    read_again = [a for a in w.anomalies if a.kind == "nan" and a.where.endswith(f":{line_of('loss = loss + 0.0 * (model(cached)', __file__)}")]
    assert read_again, [str(a) for a in w.anomalies]
    line = cause_line(read_again[0])
    made_at = line_of("cached = (calibration - calibration.mean(0)) / calibration.std(0)", __file__)
    assert f"made by aten.div.Tensor at" in line or f"made by aten.div at" in line, line
    assert f":{made_at}" in line, line


def test_what_the_blocks_hand_on_stays_flat_over_a_long_run():
    """Each block's batch is a tensor no op made, remembered weakly until it dies: the tables a
    watch keeps across its blocks drop dead entries as they grow."""
    model = nn.Linear(8, 1)
    w = opwatch.watch(warn=False, dump_on_error=False)
    for _ in range(3 * _KNOWN_START):
        batch = torch.randn(4, 8)
        with w:
            model(batch).sum().backward()
    gc.collect()
    blocks = w._earlier_blocks  # the watch's own tables (opwatch.checks.nonfinite.EarlierBlocks)
    assert len(blocks.outside) <= 2 * _KNOWN_START and len(blocks.made) <= 2 * _KNOWN_START, (len(blocks.outside), len(blocks.made))
    assert w.anomalies == []


def test_a_float64_batch_made_between_two_steps_was_made_outside_the_watch_not_by_an_older_op():
    """The collate forgets ``.float()`` for one batch, the first that took the id of an older
    float32 output of the same shape (the premise); the Linear's dtype finding tells where that
    float64 operand came from."""
    torch.manual_seed(0)
    generator = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), 1e-3)
    w = opwatch.watch(warn=False, dump_on_error=False)
    odd = None
    for step in range(100):
        batch = torch.from_numpy(generator.standard_normal((64, 32)))
        if odd is None and any(meta.ident == id(batch) and meta.shape == (64, 32) for record in w.records for meta in record.outputs or ()):
            odd = step  # this one stays float64
        else:
            batch = batch.float()
        with w:
            try:
                loss = model(batch).pow(2).mean()
            except RuntimeError:
                break  # addmm refuses the float64 batch (after the watch has found it)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert odd is not None, "premise: a batch took the id of an older output of its shape"
    (found,) = [a for a in w.anomalies if a.kind == "dtype_mismatch"]
    assert "Where the odd one came from: f64[64, 32] cpu: it was made before the watch" in found.message, found.message
