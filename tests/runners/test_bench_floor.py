"""``bench.floor``: the least per-op work of a watch written in Python, a lower bound that
``bench.ablate`` prints beside ``watch()``. A floor that did more than the watch (reduced outputs
the watch does not read, logged ops it does not) would not be one; a floor that skipped ops would
flatter nothing and tell nothing. No timing here, only the work each does."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import opwatch
from opwatch.core.compat import SKIPS_DYNAMO_PER_CODE
from opwatch.checks.nonfinite import tracker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.contenders import Passthrough  # noqa: E402
from bench.floor import ReadsFloor, RecordsFloor  # noqa: E402
from bench.workloads import transformer32_step  # noqa: E402
from support.helpers import two_steps_under  # noqa: E402


def _reduced_by_the_watch(step) -> int:
    """Outputs watch() reduces over two steps."""
    reduced = []
    original = tracker.NonFiniteTracker._reduce

    def counting(self, index, outputs, metas):
        reduced.append(len(outputs))
        return original(self, index, outputs, metas)

    tracker.NonFiniteTracker._reduce = counting
    try:
        two_steps_under(opwatch.watch, step)
    finally:
        tracker.NonFiniteTracker._reduce = original
    return sum(reduced)


def test_the_floors_log_every_op_and_read_no_more_than_the_watch():
    torch.manual_seed(0)
    step = transformer32_step()
    step()
    records = two_steps_under(RecordsFloor, step)
    reads = two_steps_under(ReadsFloor, step)
    # one entry per dispatched op, the same in both floors; the records floor reads nothing
    assert len(records.entries) == len(reads.entries) > 500
    assert len(records.refs) == 0 and records.used == 0
    # the reads floor reads one output of most checked ops, never more than the watch reduces
    watch_reduced = _reduced_by_the_watch(step)
    assert 0.8 * watch_reduced <= len(reads.refs) <= watch_reduced, (len(reads.refs), watch_reduced)
    assert reads.used == 2 * len(reads.refs)
    # every entry holds its caller's code object and offset, and the tensors' metadata tuples
    for func, code, lasti, forward, sequence, *metas in reads.entries:
        assert isinstance(func, torch._ops.OpOverload) and code.co_filename and lasti >= 0
        assert all(len(meta) == 4 and type(meta[0]) is tuple for meta in metas)
    assert sum(1 for entry in reads.entries if len(entry) > 5) > 0.9 * len(reads.entries)


@pytest.mark.skipif(not SKIPS_DYNAMO_PER_CODE, reason="this torch marks no code object: the floor keeps torch's wrapper")
def test_the_passthrough_floor_pays_no_dynamo_wrapper_per_op():
    # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless the mode keeps
    # Dynamo out itself; the floor does, as opwatch does, so no ratio over it is flattered
    assert Passthrough.__torch_dispatch__.__code__.co_filename.endswith(os.path.join("bench", "contenders.py"))
    assert RecordsFloor.__torch_dispatch__.__code__.co_filename.endswith(os.path.join("bench", "floor.py"))
