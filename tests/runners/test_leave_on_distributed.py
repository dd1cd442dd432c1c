"""Leave-on (``python -m opwatch --guard``) across ranks: every rank decides each optimizer step
together, applies the same ``on_failure``, and names the rank that made the nan/inf.

torchrun, 2 gloo ranks on 127.0.0.1, tests/scenarios/dist_leave_on.py (no DDP: the gradients are
each rank's own; one all-reduce a step). Bounded: the process group times out after 30 s, the
subprocess after 120 s; a bug fails, never hangs.
"""

from __future__ import annotations

import os
import time
import sys

import pytest
import torch.distributed as dist

from support import SCENARIOS
from support.distributed import run_ranks
from support.helpers import line_of

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")

LINE = line_of("# nan on the last rank", str(SCENARIOS / "dist_leave_on.py"))


def _torchrun(*options, nan_steps="3,4", ranks=2):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "opwatch", "--guard",
               *options, "dist_leave_on.py"]
    environment = {**os.environ, "NAN_STEPS": nan_steps, "OMP_NUM_THREADS": "1"}
    return run_ranks(command, cwd=SCENARIOS, capture_output=True, text=True, timeout=120, env=environment)


def test_skip_every_rank_skips_the_same_steps_and_names_rank_1():
    result = _torchrun()
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stderr
    # Step 3: rank 1's gradients hold nan, rank 0's are finite; both skip and re-check step 4.
    assert "opwatch (rank 1): optimizer step 3: the gradients about to be applied hold nan/inf: 0.weight (nan)" in text
    assert ("opwatch (rank 0): optimizer step 3: the gradients about to be applied hold nan/inf on rank 1 (this rank's were finite; "
            "the ranks decide each optimizer step together). The optimizer step did not run (skipped") in text
    # Step 4, watched on every rank: each names rank 1's op and line.
    assert f"opwatch (rank 1): the failure of step 3 recurred at step 4: nan first made by aten.sqrt.default at dist_leave_on.py:{LINE} (forward)." in text
    assert f"opwatch (rank 0): the failure of step 3 recurred at step 4: nan first made by aten.sqrt.default at dist_leave_on.py:{LINE} (forward) on rank 1." in text
    # The same counts on both ranks; both reached the end with finite weights.
    assert text.count("opwatch guard: 5 optimizer steps ran, 2 audited under a full watch, 2 failed (nan/inf in the gradients), 2 of them skipped.") == 2
    assert "rank 0: weights finite: True" in result.stdout and "rank 1: weights finite: True" in result.stdout


@pytest.mark.thorough
def test_raise_every_rank_raises_at_the_same_step_naming_rank_1():
    """Deciding per rank, rank 0 went on and waited in the next all-reduce for rank 1 that had
    raised (the process group's timeout); now both raise at step 4."""
    result = _torchrun("--on-failure", "raise")
    assert result.returncode != 0
    text = result.stderr
    assert f"[rank1]: opwatch.findings.anomaly.AnomalyError: nan in aten.sqrt.default at dist_leave_on.py:{LINE} (forward, rank 1)" in text
    assert ("[rank0]: opwatch.findings.anomaly.AnomalyError: opwatch (rank 0): optimizer step 4 failed on every rank (the ranks decide "
            f"each optimizer step together): rank 1 made it: nan in aten.sqrt.default at dist_leave_on.py:{LINE} (forward); "
            "this rank's gradients were finite.") in text
    assert text.count("opwatch guard: 4 optimizer steps ran, 2 audited under a full watch, 2 failed (nan/inf in the gradients), 2 of them skipped.") == 2
    assert "Timeout" not in text and "timed out" not in text


@pytest.mark.thorough
def test_three_ranks_the_two_healthy_ones_skip_with_the_last():
    result = _torchrun(ranks=3)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"opwatch (rank {rank}): optimizer step 3: the gradients about to be applied hold nan/inf on rank 2 (this rank's were finite" in result.stderr
        assert (f"opwatch (rank {rank}): the failure of step 3 recurred at step 4: nan first made by aten.sqrt.default at "
                f"dist_leave_on.py:{LINE} (forward) on rank 2.") in result.stderr
    assert result.stderr.count("2 failed (nan/inf in the gradients), 2 of them skipped.") == 3


def test_a_healthy_run_fails_no_step():
    result = _torchrun("--on-failure", "raise", nan_steps="")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OpwatchWarning" not in result.stderr
    assert result.stderr.count("opwatch guard: 5 optimizer steps ran, 1 audited under a full watch, 0 failed.") == 2


