"""``torchrun ... -m opwatch --jsonl PATH --trace PATH --tensorboard DIR``: every rank's file kept.

Rank 0 writes the path given, rank r > 0 the path with ``.rank<r>`` before its extension (its
TensorBoard run: ``DIR/rank<r>``); one process writes the path given, as before. Before, both
ranks opened the same path for writing: one rank's log lost, or a file cut in the middle.

Real torchrun, 2 ranks, gloo on 127.0.0.1 (``--standalone``); the script's process group times out
after 30 s and torchrun is killed after 120 s (``subprocess.run``'s timeout): a bug fails, never
hangs. The script is tests/scenarios/dist_rank_files.py: DDP, 3 SGD steps, a loss that
broadcasts on rank 1 only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import opwatch
from opwatch.render.notices import rank_files
from opwatch.storage.chrome_trace import chrome_trace, merge_chrome_traces, merged_chrome_trace
from opwatch.storage.per_rank import rank_folder, rank_path
from support import SCENARIOS
from support.distributed import run_ranks
from support.helpers import MLP, line_of
from support.traces import validate_trace_events

SCRIPT = "dist_rank_files.py"
LOSS_LINE = line_of("# broadcasts on the bad rank", str(SCENARIOS / SCRIPT))
BROADCAST = f"broadcast in aten.sub.Tensor at {SCRIPT}:{LOSS_LINE} (forward"
TIMEOUT = 120  # seconds for one torchrun or opwatch command, then killed

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")


def _opwatch(args: list[str], cwd, *, torchrun: bool = False, **env) -> subprocess.CompletedProcess:
    """``python -m opwatch args`` in ``cwd`` (under torchrun with 2 ranks when ``torchrun``)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else []
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # not a rank of the test's own job
        environment.pop(name, None)
    command = [sys.executable, *launcher, "-m", "opwatch", *args]
    return run_ranks(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=TIMEOUT)


def _lines(path) -> list[dict]:
    """Every line of a JSON Lines file, each parsed (a line cut or two files interleaved fails)."""
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def _assert_one_whole_log(path, rank: int | None):
    """``path`` holds one log of ``rank``, whole: one header (its rank), then lines each of one
    log (indices rising, each site once), as many as the header promised (``load`` refuses a log
    cut short)."""
    lines = _lines(path)
    headers = [line for line in lines if "format" in line]
    assert len(headers) == 1 and lines[0] is headers[0] and headers[0]["rank"] == rank
    indices = [line["index"] for line in lines if line.get("type") == "record"]
    assert indices == sorted(set(indices)) and indices
    sites = [line["site"] for line in lines if line.get("type") == "site"]
    assert sites == list(range(1, len(sites) + 1))
    log = opwatch.load(path)  # strict: the header's counts are the lines read
    assert log.rank == rank and all(record.rank == rank for record in log.records)
    return log


