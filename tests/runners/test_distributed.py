"""torch.distributed: ranks, collectives, and which rank made the first nan.

gloo on 127.0.0.1, with 2 and 4 processes started by torch.multiprocessing, and 2 by torchrun.
Every multi-process test bounds itself: process groups time out after 30 s, joins after 120 s,
the exchange and the collective-mismatch check after a few seconds; a bug fails, never hangs.
The scenarios live in tests/scenarios/dist_cases.py (one process group per spawn runs several
cases) and tests/scenarios/dist_ddp.py (the torchrun script).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import opwatch
from opwatch.findings import ranks
from opwatch.core.ops import collective_of, is_collective_op
from opwatch.findings.ranks import AllAnomalies, RankAnomaly, decode, encode
from opwatch.render import render_combined_summary
from opwatch.render.messages import explain

from support.helpers import line_of

from support import SCENARIOS, fsdp2_on_cpu
from support.distributed import run_ranks, spawn
import dist_cases  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

CASES_FILE = str(SCENARIOS / "dist_cases.py")
STEP_LINE = line_of("# nan made here", CASES_FILE)


def _spawn(world: int, cases: list[str], out_dir, *, timeout: float = 120.0) -> list[dict]:
    """Run ``cases`` on ``world`` gloo ranks; every rank's results. Killed after ``timeout``."""
    return spawn(dist_cases.worker, world, cases, out_dir, timeout=timeout)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One process group of 2 ranks running the plain 2-rank cases (spawning costs seconds)."""
    saved = os.environ.get("OPWATCH_COLLECTIVE_TIMEOUT")
    os.environ["OPWATCH_COLLECTIVE_TIMEOUT"] = "2"  # the mismatch case's missing rank
    try:
        return _spawn(2, ["ddp", "mismatch"], tmp_path_factory.mktemp("two_ranks"))
    finally:
        if saved is None:
            os.environ.pop("OPWATCH_COLLECTIVE_TIMEOUT", None)
        else:
            os.environ["OPWATCH_COLLECTIVE_TIMEOUT"] = saved


@pytest.fixture(scope="module")
def functional_ranks(tmp_path_factory):
    """The functional collectives' case on 2 ranks, in a group of its own."""
    return _spawn(2, ["functional"], tmp_path_factory.mktemp("functional_ranks"))


