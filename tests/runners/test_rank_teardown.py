"""support.distributed runs a job once more when a rank aborted at its teardown (SIGABRT with
C++'s ``terminate called without an active exception``, after its work: see that module), and
never any other failure: an abort that comes again fails, as does a plain error."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch.multiprocessing as mp

from support import SCENARIOS
from support.distributed import run_ranks, spawn

import dist_teardown  # noqa: E402

JOB = str(SCENARIOS / "dist_teardown.py")


def _job(tmp_path, case):
    return run_ranks([sys.executable, JOB, str(tmp_path), case], capture_output=True, text=True, timeout=60)


def test_a_job_that_aborted_at_its_teardown_runs_once_more(tmp_path):
    with pytest.warns(UserWarning, match="aborted at its teardown"):
        assert _job(tmp_path, "once").returncode == 0


def test_an_abort_that_comes_again_or_any_other_failure_stays_a_failure(tmp_path):
    with pytest.warns(UserWarning, match="aborted at its teardown"):
        assert _job(tmp_path, "always").returncode != 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = _job(tmp_path, "fails")
    assert done.returncode == 1 and "a plain failure" in done.stderr
    assert not caught  # not run again


def test_spawned_ranks_that_wrote_their_results_and_aborted_run_once_more(tmp_path):
    with pytest.warns(UserWarning, match="aborted at its teardown"):
        assert spawn(dist_teardown.worker, 2, ["once"], tmp_path, timeout=60.0) == [{"rank": 0}, {"rank": 1}]
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"), pytest.warns(UserWarning, match="aborted at its teardown"):
        spawn(dist_teardown.worker, 2, ["always"], again, timeout=60.0)