def _scalars(folder) -> dict[str, float]:
    """tag -> last value of the TensorBoard events directly in ``folder`` (not its subfolders)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One torchrun of the script, 2 ranks, every file option given: (result, folder)."""
    folder = tmp_path_factory.mktemp("ranks")
    shutil.copy(SCENARIOS / SCRIPT, folder / SCRIPT)
    options = ["--fingerprints", "--jsonl", "run.jsonl", "--trace", "trace.json"]
    if _has_tensorboard():
        options += ["--tensorboard", "tb"]
    result = _opwatch([*options, SCRIPT], folder, torchrun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, folder


def _has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


# -- under torchrun: one file a rank ------------------------------------------------------------


@needs_gloo
def test_each_rank_writes_its_own_log_with_its_records(two_ranks):
    result, folder = two_ranks
    assert sorted(path.name for path in folder.glob("*.jsonl")) == ["run.jsonl", "run.rank1.jsonl"]
    rank0 = _assert_one_whole_log(folder / "run.jsonl", 0)
    rank1 = _assert_one_whole_log(folder / "run.rank1.jsonl", 1)
    # The anomaly is rank 1's alone: in its log, 3 steps; rank 0's log holds none.
    assert rank0.anomalies == [] and rank0.summary() == "opwatch (rank 0): no anomalies."
    assert [anomaly.kind for anomaly in rank1.anomalies] == ["broadcast"] * 3
    assert {anomaly.lineno for anomaly in rank1.anomalies} == {LOSS_LINE} and all(anomaly.rank == 1 for anomaly in rank1.anomalies)
    # Each log is its rank's ops: rank 0 made the target's unsqueeze, rank 1 did not.
    assert sum(record.op == "aten.unsqueeze.default" for record in rank0.records) == 3
    assert not any(record.op == "aten.unsqueeze.default" for record in rank1.records)


@needs_gloo
def test_rank_0_says_once_where_each_rank_s_files_went(two_ranks):
    result, folder = two_ranks
    told = "opwatch, all 2 ranks: each rank writes its own: --jsonl run.jsonl (rank 0), run.rank1.jsonl (rank 1); --trace trace.json (rank 0), trace.rank1.json (rank 1)"
    assert result.stderr.count(told) == 1
    assert result.stderr.count("each rank writes its own") == 1


@needs_gloo
def test_show_and_diff_read_the_ranks_logs(two_ranks):
    _, folder = two_ranks
    shown = _opwatch(["show", "run.rank1.jsonl", "--last", "3"], folder)
    assert shown.returncode == 0, shown.stderr
    assert "opwatch (rank 1): 3 anomalies at 1 place:" in shown.stdout and f"{BROADCAST}, rank 1) [x3]" in shown.stdout
    shown = _opwatch(["show", "run.jsonl"], folder)
    assert shown.returncode == 0 and shown.stdout.endswith("opwatch (rank 0): no anomalies.\n")
    # The same data on both ranks: the logs first differ where rank 1's loss broadcasts.
    compared = _opwatch(["diff", "run.jsonl", "run.rank1.jsonl"], folder)
    assert compared.returncode == 1, compared.stderr
    assert f"The runs first differ at aten.sub.Tensor (forward): {SCRIPT}:{LOSS_LINE} in a, {SCRIPT}:{LOSS_LINE} in b." in compared.stdout
    assert "Output 0 has another shape: f32[4, 1] cpu in a, f32[4, 4] cpu in b." in compared.stdout
    same = _opwatch(["diff", "run.rank1.jsonl", "run.rank1.jsonl"], folder)
    assert same.returncode == 0, same.stdout + same.stderr
    # The folder holds the job's logs alone: diff reads them as one run of 2 ranks.
    job = _opwatch(["diff", ".", "."], folder)
    assert job.returncode == 0 and job.stdout.startswith("opwatch diff: a = 2 ranks (.)"), job.stdout + job.stderr


@needs_gloo
def test_each_rank_writes_its_own_chrome_trace(two_ranks):
    _, folder = two_ranks
    assert sorted(path.name for path in folder.glob("trace*.json")) == ["trace.json", "trace.rank1.json"]
    pids = []
    for rank, name in enumerate(["trace.json", "trace.rank1.json"]):
        trace = json.loads((folder / name).read_text(encoding="utf-8"))
        assert trace["otherData"]["rank"] == rank
        events = trace["traceEvents"]
        (process,) = [event for event in events if event["name"] == "process_name"]
        assert process["args"]["name"] == f"opwatch (rank {rank})"
        assert len({event["pid"] for event in events}) == 1
        pids.append(process["pid"])
        broadcasts = [event for event in events if event["ph"] == "i"]
        assert len(broadcasts) == (3 if rank == 1 else 0)
    assert pids[0] != pids[1]  # one process a rank: the traces' events stay apart when put in one file


@needs_gloo
def test_merge_traces_puts_the_ranks_in_one_trace_a_process_each(two_ranks):
    _, folder = two_ranks
    merged = _opwatch(["merge-traces", "trace.rank1.json", "trace.json", "-o", "all.json"], folder)
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout == "opwatch: 2 traces merged into all.json (open it in https://ui.perfetto.dev or chrome://tracing)\n"
    ranks = [json.loads((folder / name).read_text(encoding="utf-8")) for name in ("trace.json", "trace.rank1.json")]
    trace = json.loads((folder / "all.json").read_text(encoding="utf-8"))
    events = validate_trace_events(trace)  # one flow id a flow, each arrow within its rank's ops
    assert trace["otherData"]["rank"] == [0, 1] and trace["otherData"]["aligned"] is True
    assert len(events) == sum(len(one["traceEvents"]) for one in ranks)
    first = min(one["otherData"]["origin_unix_ns"] for one in ranks)
    for rank, one in enumerate(ranks):
        (pid,) = {event["pid"] for event in one["traceEvents"]}
        mine = [event for event in events if event["pid"] == pid]
        (process,) = [event for event in mine if event["name"] == "process_name"]
        assert process["args"]["name"] == f"opwatch (rank {rank})"
        # Each rank's events, in order, moved by where its first op lies on the shared clock.
        shift = (one["otherData"]["origin_unix_ns"] - first) / 1000
        assert [event["name"] for event in mine] == [event["name"] for event in one["traceEvents"]]
        assert [event.get("ts") for event in mine] == pytest.approx([None if "ts" not in event else event["ts"] + shift for event in one["traceEvents"]], abs=2e-3)
    assert min(event["ts"] for event in events if event.get("cat") == "op") == 0


@needs_gloo
def test_each_rank_writes_its_own_tensorboard_run(two_ranks):
    pytest.importorskip("tensorboard")
    _, folder = two_ranks
    runs = {path.parent.relative_to(folder).as_posix() for path in folder.rglob("events.out.tfevents.*")}
    assert runs == {"tb", "tb/rank1"}
    assert _scalars(folder / "tb")["opwatch/anomalies"] == 0
    rank1 = _scalars(folder / "tb" / "rank1")
    assert rank1["opwatch/anomalies"] == 3 and rank1["opwatch/anomalies/broadcast"] == 3


# -- one process: the file named as given, as before --------------------------------------------


def test_one_process_writes_the_path_given(tmp_path):
    shutil.copy(SCENARIOS / SCRIPT, tmp_path / SCRIPT)
    result = _opwatch(["--jsonl", "run.jsonl", "--trace", "trace.json", SCRIPT], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == [SCRIPT, "run.jsonl", "trace.json"]
    log = _assert_one_whole_log(tmp_path / "run.jsonl", None)
    assert [anomaly.kind for anomaly in log.anomalies] == ["broadcast"] * 3
    assert result.stderr.startswith("opwatch: 3 anomalies at 1 place:") and "(rank " not in result.stderr
    assert "each rank writes" not in result.stderr
    assert json.loads((tmp_path / "trace.json").read_text(encoding="utf-8"))["otherData"]["rank"] == 0


# -- merging traces ----------------------------------------------------------------------------


def _trained_trace(steps: int) -> dict:
    """The trace of a watched training run of a small model: forward, backward, SGD steps."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with opwatch.watch(warn=False) as w:
        for _ in range(steps):
            model(torch.randn(4, 4)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return chrome_trace(w)


def test_merged_traces_of_one_process_get_a_process_and_flows_each():
    first, second = _trained_trace(1), _trained_trace(2)
    second["otherData"]["rank"] = 0  # two runs of one process: one pid, the same flow ids
    (pid,) = {event["pid"] for event in first["traceEvents"]} | {event["pid"] for event in second["traceEvents"]}
    flow_ids = [{event["id"] for event in trace["traceEvents"] if event["ph"] == "s"} for trace in (first, second)]
    assert flow_ids[0] and flow_ids[0] <= flow_ids[1]  # put side by side as they are, their arrows would mix
    merged = merged_chrome_trace([first, second])
    events = validate_trace_events(merged)
    assert sorted({event["pid"] for event in events}) == [pid, pid + 1]
    flows = [{event["id"] for event in events if event["ph"] == "s" and event["pid"] == one} for one in (pid, pid + 1)]
    assert flows[0] and flows[1] and not flows[0] & flows[1]
    # The second run started later on the wall clock: its ops lie after the first's.
    assert merged["otherData"]["aligned"] is True
    last_of_first = max(event["ts"] for event in events if event["pid"] == pid and event.get("cat") == "op")
    assert min(event["ts"] for event in events if event["pid"] == pid + 1 and event.get("cat") == "op") > last_of_first


def test_merged_traces_are_in_rank_order_and_a_trace_without_its_origin_starts_at_0(tmp_path):
    with opwatch.watch(warn=False) as w:
        torch.ones(2).log()
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    saved = chrome_trace(opwatch.load(path))  # a saved log's clock was another process's: no origin
    assert "origin_unix_ns" not in saved["otherData"]
    later = _trained_trace(1)
    later["otherData"]["rank"], saved["otherData"]["rank"] = 0, 1
    merged = merged_chrome_trace([saved, later])
    assert merged["otherData"]["rank"] == [0, 1] and merged["otherData"]["aligned"] is False
    events = validate_trace_events(merged)
    assert events[: len(later["traceEvents"])] == later["traceEvents"]
    assert [event.get("ts") for event in events[len(later["traceEvents"]) :]] == [event.get("ts") for event in saved["traceEvents"]]


def test_merge_traces_refuses_what_opwatch_did_not_write(tmp_path):
    (tmp_path / "profile.json").write_text(json.dumps({"traceEvents": [], "otherData": {"producer": "torch.profiler"}}))
    (tmp_path / "cut.json").write_text('{"traceEvents": [')
    for name, told in [("profile.json", "not a trace written by opwatch"), ("cut.json", "not JSON"), ("missing.json", "No such file")]:
        result = _opwatch(["merge-traces", name, "-o", "all.json"], tmp_path)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr.startswith(f"python -m opwatch merge-traces: error: ") and told in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "all.json").exists()
    with pytest.raises(TypeError, match="paths must be a list of trace files"):
        merge_chrome_traces("trace.json", tmp_path / "all.json")
    with pytest.raises(ValueError, match="paths is empty"):
        merge_chrome_traces([], tmp_path / "all.json")


# -- the names, as data --------------------------------------------------------------------------


def test_rank_0_and_one_process_keep_the_name_other_ranks_add_theirs():
    assert rank_path("run.jsonl", None) == rank_path("run.jsonl", 0) == "run.jsonl"
    assert rank_path("run.jsonl", 1) == "run.rank1.jsonl"
    assert rank_path(os.path.join("out.v2", "trace.json"), 12) == os.path.join("out.v2", "trace.rank12.json")
    assert rank_path("log", 3) == "log.rank3"
    assert rank_folder("runs/exp", None) == rank_folder("runs/exp", 0) == "runs/exp"
    assert rank_folder("runs/exp", 2) == os.path.join("runs/exp", "rank2")


def test_the_notice_names_every_rank_s_file_or_the_first_and_last():
    two = rank_files([("--jsonl", ["run.jsonl", "run.rank1.jsonl"])])
    assert two == "opwatch, all 2 ranks: each rank writes its own: --jsonl run.jsonl (rank 0), run.rank1.jsonl (rank 1)"
    eight = rank_files([("--trace", [rank_path("t.json", rank) for rank in range(8)])])
    assert eight == "opwatch, all 8 ranks: each rank writes its own: --trace t.json (rank 0), t.rank1.json (rank 1) ... t.rank7.json (rank 7)"
