"""Fixtures for every test, and the import path: ``support`` (the shared test package) and the
scenario programs of ``tests/scenarios`` import by name from any layer's folder."""


from __future__ import annotations

import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _path in (_TESTS / "scenarios", _TESTS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from support import SCENARIOS, compat_subset  # noqa: E402

import pytest
import torch

# pytest-xdist runs one worker a core, and each worker's torch would run one intra-op thread a
# core as well: the workers' threads then wait on each other (OpenMP spins). One thread a
# worker, and the processes the tests start (ranks, torchrun, pytest in pytest) inherit it; a
# value set outside is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ["OMP_NUM_THREADS"] == "1":
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # The compatibility subset (support/compat_subset.py) is marked here, from one list: the
    # tests of every check, mode and runner that .ci/run runs on the oldest and newest pairs.
    chosen = compat_subset.selectors()
    for item in items:
        if compat_subset.is_compat(item.nodeid, chosen):
            item.add_marker(pytest.mark.compat)
    # Tests marked ``thorough`` are slower variants of tests the README's command keeps
    # (another layout, on_failure or rank count): skipped there to keep it within its time on
    # two cores, run by .ci/run's thorough pass (OPWATCH_THOROUGH=1).
    if os.environ.get("OPWATCH_THOROUGH") != "1":
        later = pytest.mark.skip(reason="a slower variant: .ci/run's thorough pass runs it (OPWATCH_THOROUGH=1)")
        for item in items:
            if item.get_closest_marker("thorough") is not None:
                item.add_marker(later)
    # Tests marked ``cuda`` need a CUDA device: skipped here without one, run on a GPU machine
    # (bench/gpu_check.sh selects them with ``-m cuda``).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _chdir_to_scenarios(monkeypatch):
    # Paths in messages are shown relative to the working directory: keep them stable.
    monkeypatch.chdir(SCENARIOS)
    torch.manual_seed(0)
