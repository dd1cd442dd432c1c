"""opwatch.guard in distributed jobs: one decision for every rank, and never a hang. DDP,
FSDP2 (fully_shard on a CPU mesh) and tensor parallel (Colwise/RowwiseParallel DTensors).

2 gloo ranks on 127.0.0.1 (support.distributed.spawn): process groups time out after 60 s, the
spawn after 180 s, the guard's own flag after 2 s in the ``silent`` case; a bug fails, never
hangs. The scenarios live in tests/scenarios/dist_guard.py (one process group runs every case).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from support import SCENARIOS, fsdp2_on_cpu
from support.distributed import spawn
from support.helpers import line_of

import dist_guard  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

CASES_FILE = str(SCENARIOS / "dist_cases.py")  # where the guarded step is written
NAN_LINE = line_of("# nan made here", CASES_FILE)
RUNS_FSDP2 = not fsdp2_on_cpu.args[0]
LAYOUTS = [pytest.param("fsdp2", marks=fsdp2_on_cpu), "ddp", "tp"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    # torch 2.6 cannot run FSDP2 on the CPU (support.fsdp2_on_cpu): one FSDP2 case failing would
    # fail every test of the group, so its FSDP2 cases are neither run nor tested there.
    fsdp2 = ["fsdp2_nan", "healthy_fsdp2", "fsdp2_shard"] if RUNS_FSDP2 else []
    cases = [*fsdp2, "ddp_nan", "tp_nan", "healthy_ddp", "healthy_tp", "elsewhere", "silent"]
    return spawn(dist_guard.worker, 2, cases, tmp_path_factory.mktemp("guard_ranks"), timeout=180.0)


@pytest.fixture(scope="module")
def one_rank_raises(tmp_path_factory):
    return spawn(dist_guard.worker, 2, ["raised"], tmp_path_factory.mktemp("guard_raised"), timeout=120.0)


@pytest.mark.parametrize("case", [pytest.param("fsdp2_nan", marks=fsdp2_on_cpu), "ddp_nan"])
def test_every_rank_raises_and_names_the_rank_that_made_it(two_ranks, case):
    zero, one = two_ranks[0][case]["raised"], two_ranks[1][case]["raised"]
    # Rank 1 made it: its own origin, at its line.
    assert one["type"] == "AnomalyError"
    assert one["message"].startswith(f"nan in aten.sqrt.default at dist_cases.py:{NAN_LINE} (forward, rank 1)")
    assert "\n  ranks:    this rank (rank 1) made it; every rank replayed this step" in one["message"]
    # Rank 0 received it through a collective, and its error names rank 1's op and line.
    assert zero["type"] == "AnomalyError" and zero["rank"] == 0
    assert "received through c10d." in zero["message"]
    assert f"\n  ranks:    rank 1 made it: nan in aten.sqrt.default at dist_cases.py:{NAN_LINE} (forward); every rank replayed this step" in zero["message"]


def test_tensor_parallel_every_rank_raises_and_names_the_rank_that_made_it(two_ranks):
    """Colwise/RowwiseParallel: the nan is made after the row-parallel all-reduce, on rank 1 only;
    rank 0's values stay finite, it replays with rank 1 and raises rank 1's anomaly."""
    zero, one = two_ranks[0]["tp_nan"]["raised"], two_ranks[1]["tp_nan"]["raised"]
    assert one["message"].startswith(f"nan in aten.sqrt.default at dist_cases.py:{NAN_LINE} (forward, rank 1)")
    assert zero["type"] == "AnomalyError" and (zero["rank"], zero["op"], zero["lineno"]) == (1, "aten.sqrt.default", NAN_LINE)
    assert zero["message"].startswith(
        f"opwatch.guard (rank 0): call 2 of _step failed on another rank: rank 1 made it: nan in aten.sqrt.default at dist_cases.py:{NAN_LINE} (forward)."
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_healthy_guarded_steps_are_unchanged(two_ranks, layout):
    for rank in (0, 1):
        assert two_ranks[rank][f"healthy_{layout}"] == {"same_losses": True, "same_params": True}, (rank, layout)


def test_ddp_a_nan_only_in_what_one_rank_returned_is_told_there_and_every_rank_goes_on_alike(two_ranks):
    """DDP's reduced gradients are the same on every rank and decide the step; a nan in one
    rank's returned metric is told by that rank, and no rank skips or raises (their weights
    never drift apart), with no collective of opwatch's on the way."""
    zero, one = two_ranks[0]["elsewhere"], two_ranks[1]["elsewhere"]
    for on_failure in ("raise", "skip"):
        for result in (zero[on_failure], one[on_failure]):
            assert result["raised"] is None and not result["returned_none"] and result["skipped"] == 0 and not result["grads_none"]
        assert any(text.startswith("opwatch.guard (rank 1): call 1 of _metric_step returned nan/inf on this rank, while the gradients "
                                   "DDP reduced across the ranks are finite") for text in one[on_failure]["warned"])
        assert zero[on_failure]["warned"] == []


