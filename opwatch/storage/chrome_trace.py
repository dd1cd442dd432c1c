"""A watch's log as Chrome trace-event JSON, as ``torch.profiler`` writes it, for Perfetto
(https://ui.perfetto.dev) and ``chrome://tracing``."""

from __future__ import annotations

import json
import os
import time

import torch

from ..core.notation import format_meta
from ..core.records import short_op_name
from ..modes.compiled_graphs import is_graph_record
from ..render.phrases import module_of
from .jsonl import SavedLog, anomaly_groups, rank_of_process

__all__ = ["write_chrome_trace", "chrome_trace", "merge_chrome_traces", "merged_chrome_trace"]


def write_chrome_trace(watch, path) -> None:
    """Write ``watch``'s log to ``path`` as Chrome trace-event JSON (the format of
    ``torch.profiler``'s ``export_chrome_trace``), for Perfetto and ``chrome://tracing``.

    - one complete (``X``) event per op: its name, start and duration in microseconds, and
      ``args`` with its inputs, outputs, line, code, module and phase;
    - module spans: one ``X`` event per run of consecutive ops in the same module (and phase),
      nested as the module paths are, on the same track, so ops sit inside their modules;
    - flow arrows (``s``/``f``, category ``fwdbwd`` as torch's) joining each backward op to
      the forward op it differentiates, drawn from the forward op to the backward op;
    - each anomaly (and contained nan/inf origin, and allowed finding) as an instant (``i``)
      event on its op, carrying its message.

    The forward op of a backward op is the latest forward op before it with the same source
    position, module and op as the backward op names (its ``forward_func``); a line that runs
    the same op many times in one module (a Python loop over time steps) links each backward
    op to the last of them.
    """
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(chrome_trace(watch), stream, ensure_ascii=False, allow_nan=False)


