"""The real watch with parts of its per-op work in native code, against the watch, in one process.

    python -m bench.native_parts                          # tfm32, gpt2, mlp, conv; 15 rounds
    python -m bench.native_parts --workloads tfm32 --rounds 21

Where ``python -m bench.ablate --native`` prints what native floors cost (the least per-op work,
ported), this measures what porting the watch's own largest per-op parts buys, each swapped in
by :func:`bench.native.native_parts` and held to the same entries and findings by
``tests/runners/test_bench_native.py``: every op's tensor metadata, the nan/inf tracker's queue of
reductions, and the start of each entry (the user's frame, the autograd node, the site), then
all three. It prints each variant over the passthrough floor and over ``watch()``, medians of
per-round ratios (rounds interleaved, process CPU time, one torch thread). It builds
``bench/native_floor.cpp`` against the installed torch on first use (about 15 s).
"""

from __future__ import annotations

import argparse
import sys

import torch

import opwatch
from bench import native
from bench.contenders import Contender, Passthrough
from bench.timing import measure, paired_ratio
from bench.workloads import WORKLOADS, add_paired_options, chosen_workloads

# variant -> the parts in native code (bench.native.native_parts' keywords)
VARIANTS = {
    "tensor metadata": {"metadata": True},
    "reductions' queue": {"metadata": False, "reductions": True},
    "entries' start": {"metadata": False, "head": True},
    "all three": {"metadata": True, "reductions": True, "head": True},
}


def _native(parts: dict):
    return lambda: native.native_parts(**parts)


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
    contenders += [Contender(name, _native(parts), is_opwatch=True) for name, parts in VARIANTS.items()]
    print(f"{args.rounds} interleaved rounds, process CPU time, one torch thread; x floor / x watch()")
    print(f"{'workload':10} {'watch()':>8}" + "".join(f" {name:>24}" for name in VARIANTS))
    for name in names:
        results = measure(WORKLOADS[name].factory(), contenders, args.rounds, args.target_seconds)
        failed = [m for m in results.values() if m.error]
        if failed:
            print(f"{name:10} {failed[0].contender.name} failed: {failed[0].error}")
            continue
        floor, watch = results["passthrough"], results["watch()"]
        cells = [f"{paired_ratio(results[variant], floor):.2f}x / {paired_ratio(results[variant], watch):.3f}x" for variant in VARIANTS]
        print(f"{name:10} {paired_ratio(watch, floor):7.2f}x" + "".join(f" {cell:>24}" for cell in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
