"""What ``pytest --opwatch`` costs a model's own tests: seven Hugging Face models from small
configs (Llama, Mistral, Qwen2, BERT, RoBERTa, GPT-2, OPT), each trained 15 steps with a padded
attention mask, as a test suite exercises them; pytest run plain and with ``--opwatch``,
alternating, in fresh processes.

    python -m bench.hf_tests                 # 3 rounds
    python -m bench.hf_tests --rounds 5 --opwatch-path /path/to/other/checkout

Prints the tests' own time (pytest's ``call`` durations, summed: no import, no collection, no
model construction) and the session's wall time, plain and watched, per round, and the median
ratios. ``--opwatch-path`` puts another checkout's ``opwatch`` first on ``PYTHONPATH`` for the
watched runs (the plugin is loaded by its import name), to compare two versions in one run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

TESTS = textwrap.dedent('''
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pytest
    import torch
    import transformers as tf
    from transformers.utils import logging
    logging.set_verbosity_error()

    SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    # Configs made at collection: transformers imports a model's module on first use, which
    # is no part of a test's own time.
    MODELS = {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(num_key_value_heads=2, **SMALL)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(num_key_value_heads=2, **SMALL)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(num_key_value_heads=2, **SMALL)),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(**SMALL)),
        "roberta": (tf.RobertaForMaskedLM, tf.RobertaConfig(**SMALL)),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        "opt": (tf.OPTForCausalLM, tf.OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32)),
    }

    @pytest.mark.parametrize("name", sorted(MODELS))
    def test_train_steps(name):
        torch.manual_seed(0)
        model_class, config = MODELS[name]
        model = model_class(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(3, 128, (4, 24))
        mask = torch.ones(4, 24, dtype=torch.long)
        mask[1, 16:] = 0
        for _ in range(15):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert torch.isfinite(loss)
''')


def run_pytest(folder: str, watched: bool, opwatch_path: str | None) -> tuple[float, float]:
    """(the tests' summed call seconds, the session's wall seconds) of one pytest process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if watched and opwatch_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [opwatch_path, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--durations=0", "test_hf_models.py"]
    if watched:
        command.append("--opwatch")
    start = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pytest failed ({'watched' if watched else 'plain'}):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    calls = [float(found) for found in re.findall(r"^([0-9.]+)s call", done.stdout, re.M)]
    if len(calls) != 7:
        raise SystemExit(f"expected 7 call durations, read {len(calls)}:\n{done.stdout[-3000:]}")
    return sum(calls), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_tests", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--opwatch-path", default=None, help="a checkout whose opwatch the watched runs import")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    if args.opwatch_path is not None and not os.path.isdir(os.path.join(args.opwatch_path, "opwatch")):
        parser.error(f"--opwatch-path: no opwatch package in {args.opwatch_path}")
    call_ratios, wall_ratios = [], []
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "test_hf_models.py"), "w") as out:
            out.write(TESTS)
        print(f"{'round':>5}  {'plain call s':>12}  {'watched call s':>14}  {'plain wall s':>12}  {'watched wall s':>14}")
        for number in range(args.rounds):
            plain = run_pytest(folder, False, None)
            watched = run_pytest(folder, True, args.opwatch_path)
            call_ratios.append(watched[0] / plain[0])
            wall_ratios.append(watched[1] / plain[1])
            print(f"{number + 1:>5}  {plain[0]:>12.2f}  {watched[0]:>14.2f}  {plain[1]:>12.2f}  {watched[1]:>14.2f}")
    where = args.opwatch_path or "this tree"
    print(f"pytest --opwatch ({where}) / plain: tests' own time {statistics.median(call_ratios):.2f}x, "
          f"session wall time {statistics.median(wall_ratios):.2f}x (medians of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