def chrome_trace(watch) -> dict:
    """The trace-event JSON object that :func:`write_chrome_trace` writes."""
    from .._version import __version__
    from ..render import location

    records = watch.records
    pid = os.getpid()
    tid = 1
    rank = rank_of_process()
    times = _op_times(records)
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"opwatch (rank {rank})"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": rank}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": "ops"}},
    ]
    # Module spans before ops: a span and its first op start at the same time, and viewers
    # nest events of equal start and length in file order.
    events += _module_spans(records, times, pid, tid)
    for record, (ts, dur) in zip(records, times):
        outputs = record.outputs
        args = {
            "index": record.index,
            "inputs": [format_meta(meta) for meta in record.inputs],
            "outputs": "not run" if outputs is None else [format_meta(meta) for meta in outputs],
            "line": location(record),
            "code": record.position.expression() or record.position.line_text(),
            "module": module_of(record),
            "phase": record.phase,
        }
        if record.forward_func is not None:
            args["forward op"] = short_op_name(record.forward_func)
        if record.flags:
            args["flags"] = list(record.flags)
        events.append({"ph": "X", "cat": "op", "name": short_op_name(record.func), "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args})
    events += _backward_flows(records, times, pid, tid)
    start_of = {record.index: ts for record, (ts, _) in zip(records, times)}
    categories = {"anomalies": "anomaly", "contained": "contained", "allowed": "allowed"}
    for name, group in anomaly_groups(watch).items():
        category = categories[name]
        for anomaly in group:
            ts = start_of.get(anomaly.index)
            if ts is None:  # its op left the bounded log
                continue
            events.append(
                {
                    "ph": "i",
                    "s": "t",
                    "cat": category,
                    "name": f"{anomaly.kind}: {short_op_name(anomaly.op)}" + ("" if category == "anomaly" else f" ({category})"),
                    "pid": pid,
                    "tid": tid,
                    "ts": ts,
                    "args": {"index": anomaly.index, "message": anomaly.message},
                }
            )
    timed = bool(records) and records[0].start_ns is not None
    other = {
        "producer": f"opwatch {__version__}",
        "torch": torch.__version__,
        "rank": rank,
        "timestamps": "perf_counter_ns around each kernel" if timed else "synthetic: op index, 1 us per op",
    }
    origin = _origin_unix_ns(watch, records)
    if origin is not None:  # where ts 0 lies on the wall clock: the ranks' traces line up when merged
        other["origin_unix_ns"] = origin
    return {"schemaVersion": 1, "traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _origin_unix_ns(watch, records) -> int | None:
    """The wall-clock time (ns since the epoch) of the first op's start, the trace's ts 0, for a
    live watch whose ops were timed; ``None`` for a saved log (its perf_counter was another
    process's) or synthetic times. perf_counter_ns is the host's monotonic clock, shared by the
    processes of one machine; across machines the wall clocks are as close as their sync."""
    starts = [record.start_ns for record in records]
    if isinstance(watch, SavedLog) or not starts or any(start is None for start in starts):
        return None
    return min(starts) + time.time_ns() - time.perf_counter_ns()


def merge_chrome_traces(paths, path) -> int:
    """Write the traces at ``paths`` (each written by ``--trace`` or
    :meth:`opwatch.Watch.export_chrome_trace`: the ranks of a torchrun job, ``trace.json``,
    ``trace.rank1.json``, ...) into one trace at ``path``, for Perfetto and ``chrome://tracing``;
    returns the number of traces merged. See :func:`merged_chrome_trace`."""
    paths = [os.fspath(one) for one in _paths(paths)]
    traces = [_read_trace(one) for one in paths]
    merged = merged_chrome_trace(traces)
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(merged, stream, ensure_ascii=False, allow_nan=False)
    return len(traces)


def merged_chrome_trace(traces: list[dict]) -> dict:
    """One trace-event object holding each of ``traces`` (as :func:`chrome_trace` makes them)
    as a process of its own, in rank order: a process id that an earlier trace holds already
    (two machines' ranks) is renumbered; the backward flows' ids are renumbered so that each
    arrow stays within its trace; where every trace knows its wall-clock origin, their times
    are shifted to line up (the earliest first op at 0), else each starts at 0."""
    traces = sorted(traces, key=lambda trace: _rank_key(trace["otherData"].get("rank")))
    origins = [trace["otherData"].get("origin_unix_ns") for trace in traces]
    aligned = bool(traces) and all(isinstance(origin, int) for origin in origins)
    first = min(origins) if aligned else 0
    taken: set = set()
    flows = 0  # the flow ids the traces merged so far use
    events: list[dict] = []
    for trace, origin in zip(traces, origins):
        shift = round((origin - first) / 1000, 3) if aligned else 0.0
        pids = {}
        for event in trace["traceEvents"]:
            pid = event.get("pid")
            if pid not in pids:
                pids[pid] = pid if pid not in taken else max(taken) + 1
                taken.add(pids[pid])
        ids = [event["id"] for event in trace["traceEvents"] if event.get("cat") == "fwdbwd" and isinstance(event.get("id"), int)]
        for event in trace["traceEvents"]:
            event = {**event, "pid": pids[event.get("pid")]}
            if "ts" in event and shift:
                event["ts"] = round(event["ts"] + shift, 3)
            if event.get("cat") == "fwdbwd" and isinstance(event.get("id"), int):
                event["id"] += flows
            events.append(event)
        flows += max(ids, default=0)
    other = dict(next((trace["otherData"] for trace in traces), {}))  # the first trace's, by rank
    other.pop("origin_unix_ns", None)
    other["rank"] = [trace["otherData"].get("rank") for trace in traces]
    other["aligned"] = aligned  # the traces' clocks lined up by their wall-clock origins
    return {"schemaVersion": 1, "traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _rank_key(rank) -> tuple:
    return (0, rank) if isinstance(rank, int) else (1, 0)


def _paths(paths) -> list:
    if isinstance(paths, (str, bytes, os.PathLike)) or not isinstance(paths, (list, tuple)):
        raise TypeError(f"paths must be a list of trace files (str or os.PathLike), got {type(paths).__name__}")
    if not paths:
        raise ValueError("paths is empty: give the traces to merge (trace.json, trace.rank1.json, ...)")
    for one in paths:
        if not isinstance(one, (str, os.PathLike)):
            raise TypeError(f"paths must hold file paths (str or os.PathLike), got {type(one).__name__}")
    return list(paths)


def _read_trace(path: str) -> dict:
    """The trace at ``path``, which opwatch wrote (``--trace``, ``Watch.export_chrome_trace``)."""
    with open(path, encoding="utf-8") as stream:
        try:
            trace = json.load(stream)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error}); expected a trace written by --trace or Watch.export_chrome_trace") from None
    other = trace.get("otherData") if isinstance(trace, dict) else None
    producer = other.get("producer") if isinstance(other, dict) else None
    if not isinstance(producer, str) or not producer.startswith("opwatch") or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a trace written by opwatch (--trace or Watch.export_chrome_trace); merge-traces merges opwatch's traces")
    return trace


def _op_times(records) -> list[tuple[float, float]]:
    """``(ts, dur)`` in microseconds for each record, from the first op's start."""
    starts = [record.start_ns for record in records]
    if not records or any(start is None for start in starts):
        # No op times recorded: a synthetic clock, one microsecond per op index, so that the
        # trace keeps the ops' order and nesting.
        first = records[0].index if records else 0
        return [(float(record.index - first), 1.0) for record in records]
    origin = min(starts)
    times = []
    for record, start in zip(records, starts):
        end = record.end_ns
        # An op stopped before its kernel (strict) or whose kernel raised has no end: a 0-long event.
        duration = 0 if end is None else max(end - start, 0)
        times.append((round((start - origin) / 1000, 3), round(duration / 1000, 3)))
    return times


def _module_spans(records, times, pid: int, tid: int) -> list[dict]:
    """One ``X`` event per maximal run of consecutive ops of one phase inside a module path
    (and each of its parents), from the first op's start to the last op's end."""
    spans: list[dict] = []
    open_spans: list[list] = []  # [path, phase, start, end], outermost first
    path_at, phase_at, end_at = 0, 1, 3  # positions in an open span (a list: its end grows)

    def close(count: int) -> None:
        for path, phase, start, end in reversed(open_spans[len(open_spans) - count :]):
            spans.append(
                {"ph": "X", "cat": "module", "name": path, "pid": pid, "tid": tid, "ts": start, "dur": round(end - start, 3), "args": {"module": path, "phase": phase}}
            )
        del open_spans[len(open_spans) - count :]

    for record, (ts, dur) in zip(records, times):
        module = record.module
        # A module path is a span and its parents' (blocks.0 in blocks); a compiled graph's
        # name is one span.
        parts = [] if not module else [module] if is_graph_record(record) else module.split(".")
        paths = [".".join(parts[: depth + 1]) for depth in range(len(parts))]
        kept = 0
        while kept < len(open_spans) and kept < len(paths) and open_spans[kept][path_at] == paths[kept] and open_spans[kept][phase_at] == record.phase:
            kept += 1
        close(len(open_spans) - kept)
        end = round(ts + dur, 3)
        for span in open_spans:
            span[end_at] = end
        for path in paths[kept:]:
            open_spans.append([path, record.phase, ts, end])
    close(len(open_spans))
    return spans


def _backward_flows(records, times, pid: int, tid: int) -> list[dict]:
    """A flow arrow from each forward op to each backward op that differentiates it (see
    :func:`write_chrome_trace` for the matching rule)."""
    flows: list[dict] = []
    latest_forward: dict = {}  # (position, module, op) -> ts of the latest forward op there
    for record, (ts, _) in zip(records, times):
        position = record.position
        if position.filename is None:
            continue
        site = (position.filename, position.lineno, position.col, position.end_col, record.module)
        if record.phase == "forward":
            latest_forward[(*site, record.op)] = ts
            continue
        forward = record.forward_func
        start = None if forward is None else latest_forward.get((*site, str(forward)))
        if start is None:
            continue
        flow = len(flows) // 2 + 1
        common = {"cat": "fwdbwd", "name": "fwdbwd", "id": flow, "pid": pid, "tid": tid}
        flows.append({"ph": "s", "ts": start, **common})
        flows.append({"ph": "f", "bp": "e", "ts": ts, **common})
    return flows
