"""The op log: record fields, module paths, backward attribution, the ring buffer, lifetimes."""

from __future__ import annotations

import copy
import gc
import io
import subprocess
import sys
import weakref

import pytest
import torch

import opwatch
from opwatch.core.sites import lone_call
from support import SCENARIOS, needs_columns
from support.helpers import line_of as _line_of

import stories  # noqa: E402
import training  # noqa: E402

TRAINING = str(SCENARIOS / "training.py")
STORIES = str(SCENARIOS / "stories.py")


def line_of(text: str, path=TRAINING) -> int:
    return _line_of(text, str(path))


def watched_step():
    model, x, y = training.make()
    with opwatch.watch() as w:
        training.step(model, x, y)
    return w


def test_forward_record_fields():
    w = watched_step()
    addmm = [r for r in w.records if r.op == "aten.addmm.default" and r.phase == "forward"]
    assert [r.module for r in addmm] == ["blocks.0.proj", "blocks.1.proj", "head"]
    first = addmm[0]
    assert first.filename == TRAINING
    assert first.lineno == line_of("torch.relu(self.proj(x)) + x")
    assert [(m.shape, m.dtype, m.device.type) for m in first.inputs] == [
        ((4,), torch.float32, "cpu"),
        ((3, 4), torch.float32, "cpu"),
        ((4, 4), torch.float32, "cpu"),
    ]
    assert [(m.shape, m.dtype) for m in first.outputs] == [((3, 4), torch.float32)]
    assert first.flags == ()


def test_indices_are_consecutive_from_zero():
    w = watched_step()
    assert [r.index for r in w.records] == list(range(len(w.records)))


def test_module_paths_are_relative_to_the_outermost_module():
    w = watched_step()
    modules = {r.module for r in w.records if r.phase == "forward"}
    # The outermost module is named by its class; modules are dotted state_dict paths (the
    # class beside them, module_class; messages show it where the path ends in an index).
    assert {"Net", "blocks.0.proj", "blocks.0.norm", "blocks.0", "blocks.1.norm", "head"} <= modules
    squeeze = next(r for r in w.records if r.op == "aten.squeeze.dim")
    assert squeeze.module == "Net"
    loss_sub = next(r for r in w.records if r.op == "aten.sub.Tensor" and r.phase == "forward")
    assert loss_sub.module is None
    assert loss_sub.lineno == line_of("loss = ((pred - y) ** 2).mean()")


def test_submodule_called_directly_is_the_root():
    model, x, _ = training.make()
    with opwatch.watch() as w:
        model.blocks[1](x)
    assert {r.module for r in w.records} == {"Block", "proj", "norm"}


def test_backward_ops_point_at_the_forward_line_and_module():
    w = watched_step()
    backward = [r for r in w.records if r.phase == "backward"]
    assert backward, "no backward op recorded"
    proj_grads = [r for r in backward if r.module == "blocks.0.proj"]
    assert {r.op for r in proj_grads} >= {"aten.mm.default"}
    assert {r.lineno for r in proj_grads} == {line_of("torch.relu(self.proj(x)) + x")}
    pow_grads = [r for r in backward if r.lineno == line_of("loss = ((pred - y) ** 2).mean()")]
    assert any(r.op == "aten.pow.Tensor_Scalar" for r in pow_grads)
    # No backward op points at loss.backward(): that is not where gradient bugs live.
    assert line_of("loss.backward()") not in {r.lineno for r in backward}


def test_backward_of_sqrt_points_at_sqrt_line():
    with opwatch.watch(warn=False) as w:
        stories.sqrt_grad_at_zero()
    sqrt_line = line_of("distance = x.sqrt()", path=STORIES)
    backward = [r for r in w.records if r.phase == "backward" and r.op.startswith("aten.div")]
    assert backward and all(r.lineno == sqrt_line for r in backward)


def test_args_are_named_from_the_schema():
    w = watched_step()
    mean = next(r for r in w.records if r.op.startswith("aten.native_layer_norm"))
    assert dict(mean.args)["normalized_shape"] == (4,)


@needs_columns
def test_sub_expression_of_each_op():
    w = watched_step()
    sub = next(r for r in w.records if r.op == "aten.sub.Tensor" and r.phase == "forward")
    assert sub.position.expression() == "pred - y"
    power = next(r for r in w.records if r.op == "aten.pow.Tensor_Scalar" and r.phase == "forward")
    assert power.position.expression() == "(pred - y) ** 2"


