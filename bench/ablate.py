"""Where opwatch's time goes: ablations on one workload, measured in one process.

    python -m bench.ablate                 # tfm32, 15 rounds
    python -m bench.ablate --workload gpt2 --rounds 21
    python -m bench.ablate --native        # and the floors in native code (bench.native), and
                                           # the watch with three of its parts in native code

Each variant is ``watch()`` with one part switched off or stubbed, or one of the floors of
:mod:`bench.floor` (the least per-op work a watch written in Python with the same records and
nan/inf reads does); the cost of a part is the
median over rounds of (full variant - variant without it), paired within a round, like the
ratios of ``bench.run``. Stubbing a part means patching opwatch's private internals for the
duration of a block (``_head``, ``_metas``, ``nonfinite.tracker.NonFiniteTracker._reduce``): this harness is
tied to opwatch's internals on purpose and must follow them when they change. Garbage
collection time is measured with ``gc.callbacks`` around watched blocks.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings
import weakref

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from tabulate import tabulate

import opwatch
from opwatch.checks import DEFAULT_CHECK_NAMES
from opwatch.checks.nonfinite import tracker as nonfinite
from opwatch.checks.nonfinite.rules import CHECKED_DTYPES
from opwatch.core.records import M_DTYPE
from opwatch.modes import interceptor
from bench.contenders import Contender, Passthrough
from bench.floor import ReadsFloor, RecordsFloor
from bench.timing import measure, paired_difference, paired_ratio
from bench.workloads import WORKLOADS


@contextlib.contextmanager
def _patched(replacements, **options):
    """A watch with some private attributes replaced for the block's duration."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        with opwatch.watch(**options) as w:
            yield w
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _constant_head(self, plan, others):
    """_head without the frame walk, module path, autograd node or sequence numbers."""
    log = self._log
    index = log.next_index
    log.next_index = index + 1
    return (index, plan.func_id, 0, None, "forward", -1, ())


def _constant_metas(tensors, log, types=()):
    """_metas without reading any tensor attribute (one tuple per tensor all the same)."""
    return [((), None, None, 0) for _ in tensors]


def _no_reduction(self, index, outputs, metas):
    """_reduce with no reduction queued: its outputs are still remembered, else every op that
    reads them would check them as tensors made before the watch (a reduction each)."""
    for position, tensor in enumerate(outputs):
        if metas[position][M_DTYPE] in CHECKED_DTYPES:
            self._remember(tensor, weakref.ref(tensor))


def _entry_is_its_head(head, start_ns, end_ns, inputs, outputs=None):
    """op_entry keeping nothing beyond the head the observers read (its index)."""
    return head


@contextlib.contextmanager
def entries_not_kept(make_watch=opwatch.watch):
    """The watch ``make_watch()`` (``opwatch.watch`` by default) with a log that keeps no entry:
    each op's entry is its head, held by a ring of one, so no tuple per op is built for the log
    or walked by the garbage collector. What records kept out of Python objects (native structs,
    read only when a report reads them) would save at most. Only for windows without a flag: a
    replay reads the entries, so a workload whose check points replay (Hugging Face's mask)
    would make the watch inert, which ends the block with an error instead of a flattering
    time. ``bench.native_parts`` combines it with the native parts."""
    saved = interceptor.op_entry
    interceptor.op_entry = _entry_is_its_head
    try:
        with warnings.catch_warnings(), make_watch() as watch:
            warnings.simplefilter("ignore")  # the internal error of a replay that found no entry: said below
            ring = collections.deque(maxlen=1)
            mode = watch._interceptor
            watch._log.entries = mode._entries = ring
            yield watch
    finally:
        interceptor.op_entry = saved
    if mode.inert:  # also by the last check point, at the watch's exit
        raise RuntimeError("the watch went inert: this workload's check points read the entries")


