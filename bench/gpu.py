"""opwatch on a GPU: host syncs and ratios against eager, one table (issue 28, item 7).

    python -m bench.gpu               # on CUDA: at most about 5 minutes on one H100
    python -m bench.gpu --quick       # fewer workloads and rounds (about 2 minutes)
    python -m bench.gpu --cpu-smoke   # the same code paths on the CPU, tiny (automatic without CUDA)
    python -m bench.gpu --no-compile  # leave out the torch.compile rows

What one table shows, per workload (a transformer encoder training step, built by
``bench.workloads.transformer_parts``: small in fp32 and in bf16 autocast, large in bf16 so that
the GPU's time dominates):

- **host syncs per step**, counted with ``torch.cuda.set_sync_debug_mode("warn")``: every
  synchronizing CUDA call warns once, the warnings are caught and counted over a few steps. For
  ``opwatch.guard`` and leave-on these are the healthy steps (after the audit); the audited
  step's own count is in the notes. For ``opwatch.watch()`` a whole watched step, and one check
  point (``Watch.check()`` after a forward and backward). The eager step itself makes none, and a
  ``loss.item()`` counts one (the header says so: the counter's calibration).
- **ratios against eager**, the median over rounds of the per-round ratio (``bench.timing``'s
  ``paired_ratio``): in each round every lane runs the same steps in blocks of ten, the lanes'
  blocks interleaved in a shuffled order, each block timed in wall time between two
  ``torch.cuda.synchronize()``, so a lane's steps keep their overlap of host and device within a
  block. A round (five; three with ``--quick``) is a run of 100 steps (60) with a guard (and a leave-on run) made fresh at its
  start, so its one audit is billed once per run, as in ``bench.guard_audits``; the watch lane
  watches one step in five blocks (three; a fresh ``watch()`` around each).
- **compiled steps**: ``torch.compile(model)`` (inductor; the small fp32 and the large step) and
  ``torch.compile(model, mode="reduce-overhead")`` (CUDA graphs; the small fp32 step, where
  launches dominate), each in a process of its own, plain, with one host read of the loss after
  the backward and no opwatch (the floor of any decision the host takes each step), and under
  ``guard(audit="never")`` side by side, then under ``guard(audit="new")`` after its audit (the
  audit is a full watch: the row says whether the compiled code still ran after it, read from the
  output's ``grad_fn``). Compilation is warm-up, never timed; its seconds are in the notes. A
  compile that fails is a row that says so.

Each part runs in a process of its own (torch.compile's state, and a watch's effect on it, stay
there) under one overall budget (``--budget``, 285 s by default): a part that fails or runs out
of time is a row "failed: ..." and the rest run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "BENCH_GPU_ROWS "
HEADERS = ["workload", "lane", "ms/step", "x eager", "x base", "syncs/step", "notes"]

# name: (encoder sizes, autocast dtype name); the CPU smoke shrinks every one of them.
WORKLOADS = {
    "small-fp32": (dict(d_model=256, nhead=8, dim_feedforward=1024, batch=8, seq=32, num_layers=2), None),
    "small-bf16": (dict(d_model=256, nhead=8, dim_feedforward=1024, batch=8, seq=32, num_layers=2), "bfloat16"),
    "large-bf16": (dict(d_model=1024, nhead=16, dim_feedforward=4096, batch=32, seq=256, num_layers=4), "bfloat16"),
}
SMOKE_SIZES = dict(d_model=16, nhead=2, dim_feedforward=32, batch=2, seq=4, num_layers=1)

# (rounds, steps per round, steps per block, watch: one step every this many blocks)
SCHEDULES = {"full": (5, 100, 10, 5), "quick": (3, 60, 10, 3), "smoke": (2, 4, 2, 2)}


def describe(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:150]


# -- host syncs ---------------------------------------------------------------------------------


class SyncCount:
    """``with SyncCount(device) as counted: ...``; then ``counted.n``: the synchronizing CUDA
    calls made inside (``None`` off CUDA: torch's sync debug mode is CUDA's)."""

    def __init__(self, device):
        self.device = device
        self.n = None

    def __enter__(self):
        if self.device.type != "cuda":
            return self
        import torch

        torch.cuda.synchronize()
        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        self._previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.device.type != "cuda":
            return False
        import torch

        torch.cuda.set_sync_debug_mode(self._previous)
        self._caught.__exit__(None, None, None)
        # torch's own notice on the first use of the mode ("Synchronization debug mode is a
        # prototype feature ...") is no sync: only "called a synchronizing CUDA operation" is.
        self.n = sum("called a synchronizing" in str(record.message) for record in self._records)
        return False


def syncs_per_step(device, step, steps: int = 3):
    with SyncCount(device) as counted:
        for _ in range(steps):
            step()
    return None if counted.n is None else counted.n / steps


def count_syncs(lane, device, into: dict, steps: int = 3) -> None:
    """``into[lane.name]``: the lane's syncs per step; a lane that raises keeps its error."""
    if lane.error is None:
        try:
            into[lane.name] = syncs_per_step(device, lane.step, steps)
        except Exception as error:
            lane.error = describe(error)


