"""opwatch benchmark suite: entry point.

    python -m bench.run            # full run, a few minutes
    python -m bench.run --quick    # smoke run, well under a minute
    python -m bench.run --only tfm32 --only memory

What it prints (all numbers are measured within this one run; never compare
absolute times between runs on a noisy machine, compare the ratios):

1. A header with the machine, versions and which opwatch was found.
2. The main table: for each workload and contender, median ms per step, the
   per-round paired ratio to eager and to the passthrough "floor", the
   overhead per op in microseconds, and ATen ops per step.
3. What opwatch adds: the ops and host reads a counting dispatch mode,
   entered outside opwatch, sees per step compared with the same counter
   around eager.
4. The targets (watch() <= 2x the floor on tfm32, >= 5x faster than
   DebugMode with stack traces and module tracking).
5. The price of the nan/inf check on large tensors (tfm256).
6. Memory: flat RSS and constant per-op cost over a long watch, and bytes per
   record.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
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
    Contender, OpCount, checks_contenders, count_ops, load_opwatch, main_contenders,
    probe_checks,
)
from bench.timing import Measurement, measure, paired_ratio
from bench.workloads import WORKLOADS

EAGER, FLOOR, WATCH, STRICT = "eager", "passthrough", "opwatch.watch()", "opwatch.strict()"
DEBUG_FULL = "DebugMode(stack,module)"
CHECKS_VARIANTS = ("watch(no nonfinite)", "watch(no checks)")
DEFAULT_MAX_RECORDS = 10_000  # opwatch's documented default
NAN_WORKLOAD = "tfm256"  # where the nan/inf check is priced separately

# Targets from the issue.
TARGET_WATCH_OVER_FLOOR = 2.0
TARGET_SPEEDUP_VS_DEBUG_FULL = 5.0


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


FULL = Config(rounds=7, target_seconds=0.15, count_steps=5, count_window=True, memory_steps=10_000,
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


def run_workload(name: str, contenders: list[Contender], cfg: Config) -> WorkloadResult:
    """Build the workload, count its ops, time every contender on it."""
    wl = WORKLOADS[name]
    step = wl.factory()
    by_name = {c.name: c for c in contenders}

    log(f"[{name}] counting ops")
    counts = {EAGER: count_ops(step, by_name[EAGER], cfg.count_steps)}
    user_ops = counts[EAGER].ops
    steps = cfg.count_steps
    if cfg.count_window:
        # opwatch forces a check point at the latest every max_records ops; count over
        # more than that so the per-step host reads include it.
        steps = max(steps, math.ceil(1.05 * DEFAULT_MAX_RECORDS / user_ops))
    for c in contenders:
        if c.is_opwatch or c.name == FLOOR:
            try:
                # The checks variants only show op counts: a short count is enough.
                n = cfg.count_steps if c.name in CHECKS_VARIANTS else steps
                counts[c.name] = count_ops(step, c, n)
            except Exception as exc:  # reported by the timing pass as well
                log(f"[{name}] counting under {c.name} failed: {exc!r}")

    log(f"[{name}] timing {len(contenders)} contenders x {cfg.rounds} rounds")
    t0 = time.perf_counter()
    ms = measure(step, contenders, cfg.rounds, cfg.target_seconds)
    log(f"[{name}] done in {time.perf_counter() - t0:.1f}s")
    return WorkloadResult(name, ms, user_ops, counts)


# --------------------------------------------------------------------------- reporting


def header(opwatch_status: str) -> str:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return "\n".join([
        "opwatch benchmark",
        f"  machine : {platform.machine()}, {os.cpu_count()} CPUs ({affinity} usable), "
        f"{platform.system()} {platform.release()}",
        f"  python  : {platform.python_version()}   torch: {torch.__version__}   "
        f"torch threads: {torch.get_num_threads()}",
        f"  opwatch : {opwatch_status}",
    ])


def main_table(results: list[WorkloadResult]) -> str:
    rows = []
    for wr in results:
        eager, floor = wr.measurements.get(EAGER), wr.measurements.get(FLOOR)
        first = True
        for name, m in wr.measurements.items():
            note = m.error or ""
            if m.anomalies:
                note = f"{m.anomalies} anomalies ({', '.join(sorted(m.anomaly_kinds))})"
            ok = m.error is None and m.seconds
            per_op = None
            if ok and eager and eager.seconds and wr.user_ops:
                per_op = (m.median - eager.median) / wr.user_ops * 1e6
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
                fmt(unseen, "+.3f"),
            ])
    return tabulate(rows, headers=["workload", "contender", "steps", "user ops", "ops seen",
                                   "extra ops/user op", "added reads", "added tolist",
                                   "exit: ops/reads/tolist", "unseen reads"])


def targets_report(results: list[WorkloadResult]) -> str:
    lines, rows = [], []
    for wr in results:
        w, f, d = (wr.measurements.get(k) for k in (WATCH, FLOOR, DEBUG_FULL))
        if not w:
            continue
        over_floor = paired_ratio(w, f) if f else None
        speedup = paired_ratio(d, w) if d else None
        rows.append([wr.name, fmt(over_floor, ".2f", "x"), fmt(speedup, ".1f", "x")])
        if wr.name == "tfm32":
            lines.append(_verdict("watch() / passthrough on tfm32", over_floor,
                                  f"<= {TARGET_WATCH_OVER_FLOOR}x",
                                  over_floor is not None and over_floor <= TARGET_WATCH_OVER_FLOOR))
            lines.append(_verdict("DebugMode(stack,module) / watch() on tfm32", speedup,
                                  f">= {TARGET_SPEEDUP_VS_DEBUG_FULL}x",
                                  speedup is not None and speedup >= TARGET_SPEEDUP_VS_DEBUG_FULL))
    if not rows:
        return "  (opwatch not available: targets not evaluated)"
    table = tabulate(rows, headers=["workload", "watch()/floor", "DebugMode(stack,module)/watch()"])
    return "\n".join(lines + ["", table])


def _verdict(what: str, value: float | None, target: str, ok: bool) -> str:
    return f"  {'PASS' if ok else 'FAIL'}  {what} = {fmt(value, '.2f', 'x')}  (target {target})"


def nonfinite_report(wr: WorkloadResult | None, checks_problem: str | None) -> str:
    if checks_problem is not None:
        return f"  skipped: opwatch.watch(checks=...) did not work ({checks_problem})"
    if wr is None:
        return "  skipped (workload not run or opwatch not available)"
    ms = wr.measurements
    eager, all_c, no_nf = ms.get(EAGER), ms.get(WATCH), ms.get(CHECKS_VARIANTS[0])
    if not (eager and all_c and no_nf) or any(m.error for m in (eager, all_c, no_nf)):
        return "  skipped (a checks contender failed; see the main table)"
    # Paired per round, like the ratios: (all - no_nonfinite) / eager.
    share = [(a - b) / e for a, b, e in zip(all_c.seconds, no_nf.seconds, eager.seconds)]
    share.sort()
    med = share[len(share) // 2]
    per_op = (all_c.median - no_nf.median) / wr.user_ops * 1e6
    return (f"  {wr.name}: nan/inf check costs {(all_c.median - no_nf.median) * 1e3:+.3f} ms/step "
            f"= {med * 100:+.1f}% of an eager step = {per_op:+.2f} us/op "
            f"(median over rounds; rounds ranged {share[0] * 100:+.1f}%..{share[-1] * 100:+.1f}%)")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fast smoke run (< 1 minute)")
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

    results = []
    for name in names:
        contenders = main_contenders(opwatch)
        if name == NAN_WORKLOAD and opwatch is not None and checks_problem is None:
            contenders += checks_contenders(opwatch)
        results.append(run_workload(name, contenders, cfg))

    mem_text = None
    if run_memory:
        if opwatch is None:
            mem_text = "  skipped: opwatch not available"
        else:
            mem_text = memory.report(opwatch, cfg.memory_steps, cfg.memory_block,
                                     cfg.record_sizes, cfg.rss_subprocess, log)

    out = [header(status), ""]
    if results:
        out += [f"Workloads ({cfg.rounds} interleaved rounds, medians; ratios are per-round paired "
                f"medians; 'noise' is the median absolute deviation of the rounds):"]
        out += [f"  {n:7s} {WORKLOADS[n].description}" for n in names]
        out += ["", main_table(results), ""]
        if opwatch is not None:
            out += ["What opwatch adds, per step, seen by a counting mode entered outside it",
                    "(steps run in one context; the context's exit is counted apart):",
                    extras_table(results),
                    "  added reads : host reads (aten._local_scalar_dense/is_nonzero/item) beyond eager's",
                    "  added tolist: Tensor.tolist()/numpy() calls beyond eager's (host reads that "
                    "dispatch no op on CPU)",
                    "  unseen reads: host reads the profiler saw (beyond the passthrough's) that the "
                    "counter did not, i.e. done with dispatch disabled; 0 expected",
                    ""]
        out += ["Targets:", targets_report(results), ""]
        if NAN_WORKLOAD in names:
            out += ["Cost of the nan/inf check on large tensors:",
                    nonfinite_report(next(r for r in results if r.name == NAN_WORKLOAD)
                                     if opwatch is not None else None, checks_problem), ""]
    if mem_text is not None:
        out += ["Memory and cost over a long watch:", mem_text, ""]
    out.append(f"total bench time {time.perf_counter() - t_start:.0f}s")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
