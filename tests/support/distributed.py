"""Starting gloo ranks on 127.0.0.1 for a test, bounded: every rank's results, or a failed test
after ``timeout`` seconds (the ranks killed), never a hang."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from . import SCENARIOS


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn(worker, world: int, cases: list[str], out_dir, *, timeout: float = 120.0) -> list[dict]:
    """Run ``worker(rank, world, port, out_dir, cases)`` on ``world`` processes (spawned, in the
    scenarios folder); every rank's ``out_dir/rank<r>.json``. Killed after ``timeout``."""
    import torch.multiprocessing as mp

    saved = os.getcwd()
    os.chdir(SCENARIOS)  # the children's paths in messages: relative to the scenarios folder
    try:
        context = mp.start_processes(worker, args=(world, free_port(), str(out_dir), cases), nprocs=world, join=False, start_method="spawn")
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