def test_ring_buffer_is_bounded_and_index_keeps_counting():
    model, x, y = training.make()
    unbounded = copy.deepcopy(model)
    with opwatch.watch(max_records=50) as w:
        for _ in range(5):
            training.step(model, x, y)
    records = w.records
    assert len(records) == 50
    # The same run, every op kept. Steps differ: the first one's gradients have no .grad to
    # add into, and torch stores them with as many detaches as its version makes (2.6: two).
    with opwatch.watch() as reference:
        for _ in range(5):
            training.step(unbounded, x, y)
    total = len(reference.records)
    assert total > 4 * 50
    assert records[-1].index == total - 1
    assert records[0].index == total - 50


def test_records_hold_no_tensors_and_keep_nothing_alive():
    model, x, y = training.make()
    with opwatch.watch() as w:
        pred = model(x)
        activation = weakref.ref(pred)
        loss = ((pred - y) ** 2).mean()
        loss.backward()
        del pred, loss
    gc.collect()
    assert activation() is None, "the watch kept an activation alive"
    for record in w.records:
        assert not _contains_tensor(record._entry), record


def test_log_entries_are_invisible_to_the_garbage_collector():
    # A full log must not slow down Python's collections: its entries hold only untracked
    # values (ints, strings, dtypes, devices, tuples of those), so the collector drops them.
    model, x, y = training.make()
    with opwatch.watch() as w:
        training.step(model, x, y)
        gc.collect()  # the log's own tables are long-lived from here on, as in a training loop
        first_new = w.records[-1].index + 1
        for _ in range(3):
            training.step(model, x, y)
        # An entry holds tuples: the collector untracks the inner ones on its first look and
        # the entry on its second (young collections in a running program).
        gc.collect()
        gc.collect()
    tracked = [record for record in w.records if record.index >= first_new and gc.is_tracked(record._entry)]
    assert tracked == []


def _contains_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_contains_tensor(item) for item in value)
    return False


def test_nested_watches_keep_their_own_records():
    a = torch.ones(3)
    with opwatch.watch() as outer:
        a.sin()
        with opwatch.watch() as inner:
            a.cos()
        a.tan()
    assert [r.op for r in inner.records] == ["aten.cos.default"]
    # The outer watch sees the user's ops, not the inner watch's own checking work.
    assert [r.op for r in outer.records] == ["aten.sin.default", "aten.cos.default", "aten.tan.default"]


def test_a_watch_can_be_entered_again_and_keeps_counting():
    w = opwatch.watch()
    with w:
        torch.ones(2).sin()
    with w:
        torch.ones(2).cos()
    assert [(r.index, r.op) for r in w.records] == [
        (0, "aten.ones.default"), (1, "aten.sin.default"), (2, "aten.ones.default"), (3, "aten.cos.default")
    ]
    with pytest.raises(RuntimeError, match="already active"):
        with w:
            with w:
                pass


def test_exception_passes_through_unchanged_with_a_note():
    stream = io.StringIO()
    x = torch.ones(5, 3)
    weights = torch.ones(3, 2)
    with pytest.raises(RuntimeError) as caught:
        with opwatch.watch(file=stream, warn=False):
            x.double() @ weights  # the failing line
    error = caught.value
    assert type(error) is RuntimeError
    assert "expected" in str(error) or "dtype" in str(error)  # torch's own message, untouched
    (note,) = error.__notes__
    assert "aten.mm.default" in note
    assert "f64[5, 3] cpu" in note and "f32[3, 2] cpu" in note
    assert f"test_records.py:{line_of('# the failing' + ' line', __file__)}" in note
    dump = stream.getvalue()
    assert ">> " in dump and "aten.mm" in dump


def test_the_same_exception_object_propagates():
    sentinel = ValueError("mine")
    with pytest.raises(ValueError) as caught:
        with opwatch.watch(file=io.StringIO()):
            torch.ones(2).sin()
            raise sentinel
    assert caught.value is sentinel
    assert not getattr(sentinel, "__notes__", None)  # not raised by an op: no note


def test_no_dump_when_disabled():
    stream = io.StringIO()
    with pytest.raises(ZeroDivisionError):
        with opwatch.watch(file=stream, dump_on_error=False):
            torch.ones(2).sin()
            1 / 0
    assert stream.getvalue() == ""


def test_dump_shows_last_n_ops():
    stream = io.StringIO()
    with pytest.raises(ZeroDivisionError):
        with opwatch.watch(file=stream, last=3):
            for _ in range(10):
                torch.ones(2).sin()
            1 / 0
    table_rows = [line for line in stream.getvalue().splitlines() if "aten." in line]
    assert len(table_rows) == 3


def test_importing_opwatch_does_not_import_tabulate():
    code = "import sys, opwatch; print('tabulate' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# -- bounded caches ---------------------------------------------------------------------------


