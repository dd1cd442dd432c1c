"""What the tests share, in one package: golden files, a counting dispatch mode, small models
and helpers (``helpers``), the watched-vs-unwatched machinery (``equivalence``), tiny Hugging
Face models (``hf_models``).

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

from .helpers import MLP, PRODUCER, StubContext, line_of

TESTS = Path(__file__).resolve().parent.parent
GOLDENS = TESTS / "goldens"
SCENARIOS = TESTS / "scenarios"
UPDATE_GOLDENS = os.environ.get("OPWATCH_UPDATE_GOLDENS") == "1"

# Column carets come from co_positions (3.11+); goldens are written on 3.11+.
needs_columns = pytest.mark.skipif(sys.version_info < (3, 11), reason="goldens show 3.11+ column positions")


# FSDP2 (fully_shard) on the CPU: its all-gather records an event on a torch.cpu.Stream, which
# has no record_event in torch 2.6 (AttributeError on every rank; 2.13 and 2.14 have it).
fsdp2_on_cpu = pytest.mark.skipif(
    not hasattr(torch.cpu.Stream, "record_event"),
    reason=f"FSDP2 on the CPU needs torch.cpu.Stream.record_event, which torch {torch.__version__} lacks",
)


def needs(package: str):
    """The optional test package ``package`` (the test extra installs it), or a skip that names
    it (``pytest.importorskip``). transformers is also skipped where it is installed but turned
    its PyTorch side off (transformers 5 needs torch >= 2.6). Callable at a module's top."""
    module = pytest.importorskip(package)
    if package == "transformers" and not module.utils.is_torch_available():
        pytest.skip(f"transformers {module.__version__} does not run on torch {torch.__version__}", allow_module_level=True)
    return module


def assert_golden(name: str, text: str) -> None:
    path = GOLDENS / name
    if UPDATE_GOLDENS:
        path.write_text(text)
        return
    assert path.exists(), f"missing golden {path}; run OPWATCH_UPDATE_GOLDENS=1 pytest to create it"
    expected = path.read_text()
    assert text == expected, f"output differs from golden {name}; rerun with OPWATCH_UPDATE_GOLDENS=1 to update after review"


def _tensors_in(value) -> list:
    """The tensors of a nested value (lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors_in(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors_in(item)]
    return []


class CountingMode(TorchDispatchMode):
    """Counts every op it sees; entered *outside* a watch it sees the ops opwatch issues too."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.shapes: list[list] = []  # per op: the shapes of its tensor arguments, lists of them flattened
        self.elements: list[int] = []  # per op: the elements of its tensor arguments and outputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        tensors = [tensor for tensor in _tensors_in((args, kwargs or {})) if isinstance(tensor, torch.Tensor)]
        self.shapes.append([tuple(tensor.shape) for tensor in tensors])
        out = func(*args, **(kwargs or {}))
        self.elements.append(sum(tensor.numel() for tensor in tensors + _tensors_in(out)))
        return out

    def elements_by_op(self) -> dict:
        """``{op: elements}``: the elements each op touched, summed over its calls."""
        touched: dict = {}
        for op, count in zip(self.ops, self.elements):
            touched[op] = touched.get(op, 0) + count
        return touched

    def count(self, name: str) -> int:
        return sum(1 for op in self.ops if op == name)