# -- a trainer's guard mode: Lightning's OpwatchCallback(mode="guard") on 2 DDP ranks ------------

PL_LINE = line_of("# nan on rank 1, batch 3", str(SCENARIOS / "dist_lightning_guard.py"))


def _lightning(on_failure):
    pytest.importorskip("lightning")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "dist_lightning_guard.py", ".", on_failure]
    return run_ranks(command, cwd=SCENARIOS, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_lightning_guard_every_rank_replays_the_batch_and_names_rank_1():
    """Both ranks replay batch 3 together; rank 0's replay made nothing (Lightning's replay runs
    the module's training_step, not DDP's forward), and its warning names rank 1's op and line."""
    result = _lightning("skip")
    assert result.returncode == 0, result.stderr[-3000:]
    made = f"Its batch ran again from its start (RNG states and buffers restored, .grad cleared) under a full watch: nan first made by aten.sqrt.default at dist_lightning_guard.py:{PL_LINE} (forward)"
    assert f"opwatch (rank 1): optimizer step 3: the gradients about to be applied hold nan/inf: net.0.weight (nan)" in result.stderr
    assert made + "." in result.stderr and made + " on rank 1." in result.stderr
    assert "rank 0: steps 5 failed 1 skipped 1" in result.stdout and "rank 1: steps 5 failed 1 skipped 1" in result.stdout


@pytest.mark.thorough
def test_lightning_guard_raise_every_rank_raises_naming_rank_1():
    result = _lightning("raise")
    assert result.returncode != 0
    assert f"[rank1]: opwatch.findings.anomaly.AnomalyError: nan in aten.sqrt.default at dist_lightning_guard.py:{PL_LINE} (forward, rank 1)" in result.stderr
    assert ("[rank0]: opwatch.findings.anomaly.AnomalyError: opwatch (rank 0): optimizer step 3 failed on every rank (the ranks decide each "
            f"optimizer step together): rank 1 made it: nan in aten.sqrt.default at dist_lightning_guard.py:{PL_LINE} (forward)") in result.stderr


@pytest.mark.thorough
def test_a_rank_that_never_comes_to_the_check_is_named_within_the_timeout():
    """Rank 1 leaves the loop before step 2: rank 0 waits at the check of step 2 at most
    OPWATCH_COLLECTIVE_TIMEOUT=2 s (then 5 s for where the others are), and names rank 1."""
    started = time.monotonic()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "opwatch", "--guard", "dist_leave_on.py"]
    environment = {**os.environ, "NAN_STEPS": "", "STOP_AT": "2", "OPWATCH_COLLECTIVE_TIMEOUT": "2", "OMP_NUM_THREADS": "1"}
    result = run_ranks(command, cwd=SCENARIOS, capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode != 0
    assert ("[rank0]: opwatch.runners.guarded.ranks.NoAnswer: opwatch.guard (rank 0): rank 1 did not answer within 2 s: this rank waited "
            "at the check of the gradients before optimizer step 2 (every rank decides each optimizer step together); rank 1 said nothing") in result.stderr
    assert time.monotonic() - started < 60


@pytest.mark.thorough
def test_apply_every_rank_applies_and_knows_the_weights_hold_nan_on_rank_1():
    """on_failure="apply": rank 1's weights take the nan, rank 0's stay finite; both say the
    weights hold nan/inf since step 3 and count the same failures (no rank re-checks alone)."""
    result = _torchrun("--on-failure", "apply")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "opwatch (rank 1): the weights hold nan since optimizer step 3: 0.weight (nan)" in result.stderr
    assert "opwatch (rank 0): the weights hold nan/inf on another rank since optimizer step 3 (this rank's are finite;" in result.stderr
    assert result.stderr.count("opwatch guard: 5 optimizer steps ran, 1 audited under a full watch, 3 failed (nan/inf in the gradients: 1; the weights already held nan/inf: 2).") == 2
    assert "rank 0: weights finite: True" in result.stdout and "rank 1: weights finite: False" in result.stdout


# -- a bad batch on one rank: tests/scenarios/dist_bad_batch.py -----------------------------------

BATCH_LINE = line_of("# the model is fed", str(SCENARIOS / "dist_bad_batch.py"))


def _bad_batch(*options, ranks=2, **environment):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "opwatch", "--guard",
               *options, "dist_bad_batch.py"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **environment}
    return run_ranks(command, cwd=SCENARIOS, capture_output=True, text=True, timeout=120, env=environment)