def test_bounded_cache_starts_afresh_when_full():
    from opwatch.core.bounded import BoundedCache

    cache = BoundedCache(3)
    for key in "abc":
        assert cache.put(key, key.upper()) == key.upper()
    assert cache.keep("a", "other") == "A" and len(cache) == 3  # known: kept, nothing stored
    assert cache.keep("d", "D") == "D" and dict(cache) == {"d": "D"}  # a fourth key: cleared first
    made = []
    assert cache.lookup("e", lambda key: made.append(key) or key * 2) == "ee"
    assert cache.lookup("e", lambda key: made.append(key) or "again") == "ee" and made == ["e"]
    with pytest.raises(TypeError):
        cache.keep([1], 1)
    with pytest.raises(ValueError, match="limit must be 1 or more"):
        BoundedCache(0)


def test_the_log_s_tables_stay_bounded_when_every_step_brings_new_values():
    from opwatch.core.records import OpLog

    log = OpLog(10)
    for length in range(5000):  # a new sequence length every step
        assert log.shapes[torch.Size([2, length])] == (2, length)
        assert log.intern((length, 0.5)) == (length, 0.5)
    assert len(log.shapes) <= 4096 and len(log._interned) <= 4096
    # Interned: the same shape or argument tuple is one object while it stays in the table.
    assert log.shapes[torch.Size([2, 4999])] is log.shapes[torch.Size([2, 4999])]
    assert log.intern((4999, 0.5)) is log.intern((4999, 0.5))
    assert log.intern((1, -1)) is not log.intern((1, -1.0))  # equal, but different arguments


# -- one record interface ----------------------------------------------------------------------


def test_a_record_of_another_kind_gets_the_derived_fields_from_the_interface():
    from opwatch.core.notation import TensorMeta
    from opwatch.core.records import BaseRecord
    from opwatch.render import render_table
    from opwatch.core.sites import Position

    class Plain(BaseRecord):  # only the primitive accessors, as another record kind has them
        index, func, module, phase, forward_func, args, flags, rank, label = 3, "aten.mm.default", None, "forward", None, (), (), None, None
        inputs = (TensorMeta((5, 3), torch.float64, torch.device("cpu")), TensorMeta((3, 2), torch.float32, torch.device("cpu")))
        outputs = None
        position = Position(TRAINING, 1)

    record = Plain()
    assert record.op == "aten.mm.default" and record.filename == TRAINING and record.lineno == 1
    assert record.where == "training.py:1" and record.signature() == "aten.mm(f64[5, 3] cpu, f32[3, 2] cpu)"
    assert repr(record) == "<Plain #3 aten.mm(f64[5, 3] cpu, f32[3, 2] cpu) at training.py:1 forward>"
    assert "f64[5, 3] cpu, f32[3, 2] cpu  not run" in render_table([record])


def test_live_records_share_the_interface():
    from opwatch.core.records import BaseRecord, short_op_name

    w = watched_step()
    record = w.records[0]
    assert isinstance(record, BaseRecord) and record.where == f"training.py:{record.lineno}"
    assert record.signature().startswith(short_op_name(record.func) + "(")
    assert short_op_name("aten.mm.default") == short_op_name(torch.ops.aten.mm.default) == "aten.mm"
    assert short_op_name(torch.ops.aten.add.Tensor) == "aten.add.Tensor"


def test_an_entry_logged_before_its_kernel_is_completed_in_place():
    from opwatch.core.records import E_END_NS, OpLog, op_entry

    log = OpLog(4)
    meta = ((4, 1), torch.float32, torch.device("cpu"), 7)
    head = (0, log.func_id(torch.ops.aten.sub.Tensor), 0, None, "forward", -1, ())
    record = log.add(op_entry(head, 10, -1, [meta, meta]))
    assert record.outputs is None and record.inputs[0].shape == (4, 1)  # the kernel has not run
    out = ((4, 4), torch.float32, torch.device("cpu"), 8)
    log.complete(record, op_entry(head, 10, 12, [meta, meta], [out]))
    assert len(log.entries) == 1 and log.entries[0][E_END_NS] == 12
    assert [meta.shape for meta in record.outputs] == [(4, 4)] and log.records()[0].outputs == record.outputs
    # Once a later op was logged, the record is completed alone (the log keeps its order).
    later = log.add(op_entry((1, *head[1:]), 13, -1, [out]))
    log.complete(later, op_entry((1, *head[1:]), 13, 14, [out], []))
    log.entries.append(op_entry((2, *head[1:]), 15, 16, [out], [out]))
    log.complete(record, op_entry(head, 10, 12, [meta, meta], []))
    assert record.outputs == () and [entry[E_END_NS] for entry in log.entries] == [12, 14, 16]