NO_CHECKS = ()
# Every default check but pre_dispatch: its function mode sees every torch function call and
# tensor attribute read, not only ATen ops, so its cost is apart from the per-op parts.
WITHOUT_PRE_DISPATCH = tuple(name for name in DEFAULT_CHECK_NAMES if name != "pre_dispatch")
VARIANTS = {
    "passthrough": Passthrough,
    "floor: records": RecordsFloor,
    "floor: records + nan/inf reads": ReadsFloor,
    "watch()": lambda: opwatch.watch(),
    "no checks": lambda: opwatch.watch(checks=NO_CHECKS),
    "no checks, constant _head": lambda: _patched([(interceptor.OpInterceptor, "_head", _constant_head)], checks=NO_CHECKS),
    "no checks, constant _metas": lambda: _patched([(interceptor, "_metas", _constant_metas)], checks=NO_CHECKS),
    "device + dtype only": lambda: opwatch.watch(checks=["device_mismatch", "dtype_mismatch"]),
    "broadcast only": lambda: opwatch.watch(checks=["broadcast"]),
    "nonfinite only": lambda: opwatch.watch(checks=["nonfinite"]),
    "watch(), no reductions": lambda: _patched([(nonfinite.NonFiniteTracker, "_reduce", _no_reduction)]),
    "watch() without pre_dispatch": lambda: opwatch.watch(checks=WITHOUT_PRE_DISPATCH),
    "watch(), no entries kept (windows without a flag)": entries_not_kept,
}

def native_variants() -> dict:
    """The floors in native code, built here first (a build that fails stops the run, saying why)."""
    from bench import native

    for torch_api in (False, True):
        try:
            native.load(torch_api)
        except native.NativeUnavailable as error:
            raise SystemExit(f"--native: {error}") from None
    return {
        "native floor, CPython API: records": native.NativeRecordsFloor,
        "native floor, CPython API: records + nan/inf reads": native.NativeReadsFloor,
        "native floor, torch C++ API: records": native.TorchApiRecordsFloor,
        "native floor, torch C++ API: records + nan/inf reads": native.TorchApiReadsFloor,
        NATIVE_METADATA: native.native_parts,
        NATIVE_REDUCTIONS: lambda: native.native_parts(metadata=False, reductions=True),
        NATIVE_HEAD: lambda: native.native_parts(metadata=False, head=True),
        NATIVE_ALL: lambda: native.native_parts(reductions=True, head=True),
    }


# --native: the real watch with parts of its per-op work ported, against the watch.
NATIVE_METADATA = "watch(), its tensor metadata in native code (torch C++ API)"
NATIVE_REDUCTIONS = "watch(), its nan/inf reductions' queue in native code"
NATIVE_HEAD = "watch(), its entries' start (frame, node, site) in native code"
NATIVE_ALL = "watch(), all three in native code"
NATIVE_PARTS = {
    "tensor metadata read in native code instead (torch C++ API)": (NATIVE_METADATA, "watch()"),
    "nan/inf reductions queued in native code instead": (NATIVE_REDUCTIONS, "watch()"),
    "entries' start (frame walk, node, site) in native code instead": (NATIVE_HEAD, "watch()"),
    "all three": (NATIVE_ALL, "watch()"),
}


# part -> (variant with it, variant without it)
PARTS = {
    "recording (all of it)": ("no checks", "passthrough"),
    "  .. of which tensor metadata": ("no checks", "no checks, constant _metas"),
    "  .. of which source frame, module, autograd node": ("no checks", "no checks, constant _head"),
    "device + dtype checks": ("device + dtype only", "no checks"),
    "broadcast check + size-1 provenance": ("broadcast only", "no checks"),
    "nan/inf check (all of it)": ("nonfinite only", "no checks"),
    "  .. of which its reductions (kernels, buffers, queue; no flags, no replay)": ("watch()", "watch(), no reductions"),
    "pre-dispatch function mode (every torch function call)": ("watch()", "watch() without pre_dispatch"),
    "keeping each op's entry (its tuple in the log, collected)": ("watch()", "watch(), no entries kept (windows without a flag)"),
    "everything": ("watch()", "passthrough"),
}


