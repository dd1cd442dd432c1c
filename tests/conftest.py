"""Shared test helpers: golden files and a counting dispatch mode.

Goldens: ``OPWATCH_UPDATE_GOLDENS=1 pytest`` rewrites every golden file from the current output
instead of comparing; review the diff before committing it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

GOLDENS = Path(__file__).parent / "goldens"
SCENARIOS = Path(__file__).parent / "scenarios"
UPDATE_GOLDENS = os.environ.get("OPWATCH_UPDATE_GOLDENS") == "1"

# Column carets come from co_positions (3.11+); goldens are written on 3.11+.
needs_columns = pytest.mark.skipif(sys.version_info < (3, 11), reason="goldens show 3.11+ column positions")


def assert_golden(name: str, text: str) -> None:
    path = GOLDENS / name
    if UPDATE_GOLDENS:
        path.write_text(text)
        return
    assert path.exists(), f"missing golden {path}; run OPWATCH_UPDATE_GOLDENS=1 pytest to create it"
    expected = path.read_text()
    assert text == expected, f"output differs from golden {name}; rerun with OPWATCH_UPDATE_GOLDENS=1 to update after review"


class CountingMode(TorchDispatchMode):
    """Counts every op it sees; entered *outside* a watch it sees the ops opwatch issues too."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(1 for op in self.ops if op == name)


@pytest.fixture(autouse=True)
def _chdir_to_scenarios(monkeypatch):
    # Paths in messages are shown relative to the working directory: keep them stable.
    monkeypatch.chdir(SCENARIOS)
    torch.manual_seed(0)
