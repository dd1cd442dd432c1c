"""The trace-event format (the JSON object form that torch.profiler writes and Perfetto and
chrome://tracing read), checked event by event: the Chrome traces opwatch writes and merges."""

from __future__ import annotations

import math
from collections import defaultdict

PHASES = {"X", "B", "E", "i", "I", "s", "t", "f", "M", "C"}


def validate_trace_events(trace: dict) -> list[dict]:
    """Check ``trace`` against the trace-event format (the JSON object form, as torch.profiler
    writes it); returns its events. Complete events on one thread must nest; each flow has one
    start and one end, each bound to an op event on its thread."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    events = trace["traceEvents"]
    for event in events:
        assert event["ph"] in PHASES, event
        assert isinstance(event["name"], str) and event["name"], event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int), event
        assert isinstance(event.get("args", {}), dict), event
        if event["ph"] == "M":
            assert event["name"] in {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}
            continue
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0 and math.isfinite(event["ts"]), event
        if event["ph"] == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
        if event["ph"] == "i":
            assert event["s"] in ("g", "p", "t"), event
        if event["ph"] in ("s", "f"):
            assert isinstance(event["id"], int) and event["cat"], event
        if event["ph"] == "f":
            assert event.get("bp") == "e", event
    # Complete events of one thread nest (a tolerance of a nanosecond: timestamps are in us).
    by_thread = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            by_thread[event["pid"], event["tid"]].append(event)
    for slices in by_thread.values():
        stack = []
        for event in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= event["ts"] + 1e-3:
                stack.pop()
            end = event["ts"] + event["dur"]
            assert not stack or end <= stack[-1] + 1e-3, f"{event['name']} at {event['ts']} overlaps its parent"
            stack.append(end)
    flows = defaultdict(dict)
    for event in events:
        if event["ph"] in ("s", "f"):
            assert event["ph"] not in flows[event["id"]], f"flow {event['id']} has two {event['ph']} events"
            flows[event["id"]][event["ph"]] = event
    for flow in flows.values():
        assert set(flow) == {"s", "f"} and flow["s"]["ts"] <= flow["f"]["ts"]
        for end in flow.values():
            assert any(s["cat"] == "op" and s["ts"] == end["ts"] for s in by_thread[end["pid"], end["tid"]])
    return events
