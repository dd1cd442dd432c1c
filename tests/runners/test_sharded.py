"""Sharded training, for real, on gloo: FSDP2 (``fully_shard``, a MixedPrecisionPolicy,
``reshard_after_forward`` both ways), DTensor tensor and sequence parallel, DDP; what the table
and the messages show of a DTensor; the finite checks on local shards, without a collective.

Every multi-process test is bounded: process groups time out after 60 s, the spawned ranks are
killed after 300 s (support.distributed.spawn), torchrun after 180 s. One process group of 2
ranks runs every 2-rank case (tests/scenarios/dist_sharded.py), one of 4 ranks one case; the
torchrun script is tests/scenarios/dist_sharded_script.py.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.distributed as dist

from opwatch.core.notation import Sharding, TensorMeta, format_meta, format_sharding
from opwatch.core.records import M_SHARDING, entry_inputs, entry_outputs
from opwatch.storage.codec import decode, encode, meta_fields, meta_from_fields

from support import SCENARIOS, assert_golden, fsdp2_on_cpu, needs_columns
from support.distributed import run_ranks, spawn
from support.helpers import line_of
import dist_sharded  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

CASES_FILE = str(SCENARIOS / "dist_sharded.py")
NAN_LINE = line_of("# nan made here", CASES_FILE)
BROADCAST_LINE = line_of("# broadcast here", CASES_FILE)
FSDP2_LAYOUTS = ("fsdp2_reshard", "fsdp2_keep")
# torch 2.6 cannot run FSDP2 on the CPU (support.fsdp2_on_cpu): its cases are neither run nor tested there.
RUNS_FSDP2 = not fsdp2_on_cpu.args[0]
LAYOUTS = [pytest.param(layout, marks=fsdp2_on_cpu) for layout in FSDP2_LAYOUTS] + ["tp", "sp", "ddp"]
RUN_LAYOUTS = [*(FSDP2_LAYOUTS if RUNS_FSDP2 else ()), "tp", "sp", "ddp"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One process group of 2 ranks running every 2-rank case (spawning costs seconds)."""
    cases = [*RUN_LAYOUTS, "dtensor_origin", *(("finite_local",) if RUNS_FSDP2 else ()), "tp_poisoned_weight"]  # finite_local runs FSDP2 too
    return spawn(dist_sharded.worker, 2, cases, tmp_path_factory.mktemp("sharded2"), timeout=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(dist_sharded.worker, 4, ["fsdp2_reshard"], tmp_path_factory.mktemp("sharded4"), timeout=300)


# -- healthy training: no false alarm from the sharding itself ----------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_healthy_training_gives_no_finding(two_ranks, layout):
    for rank, results in enumerate(two_ranks):
        result = results[layout]
        assert result["healthy"] == [], (rank, result["healthy"])
        assert result["healthy_ops"] > 50  # the watch saw the steps
        # Watched and guarded training gives the unwatched losses, bit for bit.
        assert result["same_losses"] and all(math.isfinite(loss) for loss in result["losses"])


@fsdp2_on_cpu
def test_the_table_shows_each_dtensor_s_shard_global_shape_and_placement(two_ranks):
    zero = two_ranks[0]
    # FSDP2: the optimizer step runs on the sharded parameters (dim 0 over 2 ranks).
    for layout in ("fsdp2_reshard", "fsdp2_keep"):
        assert "f32[8, 8] cpu (global [16, 8], Shard(0) on 2 ranks)" in zero[layout]["sharded"]  # up.weight
        assert "f32[4] cpu (global [8], Shard(0) on 2 ranks)" in zero[layout]["sharded"]  # down.bias
    # Tensor parallel: column- and row-wise weights, the replicated input, the partial sums.
    tp = zero["tp"]["sharded"]
    assert "f32[8, 8] cpu (global [16, 8], Shard(0) on 2 ranks)" in tp  # up.weight, column-wise
    assert "f32[8, 8] cpu (global [8, 16], Shard(1) on 2 ranks)" in tp  # down.weight, row-wise
    assert "f32[4, 4, 8] cpu (Replicate() on 2 ranks)" in tp
    assert "f32[16, 8] cpu (Partial(sum) on 2 ranks)" in tp
    # Sequence parallel: the norm's input sharded along the sequence.
    assert "f32[4, 4, 8] cpu (global [4, 8, 8], Shard(1) on 2 ranks)" in zero["sp"]["sharded"]
    # DDP: no DTensor, the notation of plain tensors only.
    assert zero["ddp"]["sharded"] == []


# -- planted bugs: named on the rank that made them ----------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_made_on_one_rank_is_named_there_and_received_on_the_other(two_ranks, layout):
    zero, one = two_ranks[0][layout], two_ranks[1][layout]
    assert one["nan"] == [["nan", "aten.sqrt.default", f"dist_sharded.py:{NAN_LINE}", "forward", False, 1]]
    # Rank 0 made nothing: every nan it saw came through a collective.
    assert zero["nan"] and all(kind == "nan" and received and rank == 0 for kind, _, _, _, received, rank in zero["nan"])
    assert "so another rank sent it" in zero["nan_summary"] and "first nan here" not in zero["nan_summary"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_guard_names_the_op_and_line_on_the_rank_that_made_it(two_ranks, layout):
    zero, one = two_ranks[0][layout]["guard_nan"], two_ranks[1][layout]["guard_nan"]
    assert (one["type"], one["rank"], one["op"], one["lineno"]) == ("AnomalyError", 1, "aten.sqrt.default", NAN_LINE)
    assert "ranks:    this rank (rank 1) made it" in one["message"]
    assert zero["type"] == "AnomalyError" and zero["rank"] == 0
    assert "nan received through" in zero["message"] and "first nan here" not in zero["message"]
    assert f"ranks:    rank 1 made it: nan in aten.sqrt.default at dist_sharded.py:{NAN_LINE} (forward)" in zero["message"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_broadcast_in_the_loss_is_named_on_every_rank(two_ranks, layout):
    for rank, results in enumerate(two_ranks):
        assert results[layout]["broadcast"] == [["broadcast", "aten.mean.default", f"dist_sharded.py:{BROADCAST_LINE}", "forward", False, rank]]
        (message,) = results[layout]["broadcast_messages"]
        assert "f32[4] cpu gets new leading dims and f32[4, 1] cpu" in message


@pytest.mark.thorough
@fsdp2_on_cpu
def test_four_ranks_name_the_last_rank_and_the_others_received(four_ranks):
    for rank, results in enumerate(four_ranks):
        result = results["fsdp2_reshard"]
        assert result["healthy"] == [] and result["same_losses"]
        assert "f32[4, 8] cpu (global [16, 8], Shard(0) on 4 ranks)" in result["sharded"]
        if rank == 3:
            assert result["nan"] == [["nan", "aten.sqrt.default", f"dist_sharded.py:{NAN_LINE}", "forward", False, 3]]
            assert (result["guard_nan"]["op"], result["guard_nan"]["lineno"]) == ("aten.sqrt.default", NAN_LINE)
        else:
            assert result["nan"] and all(received for *_, received, _ in result["nan"])
            assert f"rank 3 made it: nan in aten.sqrt.default at dist_sharded.py:{NAN_LINE}" in result["guard_nan"]["message"]


# -- what the table and the messages show of a DTensor -----------------------------------------


@needs_columns
def test_a_dtensor_weight_holding_nan_before_the_watch_is_that_rank_s_weights(two_ranks):
    """A tensor-parallel weight's shard poisoned before the watch (on the last rank): read
    through its local shard when an op first reads it; that rank's origin is the weight, not
    "made nan from finite inputs"; the other rank received it."""
    last = two_ranks[-1]["tp_poisoned_weight"]
    assert last["anomalies"], last
    kind, op, where, phase, received, rank = last["anomalies"][0]
    assert kind == "nan" and not received and rank == 1 and phase == "forward", last["anomalies"]
    assert last["causes"][0] == "weights", last["messages"][0]
    assert "from finite inputs" not in last["messages"][0]
    first = two_ranks[0]["tp_poisoned_weight"]
    assert first["anomalies"] and all(received for *_, received, _ in first["anomalies"]), first["anomalies"]


def _has_wrap_op() -> bool:
    if not dist.is_available():
        return False
    import torch.distributed._functional_collectives  # noqa: F401  (defines the wrap op, where torch has it)

    return hasattr(torch.ops._c10d_functional, "_wrap_tensor_autograd")


@needs_columns  # its code column shows each op's sub-expression
@pytest.mark.skipif(
    not _has_wrap_op(),
    reason=f"the golden lists the ops torch 2.13 runs: torch {torch.__version__} has no _c10d_functional._wrap_tensor_autograd op "
    "(full_tensor()'s AsyncCollectiveTensor is made in Python), so its table has one row fewer",
)
def test_table_golden_with_dtensors(two_ranks):
    assert_golden("table_dtensor.txt", two_ranks[0]["dtensor_origin"]["table"] + "\n")


@needs_columns
def test_message_golden_of_an_origin_on_dtensors(two_ranks):
    (message,) = two_ranks[1]["dtensor_origin"]["messages"]
    assert_golden("message_dtensor_origin.txt", message + "\n")


def test_an_origin_on_dtensors_is_named_in_its_shard_and_received_elsewhere(two_ranks):
    zero, one = two_ranks[0]["dtensor_origin"], two_ranks[1]["dtensor_origin"]
    line = line_of("# nan in the last rank's shard", CASES_FILE)
    assert one["anomalies"] == [["nan", "aten.sqrt.default", f"dist_sharded.py:{line}", "forward", False, 1]]
    (message,) = one["messages"]
    assert "aten.sqrt(f32[4, 8] cpu (global [4, 16], Shard(1) on 2 ranks)) -> f32[4, 8] cpu (global [4, 16], Shard(1) on 2 ranks)" in message
    assert zero["anomalies"] == [["nan", "_c10d_functional.all_reduce.default", f"dist_sharded.py:{line + 1}", "forward", True, 0]]


def test_a_saved_log_renders_dtensors_byte_equal(two_ranks):
    for results in two_ranks:
        result = results["dtensor_origin"]
        assert result["saved_table_same"] and result["saved_messages_same"]
        assert result["saved_sharding"] == [["f32[4, 8] cpu (global [4, 16], Shard(1) on 2 ranks)"]]


# -- the finite checks read local shards, no collective ------------------------------------------


@fsdp2_on_cpu
@pytest.mark.parametrize("layout", ["fsdp2_reshard", "tp"])
def test_finite_checks_read_local_shards_without_a_collective(two_ranks, layout):
    for rank, results in enumerate(two_ranks):
        result = results["finite_local"][layout]
        assert result["dtensor_grads"] >= 4
        assert result["collectives"] == []  # FusedFiniteCheck, finite_by_device, guard's check
        assert result["control"]  # the counter does see a DTensor's collective
        assert result["checks"]["healthy"] == [True, True, True]
        # The nan is in rank 1's shard: rank 1 finds it, rank 0's shard is finite.
        assert result["checks"]["nan"] == ([False, False, False] if rank == 1 else [True, True, True])


# -- torchrun -m opwatch --guard on an FSDP2 script ----------------------------------------------


def _torchrun_guard(**env):
    import os

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "opwatch", "--guard", "dist_sharded_script.py"]
    return run_ranks(command, cwd=SCENARIOS, capture_output=True, text=True, timeout=180, env={**os.environ, **env})


@fsdp2_on_cpu
def test_torchrun_guard_on_healthy_fsdp2_exits_0_with_no_finding():
    result = _torchrun_guard()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "opwatch (rank 0): no anomalies." in result.stderr and "opwatch (rank 1): no anomalies." in result.stderr
    assert "opwatch, all 2 ranks: no anomalies." in result.stderr
    assert "OpwatchWarning" not in result.stderr
    assert result.stderr.count("5 optimizer steps ran") == 2 and "0 failed" in result.stderr


@fsdp2_on_cpu  # the script trains with FSDP2
def test_torchrun_guard_names_a_nan_made_on_rank_1():
    result = _torchrun_guard(NAN_RANK="1")
    assert result.returncode == 0, result.stderr[-3000:]  # skipped steps, as GradScaler skips
    line = line_of("# nan made here", str(SCENARIOS / "dist_sharded_script.py"))
    assert f"nan in aten.sqrt.default at dist_sharded_script.py:{line} (forward, rank 1)" in result.stderr
    assert f"opwatch, all 2 ranks: the first nan was made on rank 1 by aten.sqrt.default at dist_sharded_script.py:{line} (forward); rank 0 received it through c10d._reduce_scatter_base_.default" in result.stderr


# -- the notation and the codec, in one process -------------------------------------------------


def test_the_notation_of_a_dtensor():
    shard = ((8, 16), (("shard", 0),), (2,), 1234)  # as the log stores it: plain tuples
    meta = ((16, 16), torch.float32, torch.device("cpu"), 1, shard)
    assert format_meta(meta) == "f32[8, 16] cpu (global [16, 16], Shard(0) on 2 ranks)"
    # The shard is the whole tensor: no global shape.
    assert format_meta(((16,), torch.bfloat16, torch.device("cpu"), 1, ((16,), (("replicate",),), (2,), 5))) == "bf16[16] cpu (Replicate() on 2 ranks)"
    assert format_meta(((3, 4), torch.float32, torch.device("cpu"), 1, ((3, 4), (("partial", "sum"),), (4,), 5))) == "f32[3, 4] cpu (Partial(sum) on 4 ranks)"
    # Two mesh dimensions (FSDP x tensor parallel), a strided shard, a placement opwatch does not know.
    assert format_sharding((("shard", 0), ("replicate",)), (2, 2)) == "[Shard(0), Replicate()] on 2x2 ranks"
    assert format_sharding((("strided_shard", 0, 2),), (4,)) == "_StridedShard(0, 2) on 4 ranks"
    assert format_sharding((("MyPlacement",),), (2,)) == "MyPlacement() on 2 ranks"
    # A plain tensor's four items: as ever.
    assert format_meta(((4, 1), torch.float32, torch.device("cpu"), 1)) == "f32[4, 1] cpu"
    assert str(TensorMeta((4, 1), torch.float32, torch.device("cpu"))) == "f32[4, 1] cpu"


def test_the_codec_keeps_a_dtensor_s_facts_and_reads_old_logs():
    sharding = Sharding((8, 16), (("shard", 0),), (2,), 77)
    meta = TensorMeta((16, 16), torch.float32, torch.device("cpu"), 5, sharding)
    fields = json.loads(json.dumps(meta_fields(meta)))
    assert fields["sharding"] == [[8, 16], [["shard", 0]], [2], 77]
    again = meta_from_fields(fields)
    assert again == meta and type(again.sharding) is Sharding and str(again) == str(meta)
    # In a finding's facts: tagged, read back as the same classes.
    decoded = decode(json.loads(json.dumps(encode(meta))))
    assert decoded == meta and type(decoded) is TensorMeta and type(decoded.sharding) is Sharding
    # A plain tensor's metadata is written as before DTensors were recorded, and old logs load.
    plain = TensorMeta((4,), torch.float32, torch.device("cpu"), 3)
    assert "sharding" not in meta_fields(plain)
    assert encode(plain) == {"meta": [[4], {"dtype": "float32"}, {"device": "cpu"}, 3]}
    assert decode({"meta": [[4], {"dtype": "float32"}, {"device": "cpu"}, 3]}) == plain
    assert meta_from_fields({"shape": [4], "dtype": "float32", "device": "cpu", "ident": 3}) == plain


def test_plain_ops_record_four_items_per_tensor():
    import opwatch

    with opwatch.watch(warn=False) as w:
        (torch.ones(2, 3) * 2).sum()
    assert all(meta.sharding is None for record in w.records for meta in (*record.inputs, *(record.outputs or ())))
    entries = w._log.entries
    assert entries and all(len(meta) == M_SHARDING for entry in entries for meta in (*entry_inputs(entry), *(entry_outputs(entry) or ())))