def gc_per_step(make, step, steps: int) -> tuple[float, list[float]]:
    """Seconds per step spent in garbage collection under ``make()``, and collections per step
    by generation. A full (generation 2) collection is rare and lumpy: it is counted apart."""
    spent = [0.0]
    started = [0.0]
    counts = [0, 0, 0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]
            counts[info["generation"]] += 1

    gc.collect()
    gc.callbacks.append(callback)
    try:
        with make():
            for _ in range(steps):
                step()
    finally:
        gc.callbacks.remove(callback)
    return spent[0] / steps, [count / steps for count in counts]


CHECK_POINTS = "its check points (reading the flags, replaying a window with a flag)"


def timed_calls_per_step(step, steps: int) -> dict[str, float]:
    """Seconds per step inside the nan/inf reductions' kernels (aminmax, or amin and amax for a
    large CPU tensor), opening their buffers and the nan/inf check points, timed
    around each call under watch() (the timer adds about 0.1 us a call)."""
    spent = {"aminmax kernels": 0.0, "opening buffers for their results": 0.0, CHECK_POINTS: 0.0}

    def timed(function, name):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return call

    kernels = [(nonfinite, name, timed(getattr(nonfinite, name), "aminmax kernels")) for name in ("_aminmax", "_amin", "_amax")]
    timed_open = timed(nonfinite.NonFiniteTracker._buffer_for, "opening buffers for their results")
    timed_resolve = timed(nonfinite.NonFiniteTracker.resolve, CHECK_POINTS)
    with _patched([*kernels, (nonfinite.NonFiniteTracker, "_buffer_for", timed_open), (nonfinite.NonFiniteTracker, "resolve", timed_resolve)]):
        for _ in range(steps):
            step()
    return {name: seconds / steps for name, seconds in spent.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tfm32", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--native", action="store_true", help="also the floors in native code (bench.native; builds them on first use)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    step = WORKLOADS[args.workload].factory()
    variants = dict(VARIANTS)
    if args.native:
        variants.update(native_variants())
    contenders = [Contender(name, make) for name, make in variants.items()]
    results = measure(step, contenders, args.rounds, target_seconds=0.1)
    floor = results["passthrough"]
    rows = [
        [name, "-", m.error] if m.error is not None else [name, f"{m.median * 1e3:.3f}", f"{paired_ratio(m, floor):.2f}x"]
        for name, m in results.items()
    ]
    print(f"{args.workload}: {WORKLOADS[args.workload].description}; {args.rounds} interleaved rounds, process CPU time")
    print(tabulate(rows, headers=["variant", "ms/step", "x passthrough"]))
    print()
    parts = []
    for part, (with_it, without_it) in (PARTS | NATIVE_PARTS if args.native else PARTS).items():
        difference = paired_difference(results[with_it], results[without_it])
        parts.append([part, "-" if difference is None else f"{difference * 1e3:+.3f}"])
        if part.startswith("  .. of which its reductions"):
            in_place = timed_calls_per_step(step, steps=50)
            check_points = in_place.pop(CHECK_POINTS)
            for name, seconds in in_place.items():
                parts.append([f".... of which {name} (timed in place)", f"{seconds * 1e3:.3f}"])
            parts.append([f"  .. of which {CHECK_POINTS} (timed in place)", f"{check_points * 1e3:.3f}"])
    print(tabulate(parts, headers=["part", "ms/step"], disable_numparse=True))
    print("(differences: medians of same-round pairs; \"of which\" rows are shares of the row above)")
    print()
    rows = []
    for name, make in (("watch()", opwatch.watch), ("passthrough", Passthrough)):
        seconds, per_generation = gc_per_step(make, step, steps=100)
        rows.append([name, f"{seconds * 1e3:.3f}", *(f"{count:.2f}" for count in per_generation)])
    print("Garbage collection over 100 steps in one block (a full collection is rare and lumpy):")
    print(tabulate(rows, headers=["", "ms/step", "gen 0 / step", "gen 1 / step", "gen 2 / step"], disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