def test_ddp_a_bad_batch_on_rank_1_is_named_on_every_rank(tmp_path):
    """DDP reduces rank 1's nan into every rank's gradients. Each rank's batch check used to be
    skipped in a job (each rank's batch differs; the ranks decide together): both ranks said
    "nan/inf in the gradients", then "did not recur", and the combined summary "no anomalies".
    Now rank 1's finding travels with the decision, and both ranks name its batch and line."""
    from opwatch.storage.jsonl import load

    result = _bad_batch("--jsonl", str(tmp_path / "run.jsonl"))
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stderr
    fed = f"Sequential's argument 0 (f32[8, 8] cpu) held nan when it entered the model at dist_bad_batch.py:{BATCH_LINE}, so no op of the model made them"
    assert ("opwatch (rank 1): optimizer step 4: the gradients about to be applied hold nan/inf: module.0.weight (nan), module.0.bias (nan), "
            f"module.2.weight (nan), module.2.bias (nan). cause: input: this rank's batch held nan before the model ran: {fed}") in text, text[-4000:]
    assert f"opwatch (rank 0): optimizer step 4: the gradients about to be applied hold nan/inf: module.0.weight (nan)" in text
    assert f"cause: input: rank 1's batch held nan before the model ran: {fed}" in text
    assert text.count("the weights and the buffers its forward wrote are as they were. Every rank does the same.") == 2
    # The re-check of step 5 reads step 4's loss (cloned and all-reduced for the log): that
    # step's leftovers, not a recurrence, on either rank.
    assert "recur" not in text and "anomal" not in text, text[-4000:]
    assert text.count("opwatch guard: 6 optimizer steps ran, 2 audited under a full watch, 1 failed (the batch held nan/inf), 1 of them skipped.") == 2
    assert ("opwatch, all 2 ranks: no op was named in the fully watched steps, but 1 optimizer step failed (see the guard's line above).") in text
    assert "rank 0: weights finite: True" in result.stdout and "rank 1: weights finite: True" in result.stdout
    for log in ("run.jsonl", "run.rank1.jsonl"):  # every rank's ledger keeps rank 1's batch
        (row,) = load(tmp_path / log).guard["failures"]
        assert row["cause"] == "input" and row["batch"]["rank"] == 1 and row["batch"]["where"] == f"dist_bad_batch.py:{BATCH_LINE}", row


@pytest.mark.thorough
def test_fsdp2_a_bad_batch_on_rank_1_is_named_as_the_program_fed_it():
    """FSDP2 with bfloat16 parameters: its pre-forward hook casts the batch to bfloat16, and
    fully_shard renames the model's class FSDPSequential. The batch is named as the program
    fed it (float32), and the model by its own class, on every rank."""
    result = _bad_batch(FSDP="1")
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stderr
    fed = f"Sequential's argument 0 (f32[8, 8] cpu) held nan when it entered the model at dist_bad_batch.py:{BATCH_LINE}"
    assert f"opwatch (rank 1): optimizer step 4: the gradients about to be applied hold nan/inf" in text, text[-4000:]
    assert f"cause: input: this rank's batch held nan before the model ran: {fed}" in text
    assert f"cause: input: rank 1's batch held nan before the model ran: {fed}" in text
    assert "FSDPSequential" not in text and "bf16[8, 8]" not in text
    assert text.count("1 failed (the batch held nan/inf), 1 of them skipped.") == 2
    assert "rank 0: weights finite: True" in result.stdout and "rank 1: weights finite: True" in result.stdout


@pytest.mark.thorough
def test_own_gradients_bad_micro_batches_on_two_of_three_ranks_are_named_on_the_third():
    result = _bad_batch(ranks=3, DDP="0", BAD_RANKS="1,2", MICRO="2")
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stderr
    assert ("opwatch (rank 0): optimizer step 4: the gradients about to be applied hold nan/inf on ranks 1, 2 (this rank's were finite; the "
            "ranks decide each optimizer step together). cause: input: rank 1's batch held nan before the model ran (also the batch of rank 2): "
            f"Sequential's argument 0 (f32[8, 8] cpu) held nan when it entered the model at dist_bad_batch.py:{BATCH_LINE} (call 1 of the 2 the "
            "model ran since the last optimizer step)") in text, text[-4000:]
    assert "opwatch (rank 2): optimizer step 4: the gradients about to be applied hold nan/inf: 0.weight (nan)" in text
    assert "cause: input: this rank's batch held nan before the model ran (also the batch of rank 2)" in text
    assert text.count("1 failed (the batch held nan/inf), 1 of them skipped.") == 3


