"""Fixtures for every test, and the import path: ``support`` (the shared test package) and the
scenario programs of ``tests/scenarios`` import by name from any layer's folder."""


from __future__ import annotations

import os
import shutil
import sys
import tempfile
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


# The repro folders a failing guard writes where no ``repro_dir`` is given land in tempfile's
# folder, as a user's do; the tests that check them read them there. The ones made while the
# suite ran are removed when it ends: in the controller, once every worker is done (a worker's
# own end could remove a folder another worker's test is still reading).
_REPRO_PREFIXES = ("opwatch-repro-", "opwatch-compiled-repro-")
_REPROS_BEFORE = pytest.StashKey[set]()


def _repro_folders() -> set:
    folder = tempfile.gettempdir()
    try:
        return {os.path.join(folder, name) for name in os.listdir(folder) if name.startswith(_REPRO_PREFIXES)}
    except OSError:
        return set()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_REPROS_BEFORE] = _repro_folders()


def pytest_sessionfinish(session, exitstatus):
    before = session.config.stash.get(_REPROS_BEFORE, None)
    if before is None:
        return
    for path in _repro_folders() - before:
        shutil.rmtree(path, ignore_errors=True)



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