# -- lanes --------------------------------------------------------------------------------------


class Lane:
    """One copy of the workload (same seed, same batch), stepped one way. ``make(lane)`` gives
    the call that runs the forward and backward (a guard of ``lane.forward_backward``); made at
    every run's start (``fresh=True``: one audit per run) or once."""

    def __init__(self, name, parts, *, module=None, make=None, fresh=True, every=1, mark_step=False):
        self.name = name
        self.parts = parts
        self.module = parts.model if module is None else module
        self.make = make
        self.fresh = fresh
        self.every = every  # this lane runs every `every`-th block only (one step then)
        self.mark_step = mark_step  # CUDA graphs: a new iteration begins at each step
        self.call = None
        self.rounds: list[list[float]] = []  # [seconds, steps] per round
        self.error = None
        self.note = ""

    def forward_backward(self):
        loss = self.parts.loss(self.module)
        loss.backward()
        return loss

    def start_run(self):
        if self.call is None or self.fresh:
            self.call = self.make(self) if self.make is not None else self.forward_backward
        self.rounds.append([0.0, 0])

    def step(self):
        optimizer = self.parts.optimizer
        optimizer.zero_grad(set_to_none=True)  # the last step's gradients, in the graphs' memory, let go
        if self.mark_step:
            import torch

            torch.compiler.cudagraph_mark_step_begin()
        self.call()
        optimizer.step()

    def steps_in_block(self, block_index: int, block: int) -> int:
        if self.every == 1:
            return block
        return 1 if block_index % self.every == 0 else 0


class WatchLane(Lane):
    """A fresh ``opwatch.watch()`` around each step (the optimizer step inside: its check point)."""

    def step(self):
        import opwatch

        with opwatch.watch(file=open(os.devnull, "w")) as watched:
            super().step()
        self.anomalies = max(getattr(self, "anomalies", 0), len(watched.anomalies))


class LeaveOnLane(Lane):
    """``LeaveOn`` as the trainers drive it (``audit="manual"``): a run made fresh at each round
    (``fresh=True``), its first step audited, or made once and audited in the warm-up
    (``fresh=False``: every timed step is a healthy one); the optimizer hooks are global, so the
    run is entered around each of this lane's steps only (entering registers two hooks, leaving
    removes them)."""

    def start_run(self):
        from opwatch.runners.leave_on import LeaveOn

        if self.fresh or getattr(self, "run", None) is None:
            self.run = LeaveOn(audit="manual", file=open(os.devnull, "w"))
            self.audit_next = True
        self.call = self.forward_backward
        self.rounds.append([0.0, 0])

    def step(self):
        with self.run:
            if self.audit_next:
                self.run.start_audit()
                self.audit_next = False
            super().step()


