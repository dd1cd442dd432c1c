"""Hugging Face beyond one training step: ``generate()`` with the KV cache (greedy and sampling;
GPT-2 and Llama decoder-only, BART and T5 encoder-decoder), a speech model (wav2vec2 CTC: a
training step and ``opwatch.guard`` over steps; Whisper's ``generate()``) and ``Trainer.train()``
under leave-on (``OpwatchCallback(mode="guard")``) and ``guard_trainer``, in float32 and bf16.

Each runs under ``opwatch.watch()`` (every check) and under ``opwatch.guard`` and must report no
anomaly and no ``OpwatchWarning``; a watched ``generate()`` returns the same tokens as the bare
one. Beside each, the natural bug that must be reported: a logits processor adding a float64
(NumPy) bias, a nan in one layer's weights (also under greedy search, where argmax turns the nan
logits into token ids), an audio clip shorter than its transcript (CTC loss inf), a batch whose
labels are all ignored (0 / 0), float64 regression labels under ``python -m opwatch --guard``.
Tiny configs, random weights, no download.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import warnings

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: every model here is built from a config
from support import needs  # noqa: E402

transformers = needs("transformers")

import opwatch  # noqa: E402
from support import equivalence as eq  # noqa: E402
from support.helpers import line_of  # noqa: E402
from support.hf_models import PAD, VOCAB, make_gpt2, make_llama, make_t5  # noqa: E402

NEW_TOKENS = 4


def make_bart(attn, gen):
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
                     pad_token_id=PAD, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                     forced_eos_token_id=None, attn_implementation=attn)
    return BartForConditionalGeneration(cfg), None


GENERATORS = {"gpt2": make_gpt2, "llama": make_llama, "bart": make_bart, "t5": make_t5}
LAYER_ONE = {  # a weight of the second layer, and the module that reads it
    "gpt2": "transformer.h.1.mlp.c_fc",
    "llama": "model.layers.1.mlp.up_proj",
    "bart": "model.decoder.layers.1.fc1",
    "t5": "decoder.block.1.layer.2.DenseReluDense.wi",
}
SAMPLING = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8)


def generator_model(name, attn="sdpa"):
    eq.seed_everything(0)
    model, _ = GENERATORS[name](attn, torch.Generator().manual_seed(0))
    return model.eval()


def prompt():
    """Two prompts of 6 tokens, the second left-padded by 2 (generation's convention)."""
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def generate(model, *, seed=0, **options):
    ids, mask = prompt()
    torch.manual_seed(seed)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          use_cache=True, return_dict_in_generate=True, **options)