@pytest.mark.thorough
def test_ddp_raise_every_rank_raises_naming_rank_1_s_batch():
    result = _bad_batch("--on-failure", "raise")
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"[rank{rank}]: opwatch.runners.policy.outcomes.GradientsNotFinite: opwatch (rank {rank}): optimizer step 4:" in result.stderr, result.stderr[-4000:]
    assert "cause: input: rank 1's batch held nan before the model ran" in result.stderr
    assert "The optimizer did not run on them. Every rank does the same." in result.stderr


def test_ddp_a_nan_torch_makes_on_rank_1_every_third_step_is_named_at_its_turn_on_every_rank():
    """Rank 1's loss takes the square root of a negative at steps 3, 6, 9 and 12. The step
    after each failure passes its re-check; the ranks agree on the interval, watch step 9 together
    and name rank 1's op and line on both."""
    result = _bad_batch(OP_NAN="1", EVERY="3")
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stderr
    line = line_of(".sqrt().mean()", str(SCENARIOS / "dist_bad_batch.py"))
    for rank, where in ((0, " on rank 1"), (1, "")):
        assert f"opwatch (rank {rank}): the failure of step 3 did not recur: step 4 ran under a full watch" in text, text[-4000:]
        assert (f"opwatch (rank {rank}): the failure of steps 3 and 6 recurred at step 9, its next turn (every 3 steps, watched "
                f"fully): nan first made by aten.sqrt.default at dist_bad_batch.py:{line} (forward){where}.") in text, text[-4000:]
    assert text.count("opwatch guard: 12 optimizer steps ran, 4 audited under a full watch, 4 failed") == 2, text[-4000:]
    assert "rank 0: weights finite: True" in result.stdout and "rank 1: weights finite: True" in result.stdout


def test_ddp_a_nan_torch_made_on_rank_1_blames_no_batch():
    """Rank 1's loss takes the square root of a negative at step 4: every rank's batch was
    finite, so no rank names one; the re-check of step 5 finds it did not recur (the log's
    all-reduce of step 4's loss is that step's leftover)."""
    result = _bad_batch(OP_NAN="1")
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stderr
    assert "cause: input" not in text and "batch held" not in text, text[-4000:]
    for rank in (0, 1):
        assert f"opwatch (rank {rank}): the failure of step 4 did not recur: step 5 ran under a full watch and its gradients were finite." in text
    assert text.count("1 failed (nan/inf in the gradients), 1 of them skipped.") == 2


@pytest.mark.thorough
def test_ddp_healthy_batches_fail_no_step():
    result = _bad_batch(BAD_RANKS="")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OpwatchWarning" not in result.stderr
    assert result.stderr.count("opwatch guard: 6 optimizer steps ran, 1 audited under a full watch, 0 failed.") == 2


@pytest.mark.thorough
@pytest.mark.parametrize("clean", [False, True], ids=["corrupted", "clean"])
def test_an_evaluation_nan_on_rank_1_is_in_the_combined_summary(clean):
    """Each rank checks its own evaluations and tells what it finds; the combined summary on rank 0
    read rank 0's ledger alone and said "all 2 ranks: no anomalies." beside rank 1's evaluation
    nan. Every rank's count reaches it at the run's end (the program destroyed its group: the
    store is the one held since the first step)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "opwatch", "--guard",
               "dist_evaluation.py"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **({"CLEAN": "1"} if clean else {})}
    result = run_ranks(command, cwd=SCENARIOS, capture_output=True, text=True, timeout=120, env=environment)
    text = result.stderr
    assert result.returncode == 0, text[-3000:]
    if clean:
        assert "opwatch, all 2 ranks: no anomalies." in text and "gradients off" not in text, text[-3000:]
        return
    line = line_of("# THE EVALUATION", str(SCENARIOS / "dist_evaluation.py"))
    assert (f"opwatch (rank 1): a call of Sequential with gradients off (an evaluation) at dist_evaluation.py:{line}, after optimizer step 4, "
            "returned nan") in text, text[-3000:]
    assert ("opwatch, all 2 ranks: no anomalies in the fully watched steps, but 1 call with gradients off (evaluations) returned nan "
            "(see the guard's line above).") in text, text[-3000:]


@pytest.mark.thorough
@pytest.mark.parametrize("target", ["wide", "right"])
def test_ddp_gan_audits_the_generator_s_path_on_every_rank(target):
    """The run's audit ends at the discriminator's first step; the generator's first step arms
    one on every rank alike (the arming follows the order of optimizer steps, the same on every
    rank), which names its loss's broadcast on both. Healthy: 3 of 12 steps audited on each."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "opwatch", "--guard", "dist_gan.py"]
    result = run_ranks(command, cwd=SCENARIOS, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "TARGET": target})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0: done" in result.stdout and "rank 1: done" in result.stdout
    text = result.stderr
    assert text.count("opwatch guard: 12 optimizer steps ran, 3 audited under a full watch, 0 failed.") == 2, text[-3000:]
    line = line_of("# the generator's loss", str(SCENARIOS / "dist_gan.py"))
    named = f"broadcast in aten.sub.Tensor at dist_gan.py:{line} (forward, rank "
    assert (named in text) == (target == "wide"), text[-3000:]