def timed_rounds(lanes, rounds, steps, block, sync, seed=0):
    """Every lane runs ``steps`` steps a round in blocks, the blocks' order shuffled (seeded);
    each block timed between two syncs. A lane that raises keeps its error and drops out."""
    order = random.Random(seed)
    for lane in lanes:
        lane.rounds = []
    for _ in range(rounds):
        gc.collect(1)
        live = [lane for lane in lanes if lane.error is None]
        for lane in live:
            lane.start_run()
        for index in range(steps // block):
            order.shuffle(live)
            for lane in live:
                n = lane.steps_in_block(index, block)
                if not n or lane.error is not None:
                    continue
                try:
                    sync()
                    start = time.perf_counter()
                    for _ in range(n):
                        lane.step()
                    sync()
                except Exception as error:  # one lane failing leaves the others running
                    lane.error = describe(error)
                    continue
                lane.rounds[-1][0] += time.perf_counter() - start
                lane.rounds[-1][1] += n


def per_step(lane):
    return [seconds / steps for seconds, steps in lane.rounds if steps]


def ratio(lane, base):
    """Median over rounds of the lane's seconds per step over the base's in the same round."""
    pairs = [a / b for a, b in zip(per_step(lane), per_step(base)) if b > 0]
    if not pairs or lane.error or base.error:
        return None
    return statistics.median(pairs)


def row(workload, lane, *, base=None, eager=None, syncs=None, note=""):
    if lane.error:
        return dict(workload=workload, lane=lane.name, error=lane.error)
    times = per_step(lane)
    return dict(
        workload=workload, lane=lane.name, ms=statistics.median(times) * 1e3 if times else None,
        x_eager=ratio(lane, eager) if eager is not None and eager is not lane else (1.0 if eager is lane else None),
        x_base=ratio(lane, base) if base is not None else None, syncs=syncs, note="; ".join(filter(None, [lane.note, note])),
    )


# -- the parts ----------------------------------------------------------------------------------


def setup(workload: str, smoke: bool):
    import torch

    from bench.workloads import transformer_parts

    sizes, autocast = WORKLOADS[workload]
    if smoke:
        sizes = SMOKE_SIZES
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        device = torch.device("cuda")
    autocast = None if autocast is None else getattr(torch, autocast)

    def parts():
        return transformer_parts(**sizes, device=str(device), autocast=autocast)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    return torch, device, parts, sync


def warm(lanes, steps=3):
    for lane in lanes:
        try:
            lane.start_run()
            for _ in range(steps):
                lane.step()
        except Exception as error:
            lane.error = describe(error)


def timed_step(lane, sync):
    sync()
    start = time.perf_counter()
    lane.step()
    sync()
    return time.perf_counter() - start


def eager_section(workload, smoke, schedule):
    """eager, watch, guard(audit='new'), guard(audit='never'), leave-on: syncs and ratios."""
    import opwatch

    torch, device, parts, sync = setup(workload, smoke)
    rounds, steps, block, watch_every = schedule
    eager = Lane("eager", parts())
    watched = WatchLane("watch()", parts(), every=watch_every)
    audited = Lane("guard(audit='new')", parts(), make=lambda lane: opwatch.guard(lane.forward_backward, lane.parts.model))
    never = Lane("guard(audit='never')", parts(), make=lambda lane: opwatch.guard(lane.forward_backward, lane.parts.model, audit="never"))
    leave_on = LeaveOnLane("leave-on (LeaveOn)", parts())
    lanes = [eager, watched, audited, never, leave_on]
    warnings.simplefilter("ignore", opwatch.OpwatchWarning)
    warm(lanes)

    syncs = {}
    eager_step = None
    for lane in lanes:
        if lane.error:
            continue
        try:
            if lane is eager:
                eager_step = statistics.median(timed_step(eager, sync) for _ in range(5))
            if lane in (audited, leave_on):  # a fresh run: its first step is the audit
                lane.start_run()
                audit_seconds = timed_step(lane, sync)
                lane.start_run()  # counted apart: the timer's own synchronize() calls stay out
                with SyncCount(device) as counted:
                    lane.step()
                lane.note = f"one audit per {steps}-step run: it took {audit_seconds / eager_step:.0f} eager steps"
                if counted.n is not None:
                    lane.note += f", {counted.n} syncs"
        except Exception as error:
            lane.error = describe(error)
        count_syncs(lane, device, syncs, 1 if lane is watched else 3)

    check_point = dict(workload=workload, lane="watch() check point", ms=None, x_eager=None, x_base=None, syncs=None,
                       note="syncs of one Watch.check() after a forward and backward")
    try:
        model = parts()
        with opwatch.watch(file=open(os.devnull, "w")) as w:
            model.loss(model.model).backward()
            with SyncCount(device) as counted:
                w.check()
        check_point["syncs"] = counted.n
    except Exception as error:
        check_point = dict(workload=workload, lane="watch() check point", error=describe(error))

    timed_rounds(lanes, rounds, steps, block, sync)
    if getattr(watched, "anomalies", 0):
        watched.note = f"{watched.anomalies} anomalies in a watched step"
    watched.note = "; ".join(filter(None, [watched.note, f"one watched step in {watch_every} blocks"]))
    rows = [row(workload, lane, eager=eager, syncs=syncs.get(lane.name)) for lane in lanes]
    rows.insert(2, check_point)
    return rows


def compiled_section(workload, smoke, schedule, mode):
    """A compiled step (``mode``: None for inductor's default, or "reduce-overhead": CUDA graphs)
    plain, under guard(audit='never'), and, after their audits, under guard(audit='new') and
    leave-on."""
    import opwatch

    torch, device, parts, sync = setup(workload, smoke)
    rounds, steps, block, _ = schedule
    label = "compiled" if mode is None else "CUDA-graphed"
    graphs = mode == "reduce-overhead" and device.type == "cuda"

    # The CPU smoke compiles with aot_eager: the same lanes and readings, without inductor's C++
    # builds (a minute or more on a small machine).
    how = dict(backend="aot_eager") if smoke else dict(mode=mode)

    def compiled_lane(name, make=None, kind=Lane):
        lane_parts = parts()
        return kind(name, lane_parts, module=torch.compile(lane_parts.model, **how), make=make, fresh=False, mark_step=graphs)

    def ran_compiled(lane):
        """Whether the lane's latest step ran the compiled code (its output's grad_fn)."""
        return "yes" if "Compiled" in lane.parts.last_grad_fn else f"no ({lane.parts.last_grad_fn})"

    warnings.simplefilter("ignore", opwatch.OpwatchWarning)
    eager = Lane("eager", parts())
    plain = compiled_lane(f"{label}")
    never = compiled_lane(f"{label} + guard(audit='never')", lambda lane: opwatch.guard(lane.forward_backward, lane.parts.model, audit="never"))
    # The floor of any decision on the host after the backward, with no opwatch at all: the
    # loss read once the backward is queued (the read waits for it, as the guard's check does).
    read = compiled_lane(f"{label} + one host read (no opwatch)", lambda lane: lambda: float(lane.forward_backward().detach()))
    lanes = [eager, plain, read, never]
    for lane in lanes:
        start = time.perf_counter()
        warm([lane])
        if lane is not eager and lane.error is None:
            lane.note = f"compile and warm-up {time.perf_counter() - start:.1f} s" + ("; backend aot_eager (cpu smoke)" if smoke else "")
    syncs = {}
    for lane in lanes:
        count_syncs(lane, device, syncs)
    timed_rounds(lanes, rounds, steps, block, sync)
    for lane in (plain, read, never):
        if lane.error is None:
            lane.note += f"; ran compiled: {ran_compiled(lane)}"
    rows = [row(workload, eager, eager=eager, syncs=syncs.get("eager"), note=f"{label} part's own eager lane"),
            row(workload, plain, eager=eager, syncs=syncs.get(plain.name)),
            row(workload, read, eager=eager, base=plain, syncs=syncs.get(read.name), note=f"x base: over {label}"),
            row(workload, never, eager=eager, base=plain, syncs=syncs.get(never.name), note=f"x base: over {label}")]

    def timed_after_its_audit(lane, seed, more=lambda lane: ""):
        """A lane whose first step runs under a full watch: compiled and audited in the warm-up,
        then timed beside the eager and plain lanes again, since a watch may leave compiled code
        running eagerly afterwards."""
        start = time.perf_counter()
        warm([lane])
        if lane.error is None:
            lane.note = f"compile, audit and warm-up {time.perf_counter() - start:.1f} s; timed after its audit"
            count_syncs(lane, device, syncs)
        timed_rounds([eager, plain, lane], rounds, steps, block, sync, seed=seed)
        if lane.error is None:
            lane.note += f"; ran compiled: {ran_compiled(lane)}; the plain {label} lane beside it: {ran_compiled(plain) if plain.error is None else '-'}"
            lane.note += more(lane)
        return row(workload, lane, eager=eager, base=plain, syncs=syncs.get(lane.name), note=f"x base: over {label}")

    # guard(audit='new'), then leave-on: the fused gradient check before every optimizer step.
    audited = compiled_lane(f"{label} + guard(audit='new')", lambda lane: opwatch.guard(lane.forward_backward, lane.parts.model))
    rows.append(timed_after_its_audit(audited, seed=1))
    left_on = compiled_lane(f"{label} + leave-on", kind=LeaveOnLane)
    failed = lambda lane: f"; {len(lane.run.failures)} failed steps" if lane.run.failures else ""
    rows.append(timed_after_its_audit(left_on, seed=2, more=failed))
    return rows


# -- the orchestra ------------------------------------------------------------------------------


# The parts in the order they run (the most telling first: a part the budget leaves out is a
# row that says so). CUDA graphs pay off on launch-bound steps: the small workload has them.
PLANS = {
    "full": [("small-fp32", "eager"), ("small-fp32", "compile"), ("small-fp32", "cudagraph"),
             ("large-bf16", "eager"), ("large-bf16", "compile"), ("small-bf16", "eager")],
    "quick": [("small-fp32", "eager"), ("small-fp32", "compile"), ("small-fp32", "cudagraph"), ("large-bf16", "eager")],
    "smoke": [("small-fp32", "eager"), ("small-fp32", "compile"), ("small-fp32", "cudagraph"), ("small-bf16", "eager")],
}


def plan(options):
    parts = PLANS["smoke" if options.smoke else "quick" if options.quick else "full"]
    return [part for part in parts if not (options.no_compile and part[1] != "eager")]


def run_part(workload, section, options, timeout):
    """One part in a process of its own; its rows, or one row saying why there are none."""
    command = [sys.executable, "-m", "bench.gpu", "--part", section, "--workload", workload]
    command += ["--cpu-smoke"] if options.smoke else []
    command += ["--quick"] if options.quick else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [dict(workload=workload, lane=section, error=f"timed out after {timeout:.0f} s (the budget)")]
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
    return [dict(workload=workload, lane=section, error=f"exit {done.returncode}: {tail[-1][:150] if tail else 'no output'}")]


def run_section(workload, section, options):
    schedule = SCHEDULES["smoke" if options.smoke else "quick" if options.quick else "full"]
    names = {"eager": "eager", "compile": "compiled", "cudagraph": "CUDA-graphed"}
    try:
        if section == "eager":
            rows = eager_section(workload, options.smoke, schedule)
        else:
            rows = compiled_section(workload, options.smoke, schedule, None if section == "compile" else "reduce-overhead")
    except Exception as error:
        rows = [dict(workload=workload, lane=names[section], error=describe(error))]
    print(MARK + json.dumps(rows), flush=True)


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(rows) -> str:
    from tabulate import tabulate

    body = []
    for r in rows:
        if r.get("skipped"):
            body.append([r["workload"], r["lane"], "", "", "", "", f"skipped: {r['skipped']}"])
        elif r.get("error"):
            body.append([r["workload"], r["lane"], "", "", "", "", f"failed: {r['error']}"])
        else:
            syncs = r.get("syncs")
            body.append([r["workload"], r["lane"], fmt(r.get("ms"), ".3f"), fmt(r.get("x_eager"), ".3f"),
                         fmt(r.get("x_base"), ".3f"), "n/a" if syncs is None else f"{syncs:g}", r.get("note", "")])
    return tabulate(body, headers=HEADERS, tablefmt="github", disable_numparse=True)


def calibration(device) -> str:
    """The sync counter's reading of one ``.item()`` (1 on CUDA)."""
    import torch

    if device.type != "cuda":
        return "host syncs: n/a on the CPU (torch's sync debug mode is CUDA's)"
    x = torch.ones(4, device=device)
    with SyncCount(device) as counted:
        x.sum().item()
    return f"host syncs counted with torch.cuda.set_sync_debug_mode('warn'); one .item() counts {counted.n}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer workloads and rounds")
    parser.add_argument("--cpu-smoke", dest="smoke", action="store_true", help="tiny, on the CPU (automatic without CUDA)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile parts")
    parser.add_argument("--budget", type=float, default=285.0, help="seconds for everything (default 285)")
    parser.add_argument("--part", choices=("eager", "compile", "cudagraph"), help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    import torch

    if not options.smoke and not torch.cuda.is_available():
        options.smoke = True
    if options.part:
        run_section(options.workload, options.part, options)
        return 0

    started = time.perf_counter()
    device = torch.device("cpu" if options.smoke else "cuda")
    name = "CPU (cpu smoke)" if options.smoke else torch.cuda.get_device_name(device)
    schedule = SCHEDULES["smoke" if options.smoke else "quick" if options.quick else "full"]
    print(f"bench.gpu on {name}: torch {torch.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}", flush=True)
    print(f"  {calibration(device)}", flush=True)
    print(f"  {schedule[0]} rounds of {schedule[1]}-step runs, blocks of {schedule[2]} steps interleaved (shuffled), "
          f"wall time between torch.cuda.synchronize() calls; x eager: median of per-round ratios", flush=True)
    rows = []
    for workload, section in plan(options):
        left = options.budget - (time.perf_counter() - started)
        if left < 15:
            rows.append(dict(workload=workload, lane=section, skipped=f"the {options.budget:.0f} s budget ran out"))
            continue
        part_started = time.perf_counter()
        rows += run_part(workload, section, options, left)
        print(f"  {workload} {section}: {time.perf_counter() - part_started:.1f} s", flush=True)
    print(table(rows) + ("\n(cpu smoke)" if options.smoke else ""))
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
