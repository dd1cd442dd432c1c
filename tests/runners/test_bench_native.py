"""``bench.native``: the floors of ``bench.floor`` in native code (the CPython API; torch's C++
API), which ``python -m bench.ablate --native`` prints beside the Python floors, and the real
watch with parts of its per-op work in native code (``bench.native.native_parts``, which
``python -m bench.native_parts`` times). A native floor that did less than its Python twin, or a
native part that logged or found less than the watch, would flatter native code; these tests
hold each to the same work, op for op, and the parts to the same entries and findings. No
timing here.

Building the two modules takes about 15 s on two cores, so the README's test command skips this
file; ``.ci/run``'s thorough pass runs it with ``OPWATCH_NATIVE_FLOORS=1``, where a build that
fails is a failure."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.floor import ReadsFloor, RecordsFloor  # noqa: E402
from bench.workloads import transformer32_step  # noqa: E402
from support.helpers import two_steps_under  # noqa: E402

pytestmark = pytest.mark.skipif(not os.environ.get("OPWATCH_NATIVE_FLOORS"), reason="builds two native modules (~15 s): .ci/run's thorough pass runs it (OPWATCH_NATIVE_FLOORS=1)")

NATIVE_PAIRS = [("NativeRecordsFloor", RecordsFloor), ("NativeReadsFloor", ReadsFloor), ("TorchApiRecordsFloor", RecordsFloor), ("TorchApiReadsFloor", ReadsFloor)]


def _same_work(entry) -> tuple:
    """An entry without what differs from run to run: tensor identities, sequence numbers."""
    func, code, lasti, forward, _, *metas = entry
    return (func, code, lasti, forward, tuple(meta[:3] for meta in metas))


@pytest.mark.parametrize("native_name, python_floor", NATIVE_PAIRS, ids=[name for name, _ in NATIVE_PAIRS])
def test_a_native_floor_logs_and_reads_what_its_python_twin_does(native_name, python_floor):
    from bench import native

    native_floor = getattr(native, native_name)
    torch.manual_seed(0)
    step = transformer32_step()
    step()
    twin = two_steps_under(python_floor, step)
    floor = two_steps_under(native_floor, step)
    entries = [entry for entry in floor.entries if entry is not None]
    assert len(entries) == len(twin.entries) > 500
    assert [_same_work(entry) for entry in entries] == [_same_work(entry) for entry in twin.entries]
    # a sequence number per entry, as torch counts: the same steps from the same start
    assert [entry[4] - entries[0][4] for entry in entries] == [entry[4] - twin.entries[0][4] for entry in twin.entries]
    # the same outputs read: one weak reference each
    refs = [ref for ref in floor.refs if ref is not None]
    assert len(refs) == len(twin.refs)
    assert (len(refs) > 100) == native_floor.reads


def test_a_native_floor_logs_every_tensor_of_an_op_with_many():
    from bench import native

    tensors = [torch.full((2,), float(number)) for number in range(40)]

    def add_one():
        torch._foreach_add(tensors, 1.0)  # 40 tensors out: more than the native floor's stack holds

    for native_floor, python_floor in ((native.NativeRecordsFloor, RecordsFloor), (native.TorchApiReadsFloor, ReadsFloor)):
        with python_floor() as twin:
            add_one()
        with native_floor() as floor:
            add_one()
        entries = [entry for entry in floor.entries if entry is not None]
        assert [_same_work(entry) for entry in entries] == [_same_work(entry) for entry in twin.entries]
        assert len(entries[-1]) == 5 + 40


def test_a_native_floor_reads_the_same_values():
    from bench import native

    x = torch.tensor([[1.0, -3.0], [float("inf"), 2.0]])
    for floor_class in (native.NativeReadsFloor, native.TorchApiReadsFloor):
        with floor_class(max_records=2) as floor:
            (x * 2).sum().neg()
        # the first pair of slots holds the min and max of x * 2
        assert [float(value) for value in floor.slots[:2]] == [-6.0, float("inf")]
        # the ring keeps the newest max_records entries: mul's was written over
        assert sorted(str(entry[0]) for entry in floor.entries) == ["aten.neg.default", "aten.sum.default"]


def test_a_native_floor_lets_a_kernel_error_through():
    from bench import native

    for floor_class in (native.NativeRecordsFloor, native.TorchApiReadsFloor):
        with floor_class() as floor, pytest.raises(RuntimeError, match="size of tensor"):
            torch.ones(3) + torch.ones(4)
        with floor:
            assert (torch.ones(2) + 1).tolist() == [2.0, 2.0]


def _without_identities(entry) -> tuple:
    """A watch's entry without what differs from run to run: its times and tensor identities."""
    from opwatch.core.records import E_START_NS, E_TENSORS

    return (*entry[:E_START_NS], *entry[E_START_NS + 2:E_TENSORS], *(meta[:3] for meta in entry[E_TENSORS:]))