@fsdp2_on_cpu
def test_fsdp2_a_nan_in_one_rank_s_shard_only_fails_every_rank(two_ranks):
    line = line_of("# nan in rank 1's shard only", str(SCENARIOS / "dist_guard.py"))
    zero, one = two_ranks[0]["fsdp2_shard"]["raised"], two_ranks[1]["fsdp2_shard"]["raised"]
    assert one["type"] == "AnomalyError" and one["message"].startswith(f"nan in aten.sqrt_.default at dist_guard.py:{line} (")
    assert zero["type"] == "AnomalyError" and (zero["rank"], zero["op"], zero["lineno"]) == (1, "aten.sqrt_.default", line)
    assert zero["message"].startswith(f"opwatch.guard (rank 0): call 1 of _shard_step failed on another rank: rank 1 made it: nan in aten.sqrt_.default at dist_guard.py:{line} (")


def test_a_rank_that_does_not_answer_is_named_instead_of_a_hang(two_ranks):
    raised = two_ranks[0]["silent"]["raised"]
    assert raised["type"] == "NoAnswer"
    assert raised["message"].startswith(
        "opwatch.guard (rank 0): rank 1 did not answer within 2 s: this rank waited at the failure flag of call 2 of silent.<locals>.<lambda>"
    )
    assert "rank 1 said nothing: crashed, hangs in a collective of its own, or ran a different number of guarded steps" in raised["message"]
    assert two_ranks[1]["silent"]["raised"] is None


RAISE_LINE = line_of("# rank 1 raises here", str(SCENARIOS / "dist_guard.py"))


def _check_raised(spawned, raising=1):
    results = [found["raised"] for found in spawned]  # the case
    one = results[raising]["raised"]
    assert one["type"] == "ValueError" and one["message"] == "a batch this rank cannot read"
    world = len(results)
    assert any(note.startswith(f"opwatch.guard (rank {raising}): this rank's step raised; every one of the {world} ranks stops at this step")
               for note in one["notes"])
    for rank, result in enumerate(results):
        assert result["grads_dropped"], rank  # a failing step's .grad are dropped, on every rank
        if rank == raising:
            continue
        raised = result["raised"]
        assert raised["type"] == "RaisedElsewhere", (rank, raised)
        assert raised["facts"] == [raising, "ValueError", f"dist_guard.py:{RAISE_LINE}", "a batch this rank cannot read"]
        assert raised["message"].startswith(
            f"opwatch.guard (rank {rank}): call 2 of raised.<locals>.step raised on another rank: rank {raising} raised ValueError "
            f"at dist_guard.py:{RAISE_LINE} (a batch this rank cannot read). Every rank stops at this step"
        )


def test_a_step_that_raised_on_one_rank_stops_every_rank_naming_it(one_rank_raises):
    """The raising rank takes part in the flag before re-raising: rank 0 raises RaisedElsewhere
    at once (no timeout, no NoAnswer), naming rank 1, its exception and its line."""
    _check_raised(one_rank_raises)


def test_three_ranks_a_step_that_raised_on_one_stops_the_other_two(tmp_path):
    _check_raised(spawn(dist_guard.worker, 3, ["raised"], tmp_path, timeout=120.0))


# -- the sentences, on plain facts ---------------------------------------------------------------


def test_the_ranks_line_names_the_origin_and_the_ranks_that_did_not_report():
    from opwatch.render import guard as words
    from opwatch.runners.guarded.ranks import Made, RankOrigin

    made = Made(3, "inf", "aten.exp.default", "train.py:9", "forward")
    assert words.ranks_text(RankOrigin(0, made, (), 30.0)) == (
        "rank 3 made it: inf in aten.exp.default at train.py:9 (forward); every rank replayed this step (the ranks decide each step's failure together)"
    )
    assert words.ranks_text(RankOrigin(3, made, (1, 2), 5.0)).startswith("this rank (rank 3) made it;")
    assert words.ranks_text(RankOrigin(3, made, (1, 2), 5.0)).endswith("; ranks 1, 2 did not report what their replays found within 5 s")
    assert words.ranks_text(RankOrigin(0, None, (1,), 5.0)).startswith("no rank's replay found where it was made;")


def test_no_answer_says_which_ranks_were_silent_and_where_the_others_were():
    from opwatch.render import guard as words

    here = {"call": 4, "name": "train_step", "waited": "flag", "detail": ""}
    text = words.no_answer(0, here, {2: {"call": 3, "name": "train_step", "waited": "flag", "detail": ""}}, [1, 3], None, "RuntimeError: timed out")
    assert text.startswith(
        "opwatch.guard (rank 0): ranks 1, 3 did not answer within the process group's timeout: this rank waited at the failure flag of call 4 of train_step"
    )
    assert "; rank 2 was at the failure flag of call 3 of train_step" in text
    assert "; ranks 1, 3 said nothing: crashed, hangs in a collective of its own, or ran a different number of guarded steps (RuntimeError: timed out)." in text
