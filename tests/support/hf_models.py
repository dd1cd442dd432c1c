"""Tiny Hugging Face models built from a small config (no download): ``MODELS`` by name and
``build(name, attn)`` -> (model, inputs). Shared by the equivalence and autocast tests."""

from __future__ import annotations

import os

import torch

from . import equivalence as eq

# Never touch the network, whatever the environment says.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BATCH = 2
SEQ = 8
VOCAB = 99
PAD = 0
DROPOUT = 0.1


def _text_batch(gen: torch.Generator, pad_left: bool = False):
    """input_ids / attention_mask / labels; row 1 has 3 padding positions."""
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if pad_left:
        mask[1, :3] = 0
    else:
        mask[1, -3:] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


# --------------------------------------------------------------------------
# model factories: each returns (model, inputs dict)
# --------------------------------------------------------------------------


def make_bert(attn, gen):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=37, max_position_embeddings=64, type_vocab_size=2,
                     hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT,
                     pad_token_id=PAD, attn_implementation=attn)
    model = BertForMaskedLM(cfg)
    ids, mask, labels = _text_batch(gen)
    token_type_ids = torch.zeros_like(ids)
    token_type_ids[:, SEQ // 2:] = 1
    return model, dict(input_ids=ids, attention_mask=mask, token_type_ids=token_type_ids, labels=labels)


def make_gpt2(attn, gen):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                     resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT,
                     bos_token_id=1, eos_token_id=2, pad_token_id=PAD, attn_implementation=attn)
    model = GPT2LMHeadModel(cfg)
    ids, mask, labels = _text_batch(gen, pad_left=True)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return model, dict(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=labels)


def make_llama(attn, gen):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads = 32, 2  # head_dim 16 -> len(inv_freq) == 8 == SEQ
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=64,
                      attention_dropout=DROPOUT, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
                      attn_implementation=attn)
    model = LlamaForCausalLM(cfg)
    assert len(model.model.rotary_emb.inv_freq) == SEQ, model.model.rotary_emb.inv_freq.shape
    ids, mask, labels = _text_batch(gen)
    return model, dict(input_ids=ids, attention_mask=mask, labels=labels)


def make_t5(attn, gen):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   dropout_rate=DROPOUT, pad_token_id=PAD, eos_token_id=1, decoder_start_token_id=PAD,
                   attn_implementation=attn)
    model = T5ForConditionalGeneration(cfg)
    ids, mask, _ = _text_batch(gen)
    dec_ids, dec_mask, labels = _text_batch(gen)
    labels = labels[:, :6].contiguous()
    return model, dict(input_ids=ids, attention_mask=mask, labels=labels, decoder_attention_mask=dec_mask[:, :6].contiguous())


def make_vit(attn, gen):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=37, hidden_dropout_prob=DROPOUT,
                    attention_probs_dropout_prob=DROPOUT, num_labels=3, attn_implementation=attn)
    model = ViTForImageClassification(cfg)
    pixels = torch.randn(BATCH, 3, 16, 16, generator=gen)
    labels = torch.tensor([0, 2])
    return model, dict(pixel_values=pixels, labels=labels)


def make_whisper(attn, gen):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
                        decoder_ffn_dim=37, max_source_positions=15, max_target_positions=32,
                        dropout=DROPOUT, attention_dropout=DROPOUT, activation_dropout=DROPOUT,
                        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                        begin_suppress_tokens=None, suppress_tokens=None, attn_implementation=attn)
    model = WhisperForConditionalGeneration(cfg)
    features = torch.randn(BATCH, 16, 30, generator=gen)  # 2 * max_source_positions frames
    dec_ids, dec_mask, labels = _text_batch(gen)
    return model, dict(input_features=features, decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask,
                       labels=labels)


MODELS = {
    "bert": make_bert,
    "gpt2": make_gpt2,
    "llama": make_llama,
    "t5": make_t5,
    "vit": make_vit,
    "whisper": make_whisper,
}
ATTENTION = ("sdpa", "eager")


# --------------------------------------------------------------------------
# one training step
# --------------------------------------------------------------------------


def build(name: str, attn: str):
    eq.seed_everything(0)
    gen = torch.Generator().manual_seed(0)
    model, inputs = MODELS[name](attn, gen)
    model.train()
    return model, inputs
