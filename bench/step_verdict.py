"""Leave it on for free (issue 41): what leave-on, the trainers' guard mode and ``guard()`` add
to a step that already clips, measured side by side, interleaved round by round (the order
reversed every other round), as paired ratios (the median over rounds of the same round's ratio).

- ``nanogpt``: a nanoGPT-style step (token and position embeddings, causal attention, an MLP, a
  tied head; AdamW, ``clip_grad_norm_(..., 1.0)``), eager and compiled (``torch.compile`` of the
  model): ``plain``; ``leave-on`` (after its audited first step: the verdict rides on the clip's
  norm); ``leave-on, own pass`` (the same with the verdict made by opwatch's fused pass over the
  gradients, what a loop without a clip pays); ``guard`` (``opwatch.guard`` over forward,
  backward and clip; the optimizer step after it); then the same step with a fused AdamW
  (``fused=True``): ``plain`` and ``leave-on`` (the verdict handed to the optimizer as
  ``found_inf``, read a step late).
- ``hf``: ``transformers.Trainer.train`` of the same model, its default step (AdamW,
  ``max_grad_norm=1.0``), without and with ``OpwatchCallback(mode="guard")`` (``guard mode``),
  and with ``guard_trainer`` as well (``guard``: ``opwatch.guard`` over the Trainer's training
  step); eager, and with ``torch_compile=True`` unless ``--no-compiled``. Two tables of the same
  runs: ``train()`` as a whole (its one-off costs, the guard mode's audited first step among
  them, amortised over the steps), and a healthy step (the median step once the first ones ran,
  timed from one step's start to the next by a callback ahead of opwatch's).
- ``ddp``: the nanoGPT step in ``DistributedDataParallel`` on 2 gloo ranks (127.0.0.1):
  ``plain``, ``leave-on``, ``guard`` (no collective of opwatch's on a healthy step).

Every lane has a model of its own; ``plain, again`` is a second unguarded one, whose ratio to
``plain`` is what two lanes differ by with nothing of opwatch's in either: a ratio within that
distance of 1 cannot be told from it. CPU time of this process for ``nanogpt`` and ``hf``
(single-threaded work); wall clock for
``ddp`` (a collective waits). Targets on CPU (issue 41): leave-on and the trainers' guard mode
<= 1.01x the plain step, ``guard()`` <= 1.02x. Timings on a shared machine are noisy: read the
per-round ratios, not one number.

    python -m bench.step_verdict                  # every lane, 7 rounds
    python -m bench.step_verdict --quick          # 3 rounds of fewer steps
    python -m bench.step_verdict --only nanogpt --no-compiled --rounds 41   # one lane, a finer median
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

TARGETS = {"leave-on": 1.01, "guard mode": 1.01, "guard": 1.02}
# A second unguarded lane, a model of its own like every lane: its ratio to "plain" is the
# resolution of the run (interleaving, memory placement, a shared machine), printed beside the others.
SAME_STEP = "plain, again"


class TinyGPT(nn.Module):
    def __init__(self, vocab=256, width=128, context=64, heads=4):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.register_buffer("mask", torch.triu(torch.ones(context, context, dtype=torch.bool), 1), persistent=False)

    def forward(self, idx, labels=None):
        steps = idx.shape[1]
        h = self.tokens(idx) + self.positions(torch.arange(steps, device=idx.device))
        a = self.norm1(h)
        h = h + self.attention(a, a, a, attn_mask=self.mask[:steps, :steps], need_weights=False)[0]
        h = h + self.mlp(self.norm2(h))
        logits = self.head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss}


def _batch(seed=0, size=8, context=64, vocab=256):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (size, context), generator=generator), torch.randint(0, vocab, (size, context), generator=generator)


def _fresh(compiled: bool, fused: bool = False):
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
    return model, (torch.compile(model) if compiled else model), optimizer


def _clock(wall: bool):
    return time.perf_counter if wall else time.process_time


def _nanogpt_lanes(compiled: bool, wall: bool = False, ddp: bool = False, fused: bool = False) -> dict:
    """``{name: block(steps) -> seconds per step}`` of one model each (``fused``: a fused AdamW,
    the plain and leave-on lanes only)."""
    import opwatch
    from opwatch.runners.leave_on import LeaveOn

    clock = _clock(wall)
    x, y = _batch(seed=torch.initial_seed() % 1000)
    lanes = {}

    def make():
        model, forward, optimizer = _fresh(compiled, fused)
        if ddp:
            model = forward = nn.parallel.DistributedDataParallel(model)
            forward = torch.compile(model) if compiled else model
        return model, forward, optimizer

    def stepping(forward, model, optimizer, around=None):
        def one():
            loss = forward(x, y)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def block(steps: int) -> float:
            start = clock()
            if around is None:
                for _ in range(steps):
                    one()
            else:
                with around():
                    for _ in range(steps):
                        one()
            return (clock() - start) / steps

        return block

    model, forward, optimizer = make()
    lanes["plain"] = stepping(forward, model, optimizer)
    if not ddp:  # the same plain step of a second model: what two unguarded lanes differ by
        model, forward, optimizer = make()
        lanes[SAME_STEP] = stepping(forward, model, optimizer)
    for name, own_pass in (("leave-on", False), ("leave-on, own pass", True)):
        if (ddp or fused) and own_pass:
            continue
        model, forward, optimizer = make()
        run = LeaveOn(audit="manual", warn=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with run:
                run.start_audit()  # the audited first step, not timed
                stepping(forward, model, optimizer)(1)
        if own_pass:
            run.policy.verdict.from_step.reductions = None  # the fused pass over the gradients, as a loop without a clip pays
        lanes[name] = stepping(forward, model, optimizer, around=lambda run=run: run)
    if fused:
        return lanes
    model, forward, optimizer = make()

    def forward_backward_clip(idx, labels, forward=forward, model=model):
        loss = forward(idx, labels)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    guarded = opwatch.guard(forward_backward_clip, model)

    def guarded_block(steps: int, optimizer=optimizer, model=model) -> float:
        start = clock()
        for _ in range(steps):
            guarded(x, y)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (clock() - start) / steps

    guarded_block(1)  # its audited first call, not timed
    lanes["guard"] = guarded_block
    return lanes


def _rounds(lanes: dict, rounds: int, steps: int) -> dict:
    for block in lanes.values():
        block(max(2, steps // 4))  # warm up (compilation, allocator)
    times = {name: [] for name in lanes}
    for index in range(rounds):
        order = list(lanes.items())
        if index % 2:
            order.reverse()
        for name, block in order:
            times[name].append(block(steps))
    return times


def _report(title: str, times: dict, base: str, unit: str) -> list[str]:
    lines = [title]
    for name, found in times.items():
        lines.append(f"  {name:<28} {statistics.median(found) * 1e3:9.3f} ms/step ({unit})")
    for name in times:
        if name == base:
            continue
        pairs = [b / a for a, b in zip(times[base], times[name])]
        target = next((value for key, value in TARGETS.items() if name == key), None)
        judged = "" if target is None else f"; target <= {target}x: {'PASS' if statistics.median(pairs) <= target else 'over'}"
        lines.append(f"  {name + ' / ' + base:<40} {statistics.median(pairs):6.3f}x (per round {', '.join(f'{p:.3f}' for p in pairs)}{judged})")
    return lines


def bench_nanogpt(rounds: int, steps: int, compiled_too: bool) -> list[str]:
    torch.set_num_threads(1)
    lines = []
    for compiled in (False, True) if compiled_too else (False,):
        mode = "compiled" if compiled else "eager"
        times = _rounds(_nanogpt_lanes(compiled), rounds, steps)
        lines += _report(f"nanogpt, {mode}: {rounds} rounds x {steps} steps", times, "plain", "CPU")
        times = _rounds(_nanogpt_lanes(compiled, fused=True), rounds, steps)
        lines += _report(f"nanogpt, {mode}, fused AdamW: {rounds} rounds x {steps} steps", times, "plain", "CPU")
    return lines


def bench_hf(rounds: int, steps: int, compiled_too: bool) -> list[str]:
    try:
        import transformers
    except ImportError:
        return ["hf: skipped (transformers is not installed)"]
    from opwatch.runners.transformers import OpwatchCallback, guard_trainer

    class StepClock(transformers.TrainerCallback):
        """The CPU time at each step's start (the first callback: before opwatch's), so that a
        step's time is the whole of it, the callbacks' work included."""

        def __init__(self):
            self.starts = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.starts.append(time.process_time())

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    x, y = _batch()
    data = [{"idx": x[row], "labels": y[row]} for row in range(len(x))] * (steps + 2)
    lines = []
    for compiled in (False, True) if compiled_too else (False,):
        folder = tempfile.mkdtemp(prefix="bench_step_verdict_")
        healthy = {}  # lane -> the median time of its steps after the first _SETTLED ones, per round

        def lane(name: str, guarded: bool, call_guard: bool = False):
            def block(count: int) -> float:
                torch.manual_seed(0)
                args = transformers.TrainingArguments(output_dir=folder, max_steps=count, per_device_train_batch_size=8, save_strategy="no",
                                                      report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no",
                                                      dataloader_num_workers=0, torch_compile=compiled)
                clock = StepClock()
                callbacks = [clock] + ([OpwatchCallback(mode="guard", warn=False, file=open(os.devnull, "w"))] if guarded else [])
                trainer = transformers.Trainer(model=TinyGPT(), args=args, train_dataset=data, callbacks=callbacks)
                trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no log lines between the figures
                if call_guard:
                    guard_trainer(trainer)
                start = time.process_time()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if guarded:
                        with callbacks[1]:
                            trainer.train()
                    else:
                        trainer.train()
                total = time.process_time() - start
                settled = [later - earlier for earlier, later in zip(clock.starts, clock.starts[1:])][_SETTLED:]
                if settled:
                    healthy.setdefault(name, []).append(statistics.median(settled))
                return total / count

            return block

        lanes = {"plain": lane("plain", False), SAME_STEP: lane(SAME_STEP, False), "guard mode": lane("guard mode", True),
                 "guard": lane("guard", True, call_guard=True)}
        times = _rounds(lanes, rounds, steps)
        mode = "torch_compile" if compiled else "eager"
        lines += _report(f"hf Trainer, {mode}: {rounds} rounds x {steps} steps (train() included: "
                         "the guard mode's audited first step is amortised over them)", times, "plain", "CPU")
        # The warm-up blocks of _rounds are left out: the same rounds as the table above.
        lines += _report(f"hf Trainer, {mode}: the same runs, a healthy step (the median step after the first {_SETTLED}, "
                         "the audited one among them)", {name: found[-rounds:] for name, found in healthy.items()}, "plain", "CPU")
    return lines


# The Trainer's first steps left out of its healthy-step figure: the guard mode's audited first
# step, and the step after it (the allocator and the caches settle).
_SETTLED = 3


def _ddp_worker(rank: int, world: int, port: int, rounds: int, steps: int, compiled_too: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(rank)
    lines = []
    for compiled in (False, True) if compiled_too else (False,):
        times = _rounds(_nanogpt_lanes(compiled, wall=True, ddp=True), rounds, steps)
        lines += _report(f"ddp on {world} gloo ranks, {'compiled' if compiled else 'eager'}: {rounds} rounds x {steps} steps", times, "plain", "wall")
    if rank == 0:
        print("\n".join(lines))
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def bench_ddp(rounds: int, steps: int, compiled_too: bool) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(_ddp_worker, args=(2, port, rounds, steps, compiled_too), nprocs=2, start_method="spawn")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_verdict", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of fewer steps")
    parser.add_argument("--only", action="append", choices=("nanogpt", "hf", "ddp"), help="one lane (repeatable)")
    parser.add_argument("--no-compiled", action="store_true", help="eager lanes only")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7; 3 with --quick): more rounds, a finer median")
    options = parser.parse_args(argv)
    rounds, steps = (3, 10) if options.quick else (7, 40)
    if options.rounds is not None:
        if options.rounds < 1:
            parser.error(f"--rounds must be a positive number of rounds, got {options.rounds}")
        rounds = options.rounds
    only = set(options.only or ("nanogpt", "hf", "ddp"))
    compiled_too = not options.no_compiled
    print(f"torch {torch.__version__}; paired ratios within this run; a shared machine makes them noisy")
    if "nanogpt" in only:
        print("\n".join(bench_nanogpt(rounds, steps, compiled_too)), flush=True)
    if "hf" in only:
        print("\n".join(bench_hf(rounds, steps, compiled_too)), flush=True)
    if "ddp" in only:
        bench_ddp(rounds, steps, compiled_too)
    return 0


if __name__ == "__main__":
    sys.exit(main())
