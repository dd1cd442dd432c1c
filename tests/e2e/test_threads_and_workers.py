"""A watch in threads and beside DataLoader worker processes: it records only the ops of its own
thread (dispatch modes are thread-local), and none of the workers' ops.

Where they apply, the common promises of :func:`equivalence.assert_transparent` are asserted:
no ``OpwatchWarning``, no anomaly, a result bitwise equal to the unwatched reference.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

import opwatch

from support.equivalence import ops, opwatch_warnings  # noqa: E402
from support.helpers import MLP  # noqa: E402

HERE = os.path.abspath(__file__)
MLP_FILE = MLP.forward.__code__.co_filename  # where the MLP's ops are attributed


# --------------------------------------------------------------------------------------------
# threads
# --------------------------------------------------------------------------------------------


def _in_thread(target, *args):
    """Run ``target`` in a thread; re-raise what it raised, return what it returned."""
    result = {}

    def run():
        try:
            result["value"] = target(*args)
        except BaseException as error:  # noqa: BLE001
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_a_watch_in_a_non_main_thread():
    def body():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with opwatch.watch() as w:
                out = (torch.ones(3) * 2).sin()
        return out, w, opwatch_warnings(caught)

    out, w, warned = _in_thread(body)
    assert warned == []
    assert torch.equal(out, (torch.ones(3) * 2).sin())
    assert ops(w.records) == ["aten.ones.default", "aten.mul.Tensor", "aten.sin.default"]


def test_two_watches_in_two_threads_record_only_their_own_ops():
    barrier = threading.Barrier(2, timeout=30)
    watches = {}
    errors = []

    def worker(name, op, count):
        try:
            x = torch.ones(4)
            with opwatch.watch() as w:
                barrier.wait()  # both watches are active from here on
                for _ in range(count):
                    x = op(x)
                barrier.wait()
            watches[name] = w
        except BaseException as error:  # noqa: BLE001
            errors.append(error)
            barrier.abort()

    threads = [
        threading.Thread(target=worker, args=("sin", torch.sin, 30)),
        threading.Thread(target=worker, args=("cos", torch.cos, 20)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    assert ops(watches["sin"].records) == ["aten.sin.default"] * 30
    assert ops(watches["cos"].records) == ["aten.cos.default"] * 20


def test_a_watch_does_not_record_other_threads():
    model = MLP()
    started = threading.Event()
    stop = threading.Event()

    def busy():
        started.set()
        while not stop.is_set():
            model(torch.randn(2, 4)).exp()

    thread = threading.Thread(target=busy)
    with opwatch.watch() as w:
        thread.start()
        started.wait()
        out = torch.ones(3).tan()
        model(torch.ones(1, 4))
    stop.set()
    thread.join()
    assert torch.equal(out, torch.ones(3).tan())
    assert "aten.exp.default" not in ops(w.records)
    assert ops(w.records)[:2] == ["aten.ones.default", "aten.tan.default"]
    assert [r.module for r in w.records if r.op == "aten.addmm.default"] == ["fc1", "fc2"]
    assert {r.filename for r in w.records} == {HERE, MLP_FILE}  # this test's lines and MLP.forward


# --------------------------------------------------------------------------------------------
# DataLoader with workers
# --------------------------------------------------------------------------------------------


class SinDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.full((3,), float(index)).sin(), torch.tensor(os.getpid())


def test_dataloader_with_two_workers():
    loader_args = dict(batch_size=2, num_workers=2)
    reference = list(torch.utils.data.DataLoader(SinDataset(), **loader_args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch() as w:
            batches = list(torch.utils.data.DataLoader(SinDataset(), **loader_args))
            total = torch.stack([x for x, _ in batches]).sum()
    assert opwatch_warnings(caught) == []
    assert w.anomalies == []
    assert len(batches) == len(reference) == 4
    for (x, pid), (x_ref, _) in zip(batches, reference):
        assert torch.equal(x, x_ref)
        assert int(pid[0]) != os.getpid()  # really made in a worker process
    # The workers' ops ran in other processes: the watch holds only this process's ops.
    assert "aten.sin.default" not in ops(w.records) and "aten.full.default" not in ops(w.records)
    assert ops(w.records)[-2:] == ["aten.stack.default", "aten.sum.default"]
    assert torch.equal(total, torch.stack([x for x, _ in reference]).sum())
