"""opwatch benchmark suite: entry point.

    python -m bench.run            # full run, about 3 minutes on 2 cores
    python -m bench.run --quick    # smoke run, under a minute
    python -m bench.run --only tfm32 --only memory
    python -m bench.run --clock wall   # wall time instead of process CPU time

What it prints (all numbers are measured within this one run; on a noisy
machine compare ratios, never absolute times, between runs):

1. A header: machine, versions, and which opwatch was found (with a hash of
   its sources, to tell which code a report measured).
2. The main table: for each workload and contender, median ms per step, the
   per-round paired ratio to eager and to the passthrough "floor", the
   overhead per op in microseconds, and ATen ops per step.
3. What opwatch adds: the ops and host reads that counters entered outside
   opwatch see per step, compared with the same counters around eager.
4. The targets: watch() <= 2x the floor on tfm32, and >= 5x faster than
   DebugMode with stack traces and module tracking.
5. The price of the nan/inf check on large tensors (tfm256), and opwatch.guard's
   healthy steps against eager on tfm32 (target <= 1.10x).
6. Memory: flat RSS and constant per-op cost over a 10,000-step watch (in a
   fresh process), and bytes per record.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

if __package__ in (None, ""):
    # Run as ``python bench/run.py``: make ``bench`` and ``opwatch`` importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from tabulate import tabulate

from bench import memory
from bench.contenders import (
    Contender, OpCount, checks_contenders, count_ops, guard_split, load_opwatch,
    main_contenders, probe_checks,
)
from bench.timing import CLOCKS, Measurement, measure, paired_difference, paired_ratio
from bench.workloads import WORKLOADS

EAGER, FLOOR, WATCH = "eager", "passthrough", "opwatch.watch()"
DEBUG_FULL = "DebugMode(stack,module)"
DETECT_ANOMALY = "detect_anomaly(check_nan=True)"
CHECKS_VARIANTS = ("watch(no nonfinite)", "watch(no checks)")
DEFAULT_MAX_RECORDS = 10_000  # opwatch's documented default
NAN_WORKLOAD = "tfm256"  # where the nan/inf check is priced separately

# Targets from the issue.
TARGET_WATCH_OVER_FLOOR = 2.0
TARGET_SPEEDUP_VS_DEBUG_FULL = 5.0
GUARD_WORKLOAD = "tfm32"  # where opwatch.guard's healthy steps are timed against eager
GUARD_ROUNDS = 3  # x the config's rounds: two contenders only, and a few percent to resolve
TARGET_GUARD_OVER_EAGER = 1.10


@dataclass(frozen=True)
class Config:
    """Knobs that differ between the full run and ``--quick``."""

    rounds: int            # interleaved repetitions per workload
    target_seconds: float  # wall time of one timed block (sets steps per block)
    count_steps: int       # steps under the op counter (at least)
    count_window: bool     # count opwatch over >= max_records ops, to catch periodic checks
    memory_steps: int      # length of the long watch loop
    memory_block: int      # steps per block of that loop
    record_sizes: tuple[int, int]  # (small, large) max_records for bytes/record
    rss_subprocess: bool   # measure bytes/record by RSS in fresh processes too


FULL = Config(rounds=15, target_seconds=0.1, count_steps=5, count_window=True, memory_steps=10_000,
              memory_block=1_000, record_sizes=(1_000, 20_000), rss_subprocess=True)
QUICK = Config(rounds=3, target_seconds=0.02, count_steps=2, count_window=False, memory_steps=1_000,
               memory_block=100, record_sizes=(500, 5_000), rss_subprocess=False)


@dataclass
class WorkloadResult:
    name: str
    measurements: dict[str, Measurement]
    user_ops: float
    counts: dict[str, OpCount] = field(default_factory=dict)


def log(msg: str) -> None:
    """Progress goes to stderr so stdout holds only the report."""
    print(msg, file=sys.stderr, flush=True)


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


# --------------------------------------------------------------------------- running


def run_workload(name: str, contenders: list[Contender], cfg: Config, clock: str) -> WorkloadResult:
    """Build the workload, count its ops, time every contender on it."""
    step = WORKLOADS[name].factory()
    by_name = {c.name: c for c in contenders}

    log(f"[{name}] counting ops (RSS {memory.rss_bytes() / 2**20:.0f} MB)")
    n_short = cfg.count_steps
    counts = {EAGER: count_ops(step, by_name[EAGER], n_short, n_short)}
    user_ops = counts[EAGER].ops
    n_window = n_short
    if cfg.count_window:
        # opwatch forces a check point at the latest every max_records ops: count
        # watch() over more than that, so its per-step host reads include one.
        # (The other variants share that code path; a short count shows their ops.)
        n_window = max(n_short, math.ceil(1.05 * DEFAULT_MAX_RECORDS / user_ops))
    for c in contenders:
        if c.is_opwatch or c.name == FLOOR:
            try:
                n = n_window if c.name == WATCH else n_short
                counts[c.name] = count_ops(step, c, n, n_short)
            except Exception as exc:  # reported by the timing pass as well
                log(f"[{name}] counting under {c.name} failed: {exc!r}")

    log(f"[{name}] timing {len(contenders)} contenders x {cfg.rounds} rounds")
    t0 = time.perf_counter()
    ms = measure(step, contenders, cfg.rounds, cfg.target_seconds, CLOCKS[clock])
    log(f"[{name}] done in {time.perf_counter() - t0:.1f}s (RSS {memory.rss_bytes() / 2**20:.0f} MB)")
    return WorkloadResult(name, ms, user_ops, counts)


# --------------------------------------------------------------------------- reporting


def header(opwatch_status: str, clock: str) -> str:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return "\n".join([
        "opwatch benchmark",
        f"  machine : {platform.machine()}, {os.cpu_count()} CPUs ({affinity} usable), "
        f"{platform.system()} {platform.release()}",
        f"  python  : {platform.python_version()}   torch: {torch.__version__}   "
        f"torch threads: {torch.get_num_threads()}",
        f"  opwatch : {opwatch_status}",
        f"  timing  : {'process CPU time (not counting other processes)' if clock == 'cpu' else 'wall time'}",
    ])


def main_table(results: list[WorkloadResult]) -> str:
    rows = []
    for wr in results:
        eager, floor = wr.measurements.get(EAGER), wr.measurements.get(FLOOR)
        first = True
        for name, m in wr.measurements.items():
            note = m.error or ""
            if m.anomalies:
                note = f"{m.anomalies} anomalies/block ({', '.join(sorted(m.anomaly_kinds))})"
            ok = m.error is None and m.seconds
            per_op = None
            if ok and eager and wr.user_ops:
                diff = paired_difference(m, eager)
                per_op = None if diff is None else diff / wr.user_ops * 1e6
            rows.append([
                wr.name if first else "",
                name,
                fmt(m.median * 1e3, ".3f") if ok else "-",
                fmt(paired_ratio(m, eager), ".2f", "x") if ok and name != EAGER else "",
                fmt(paired_ratio(m, floor), ".2f", "x") if ok and floor and name != FLOOR else "",
                fmt(per_op, ".1f") if name != EAGER else "",
                fmt(wr.user_ops, ".0f") if first else "",
                fmt(m.spread * 100, ".0f", "%") if ok else "",
                note,
            ])
            first = False
    return tabulate(rows, headers=["workload", "contender", "ms/step", "x eager", "x floor",
                                   "us/op added", "ops/step", "noise", "note"],
                    colalign=("left", "left", "right", "right", "right", "right", "right",
                              "right", "left"))


def extras_table(results: list[WorkloadResult]) -> str:
    """Ops and host reads opwatch adds, seen by counters entered outside it."""
    rows = []
    for wr in results:
        eager, floor = wr.counts.get(EAGER), wr.counts.get(FLOOR)
        for name, c in wr.counts.items():
            if name in (EAGER, FLOOR):
                continue
            unseen = None
            if floor is not None:
                # Host reads the profiler saw beyond the passthrough's, minus those the
                # counter saw beyond eager's: reads done with dispatch disabled.
                unseen = ((c.profiler_reads - floor.profiler_reads)
                          - (c.total_reads - eager.total_reads))
            rows.append([
                wr.name, name, c.steps, fmt(eager.ops, ".0f"), fmt(c.ops, ".1f"),
                fmt((c.ops - eager.ops) / eager.ops if eager.ops else None, ".3f"),
                fmt(c.host_reads - eager.host_reads, "+.3f"),
                fmt(c.bypass_reads - eager.bypass_reads, "+.3f"),
                f"{c.exit_ops} / {c.exit_reads} / {c.exit_bypass_reads}",
                fmt(unseen, "d"),
                _top_extra_ops(c, eager, floor),
            ])
    return tabulate(rows, headers=["workload", "contender", "steps", "user ops", "ops seen",
                                   "extra/user op", "+reads", "+tolist", "exit ops/reads/tolist",
                                   "unseen*", "most added ops (profiler)"])


def _top_extra_ops(c: OpCount, eager: OpCount, floor: OpCount | None, n: int = 2) -> str:
    """The ops the contender adds most of, per step: 'aminmax 99, stack 3.2'.

    Taken from the profiler against the passthrough (both Python modes, so the
    program's own ops are recorded alike): opwatch runs its reductions with
    Python dispatch disabled, where no counting mode sees them.
    """
    if floor is not None:
        ours, base = c.profiler_by_op, floor.profiler_by_op
    else:
        ours, base = c.by_op, eager.by_op
    extra = {op: per_step - base.get(op, 0.0) for op, per_step in ours.items()}
    top = sorted((d, op) for op, d in extra.items() if d > 0.005)[::-1][:n]
    return ", ".join(f"{op.removeprefix('aten::').removeprefix('aten.').removesuffix('.default')} {d:.3g}"
                     for d, op in top)


def targets_report(results: list[WorkloadResult]) -> str:
    lines, rows = [], []
    for wr in results:
        w, f, d = (wr.measurements.get(k) for k in (WATCH, FLOOR, DEBUG_FULL))
        a, e = wr.measurements.get(DETECT_ANOMALY), wr.measurements.get(EAGER)
        if not w:
            continue
        over_floor = paired_ratio(w, f) if f else None
        speedup = paired_ratio(d, w) if d else None
        anomaly_over_eager = paired_ratio(a, e) if a and e and not a.error else None
        anomaly_over_watch = paired_ratio(a, w) if a and not a.error else None
        rows.append([wr.name, fmt(over_floor, ".2f", "x"), fmt(speedup, ".1f", "x"),
                     fmt(anomaly_over_eager, ".2f", "x"), fmt(anomaly_over_watch, ".2f", "x")])
        if wr.name == "tfm32":
            lines.append(_verdict("watch() / passthrough on tfm32", over_floor,
                                  f"<= {TARGET_WATCH_OVER_FLOOR}x",
                                  over_floor is not None and over_floor <= TARGET_WATCH_OVER_FLOOR))
            lines.append(_verdict("DebugMode(stack,module) / watch() on tfm32", speedup,
                                  f">= {TARGET_SPEEDUP_VS_DEBUG_FULL}x",
                                  speedup is not None and speedup >= TARGET_SPEEDUP_VS_DEBUG_FULL))
    if not rows:
        return "  (opwatch not available: targets not evaluated)"
    table = tabulate(rows, headers=["workload", "watch()/floor", "DebugMode(stack,module)/watch()",
                                    "detect_anomaly/eager", "detect_anomaly/watch()"])
    return "\n".join(lines + ["", table])


def _verdict(what: str, value: float | None, target: str, ok: bool) -> str:
    return f"  {'PASS' if ok else 'FAIL'}  {what} = {fmt(value, '.2f', 'x')}  (target {target})"


def guard_report(opwatch, cfg: Config, clock: str) -> str:
    """opwatch.guard on healthy steps against eager, interleaved on the same step (the
    workload's step split so that forward and backward can be guarded), with what it adds."""
    try:
        step, (eager, guard) = guard_split(opwatch, WORKLOADS[GUARD_WORKLOAD].factory())
        rounds = GUARD_ROUNDS * cfg.rounds
        log(f"[guard] timing 2 contenders x {rounds} rounds, counting ops")
        ms = measure(step, [eager, guard], rounds, cfg.target_seconds, CLOCKS[clock])
        # Counted after the warm-up: the guard's first call makes a tensor it keeps.
        counts = {c.name: count_ops(step, c, cfg.count_steps, cfg.count_steps) for c in (eager, guard)}
    except Exception as exc:
        return f"  skipped ({type(exc).__name__}: {exc})"
    m, e = ms[guard.name], ms[eager.name]
    if m.error or e.error:
        return f"  failed: {m.error or e.error}"
    ratio, diff = paired_ratio(m, e), paired_difference(m, e)
    c, base = counts[guard.name], counts[eager.name]
    added = {op: n - base.by_op.get(op, 0.0) for op, n in c.by_op.items()}
    added_text = ", ".join(f"{op.removeprefix('aten.').removesuffix('.default')} {n:.3g}"
                           for op, n in sorted(added.items()) if n > 0.005) or "none"
    return "\n".join([
        f"  {GUARD_WORKLOAD}: eager {e.median * 1e3:.3f} ms/step, opwatch.guard() {m.median * 1e3:.3f} ms/step: "
        f"{fmt(ratio, '.3f', 'x')} eager ({diff * 1e6:+.0f} us/step; noise {e.spread * 100:.0f}% / {m.spread * 100:.0f}%)",
        f"  ops added per step: {added_text}; host reads added per step: "
        f"{c.host_reads - base.host_reads:+.2f} (+tolist {c.bypass_reads - base.bypass_reads:+.2f})",
        _verdict(f"opwatch.guard() / eager on {GUARD_WORKLOAD} (healthy steps)", ratio,
                 f"<= {TARGET_GUARD_OVER_EAGER}x", ratio is not None and ratio <= TARGET_GUARD_OVER_EAGER),
    ])


def nonfinite_report(wr: WorkloadResult | None, checks_problem: str | None) -> str:
    if checks_problem is not None:
        return f"  skipped: opwatch.watch(checks=...) did not work ({checks_problem})"
    if wr is None:
        return "  skipped (workload not run or opwatch not available)"
    ms = wr.measurements
    eager, all_c, no_nf = ms.get(EAGER), ms.get(WATCH), ms.get(CHECKS_VARIANTS[0])
    if not (eager and all_c and no_nf) or any(m.error for m in (eager, all_c, no_nf)):
        return "  skipped (a checks contender failed; see the main table)"
    # Paired per round, like the ratios.
    diffs = sorted(a - b for a, b in zip(all_c.seconds, no_nf.seconds))
    shares = sorted((a - b) / e for a, b, e in zip(all_c.seconds, no_nf.seconds, eager.seconds))
    diff, share = statistics.median(diffs), statistics.median(shares)
    return (f"  {wr.name}: watch() with the nan/inf check vs without it: {diff * 1e3:+.2f} ms/step "
            f"= {share * 100:+.0f}% of an eager step = {diff / wr.user_ops * 1e6:+.1f} us/op\n"
            f"  (median of per-round differences; rounds ranged {shares[0] * 100:+.0f}% to "
            f"{shares[-1] * 100:+.0f}% of an eager step)")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fast smoke run (< 1 minute)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="time steps in process CPU time (default; ignores other processes) "
                        "or wall time")
    p.add_argument("--only", action="append", metavar="NAME",
                   choices=[*WORKLOADS, "memory"],
                   help="run only this workload, or 'memory' (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    # detect_anomaly warns on every entry, and opwatch warns on anomalies; the
    # report counts anomalies itself, so keep the output readable.
    warnings.simplefilter("ignore")

    t_start = time.perf_counter()
    opwatch, status = load_opwatch()
    checks_problem = probe_checks(opwatch) if opwatch is not None else None
    names = [n for n in WORKLOADS if not args.only or n in args.only]
    run_memory = not args.only or "memory" in args.only

    results, skipped = [], []
    for name in names:
        contenders = main_contenders(opwatch)
        if name == NAN_WORKLOAD and opwatch is not None and checks_problem is None:
            contenders += checks_contenders(opwatch)
        try:
            results.append(run_workload(name, contenders, cfg, args.clock))
        except Exception as exc:  # e.g. the workload cannot be built here
            log(f"[{name}] skipped: {exc!r}")
            skipped.append(f"  {name}: skipped ({type(exc).__name__}: {exc})")

    guard_text = None
    if GUARD_WORKLOAD in names and opwatch is not None and hasattr(opwatch, "guard"):
        guard_text = guard_report(opwatch, cfg, args.clock)

    mem_text = None
    if run_memory:
        if opwatch is None:
            mem_text = "  skipped: opwatch not available"
        else:
            mem_text = memory.report(opwatch, cfg.memory_steps, cfg.memory_block,
                                     cfg.record_sizes, cfg.rss_subprocess, args.clock, log)

    out = [header(status, args.clock), ""]
    if results:
        out += [f"Workloads ({cfg.rounds} interleaved rounds, medians; ratios are per-round paired "
                f"medians; 'noise' is the median absolute deviation of the rounds):"]
        out += [f"  {n:7s} {WORKLOADS[n].description}" for n in names]
        out += ["Compare ratios, not absolute times, between runs.", "", main_table(results), ""]
        out += skipped + ([""] if skipped else [])
        if opwatch is not None:
            out += ["What opwatch adds, per step, seen by a counting mode entered outside it",
                    "(steps run in one context; the context's exit is counted apart). opwatch runs",
                    "its own reductions with Python dispatch off: the counter does not see them, the",
                    "profiler does ('most added ops', against the passthrough):",
                    extras_table(results),
                    "  +reads : host reads (aten._local_scalar_dense/is_nonzero/item) beyond eager's",
                    "  +tolist: Tensor.tolist()/numpy() calls beyond eager's (host reads that "
                    "dispatch no op on CPU)",
                    f"  unseen*: in a {cfg.count_steps}-step block with its exit, host reads the "
                    "profiler saw (beyond the passthrough's) that the counter did not (done with "
                    "dispatch disabled); 0 expected",
                    ""]
        out += ["Targets:", targets_report(results), ""]
        if NAN_WORKLOAD in names:
            nan_result = next((r for r in results if r.name == NAN_WORKLOAD), None)
            out += ["Cost of the nan/inf check on large tensors:",
                    nonfinite_report(nan_result if opwatch is not None else None, checks_problem),
                    ""]
    if guard_text is not None:
        out += [f"opwatch.guard on healthy steps ({GUARD_ROUNDS * cfg.rounds} rounds interleaved with "
                "eager on the same step):", guard_text, ""]
    if mem_text is not None:
        out += ["Memory and cost over a long watch:", mem_text, ""]
    out.append(f"total bench time {time.perf_counter() - t_start:.0f}s")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