class _Centered(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(-1)  # [5, 1] - [5]: a broadcast (the keepdim forgotten)


def test_sequential_children_are_named_by_path_and_class():
    """A record holds the module's path and class as two facts (``3`` and ``_Centered``);
    messages name the children of nn.Sequential as users know them (``3 (_Centered)``); an allow
    entry may name the path or the label."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1), _Centered())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    for allow in ((), [opwatch.Allow(module="3")], [opwatch.Allow(module="3 (_Centered)")], [opwatch.Allow(module="3 (*)")]):
        with opwatch.watch(warn=False, allow=allow) as w:
            optimizer.zero_grad()
            net(x).pow(2).mean().backward()
            optimizer.step()
        modules = {(r.module, r.module_class) for r in w.records if r.phase == "forward"}
        assert {("0", "Linear"), ("1", "ReLU"), ("2", "Linear"), ("3", "_Centered")} <= modules
        (anomaly,) = w.anomalies + w.allowed
        assert (anomaly.module, anomaly.module_class) == ("3", "_Centered")
        assert ", module 3 (_Centered) (forward)" in anomaly.message.partition("\n")[0]
        assert "3 (_Centered)" in w.table()
        assert len(w.allowed) == len(allow)


def test_named_modules_keep_their_paths():
    records = watched_step().records
    named = {r.module for r in records}
    assert {"Net", "blocks.0", "blocks.0.proj", "blocks.1.norm", "head"} <= named
    assert not {m for m in named if m and "(" in m}  # a path, never a label
    classes = {(r.module, r.module_class) for r in records if r.module}
    assert {("Net", "Net"), ("blocks.0", "Block"), ("blocks.0.proj", "Linear")} <= classes


def test_the_log_numbers_every_call_it_logs():
    """OpLog.log_call numbers a call and logs its entry; the interceptor takes its numbers from
    the same counter (OpLog.next_index), so a Watch's ops and calls share one sequence."""
    from opwatch.core.records import ModuleCall, OpLog

    log = OpLog(8)
    log.next_index = 5  # a Watch's second block goes on where the first stopped
    meta = (log.shapes[torch.Size([2, 3])], torch.float32, torch.device("cpu"), 1)
    first = log.view(log.log_call(ModuleCall("LSTM.forward"), 0, ("rnn", "LSTM"), "forward", [meta], start_ns=10))
    second = log.view(log.log_call(torch.ops.aten.add.Tensor, 0, None, "backward", [meta, meta], start_ns=11, end_ns=12, outputs=[meta]))
    assert (first.index, second.index, log.next_index) == (5, 6, 7)
    assert (str(first.func), first.module, first.module_class, first.outputs, first.end_ns) == ("LSTM.forward", "rnn", "LSTM", None, None)
    assert (second.op, second.module, second.phase, len(second.inputs), second.end_ns) == ("aten.add.Tensor", None, "backward", 2, 12)
    assert [record.index for record in log.records()] == [5, 6]


def test_the_lone_python_data_call_on_a_line_stands_in_for_its_sub_expression(tmp_path):
    # Python 3.10 has no column positions: a line's one torch.tensor(...) call names the maker.
    script = tmp_path / "losses.py"
    script.write_text(
        "aux = model.aux(h).mean() if use_aux else torch.tensor(0.0)\n"
        "pair = torch.stack([torch.tensor(1.0), torch.as_tensor(x)])\n"
        "total = (main +\n"
    )
    names = frozenset(("tensor", "as_tensor", "from_numpy"))
    assert lone_call(str(script), 1, names) == "torch.tensor(0.0)"
    assert lone_call(str(script), 2, names) is None  # two calls: which one made it is unknown
    assert lone_call(str(script), 3, names) is None  # not a whole statement


def test_the_producer_of_a_tensor_like_another_is_none_where_its_id_was_an_older_tensors():
    """``producer_of(ident, like=meta)``: the op that output a tensor of that shape, dtype and
    device under the id; none where the op's output under it differed (a freed tensor whose
    address a newer one took)."""
    w = watched_step()
    first = next(r for r in w.records if r.op == "aten.addmm.default" and r.phase == "forward")
    ident = first.outputs[0].ident
    # The latest op that output a tensor under this id (a later one may have taken it).
    made, out = [(r, meta) for r in w.records for meta in r.outputs or () if meta.ident == ident][-1]
    log = w._log
    assert log.producer_of(ident, like=out).index == made.index
    assert log.producer_of(ident).index == made.index  # without like: by id alone, as before
    assert log.producer_of(ident, like=out._replace(dtype=torch.float64 if out.dtype != torch.float64 else torch.float32)) is None
    assert log.producer_of(ident, like=out._replace(shape=(*out.shape, 1))) is None
    assert log.producer_of(ident, like=out._replace(device=torch.device("meta"))) is None
