"""The real watch with parts of its per-op work in native code, against the watch, in one process.

    python -m bench.native_parts                          # tfm32, gpt2, mlp, conv; 15 rounds
    python -m bench.native_parts --workloads tfm32 --rounds 21

Where ``python -m bench.ablate --native`` prints what native floors cost (the least per-op work,
ported), this measures what porting the watch's own largest per-op parts buys, each swapped in
by :func:`bench.native.native_parts` and held to the same entries and findings by
``tests/runners/test_bench_native.py``: every op's tensor metadata, the nan/inf tracker's queue of
reductions, and the start of each entry (the user's frame, the autograd node, the site), then
all three, then all three with no entry kept (``bench.ablate.entries_not_kept``: the most that
records kept out of Python objects could add), then that without the pre-dispatch function
mode. It prints each variant over the passthrough floor and over ``watch()``, medians of
per-round ratios (rounds interleaved, process CPU time, one torch thread). It builds
``bench/native_floor.cpp`` against the installed torch on first use (about 15 s).
"""

from __future__ import annotations

import argparse
import sys

import torch

import opwatch
from bench import native
from bench.ablate import WITHOUT_PRE_DISPATCH, entries_not_kept
from bench.contenders import Contender, Passthrough
from bench.timing import measure, paired_ratio
from bench.workloads import WORKLOADS, add_paired_options, chosen_workloads

ALL_THREE = {"metadata": True, "reductions": True, "head": True}
# variant -> a fresh watch with those parts in native code, and what more it leaves out
VARIANTS = {
    "tensor metadata": lambda: native.native_parts(metadata=True),
    "reductions' queue": lambda: native.native_parts(metadata=False, reductions=True),
    "entries' start": lambda: native.native_parts(metadata=False, head=True),
    "all three": lambda: native.native_parts(**ALL_THREE),
    # the most that records kept out of Python objects could add (bench.ablate.entries_not_kept):
    # not where a check point replays its window (GPT-2's mask), where the cell says so
    "+ no entries kept": lambda: entries_not_kept(lambda: native.native_parts(**ALL_THREE)),
    "+ no pre-dispatch mode": lambda: entries_not_kept(lambda: native.native_parts(**ALL_THREE, checks=WITHOUT_PRE_DISPATCH)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.native_parts", description=__doc__.split("\n\n")[0])
    add_paired_options(parser, workloads="tfm32,gpt2,mlp,conv", target_seconds=0.3)
    args = parser.parse_args(argv)
    names = chosen_workloads(parser, args.workloads)
    try:
        native.load(torch_api=True)
    except native.NativeUnavailable as error:
        raise SystemExit(f"bench.native_parts: {error}") from None
    torch.set_num_threads(1)
    contenders = [Contender("passthrough", Passthrough), Contender("watch()", opwatch.watch, is_opwatch=True)]
    contenders += [Contender(name, make, is_opwatch=True) for name, make in VARIANTS.items()]
    print(f"{args.rounds} interleaved rounds, process CPU time, one torch thread; x floor / x watch()")
    print(f"{'workload':10} {'watch()':>8}" + "".join(f" {name:>24}" for name in VARIANTS))
    for name in names:
        results = measure(WORKLOADS[name].factory(), contenders, args.rounds, args.target_seconds)
        floor, watch = results["passthrough"], results["watch()"]
        if floor.error or watch.error:
            print(f"{name:10} failed: {floor.error or watch.error}")
            continue
        cells = [
            f"{paired_ratio(m, floor):.2f}x / {paired_ratio(m, watch):.3f}x" if m.error is None else "-"
            for m in (results[variant] for variant in VARIANTS)
        ]
        print(f"{name:10} {paired_ratio(watch, floor):7.2f}x" + "".join(f" {cell:>24}" for cell in cells))
        for variant in VARIANTS:
            if results[variant].error:
                print(f"{'':10} {variant}: {results[variant].error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
