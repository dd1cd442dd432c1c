"""Memory and long-run checks for opwatch.watch().

Three questions, all on a tiny training step (a few dozen ops) so that a
10,000-step loop stays short:

1. Flat RSS: under one long ``watch()`` the ring buffer fills within the first
   few hundred steps; after that, resident memory must stop growing (no
   per-op or per-step leak beyond the fixed cost of ``max_records``).  An
   eager run of the same loop is the control for allocator noise.
2. Constant per-op cost: the per-op time of the first block of steps and the
   last block of the same long watch should match (no cost that grows with
   the number of ops seen so far).
3. Bytes per record: the memory difference between a full ring of
   ``max_records=large`` and one of ``max_records=small``, divided by the
   difference in records.  Measured with tracemalloc (Python objects only,
   exact) and, in the full run, by RSS in fresh subprocesses (everything,
   coarser).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
from typing import Any, Callable

import torch
from tabulate import tabulate

from .contenders import OpCounter
from .workloads import Step, tiny_step

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Timing samples per block.  A block's time is the *minimum* sample: the work
# is identical from sample to sample, so anything above the minimum is
# interference from other processes, which on a small shared machine comes in
# bursts long enough to swamp a median.
SUB_BLOCKS = 50
FLAT_TOLERANCE_BYTES = 4 << 20  # RSS growth we still call flat (allocator noise)
MAX_RECORDS = 10_000  # the documented default, passed explicitly


def rss_bytes() -> int:
    """Current (not peak) resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ops_per_step(step: Step) -> int:
    counter = OpCounter()
    with counter:
        step()
    return counter.total


