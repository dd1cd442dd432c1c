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

from support import SCENARIOS  # noqa: E402

import pytest
import torch

def pytest_collection_modifyitems(config, items):
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
