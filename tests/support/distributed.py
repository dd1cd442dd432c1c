"""Starting gloo ranks on 127.0.0.1 for a test, bounded: every rank's results, or a failed test
after ``timeout`` seconds (the ranks killed), never a hang.

A rank process may abort in C++ as it exits, after its work is done: ``terminate called without
an active exception`` (a thread still joinable when torch's distributed objects are torn down),
SIGABRT. Seen about once in ten full suites on two busy cores (in a ``torchrun`` job whose ranks
had printed everything, and in spawned ranks that had written their results), never in 155 runs
of the same jobs alone; torch leaves a ``Store`` of its own alive at exit with or without opwatch.
Such a run is run once more (:func:`run_ranks`, :func:`spawn`), with a warning: an abort that
comes again fails the test, as does any other failure.

Spawned ranks meet at a ``TCPStore`` the test's own process serves on a port the system picks
(:func:`rendezvous_store`), for as long as the ranks run: a port picked free, closed, and handed
to the ranks to bind could be taken in between by a rank of a test running beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings

import pytest

TEARDOWN_ABORT = "terminate called without an active exception"

from . import SCENARIOS


def rendezvous_store(timeout: float):
    """A ``TCPStore`` served by this process on 127.0.0.1, on a port the system picks (its
    ``port``): the ranks join it as clients (``scenarios/dist_cases.join_group``)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)


def run_ranks(command, **options) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **options)`` of a job that starts ranks (``torchrun``, a script
    that spawns them; ``capture_output`` and ``text`` on), run once more when a rank aborted at
    its teardown (see the module's doc)."""
    done = subprocess.run(command, **options)
    if done.returncode != 0 and TEARDOWN_ABORT in done.stderr:
        warnings.warn(f"a rank aborted at its teardown ({TEARDOWN_ABORT}); the job runs once more")
        done = subprocess.run(command, **options)
    return done


def spawn(worker, world: int, cases: list[str], out_dir, *, timeout: float = 120.0) -> list[dict]:
    """Run ``worker(rank, world, port, out_dir, cases)`` on ``world`` processes (spawned, in the
    scenarios folder), ``port`` that of the store they meet at (:func:`rendezvous_store`);
    every rank's ``out_dir/rank<r>.json``. Killed after ``timeout``. Run once
    more when a rank died of SIGABRT after every rank had written its results (its teardown)."""
    import torch.multiprocessing as mp

    try:
        return _spawn_once(mp, worker, world, cases, out_dir, timeout)
    except mp.ProcessExitedException as error:
        written = all((out_dir / f"rank{rank}.json").exists() for rank in range(world))
        if error.signal_name != "SIGABRT" or not written:
            raise
        warnings.warn(f"rank {error.error_index} aborted at its teardown (SIGABRT after every rank wrote its results); the ranks run once more")
        for rank in range(world):
            (out_dir / f"rank{rank}.json").unlink()
        return _spawn_once(mp, worker, world, cases, out_dir, timeout)


def _spawn_once(mp, worker, world, cases, out_dir, timeout) -> list[dict]:
    store = rendezvous_store(timeout)
    saved = os.getcwd()
    os.chdir(SCENARIOS)  # the children's paths in messages: relative to the scenarios folder
    try:
        context = mp.start_processes(worker, args=(world, store.port, str(out_dir), cases), nprocs=world, join=False, start_method="spawn")
    finally:
        os.chdir(saved)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks did not finish {cases} within {timeout:g} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]