def _timed_blocks(step: Step, steps: int, block: int) -> list[tuple[int, float, int]]:
    """Run ``steps`` steps; per block return (steps done, s/step, RSS at block end)."""
    sub = max(1, block // SUB_BLOCKS)
    out = []
    done = 0
    while done < steps:
        samples = []
        for _ in range(block // sub):
            t0 = time.perf_counter()
            for _ in range(sub):
                step()
            samples.append((time.perf_counter() - t0) / sub)
        done += (block // sub) * sub
        out.append((done, min(samples), rss_bytes()))
    return out


def long_watch(opwatch: Any, steps: int, block: int) -> tuple[str, dict[str, float]]:
    """Eager control loop, then the same loop under one long watch()."""
    step = tiny_step()
    step()
    n_ops = ops_per_step(step)

    gc.collect()
    eager = _timed_blocks(step, steps, block)
    gc.collect()
    with opwatch.watch(max_records=MAX_RECORDS) as w:
        watched = _timed_blocks(step, steps, block)
        n_records, n_anomalies = len(w.records), len(w.anomalies)

    # Growth is measured from the first block by whose end the ring is full.
    full = next((i for i, (done, _, _) in enumerate(watched) if done * n_ops >= MAX_RECORDS),
                len(watched) - 1)
    rows = []
    for (done, t_e, rss_e), (_, t_w, rss_w) in zip(eager, watched):
        rows.append([done, f"{t_e / n_ops * 1e6:.2f}", f"{rss_e / 2**20:.1f}",
                     f"{t_w / n_ops * 1e6:.2f}", f"{(t_w - t_e) / n_ops * 1e6:.2f}",
                     f"{rss_w / 2**20:.1f}"])
    table = tabulate(rows, headers=["steps", "eager us/op", "eager RSS MB", "watch us/op",
                                    "added us/op", "watch RSS MB"])
    stats = {
        "ops_per_step": n_ops,
        "records": n_records,
        "anomalies": n_anomalies,
        "full_at": watched[full][0],
        "growth_watch": watched[-1][2] - watched[full][2],
        "growth_eager": eager[-1][2] - eager[full][2],
        "cost_ratio": watched[-1][1] / watched[0][1],
        # Later blocks against each other, free of first-block warm-up effects.
        "cost_ratio_late": watched[-1][1] / watched[1][1] if len(watched) > 1 else float("nan"),
    }
    return table, stats


def _fill_ring(opwatch: Any, step: Step, max_records: int, steps: int) -> tuple[int, int]:
    """Traced Python memory held by a watch whose ring holds ``max_records``."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with opwatch.watch(max_records=max_records) as w:
            for _ in range(steps):
                step()
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
        return held, len(w.records)
    finally:
        tracemalloc.stop()


def bytes_per_record_tracemalloc(opwatch: Any, small: int, large: int) -> tuple[float, int, int]:
    step = tiny_step()
    step()
    steps = int(large / ops_per_step(step) * 1.1) + 1  # enough to fill the large ring
    held_s, n_s = _fill_ring(opwatch, step, small, steps)
    held_l, n_l = _fill_ring(opwatch, step, large, steps)
    return (held_l - held_s) / max(1, n_l - n_s), n_s, n_l


def _rss_child(max_records: int, steps: int) -> None:
    """Subprocess body: RSS added by one full watch(max_records=...)."""
    import opwatch

    torch.set_num_threads(1)
    step = tiny_step()
    for _ in range(3):
        step()
    gc.collect()
    before = rss_bytes()
    with opwatch.watch(max_records=max_records) as w:
        for _ in range(steps):
            step()
        gc.collect()
        after = rss_bytes()
    print(json.dumps({"delta": after - before, "records": len(w.records)}))


def bytes_per_record_rss(small: int, large: int, n_ops: int) -> float:
    steps = int(large / n_ops * 1.1) + 1
    results = []
    for n in (small, large):
        proc = subprocess.run(
            [sys.executable, "-c", f"from bench.memory import _rss_child; _rss_child({n}, {steps})"],
            cwd=REPO_ROOT, capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONPATH": REPO_ROOT, "PYTHONWARNINGS": "ignore"},
        )
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    small_r, large_r = results
    return (large_r["delta"] - small_r["delta"]) / max(1, large_r["records"] - small_r["records"])


def report(opwatch: Any, steps: int, block: int, record_sizes: tuple[int, int],
           rss_subprocess: bool, log: Callable[[str], None]) -> str:
    """Run all memory checks and return the report text."""
    log(f"[memory] {steps}-step loop, eager then one long watch()")
    table, s = long_watch(opwatch, steps, block)
    mb = 2**20
    flat = s["growth_watch"] <= max(FLAT_TOLERANCE_BYTES, 2 * s["growth_eager"])
    lines = [
        f"  tiny step: {s['ops_per_step']} ops; {steps} steps = {steps * s['ops_per_step']:,} ops "
        f"under one watch(max_records=10,000); records kept {s['records']:,}, "
        f"anomalies {s['anomalies']}",
        "",
        *("  " + line for line in table.splitlines()),
        "",
        f"  {'PASS' if flat else 'FAIL'}  RSS growth from step {s['full_at']:,} (ring full) "
        f"to step {steps:,}: watch {s['growth_watch'] / mb:+.1f} MB vs eager "
        f"{s['growth_eager'] / mb:+.1f} MB (flat = within {FLAT_TOLERANCE_BYTES / mb:.0f} MB)",
        f"  per-op cost, last block / first block = {s['cost_ratio']:.2f}x "
        f"(last / second = {s['cost_ratio_late']:.2f}x; ~1.0 means constant)",
    ]

    small, large = record_sizes
    log(f"[memory] bytes per record (tracemalloc, max_records {small} vs {large})")
    per_rec, n_s, n_l = bytes_per_record_tracemalloc(opwatch, small, large)
    lines.append(f"  bytes per record (tracemalloc, Python objects): {per_rec:,.0f} B "
                 f"(rings held {n_s:,} vs {n_l:,} records) -> max_records=10,000 costs "
                 f"~{per_rec * 10_000 / mb:.1f} MB")
    if rss_subprocess:
        log("[memory] bytes per record (RSS, fresh subprocesses)")
        try:
            per_rec_rss = bytes_per_record_rss(small, large, s["ops_per_step"])
            lines.append(f"  bytes per record (RSS delta, fresh processes): {per_rec_rss:,.0f} B")
        except subprocess.CalledProcessError as exc:
            lines.append(f"  bytes per record (RSS): subprocess failed: {exc.stderr.strip()[-300:]}")
    return "\n".join(lines)