@pytest.fixture(scope="module")
def two_sharded_ranks(tmp_path_factory):
    """The sharded 2-rank cases (FSDP2, DTensor), in a group of their own: a rank that crashes
    in them (the nan/inf cause once read FSDP's freed storage: SIGSEGV) must not take the plain
    cases' tests with it."""
    return _spawn(2, ["ddp", "functional", "fsdp2", "dtensor"], tmp_path_factory.mktemp("two_sharded_ranks"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _spawn(4, ["ddp", "missing"], tmp_path_factory.mktemp("four_ranks"))


# -- DDP ----------------------------------------------------------------------------------------


def test_ddp_origin_on_its_rank_received_on_the_other(two_ranks):
    zero, one = two_ranks[0]["ddp"], two_ranks[1]["ddp"]
    # Rank 1 made it: its origin, at its line, and nothing else.
    assert one["anomalies"] == [["nan", "aten.sqrt.default", f"dist_cases.py:{STEP_LINE}", "forward", False, 1]]
    # Rank 0's own inputs were finite: received through the gradient all-reduce, not an origin.
    assert len(zero["anomalies"]) == 1
    kind, op, where, phase, received, rank = zero["anomalies"][0]
    assert (kind, op, phase, received, rank) == ("nan", "c10d.allreduce_.default", "backward", True, 0)
    assert where.startswith("DDP bucket [2.bias, 2.weight, 0.bias, +1]")
    assert "nan received through c10d.allreduce_(f32[58] cpu) -> f32[58] cpu" in zero["summary"]
    assert "another rank sent it" in zero["summary"]
    assert zero["summary"].startswith("opwatch (rank 0): 1 anomaly")
    assert one["summary"].startswith("opwatch (rank 1): 1 anomaly")
    assert f"at dist_cases.py:{STEP_LINE} (forward, rank 1)" in one["summary"]
    # torch.compile(ddp) under the watch: the same findings, the bucket named as DDP names it
    # (not torch.compile's _orig_mod.module.2.bias)
    assert one["compiled"] == one["anomalies"]
    assert [row[:2] + row[3:] for row in zero["compiled"]] == [["nan", "c10d.allreduce_.default", "backward", True, 0]]
    assert zero["compiled"][0][2].startswith("DDP bucket [2.bias, 2.weight, 0.bias, +1]"), zero["compiled"]


def test_ddp_reducer_ops_are_backward_and_named(two_ranks):
    rows = two_ranks[0]["ddp"]["rows"]
    assert all(where != "?" for _, where, _, _ in rows)
    by_op = {}
    for op, where, phase, outputs in rows:
        by_op.setdefault(op, []).append((where, phase, outputs))
    # The bucket's all-reduce: recorded with its output, named by the bucket's parameters.
    (where, phase, outputs), = by_op["c10d.allreduce_.default"]
    assert where.startswith("DDP bucket [") and phase == "backward" and outputs == 1
    # The reducer's copies: into the bucket in each parameter's hook, out of it at the end.
    assert {where for where, _, _ in by_op["aten.mul.out"]} == {"DDP gradient of 0.weight", "DDP gradient of 0.bias", "DDP gradient of 2.weight", "DDP gradient of 2.bias"}
    assert {(where, phase) for where, phase, _ in by_op["aten.copy_.default"]} == {("DDP end of backward", "backward")}


def test_ddp_watching_changes_no_gradient(two_ranks):
    for rank in (0, 1):
        assert two_ranks[rank]["ddp"]["same_grads"]
        assert two_ranks[rank]["ddp"]["healthy"] == f"opwatch (rank {rank}): no anomalies."


def test_all_anomalies_names_the_rank_op_and_line(two_ranks):
    every = two_ranks[0]["ddp"]["all"]
    assert every["missing"] == []
    assert [row[:2] + row[4:] for row in every["anomalies"]] == [[0, "nan", True], [1, "nan", False]]
    headline = every["summary"].splitlines()[0]
    assert headline.startswith(f"opwatch, all 2 ranks: the first nan was made on rank 1 by aten.sqrt.default at dist_cases.py:{STEP_LINE} (forward); rank 0 received it through c10d.allreduce_.default at DDP bucket [")
    assert "\nrank 0: 1 anomaly at 1 place:\n" in every["summary"]
    assert "\nrank 1: 1 anomaly at 1 place:\n" in every["summary"]


def test_four_ranks(four_ranks):
    every = four_ranks[0]["ddp"]["all"]
    assert every["missing"] == []
    assert [(row[0], row[4]) for row in every["anomalies"]] == [(0, True), (1, True), (2, True), (3, False)]
    assert every["summary"].startswith(
        f"opwatch, all 4 ranks: the first nan was made on rank 3 by aten.sqrt.default at dist_cases.py:{STEP_LINE} (forward); ranks 0, 1 and 2 received it through c10d.allreduce_.default"
    )
    # The three ranks that received it through the same all-reduce are shown once.
    assert "\nranks 0, 1 and 2: 1 anomaly at 1 place each:\n\nnan in c10d.allreduce_.default at DDP bucket [" in every["summary"]
    assert "\nrank 3: 1 anomaly at 1 place:\n" in every["summary"]
    for rank in range(4):
        assert four_ranks[rank]["ddp"]["same_grads"]


def test_a_rank_that_does_not_report_is_named(four_ranks):
    missing = four_ranks[0]["missing"]
    assert missing["missing"] == [3]
    assert missing["summary"].splitlines() == [
        "opwatch, the 3 of 4 ranks that reported: no anomalies.",
        "  rank 3 did not report within 1 s: it crashed, hangs, is still running, or ran a different number of watched blocks",
    ]


# -- functional collectives, c10d lists, FSDP2, DTensor ---------------------------------------


def test_functional_collectives_raise_no_false_alarm(functional_ranks):
    for rank in (0, 1):
        assert functional_ranks[rank]["functional"]["false_alarms"] == []
        assert functional_ranks[rank]["functional"]["total_finite"]


def test_functional_collective_received_and_its_consumer_not_blamed(functional_ranks):
    zero, one = functional_ranks[0]["functional"], functional_ranks[1]["functional"]
    line = line_of("# functional: received on rank 0", CASES_FILE)
    assert zero["anomalies"] == [["nan", "_c10d_functional.all_reduce.default", f"dist_cases.py:{line}", "forward", True, 0]]
    assert one["anomalies"] == [["nan", "aten.sqrt.default", f"dist_cases.py:{line_of('# nan on rank 1', CASES_FILE)}", "forward", False, 1]]


def test_c10d_nested_list_outputs_are_recorded(functional_ranks):
    c10d = functional_ranks[0]["functional"]["c10d"]
    (row,) = [row for row in c10d["rows"] if row[0] == "c10d.allgather_.default"]
    assert row[3] == 2  # [[t0, t1]]: both gathered tensors
    line = line_of("# c10d allgather_", CASES_FILE)
    assert c10d["anomalies"] == [["nan", "c10d.allgather_.default", f"dist_cases.py:{line}", "forward", True, 0]]


@fsdp2_on_cpu
def test_fsdp2(two_sharded_ranks):
    zero, one = two_sharded_ranks[0]["fsdp2"], two_sharded_ranks[1]["fsdp2"]
    for rank in (0, 1):
        assert two_sharded_ranks[rank]["fsdp2"]["same_grads"]
        assert two_sharded_ranks[rank]["fsdp2"]["healthy"] == f"opwatch (rank {rank}): no anomalies."
    assert one["anomalies"] == [["nan", "aten.sqrt.default", f"dist_cases.py:{STEP_LINE}", "forward", False, 1]]
    # Rank 0 receives it in both layers' gradient reduce-scatters (gloo copies their results out
    # when FSDP waits: that copy is the collective's delivery, not an origin).
    assert zero["anomalies"] and all(a[1] == "c10d._reduce_scatter_base_.default" and a[4] for a in zero["anomalies"])


@fsdp2_on_cpu  # its ranks run the FSDP2 case first, in the same process group
def test_dtensor(two_sharded_ranks):
    zero, one = two_sharded_ranks[0]["dtensor"], two_sharded_ranks[1]["dtensor"]
    for rank in (0, 1):
        assert two_sharded_ranks[rank]["dtensor"]["same"]
        assert two_sharded_ranks[rank]["dtensor"]["healthy"] == f"opwatch (rank {rank}): no anomalies."
    line = line_of(".full_tensor()  # received on rank 0", CASES_FILE)
    assert zero["anomalies"] == [["nan", "_c10d_functional.all_gather_into_tensor.default", f"dist_cases.py:{line}", "forward", True, 0]]
    assert one["anomalies"] == [["nan", "aten.sqrt.default", f"dist_cases.py:{line_of('# nan in rank 1', CASES_FILE)}", "forward", False, 1]]


# -- the collective-mismatch check -------------------------------------------------------------


def test_collective_mismatch_check(two_ranks):
    shapes = line_of("# shapes differ", CASES_FILE)
    for rank in (0, 1):
        result = two_ranks[rank]["mismatch"]
        assert result["default_writes_nothing"]  # off by default: no store traffic
        assert result["matching"] == []
        # Raised in strict() on every rank, before the collective: no hang.
        assert result["raised"][0].startswith(f"collective_mismatch in c10d.allreduce_.default at dist_cases.py:{shapes} (forward, rank {rank})")
        assert (
            f"rank 0: c10d.allreduce_(f32[4] cpu) at dist_cases.py:{shapes}; rank 1: c10d.allreduce_(f32[6] cpu) at dist_cases.py:{shapes}"
            in result["raised"][0]
        )
        assert "call different collectives" in result["raised"][1]
        assert "rank 0: c10d.allreduce_(f32[2] cpu)" in result["raised"][1] and "rank 1: c10d.broadcast_(f32[2] cpu)" in result["raised"][1]
    # Rank 1 never calls the last one: rank 0 says so after the timeout, before the hang.
    assert len(two_ranks[0]["mismatch"]["raised"]) == 3
    assert "rank 1 of process group 0 did not reach its collective" in two_ranks[0]["mismatch"]["raised"][2]
    assert len(two_ranks[1]["mismatch"]["raised"]) == 2


# -- torchrun -----------------------------------------------------------------------------------


def test_torchrun_prints_each_rank_and_the_combined_summary():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "opwatch", "dist_ddp.py"]
    result = run_ranks(command, cwd=SCENARIOS, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    line = line_of("# nan on one rank", str(SCENARIOS / "dist_ddp.py"))
    assert "opwatch (rank 0): 1 anomaly at 1 place:" in result.stderr
    assert "opwatch (rank 1): 1 anomaly at 1 place:" in result.stderr
    assert f"nan in aten.sqrt.default at dist_ddp.py:{line} (forward, rank 1)" in result.stderr
    assert "nan in c10d.allreduce_.default at DDP bucket [" in result.stderr
    assert f"opwatch, all 2 ranks: the first nan was made on rank 1 by aten.sqrt.default at dist_ddp.py:{line} (forward)" in result.stderr
    assert result.stderr.count("opwatch, all 2 ranks") == 1  # rank 0 only


# -- in one process ------------------------------------------------------------------------------


def test_single_process_output_is_unchanged():
    with opwatch.watch(warn=False) as w:
        torch.ones(2).log().neg().sum()
    assert w.rank is None and w.records[0].rank is None
    assert w.summary() == "opwatch: no anomalies."
    everyone = w.all_anomalies()
    assert list(everyone) == [] and everyone.world is None and everyone.missing == ()


def test_collectives_are_told_apart_per_op():
    import torch.distributed._functional_collectives  # noqa: F401  (registers the functional ops)

    assert collective_of(torch.ops.aten.add.Tensor) is None
    allreduce = collective_of(torch.ops.c10d.allreduce_.default)
    assert (allreduce.kind, allreduce.writes_first, allreduce.compare) == ("c10d", True, "all")
    assert collective_of(torch.ops.c10d.gather_.default).compare == "last"
    assert collective_of(torch.ops.c10d.send.default).compare is None  # point to point: not compared
    assert collective_of(torch.ops._c10d_functional.wait_tensor.default).kind == "wait"
    # torch 2.6 has no _wrap_tensor_autograd op (it makes the AsyncCollectiveTensor in Python).
    if hasattr(torch.ops._c10d_functional, "_wrap_tensor_autograd"):
        assert collective_of(torch.ops._c10d_functional._wrap_tensor_autograd.default).kind == "wrap"
    assert is_collective_op(torch.ops._c10d_functional.all_reduce.default)
    assert not is_collective_op(torch.ops._c10d_functional.wait_tensor.default)


def test_an_async_collective_tensor_made_without_an_op_is_followed_to_its_collective_output():
    """torch 2.6 wraps a functional collective's output in an AsyncCollectiveTensor from Python,
    with no op: the ops that use the wrapper name the output it wraps (as the wrap op links the
    two on newer torch), so the collective's output is read when used and its consumer not blamed."""
    import torch.distributed._functional_collectives as funcol
    from opwatch.core.compat import python_made_collective_wrapper
    from opwatch.core.records import M_IDENT, OpLog, tensor_metas

    output = torch.ones(3)
    wrapper = funcol.AsyncCollectiveTensor(output)
    plain = torch.zeros(2)
    metas = tensor_metas([wrapper, plain], OpLog(4), (type(wrapper),))
    if hasattr(torch.ops._c10d_functional, "_wrap_tensor_autograd"):  # the op links them (torch 2.13)
        assert python_made_collective_wrapper() is None
        assert [meta[M_IDENT] for meta in metas] == [id(wrapper), id(plain)]
    else:
        assert python_made_collective_wrapper() is funcol.AsyncCollectiveTensor
        assert [meta[M_IDENT] for meta in metas] == [id(output), id(plain)]
    assert [tuple(meta[0]) for meta in metas] == [(3,), (2,)]


def _row(rank, kind, op, where, received, time_ns, message=None):
    return RankAnomaly(
        rank=rank, kind=kind, op=op, filename="train.py", lineno=3, where=where, module=None, phase="forward",
        index=7, received=received, count=1, time_ns=time_ns, message=message or f"{kind} in {op} at {where} (forward, rank {rank})",
    )


def test_combined_summary_names_the_first_origin():
    rows = [
        _row(0, "nan", "c10d.allreduce_.default", "DDP bucket [fc.weight]", True, 30),
        _row(2, "nan", "aten.log.default", "train.py:3", False, 20),
        _row(1, "nan", "aten.div.Tensor", "train.py:9", False, 25),
    ]
    text = render_combined_summary(rows, world=4, missing=(3,), timeout=5.0)
    assert text.splitlines()[0] == (
        "opwatch, the 3 of 4 ranks that reported: the first nan was made on rank 2 by aten.log.default at train.py:3 (forward); "
        "nan/inf was also made on rank 1; rank 0 received it through c10d.allreduce_.default at DDP bucket [fc.weight]."
    )
    assert "  rank 3 did not report within 5 s" in text
    only_received = render_combined_summary([_row(0, "inf", "c10d.allreduce_.default", "train.py:4", True, 1)], world=2)
    assert only_received.startswith("opwatch, all 2 ranks: inf received on rank 0 through c10d.allreduce_.default at train.py:4, and no rank made it")
    assert render_combined_summary([], world=2) == "opwatch, all 2 ranks: no anomalies."


def test_exchange_through_files_and_a_missing_rank(tmp_path, monkeypatch):
    monkeypatch.setenv(ranks.EXCHANGE_DIR_VARIABLE, str(tmp_path))
    with opwatch.watch(warn=False) as w:
        kept = torch.zeros(1).log()  # -inf, alive at the end: one anomaly
    payload = encode(w.anomalies, rank=1, world=3)
    for rank in (0, 1):
        ranks.Exchange.open(None, rank, 3, block=5).publish(payload if rank == 1 else encode([], rank=0, world=3))
    started = time.monotonic()
    found, missing = ranks.Exchange.open(None, 0, 3, block=5).collect(timeout=0.3)
    assert time.monotonic() - started < 2.0
    assert missing == [2] and set(found) == {1}
    (received,) = decode(found[1])
    assert (received.rank, received.kind, received.op, received.received, received.count) == (1, "inf", "aten.log.default", False, 1)
    assert received.message == w.anomalies[0].message
    rows = AllAnomalies([received], world=3, missing=missing, timeout=0.3)
    assert rows.summary().startswith("opwatch, the 2 of 3 ranks that reported: the first inf was made on rank 1 by aten.log.default")


def test_collective_handshakes_are_per_watch(monkeypatch):
    """Each watch numbers its collectives from 1 in keys of its own: a late entry of an earlier
    watch never answers a later one (rank 1 is played here by a second Handshakes)."""
    from opwatch.checks import collectives

    store = dist.HashStore()
    monkeypatch.setattr(collectives, "group_store", lambda: store)

    def call(shape):
        return {"op": "c10d.allreduce_", "tensors": [f"f32[{shape}] cpu"], "where": [None, None, None]}

    first = collectives.Handshakes()
    assert first.meet("0", 0, [0, 1], call(4), 0.05) == (1, {0: call(4)}, [1])  # rank 1 is late
    assert first.meet("7", 0, [0, 1], call(4), 0.05)[0] == 1  # counted per group
    peer = collectives.Handshakes()  # rank 1 reaches its first watch's collective now
    assert peer.meet("0", 1, [0, 1], call(6), 0.05) == (1, {1: call(6), 0: call(4)}, [])
    second = collectives.Handshakes()  # rank 0's next watch: rank 1's entry above is not its
    assert second.meet("0", 0, [0, 1], call(4), 0.05) == (1, {0: call(4)}, [1])
    assert (store.add(collectives.counter_key(0), 0), store.add(collectives.counter_key(1), 0)) == (2, 1)


def test_collective_mismatch_compares_plain_data():
    from opwatch.checks import collectives
    from opwatch.storage.codec import finding_fields, finding_from_fields

    def call(shape, line=3, op="c10d.allreduce_"):
        return {"op": op, "tensors": [f"f32[{shape}] cpu"], "where": [str(SCENARIOS / "train.py"), line, None]}

    saved = os.getcwd()
    os.chdir(SCENARIOS)  # where a call was made is shown relative to the working directory
    try:
        assert collectives.compare("c10d.allreduce_", 1, "0", {0: call(4), 1: call(4)}, [], 60.0) is None
        finding = collectives.compare("c10d.allreduce_", 1, "0", {0: call(4), 1: call(6), 2: call(4)}, [], 60.0)
        assert (finding.kind, finding.rule) == ("collective_mismatch", "collective.mismatch")
        _, second = finding.facts.calls
        assert second == collectives.CollectiveCall([1], "c10d.allreduce_", ["f32[6] cpu"], [call(6)["where"]])
        saved_finding = finding_from_fields(json.loads(json.dumps(finding_fields(finding))))
        assert saved_finding.facts == finding.facts and explain(saved_finding) == explain(finding)  # facts survive the export
        assert explain(finding)[0] == (
            "c10d.allreduce_ gets different tensors on the ranks of process group 0: "
            "ranks 0 and 2: c10d.allreduce_(f32[4] cpu) at train.py:3; rank 1: c10d.allreduce_(f32[6] cpu) at train.py:3"
        )
        late = collectives.compare("c10d.allreduce_", 7, "0", {0: call(4)}, [1], 5.0)
        assert (late.rule, late.facts["missing"], late.facts["number"]) == ("collective.late", [1], 7)
        assert explain(late)[0].startswith("rank 1 of process group 0 did not reach its collective #7 (c10d.allreduce_) within 5 s")
        other = collectives.compare("c10d.allreduce_", 2, "0", {0: call(2), 1: call(2, line=9, op="c10d.broadcast_")}, [], 5.0)
        assert other.rule == "collective.different_ops"
        assert explain(other)[0] == (
            "the ranks of process group 0 call different collectives as collective #2: "
            "rank 0: c10d.allreduce_(f32[2] cpu) at train.py:3; rank 1: c10d.broadcast_(f32[2] cpu) at train.py:9"
        )
        bucket = collectives.compare("c10d.allreduce_", 1, "0", {0: {**call(4), "where": [None, None, "DDP bucket [fc.weight]"]}, 1: call(6)}, [], 5.0)
        assert "rank 0: c10d.allreduce_(f32[4] cpu) at DDP bucket [fc.weight];" in explain(bucket)[0]
    finally:
        os.chdir(saved)
    metas = [((2, 3), torch.float32, torch.device("cpu"), 1), ((4,), torch.float16, torch.device("cpu"), 2)]
    assert collectives.compared("all", metas) == ["f32[2, 3] cpu", "f16[4] cpu"]
    assert collectives.compared("last", metas) == ["f16[4] cpu"]
    assert collectives.compared("dtypes", metas) == ["float32", "float16"]
    assert collectives.compared("nothing", metas) == []
