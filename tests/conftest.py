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

@pytest.fixture(autouse=True)
def _chdir_to_scenarios(monkeypatch):
    # Paths in messages are shown relative to the working directory: keep them stable.
    monkeypatch.chdir(SCENARIOS)
    torch.manual_seed(0)
