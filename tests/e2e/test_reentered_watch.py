"""A watch re-entered step after step (the trainers' callbacks do it): where a tensor came from,
and what one block hands on to the next (the tensors left holding an origin's nan/inf: weights a
bad step wrote, a cached statistic; data that waits), so that it tells what one watch kept over
the run would.

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


def train_with_a_watch_per_step(corrupt: bool, steps=40, after=1):
    """A training loop whose watch is re-entered for each step, its batch stacked from samples
    between two blocks (as a collate does). With ``corrupt``, one feature of the first batch
    that took the id of a tensor an earlier step's op output (the premise: a few steps in ten
    do) is nan, as a corrupted sample would make it; the loop ends ``after`` steps after it.
    Returns the watch and that step, or None."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3, fused=True)
    w = opwatch.watch(warn=False, dump_on_error=False)
    corrupted = None
    for step in range(steps):
        if corrupted is not None and step > corrupted + after:
            break  # the corrupted step and the ones after it
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


def test_the_weights_the_bad_step_wrote_are_its_spread_in_the_later_blocks_not_new_origins():
    """The optimizer applied the bad batch's gradients: every later step reads nan weights. One
    watch kept over the run follows them as the batch's spread; re-entered step after step, each
    block found them holding nan when first read (cause: weights) and named them again."""
    w, corrupted = train_with_a_watch_per_step(corrupt=True, after=4)
    assert corrupted is not None, "premise: a batch took the id of a tensor an earlier step's op output"
    found = [a for a in w.anomalies if a.kind == "nan"]
    assert len(found) == 1 and found[0].finding.facts["cause"].kind == "input", [a.message for a in found]


def test_lightning_s_watch_names_the_bad_batch_once_not_adamw_s_weight_decay_at_every_later_step(tmp_path):
    lightning = needs("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from opwatch.runners.lightning import OpwatchCallback

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    x[9, 3] = float("nan")  # a corrupted sample, in the third batch

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def forward(self, x):
            return self.net(x)  # THE BATCH ENTERS

        def training_step(self, batch, batch_idx):
            inputs, target = batch
            return nn.functional.mse_loss(self(inputs), target)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    callback = OpwatchCallback(warn=False)
    trainer = lightning.Trainer(max_steps=8, accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=[callback],
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(TensorDataset(x, y), batch_size=4))
    (found,) = [a for a in callback.anomalies if a.kind == "nan"]
    assert found.lineno == line_of("# THE BATCH ENTERS", __file__) and found.finding.facts["cause"].kind == "input", found.message


def test_weights_the_program_wrote_between_two_blocks_are_still_named():
    """No op of the watch wrote them: named with the cause weights, once (the optimizer's
    writes of them at that step make the next block's reads their spread)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    w = opwatch.watch(warn=False, dump_on_error=False)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                model[2].weight[0, 3] = float("nan")  # WRITTEN BETWEEN BLOCKS
        x = torch.randn(16, 8)
        with w:
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    (found,) = [a for a in w.anomalies if a.kind == "nan"]
    assert found.finding.facts["cause"].kind == "weights", found.message


def fit_blocks_on_a_table(missing: str):
    """A numpy table with one missing value (nan) loaded in the watch's first block, its rows fed
    32 at a time, one block a step; ``missing``: ``"drop"`` leaves the incomplete row out."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((256, 9)).astype(np.float32)
    table[100, 3] = np.nan
    torch.manual_seed(0)
    w = opwatch.watch(warn=False, dump_on_error=False)
    with w:
        data = torch.from_numpy(table)  # LOADED IN THE FIRST BLOCK
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for start in range(0, 256, 32):
        with w:
            batch = data[start : start + 32]
            if missing == "drop":
                batch = batch[~batch.isnan().any(1)]
            loss = (model(batch[:, :8]) - batch[:, 8:]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w


def test_data_loaded_in_one_block_waits_and_is_named_where_it_came_in_when_a_later_block_feeds_it():
    assert fit_blocks_on_a_table("drop").anomalies == []
    (found,) = fit_blocks_on_a_table("leak").anomalies
    assert (found.op, found.lineno) == ("aten.lift_fresh.default", line_of("# LOADED IN THE FIRST BLOCK", __file__)), found.message


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
    first, *later = [a for a in callback.anomalies if a.kind == "nan"]
    line = cause_line(first)
    assert "made before the watch" in line and "made by" not in line, line
    assert later == [], [a.message for a in later]  # the weights the bad step wrote are its spread


def test_a_nan_an_earlier_step_made_and_kept_is_named_once_where_it_was_made():
    """An auxiliary loss on every other step reads a statistic cached at the first step; its
    standard deviation over one sample is nan. Made at the first step and kept, it is named
    there; read again two blocks later (a block in between never read it), it is that origin's
    spread, carried on from block to block as one watch kept over the run would follow it."""
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
                loss = loss + 0.0 * (model(cached) ** 2).mean()  # READ AGAIN
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    made_at = line_of("cached = (calibration - calibration.mean(0)) / calibration.std(0)", __file__)
    (found,) = [a for a in w.anomalies if a.kind == "nan"]
    assert (found.op, found.lineno) == ("aten.std.correction", made_at), found.message
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # (the premise: the read at step 2 reached the weights)


def test_what_the_blocks_hand_on_stays_flat_over_a_long_run():
    """Each block's batch is a tensor no op made, remembered weakly until it dies: the tables a
    watch keeps across its blocks drop dead entries as they grow."""
    model = nn.Linear(8, 1)
    static = torch.zeros(4, 8)  # a static input buffer (as for CUDA graphs)
    w = opwatch.watch(warn=False, dump_on_error=False)
    for _ in range(3 * _KNOWN_START):
        batch, other = torch.randn(4, 8), torch.randn(4, 8)
        with w:
            static.copy_(other)  # read by an in-place op's source only (the table of unchecked reads)
            (model(batch) + model(static)).sum().backward()
    gc.collect()
    blocks = w._earlier_blocks  # the watch's own tables (opwatch.checks.nonfinite.EarlierBlocks)
    sizes = (len(blocks.outside), len(blocks.made), len(blocks.unchecked))
    assert max(sizes) <= 2 * _KNOWN_START and min(len(blocks.outside), len(blocks.unchecked)) > _KNOWN_START // 2, sizes
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
