"""Interleaved, repeated timing of contenders on one workload.

The machine this runs on is small and noisy, so the harness never compares
absolute times across runs.  Instead, within one run:

* every contender is measured in every *round*, and the order of contenders
  rotates from round to round, so slow drifts (thermal, neighbours) hit all
  contenders alike;
* ratios are taken *per round* (contender time / eager time in the same
  round) and the median of those ratios is reported, which cancels most of the
  drift that a ratio of medians would keep;
* each timed block uses a fresh context (built outside the timer) and
  includes its ``__enter__`` and ``__exit__``, so end-of-block work such as a
  final batched check is paid for;
* by default blocks are timed in process CPU time, not wall time: every
  workload is single-threaded CPU work (``torch.set_num_threads(1)``, CPU
  backward runs on the calling thread), so on an idle machine the two agree,
  but CPU time does not count the time other processes hold the core.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from .contenders import Contender
from .workloads import Step

Clock = Callable[[], float]
#: Clocks by name: "cpu" (default, robust to other processes) and "wall".
CLOCKS: dict[str, Clock] = {"cpu": time.process_time, "wall": time.perf_counter}


@dataclass
class Measurement:
    """Per-round seconds-per-step of one contender on one workload."""

    contender: Contender
    steps_per_block: int = 1
    seconds: list[float] = field(default_factory=list)
    error: str | None = None
    anomalies: int = 0  # most anomalies an opwatch contender reported in one block
    anomaly_kinds: set[str] = field(default_factory=set)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """Median absolute deviation as a fraction of the median (noise gauge)."""
        med = self.median
        return statistics.median(abs(s - med) for s in self.seconds) / med if med else 0.0


def quick_or_full(prog: str, description: str, quick_help: str, argv: list[str] | None) -> tuple[argparse.Namespace, Clock]:
    """The options of a side-by-side benchmark (``--quick``, ``--clock``) and its clock; torch
    set to one thread, so that rounds on a shared machine stay comparable."""
    import torch

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    return options, CLOCKS[options.clock]


def run_block(contender: Contender, step: Step, n: int, m: Measurement | None = None,
              clock: Clock = time.process_time) -> float:
    """Time ``n`` steps inside one fresh context; return seconds per step."""
    ctx = contender.make()
    # Don't bill this block for the previous block's young garbage.  A full
    # collection would be fairer still but costs ~0.2 s with torch loaded,
    # far more than most blocks.
    gc.collect(1)
    per_step = contender.per_step
    t0 = clock()
    with ctx as handle:
        if per_step is None:
            for _ in range(n):
                step()
        else:
            for _ in range(n):
                step()
                per_step(handle)
    elapsed = clock() - t0
    if m is not None and contender.is_opwatch:
        anomalies = list(getattr(handle, "anomalies", ()))
        m.anomalies = max(m.anomalies, len(anomalies))
        m.anomaly_kinds.update(str(getattr(a, "kind", "?")) for a in anomalies)
    return elapsed / n


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def measure(step: Step, contenders: list[Contender], rounds: int, target_seconds: float,
            clock: Clock = time.process_time, max_steps: int = 200) -> dict[str, Measurement]:
    """Measure every contender on ``step``; return measurements by name.

    Each contender first runs two one-step warm-up blocks; the faster of the
    two calibrates how many steps fill ``target_seconds`` (a full garbage
    collection, about 0.2 s with torch loaded, landing in one of them would
    otherwise leave that contender one-step blocks for the whole run, each
    paying its context's entry and exit).  A contender that raises is
    recorded with its error and left out of later rounds.
    """
    results = {c.name: Measurement(c) for c in contenders}
    for c in contenders:
        m = results[c.name]
        try:
            first = run_block(c, step, 1, clock=clock)
            per_step = min(first, run_block(c, step, 1, clock=clock))
        except Exception as exc:
            m.error = _describe(exc)
            continue
        m.steps_per_block = max(1, min(max_steps, round(target_seconds / max(per_step, 1e-9))))

    live = [c for c in contenders if results[c.name].error is None]
    for r in range(rounds):
        k = r % len(live) if live else 0
        for c in live[k:] + live[:k]:
            m = results[c.name]
            if m.error is not None:
                continue
            try:
                m.seconds.append(run_block(c, step, m.steps_per_block, m, clock))
            except Exception as exc:
                m.error = _describe(exc)
    return results


def paired_ratio(a: Measurement, b: Measurement) -> float | None:
    """Median over rounds of a/b, pairing the two contenders' same-round times."""
    pairs = [x / y for x, y in zip(a.seconds, b.seconds) if y > 0]
    if not pairs or a.error or b.error:
        return None
    return statistics.median(pairs)


def paired_difference(a: Measurement, b: Measurement) -> float | None:
    """Median over rounds of a-b (seconds per step), same-round pairs."""
    diffs = [x - y for x, y in zip(a.seconds, b.seconds)]
    if not diffs or a.error or b.error:
        return None
    return statistics.median(diffs)