@contextlib.contextmanager
def opwatch_warnings_fail():
    """An ``OpwatchWarning`` (an anomaly warned, or opwatch's own error) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # transformers' own notices
        warnings.simplefilter("error", opwatch.OpwatchWarning)
        yield


# -- generate(): quiet -----------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(GENERATORS))
def test_generate_with_the_kv_cache_is_quiet_and_unchanged(name, attn, sampling):
    model = generator_model(name, attn)
    options = SAMPLING if sampling else dict(do_sample=False)
    bare = generate(model, **options)
    with opwatch_warnings_fail():
        with opwatch.watch() as w:
            watched = generate(model, **options)
    assert w.anomalies == [] and torch.equal(watched.sequences, bare.sequences)
    # T5's relative position buckets take log(0) = -inf on the diagonal and drop it (torch.where):
    # contained, never an anomaly
    assert {(a.op, a.filename.rsplit("/", 1)[-1]) for a in w.contained} <= {("aten.log.default", "modeling_t5.py")}
    # the cache was used: the prompt once, then one token a forward (decoder-only: the cache
    # holds the prompt and the tokens fed back; encoder-decoder: the decoder's tokens)
    cache = watched.past_key_values
    cache = getattr(cache, "self_attention_cache", cache)
    fed = prompt()[0].shape[1] if name in ("gpt2", "llama") else 1
    assert cache.get_seq_length() == fed + NEW_TOKENS - 1
    assert any(r.op.startswith(("aten.mm", "aten.addmm", "aten.bmm")) for r in w.records)


@pytest.mark.parametrize("name", list(GENERATORS))
def test_guarded_generate_audits_once_and_finds_nothing(name):
    model = generator_model(name)
    with opwatch_warnings_fail():
        step = opwatch.guard(lambda seed: generate(model, seed=seed, **SAMPLING).sequences, model)
        outputs = [step(seed) for seed in range(3)]
    assert (step.calls, step.audits, len(step.failures), list(step.anomalies)) == (3, 1, 0, [])
    assert torch.equal(outputs[0], generate(model, seed=0, **SAMPLING).sequences)


# -- generate(): must flag ------------------------------------------------------------------------


class NumpyBias(transformers.LogitsProcessor):
    """A prior over the vocabulary from NumPy: float64, as NumPy makes it."""

    def __call__(self, input_ids, scores):
        bias = torch.from_numpy(np.linspace(0.0, 1.0, scores.shape[-1]))
        return scores + bias  # F64 BIAS


@pytest.mark.parametrize("name", ["gpt2", "bart"])
def test_a_float64_logits_processor_is_flagged_at_its_line(name):
    model = generator_model(name)
    with opwatch.watch(warn=False) as w:
        generate(model, do_sample=False, logits_processor=transformers.LogitsProcessorList([NumpyBias()]))
    assert {(a.kind, a.op, a.lineno) for a in w.anomalies} == {("dtype_mismatch", "aten.add.Tensor", line_of("F64 BIAS", __file__))}
    assert len(w.anomalies) == NEW_TOKENS
    assert "f32 with f64 -> f64" in str(w.anomalies[0]) and "torch.from_numpy" in str(w.anomalies[0])


def poisoned(name):
    """The model with one nan in a weight of its second layer."""
    model = generator_model(name)
    module = model.get_submodule(LAYER_ONE[name])
    with torch.no_grad():
        module.weight.view(-1)[0] = float("nan")
    return model


def assert_named_at_the_layer(anomaly, name):
    assert anomaly.kind == "nan" and anomaly.module == LAYER_ONE[name], str(anomaly)
    assert anomaly.phase == "forward" and "/transformers/" in anomaly.filename.replace(os.sep, "/")
    assert "already held nan" in str(anomaly) and f"({LAYER_ONE[name]})" in str(anomaly)


@pytest.mark.parametrize("name", list(GENERATORS))
def test_a_nan_weight_is_named_at_the_layer_that_reads_it_when_scores_are_kept(name):
    model = poisoned(name)  # before the watch: a nan written inside it is a deliberate constant
    with opwatch.watch(warn=False) as w:
        out = generate(model, do_sample=False, output_scores=True)
    assert torch.isnan(out.scores[0]).any()
    # each forward reads the weight again: one origin a forward, all at the layer's line
    assert 1 <= len(w.anomalies) <= NEW_TOKENS and len({a.where for a in w.anomalies}) == 1
    assert_named_at_the_layer(w.anomalies[0], name)


@pytest.mark.parametrize("name", list(GENERATORS))
def test_a_nan_weight_under_sampling_is_named_and_the_error_is_unchanged(name):
    model = poisoned(name)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        with opwatch.watch(warn=False, dump_on_error=False) as w:
            generate(model, **SAMPLING)
    assert len(w.anomalies) == 1
    assert_named_at_the_layer(w.anomalies[0], name)


def test_a_nan_weight_under_greedy_search_is_named_with_the_argmax_that_picked_from_it():
    # argmax turns the nan logits into token ids: no nan is left to see, every token is wrong
    model = poisoned("gpt2")
    with opwatch.watch(warn=False) as w:
        out = generate(model, do_sample=False)
    assert w.contained == [] and len(w.anomalies) >= 1
    anomaly = w.anomalies[0]
    assert_named_at_the_layer(anomaly, "gpt2")
    picked = anomaly.finding.facts["picked_by"]
    assert picked.op == "aten.argmax.default" and picked.filename.replace(os.sep, "/").endswith("transformers/generation/utils.py")
    assert f"{picked.op} at transformers/generation/utils.py:{picked.lineno} (forward) picked indices by comparing its nan values" in str(anomaly)
    assert out.sequences.shape == (2, 6 + NEW_TOKENS)


def test_a_guarded_generate_that_returns_its_scores_names_the_nan_weight():
    # the guard checks what the step returns: token ids hold no nan, the scores do
    model = poisoned("gpt2")

    def decode(seed):
        out = generate(model, seed=seed, do_sample=False, output_scores=True)
        return out.sequences, out.scores

    step = opwatch.guard(decode, model)
    with pytest.raises(RuntimeError, match=r"call 1 of \S*decode failed and the weights already hold nan/inf: transformer\.h\.1\.mlp\.c_fc\.weight \(nan\)"):
        step(0)


def test_the_picked_nan_survives_the_export(tmp_path):
    model = poisoned("gpt2")
    with opwatch.watch(warn=False) as w:
        generate(model, do_sample=False)
    w.export_jsonl(tmp_path / "run.jsonl")
    saved = opwatch.load(tmp_path / "run.jsonl")
    assert [str(a) for a in saved.anomalies] == [str(a) for a in w.anomalies]


# -- picked indices: a masked mean pooling that divides 0 by 0 for an all-padding row ---------------


class Pooled(torch.nn.Module):
    """Token embeddings, mean-pooled over the unmasked tokens, then a linear classifier."""

    def __init__(self, clean):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, 3)
        self.clean = clean

    def forward(self, ids, mask):
        kept = mask.unsqueeze(-1).float()
        pooled = (self.embed(ids) * kept).sum(1) / kept.sum(1)  # POOL: 0 / 0 for an all-padding row
        if self.clean:
            pooled = torch.nan_to_num(pooled)  # the fix: an empty row pools to zeros
        return self.head(pooled)


@pytest.mark.parametrize("picker", ["argmax", "topk", "max"])
def test_predictions_picked_from_nan_logits_are_reported_at_the_pooling(picker):
    torch.manual_seed(0)
    model = Pooled(clean=False).eval()
    ids, mask = prompt()
    mask[1] = 0  # a row of padding only
    pick = {"argmax": lambda z: z.argmax(-1), "topk": lambda z: z.topk(2, -1).indices,
            "max": lambda z: z.max(-1).indices}[picker]
    with opwatch.watch(warn=False) as w, torch.no_grad():
        predictions = pick(model(ids, mask)).tolist()
    assert [(a.kind, a.op, a.lineno) for a in w.anomalies] == [("nan", "aten.div.Tensor", line_of("POOL: 0 / 0", __file__))]
    assert "picked indices by comparing its nan values" in str(w.anomalies[0]) and len(predictions) == 2


def test_predictions_from_cleaned_logits_and_finite_ones_are_not_reported():
    torch.manual_seed(0)
    ids, mask = prompt()
    mask[1] = 0
    with opwatch.watch(warn=False) as w, torch.no_grad():
        cleaned = Pooled(clean=True).eval()(ids, mask).argmax(-1)  # the nan was removed before argmax
        finite = Pooled(clean=False).eval()(*prompt()).topk(2, -1).indices
        # sort puts nan last on purpose (missing values after every number): no pick
        ranked = Pooled(clean=False).eval()(ids, mask).sort(-1).indices
    assert cleaned.shape == finite.shape[:1] == ranked.shape[:1] == (2,)
    assert w.anomalies == [] and [a.op for a in w.contained] == ["aten.div.Tensor"] * 2


# -- speech: wav2vec2 CTC training, Whisper generate ------------------------------------------------


def wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    eq.seed_everything(0)
    cfg = Wav2Vec2Config(vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=37, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, pad_token_id=0,
                         ctc_loss_reduction="mean", mask_time_prob=0.2, mask_time_length=2, layerdrop=0.0)
    return Wav2Vec2ForCTC(cfg).train()


def speech_batch(seed, *, clip=1200, transcript=5):
    """Two clips of 1600 samples (100 ms at 16 kHz); the second one is ``clip`` samples long,
    padded with zeros, its transcript ``transcript`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    audio = torch.randn(2, 1600, generator=gen)
    mask = torch.ones(2, 1600, dtype=torch.long)
    mask[1, clip:] = 0
    audio[1, clip:] = 0
    labels = torch.randint(1, 12, (2, max(transcript, 5)), generator=gen)
    labels[1, transcript:] = -100
    return audio, mask, labels


def ctc_step(model):
    def step(audio, mask, labels):
        loss = model(input_values=audio, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_wav2vec2_ctc_training_step_is_quiet_and_unchanged(attn):
    def train(mode):
        model = wav2vec2()  # seeds torch, numpy (SpecAugment's masks) and random
        model.set_attn_implementation(attn)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with mode:
            loss = ctc_step(model)(*speech_batch(0))
            optimizer.step()
        return loss, [p.detach().clone() for p in model.parameters()]

    bare_loss, bare_weights = train(eq.PassthroughMode())
    with opwatch_warnings_fail():
        watch = opwatch.watch()
        loss, weights = train(watch)
    assert torch.isfinite(loss) and watch.anomalies == []
    assert torch.equal(loss, bare_loss) and all(torch.equal(a, b) for a, b in zip(weights, bare_weights))
    # CTC's forward variables hold log(0) = -inf by design; they die unread: contained
    assert [a.op for a in watch.contained] in ([], ["aten._ctc_loss.Tensor"])
    assert any((r.module or "").startswith("wav2vec2.feature_extractor") for r in watch.records)


def test_guarded_wav2vec2_steps_are_quiet_until_a_clip_is_shorter_than_its_transcript():
    model = wav2vec2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = opwatch.guard(ctc_step(model), model)
    for seed in range(3):
        optimizer.zero_grad()
        step(*speech_batch(seed))
        optimizer.step()
    assert (step.calls, step.audits, len(step.failures), list(step.anomalies)) == (3, 1, 0, [])
    # 200 samples make 9 frames for 12 tokens: no alignment exists, the CTC loss is inf
    optimizer.zero_grad()
    with pytest.raises(opwatch.AnomalyError) as raised:
        step(*speech_batch(3, clip=200, transcript=12))
    anomaly = raised.value.anomaly
    assert (anomaly.kind, anomaly.op, anomaly.module) == ("inf", "aten._ctc_loss.Tensor", "Wav2Vec2ForCTC")
    # Where the installed transformers calls ctc_loss: its loss module, or (older releases, 5.20) the model's file.
    ctc_file = "loss/loss_ctc.py" if importlib.util.find_spec("transformers.loss.loss_ctc") else "models/wav2vec2/modeling_wav2vec2.py"
    assert anomaly.filename.replace(os.sep, "/").endswith(f"transformers/{ctc_file}")


def test_whisper_generate_is_quiet():
    from support.hf_models import build

    model, inputs = build("whisper", "sdpa")
    model.eval()
    with opwatch_warnings_fail():
        torch.manual_seed(0)
        bare = model.generate(input_features=inputs["input_features"], max_new_tokens=NEW_TOKENS)
        with opwatch.watch() as w:
            torch.manual_seed(0)
            watched = model.generate(input_features=inputs["input_features"], max_new_tokens=NEW_TOKENS)
    assert w.anomalies == [] and torch.equal(watched, bare)
    assert {"conv1", "conv2"} <= {r.module for r in w.records if r.op == "aten.convolution.default"}


# -- Trainer: leave-on and guard_trainer, float32 and bf16 ------------------------------------------


def train_gpt2(tmp_path, callback, *, bf16=False, guard=None, ignored_batch=None, steps=4):
    """Four GPT-2 steps of 4 sequences of 8 tokens, every other one right-padded; batch
    ``ignored_batch`` (from 1) holds only prompts: a completion-only loss ignores all its labels."""
    pytest.importorskip("accelerate")
    eq.seed_everything(0)
    model, _ = make_gpt2("sdpa", torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    data = []
    for index in range(4 * steps):
        ids = torch.randint(3, VOCAB, (8,), generator=gen)
        mask = torch.ones(8, dtype=torch.long)
        if index % 2:
            mask[-3:] = 0
        ids = ids.masked_fill(mask == 0, PAD)
        prompt_only = ignored_batch is not None and index // 4 == ignored_batch - 1
        labels = torch.full_like(ids, -100) if prompt_only else ids.masked_fill(mask == 0, -100)
        data.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, bf16=bf16, max_grad_norm=1.0, train_sampling_strategy="sequential",
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    guarded = guard(trainer) if guard else None
    with opwatch_warnings_fail():
        with callback:
            trainer.train()
    return trainer, guarded


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_gpt2_trainer_run_under_leave_on_and_guard_trainer_is_quiet(tmp_path, bf16):
    from opwatch.runners.transformers import OpwatchCallback, guard_trainer

    out = io.StringIO()
    callback = OpwatchCallback(mode="guard", file=out)
    trainer, guarded = train_gpt2(tmp_path, callback, bf16=bf16, guard=guard_trainer)
    runner = callback.runner
    assert callback.anomalies == [] and (runner.steps, runner.audited, runner.failed, runner.skipped) == (4, 1, 0, 0)
    assert (guarded.calls, guarded.audits, len(guarded.failures), list(guarded.anomalies)) == (4, 1, 0, [])
    assert "opwatch: no anomalies." in out.getvalue()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    # the audited step ran the model in bf16 under the Trainer's CPU autocast, or in float32
    dtypes = {r.outputs[0].dtype for r in callback.watch.records if r.op == "aten.addmm.default" and r.outputs}
    assert (torch.bfloat16 in dtypes) == bf16


def test_a_gpt2_trainer_run_fully_watched_is_quiet(tmp_path):
    from opwatch.runners.transformers import OpwatchCallback

    callback = OpwatchCallback(strict=True, file=io.StringIO())
    trainer, _ = train_gpt2(tmp_path, callback, steps=2)
    assert callback.anomalies == [] and trainer.state.log_history[-1]["opwatch/anomalies"] == 0


def test_guard_trainer_names_the_division_of_a_batch_whose_labels_are_all_ignored(tmp_path):
    # The Trainer passes num_items_in_batch = 0: the loss is a sum over no token divided by 0.
    from opwatch.runners.transformers import OpwatchCallback, guard_trainer

    callback = OpwatchCallback(mode="guard", on_failure="raise", warn=False, file=io.StringIO())
    with pytest.raises(opwatch.AnomalyError) as raised:
        train_gpt2(tmp_path, callback, guard=guard_trainer, ignored_batch=3)
    anomaly = raised.value.anomaly
    assert (anomaly.kind, anomaly.op, anomaly.phase) == ("nan", "aten.div.Tensor", "forward")
    assert anomaly.filename.replace(os.sep, "/").endswith("transformers/loss/loss_utils.py")
    assert "0 / 0 = nan" in str(raised.value) and "call 3 of" in str(raised.value)


# -- python -m opwatch --guard over a Trainer script ------------------------------------------------

REGRESSION = """\
import os
import sys

import numpy as np
import torch
import transformers

torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                                 bos_token_id=1, eos_token_id=2, num_labels=1)
model = transformers.GPT2ForSequenceClassification(config)
scores = np.random.default_rng(0).uniform(0, 5, 24)  # a score per text, from NumPy: float64
if os.environ["LABELS"] == "float32":
    scores = scores.astype(np.float32)
data = [{"input_ids": torch.randint(3, 99, (8,)), "attention_mask": torch.ones(8, dtype=torch.long),
         "labels": torch.tensor(score)} for score in scores]
args = transformers.TrainingArguments(output_dir="out", max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
                                      logging_steps=100, save_strategy="no", report_to=[], use_cpu=True,
                                      disable_tqdm=True)
transformers.Trainer(model=model, args=args, train_dataset=data).train()
print("weights finite:", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
"""


def guard_cli(tmp_path, labels):
    pytest.importorskip("accelerate")
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (tmp_path / "train.py").write_text(REGRESSION)
    environment = dict(os.environ, PYTHONPATH=root, LABELS=labels, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "opwatch", "--guard", "train.py"], capture_output=True, text=True,
                            cwd=tmp_path, env=environment, timeout=240)
    assert result.returncode == 0 and "weights finite: True" in result.stdout, result.stderr
    return result.stderr


def test_guard_cli_over_a_trainer_script_is_quiet(tmp_path):
    told = guard_cli(tmp_path, "float32")
    assert "OpwatchWarning" not in told and "opwatch: no anomalies." in told, told
    assert "opwatch guard: 6 optimizer steps ran, 1 audited under a full watch, 0 failed" in told


def _mse_loss_backward_takes_a_wider_target() -> bool:
    """Whether this torch's mse_loss backward runs for a f32 input and a f64 target (torch 2.6's
    raises "Found dtype Double but expected Float", with or without opwatch)."""
    pred = torch.zeros(2, requires_grad=True)
    try:
        torch.nn.functional.mse_loss(pred, torch.zeros(2, dtype=torch.float64)).backward()
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(
    not _mse_loss_backward_takes_a_wider_target(),
    reason=f"torch {torch.__version__}'s mse_loss backward raises for a f32 input and a f64 target: the float64-labels program fails without opwatch",
)
def test_guard_cli_audit_names_float64_regression_labels(tmp_path):
    told = guard_cli(tmp_path, "float64")
    assert "opwatch: 1 anomaly at 1 place" in told, told
    assert "dtype_mismatch in aten.mse_loss.default at transformers/models/gpt2/modeling_gpt2.py:" in told
    assert "mse_loss gets a f64 target for a f32 input" in told
    assert "6 optimizer steps ran, 1 audited under a full watch, 0 failed" in told
