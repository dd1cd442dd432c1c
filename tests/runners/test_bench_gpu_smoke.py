"""``python -m bench.gpu --cpu-smoke``: the GPU bench's code paths (every lane, the compiled
parts, the table) on the CPU, tiny; no timing thresholds, only that every row is there.

The whole smoke takes about 18 s of one core (it compiles with inductor), so the README's test
command runs only its budget's test; ``.ci/run``'s thorough pass runs the smoke with
``OPWATCH_BENCH_SMOKE=1``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EAGER_LANES = ["eager", "watch()", "watch() check point", "guard(audit='new')", "guard(audit='never')", "leave-on (LeaveOn)"]
COMPILED_LANES = [f"{label}{suffix}" for label in ("compiled", "CUDA-graphed")
                  for suffix in ("", " + one host read (no opwatch)", " + guard(audit='never')", " + guard(audit='new')", " + leave-on")]


def bench(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "bench.gpu", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in done.stdout.splitlines() if line.startswith("| small")]
    return done.stdout, rows


@pytest.mark.skipif(not os.environ.get("OPWATCH_BENCH_SMOKE"), reason="the whole CPU smoke (~18 s): .ci/run's thorough pass runs it (OPWATCH_BENCH_SMOKE=1)")
def test_the_cpu_smoke_prints_a_row_for_every_lane_and_no_failure():
    out, rows = bench("--cpu-smoke")
    assert "bench.gpu on CPU (cpu smoke)" in out and out.rstrip().splitlines()[-2] == "(cpu smoke)"
    lanes = [(workload, lane) for workload, lane, *_ in rows]
    assert lanes == [("small-fp32", lane) for lane in EAGER_LANES + ["eager"] + COMPILED_LANES[:5] + ["eager"] + COMPILED_LANES[5:]] + [
        ("small-bf16", lane) for lane in EAGER_LANES]
    assert not [row for row in rows if "failed" in row[-1]], out
    for workload, lane, ms, x_eager, *_ in rows:
        if lane != "watch() check point":
            assert float(ms) > 0 and float(x_eager) > 0, (workload, lane)
    compiled = {lane: notes for _, lane, *_, notes in rows if lane in ("compiled", "compiled + one host read (no opwatch)", "compiled + guard(audit='never')", "compiled + leave-on")}
    assert all("ran compiled: yes" in notes for notes in compiled.values()), compiled


def test_a_part_the_budget_leaves_out_is_a_row_that_says_so():
    out, rows = bench("--cpu-smoke", "--no-compile", "--budget", "0")
    assert [(workload, lane, notes) for workload, lane, *_, notes in rows] == [
        ("small-fp32", "eager", "skipped: the 0 s budget ran out"),
        ("small-bf16", "eager", "skipped: the 0 s budget ran out"),
    ]
