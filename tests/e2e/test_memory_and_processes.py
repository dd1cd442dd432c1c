"""Memory stays flat however long a watch runs or however many watches a process makes; a
forked child (a DataLoader worker started with ``fork``) does not run its parent's watch."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import tracemalloc

import pytest
import torch

import opwatch
from opwatch.core import sites


def _python_bytes_after(step, count: int) -> int:
    for _ in range(count):
        step()
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_flags_of_a_long_flagged_loop_leave_with_the_ring():
    # Every step is flagged (a broadcast anomaly): the flags must be pruned with the ring.
    tracemalloc.start()
    try:
        with opwatch.watch(max_records=100, warn=False) as w:
            def step():
                torch.ones(4) - torch.ones(4, 1)

            after_2000 = _python_bytes_after(step, 2000)
            after_8000 = _python_bytes_after(step, 6000)
    finally:
        tracemalloc.stop()
    # Before the fix the flags of 6,000 more anomalies held about 700 KiB more.
    assert after_8000 - after_2000 < 64 * 1024, after_8000 - after_2000
    assert all(record.flags == ("broadcast",) for record in w.records if record.op == "aten.sub.Tensor")


def _distinct_function(number: int):
    namespace: dict = {}
    exec(compile(f"def f(x):\n    return x * {number} + 1\n", f"<generated {number}>", "exec"), namespace)
    return namespace["f"]


def test_many_finished_watches_over_distinct_functions_stay_flat(monkeypatch):
    # A small bound, so that both measurements below lie past its first reset.
    monkeypatch.setattr(sites, "CODE_CACHE_LIMIT", 256, raising=False)
    x = torch.ones(2)

    def one_watch(number):
        function = _distinct_function(number)
        with opwatch.watch():
            function(x)

    tracemalloc.start()
    try:
        for number in range(500):
            one_watch(number)
        gc.collect()
        after_500 = tracemalloc.get_traced_memory()[0]
        for number in range(500, 2500):
            one_watch(number)
        gc.collect()
        after_2500 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # Before the bound, the code cache kept every function: about 1 MiB more after 2,500.
    assert after_2500 - after_500 < 256 * 1024, after_2500 - after_500
    assert len(sites._known_codes) <= sites.CODE_CACHE_LIMIT


class _BroadcastingDataset(torch.utils.data.Dataset):
    """Its items are made with ops that opwatch flags: a forked worker must not run the watch."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return (torch.ones(3) - torch.ones(3, 1)).sum() + index


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_dataloader_workers_started_with_fork_do_not_run_the_parents_watch():
    loader = torch.utils.data.DataLoader(
        _BroadcastingDataset(),
        batch_size=2,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context("fork"),
        timeout=60,
    )
    with opwatch.strict() as w:
        batches = [batch for batch in loader]  # the parent's training would die here before
        total = torch.cat(batches).sum()
    assert total.item() == 0 + 1 + 2 + 3  # each item: a (3, 3) of zeros summed, plus its index
    assert w.anomalies == []  # what workers compute is not seen by the parent's watch


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_continuing_the_block_is_inert():
    read, write = os.pipe()
    with opwatch.strict() as w:
        pid = os.fork()
        if pid == 0:  # the child: ops pass through, nothing is recorded or raised
            status = 1
            try:
                before = len(w.records)
                torch.ones(4) - torch.ones(4, 1)
                status = 0 if len(w.records) == before else 2
            finally:
                os.write(write, bytes([status]))
                os._exit(0)
        os.close(write)
        child_status = os.read(read, 1)
        os.waitpid(pid, 0)
        os.close(read)
    assert child_status == bytes([0])
    with pytest.raises(opwatch.AnomalyError):  # the parent's watch still works
        with opwatch.strict():
            torch.ones(4) - torch.ones(4, 1)


def test_importing_opwatch_imports_no_torch_and_submodules_do_not_hide_its_functions():
    import subprocess

    code = (
        "import sys, opwatch\n"
        "print('torch' in sys.modules)\n"
        "import opwatch.session, opwatch.storage.jsonl\n"
        "print(callable(opwatch.watch), opwatch.watch.__module__, opwatch.load.__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "True", "opwatch.session", "opwatch.storage.jsonl"], result.stderr
