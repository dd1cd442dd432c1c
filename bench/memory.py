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

   Both run in a fresh subprocess, where RSS means something.
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
import tracemalloc
from typing import Any, Callable

import torch
from tabulate import tabulate

from .contenders import OpCounter
from .timing import CLOCKS
from .workloads import Step, tiny_step

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Timing samples per block.  A block's time is the *minimum* sample: the work
# is identical from sample to sample, so anything above the minimum is
# interference (other processes, even in CPU time: caches, frequency), which
# on a small shared machine comes in bursts long enough to swamp a median.
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


def _timed_blocks(step: Step, steps: int, block: int,
                  clock: Callable[[], float]) -> list[tuple[int, float, int]]:
    """Run ``steps`` steps; per block return (steps done, s/step, RSS at block end)."""
    sub = max(1, block // SUB_BLOCKS)
    out = []
    done = 0
    while done < steps:
        samples = []
        for _ in range(block // sub):
            t0 = clock()
            for _ in range(sub):
                step()
            samples.append((clock() - t0) / sub)
        done += (block // sub) * sub
        out.append((done, min(samples), rss_bytes()))
    return out


def long_watch(steps: int, block: int, clock: str) -> dict[str, Any]:
    """Child body: an eager control loop, then the same loop under one long watch()."""
    import opwatch

    timer = CLOCKS[clock]

    step = tiny_step()
    step()
    n_ops = ops_per_step(step)
    gc.collect()
    eager = _timed_blocks(step, steps, block, timer)
    gc.collect()
    before = rss_bytes()
    with opwatch.watch(max_records=MAX_RECORDS) as w:
        watched = _timed_blocks(step, steps, block, timer)
        n_records, n_anomalies = len(w.records), len(w.anomalies)
    return {"ops_per_step": n_ops, "eager": eager, "watched": watched, "rss_before": before,
            "records": n_records, "anomalies": n_anomalies}


def ring_rss(max_records: int, steps: int) -> dict[str, int]:
    """Child body: RSS added by one watch(max_records=...) run for ``steps`` steps."""
    import opwatch

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
    return {"delta": after - before, "records": len(w.records)}


_CHILDREN = {"long_watch": long_watch, "ring_rss": ring_rss}


def in_child(name: str, **kwargs: Any) -> Any:
    """Run a child body in a fresh interpreter and return its JSON result.

    RSS is only meaningful in a fresh process: the main benchmark process has
    already grown and freed far more memory than opwatch would ever hold, and
    the allocator reuses that freed memory without changing RSS.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "bench.memory", name, json.dumps(kwargs)],
        cwd=REPO_ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{name} child failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


def _steps_to_fill(max_records: int, n_ops: int) -> int:
    # Ops like record_function markers are counted but not recorded: leave margin.
    return int(max_records / n_ops * 1.25) + 1


def bytes_per_record_tracemalloc(opwatch: Any, small: int, large: int) -> tuple[float, int, int]:
    step = tiny_step()
    step()
    steps = _steps_to_fill(large, ops_per_step(step))
    held_s, n_s = _fill_ring(opwatch, step, small, steps)
    held_l, n_l = _fill_ring(opwatch, step, large, steps)
    return (held_l - held_s) / max(1, n_l - n_s), n_s, n_l


def bytes_per_record_rss(small: int, large: int, n_ops: int) -> float:
    steps = _steps_to_fill(large, n_ops)
    s, l = (in_child("ring_rss", max_records=n, steps=steps) for n in (small, large))
    return (l["delta"] - s["delta"]) / max(1, l["records"] - s["records"])


def _long_watch_report(r: dict[str, Any], steps: int) -> list[str]:
    n_ops, eager, watched = r["ops_per_step"], r["eager"], r["watched"]
    mb = 2**20
    # Growth is measured from the first block by whose end the ring is full.
    full = next((i for i, (done, _, _) in enumerate(watched)
                 if done >= _steps_to_fill(MAX_RECORDS, n_ops)), len(watched) - 1)
    rows = [[done, f"{t_e / n_ops * 1e6:.2f}", f"{t_w / n_ops * 1e6:.2f}",
             f"{(t_w - t_e) / n_ops * 1e6:.2f}", f"{rss_e / mb:.1f}", f"{rss_w / mb:.1f}"]
            for (done, t_e, rss_e), (_, t_w, rss_w) in zip(eager, watched)]
    table = tabulate(rows, headers=["steps", "eager us/op", "watch us/op", "added us/op",
                                    "eager RSS MB", "watch RSS MB"])
    growth_w = watched[-1][2] - watched[full][2]
    growth_e = eager[-1][2] - eager[full][2]
    flat = growth_w <= max(FLAT_TOLERANCE_BYTES, 2 * growth_e)
    cost_ratio = watched[-1][1] / watched[0][1]
    # Last against second block, free of first-block warm-up effects.
    late_ratio = watched[-1][1] / watched[1][1] if len(watched) > 1 else float("nan")
    return [
        f"  (fresh process) tiny step: {n_ops} ops; {steps:,} steps = {steps * n_ops:,} ops under "
        f"one watch(max_records={MAX_RECORDS:,}); records kept {r['records']:,}, "
        f"anomalies {r['anomalies']}; per-op times are the fastest of {SUB_BLOCKS} samples per block",
        "",
        *("  " + line for line in table.splitlines()),
        "",
        f"  {'PASS' if flat else 'FAIL'}  RSS growth from step {watched[full][0]:,} (ring full) "
        f"to step {steps:,}: watch {growth_w / mb:+.1f} MB vs eager {growth_e / mb:+.1f} MB "
        f"(flat = within {FLAT_TOLERANCE_BYTES / mb:.0f} MB); RSS taken by the watch "
        f"up to then {(watched[full][2] - r['rss_before']) / mb:+.1f} MB",
        f"  per-op cost, last block / first block = {cost_ratio:.2f}x "
        f"(last / second = {late_ratio:.2f}x; ~1.0 means constant)",
    ]


def report(opwatch: Any, steps: int, block: int, record_sizes: tuple[int, int],
           rss_subprocess: bool, clock: str, log: Callable[[str], None]) -> str:
    """Run all memory checks and return the report text."""
    log(f"[memory] {steps}-step loop in a fresh process, eager then one long watch()")
    try:
        long = in_child("long_watch", steps=steps, block=block, clock=clock)
        lines = _long_watch_report(long, steps)
    except RuntimeError as exc:
        long, lines = None, [f"  long watch: {exc}"]

    small, large = record_sizes
    log(f"[memory] bytes per record (tracemalloc, max_records {small} vs {large})")
    per_rec, n_s, n_l = bytes_per_record_tracemalloc(opwatch, small, large)
    lines.append(f"  bytes per record (tracemalloc, Python objects): {per_rec:,.0f} B "
                 f"(rings held {n_s:,} vs {n_l:,} records) -> max_records=10,000 costs "
                 f"~{per_rec * 10_000 / 2**20:.1f} MB")
    if rss_subprocess:
        log("[memory] bytes per record (RSS, fresh processes)")
        try:
            n_ops = long["ops_per_step"] if long else 41
            per_rec_rss = bytes_per_record_rss(small, large, n_ops)
            lines.append(f"  bytes per record (RSS delta, fresh processes, all allocations): "
                         f"{per_rec_rss:,.0f} B")
        except RuntimeError as exc:
            lines.append(f"  bytes per record (RSS): {exc}")
    return "\n".join(lines)


if __name__ == "__main__":
    # Child entry point: python -m bench.memory NAME JSON_KWARGS
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(json.dumps(_CHILDREN[sys.argv[1]](**json.loads(sys.argv[2]))))