PARTS = {"metadata": {"metadata": True}, "reductions": {"metadata": False, "reductions": True}, "head": {"metadata": False, "head": True}, "all": {"reductions": True, "head": True}}


@pytest.mark.parametrize("parts", PARTS.values(), ids=PARTS)
def test_the_watch_with_native_parts_logs_and_finds_what_the_watch_does(parts):
    """bench.ablate --native's variants: only where the work is done changes. Two healthy steps of
    the transformer, then one whose batch holds a nan and one whose activations overflow in
    float16 headroom: the same entries, the same findings, word for word."""
    import opwatch
    from bench import native

    def run(make):
        torch.manual_seed(0)
        model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0), 2)
        head = torch.nn.Linear(32, 1)
        optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.01)
        batches = [torch.randn(4, 8, 32) for _ in range(3)]
        batches[2][1, 3, 5] = float("nan")  # one bad batch
        with make() as watch:
            for batch in batches:
                optimizer.zero_grad()
                head(model(batch)).pow(2).mean().backward()
                optimizer.step()
            half = torch.tensor([300.0, 2.0, -5.0, 1.0], dtype=torch.float16)
            overflowed = (half * half).sum()  # 90,000 overflows float16; the message gives its inputs' ranges
        assert overflowed.isinf()
        return [_without_identities(entry) for entry in watch._log.entries], [str(anomaly) for anomaly in watch.anomalies]

    entries, anomalies = run(opwatch.watch)
    native_entries, native_anomalies = run(lambda: native.native_parts(**parts))
    assert len(entries) > 500 and len(anomalies) >= 2
    assert native_entries == entries
    assert native_anomalies == anomalies


def test_native_metadata_interns_shapes_in_the_watch_table_and_declines_what_is_no_plain_tensor():
    from bench import native
    from opwatch.core.records import SharedShapes, tensor_metas

    watch_metas = native.load(torch_api=True).watch_metas
    shapes = SharedShapes()
    x, y = torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.float16)
    metas = watch_metas([x, y], shapes)
    assert metas == [((2, 3), torch.float32, torch.device("cpu"), id(x)), ((2, 3), torch.float16, torch.device("cpu"), id(y))]
    assert metas[0][0] is metas[1][0] is shapes[torch.Size([2, 3])]
    assert watch_metas((x,), shapes)[0][0] is tensor_metas([x], _Log(shapes))[0][0]
    assert watch_metas([x, 3], shapes) is None  # not a tensor: the Python path decides
    with pytest.raises(TypeError, match="list or tuple"):
        watch_metas(x, shapes)


class _Log:
    def __init__(self, shapes):
        self.shapes = shapes


def test_bench_native_parts_prints_each_variant_over_the_floor_and_the_watch(capsys):
    from bench import native_parts

    assert native_parts.main(["--workloads", "mlp", "--rounds", "1", "--target-seconds", "0.01"]) == 0
    header, row = capsys.readouterr().out.splitlines()[1:3]
    assert all(name in header for name in native_parts.VARIANTS)
    cells = row.split()
    assert cells[0] == "mlp" and len(cells) == 2 + 3 * len(native_parts.VARIANTS)  # "a.aax / b.bbbx" per variant
    with pytest.raises(SystemExit):
        native_parts.main(["--workloads", "mlp,nope"])


def test_bench_native_parts_prints_a_dash_and_the_error_of_a_variant_that_fails(capsys, monkeypatch):
    """GPT-2's check points replay the mask, which reads the entries: the variants that keep
    none end with an error there; the row goes on, the error is said under it."""
    import contextlib

    from bench import native_parts

    @contextlib.contextmanager
    def failing():
        raise RuntimeError("the watch went inert: this workload's check points read the entries")
        yield

    monkeypatch.setattr(native_parts, "VARIANTS", {"tensor metadata": native_parts.VARIANTS["tensor metadata"], "+ no entries kept": failing})
    assert native_parts.main(["--workloads", "mlp", "--rounds", "1", "--target-seconds", "0.01"]) == 0
    row, error = capsys.readouterr().out.splitlines()[2:4]
    assert row.split()[-1] == "-" and len(row.split()) == 2 + 3 + 1
    assert error.split() == ["+", "no", "entries", "kept:", "RuntimeError:", "the", "watch", "went", "inert:", "this", "workload's", "check", "points", "read", "the", "entries"]