@pytest.mark.parametrize("bad_rank", [pytest.param(1, id="rank 1's batch"), pytest.param(-1, id="healthy", marks=pytest.mark.thorough)])
def test_ddp_float16_a_bad_batch_s_nan_loss_is_counted_alike_on_every_rank(bad_rank):
    """One corrupt sample in rank 1's batch: its loss is nan, DDP's all-reduce carries the nan
    into rank 0's gradients too, and GradScaler skips the step on both. Rank 1 tells it with its
    batch; both ranks count it as a skip on a loss not finite (one all-reduce at that skipped step),
    so that the job's summary does not say "no anomalies" nor call it an overflow."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "opwatch", "--guard",
               "dist_fp16_bad_batch.py"]
    result = run_ranks(command, cwd=SCENARIOS, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "BAD_RANK": str(bad_rank)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0: weights finite: True" in result.stdout and "rank 1: weights finite: True" in result.stdout
    text = result.stderr
    if bad_rank < 0:
        assert text.count("opwatch guard: 12 optimizer steps ran, 1 audited under a full watch, 0 failed.") == 2, text[-3000:]
        assert "opwatch, all 2 ranks: no anomalies." in text and "GradScaler skipped" not in text
        return
    assert text.count("opwatch guard: 11 optimizer steps ran, 1 audited under a full watch, 0 failed; GradScaler skipped 1 more (the "
                      "loss was not finite before it was scaled).") == 2, text[-3000:]
    told = "GradScaler skipped the optimizer step after optimizer step 6: the loss backward() ran on held nan before GradScaler scaled it"
    assert text.count(told) == 1 and f"opwatch (rank 1): {told}" in text
    assert "cause: input: Sequential's argument 0 (f32[32, 16] cpu) held nan when it entered the model" in text
    assert ("opwatch, all 2 ranks: no op was named in the fully watched steps, but GradScaler skipped 1 optimizer step on a loss that "
            "was not finite before it was scaled") in text
    assert "no anomalies" not in text and "overflows" not in text


def test_ddp_float16_a_nan_loss_made_by_an_op_names_torchrun_s_command_and_it_names_the_op():
    """Every sample of rank 1's batch dropped by a mask (0/0): its batch was finite, so the rank
    names the command that runs the step under a full watch, as torchrun launched the job (the
    script needs the job: ``python -m opwatch`` would not set up its process group). That
    command names the division."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "opwatch"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BAD_RANK": "1", "BAD": "mask"}
    result = run_ranks([*launch, "--guard", "dist_fp16_bad_batch.py"], cwd=SCENARIOS, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("opwatch (rank 1): GradScaler skipped the optimizer step after optimizer step 6: the loss backward() ran on held nan before "
            "GradScaler scaled it") in result.stderr
    assert ("the batch was finite when it entered the model, so an op of the step made it; to name the op that made it, run the step "
            "where it fails under a full watch: torchrun --nproc-per-node 2 -m opwatch dist_fp16_bad_batch.py (with the same seeds and "
            "data order)") in result.stderr, result.stderr[-3000:]
    watched = run_ranks([*launch, "dist_fp16_bad_batch.py"], cwd=SCENARIOS, capture_output=True, text=True, timeout=180, env=env)
    assert watched.returncode == 0, watched.stderr[-3000:]
    line = line_of("# the mean over the samples kept", str(SCENARIOS / "dist_fp16_bad_batch.py"))
    assert f"nan in aten.div.Tensor at dist_fp16_bad_batch.py:{line} (forward, rank 1)" in watched.stderr, watched.stderr[-3000:]
