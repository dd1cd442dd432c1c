"""opwatch among its neighbours: grad modes, autocast, checkpointing, double backward, other
dispatch modes, torch.compile, threads, DataLoader workers; and what happens when things go
wrong (internal errors, user exceptions, bad arguments, ``OPWATCH_DISABLE``).

Common promises, asserted in every case where they apply: no crash, no ``OpwatchWarning``
(neither an internal error nor an anomaly warning on healthy code), ``w.anomalies == []``, and
the watched result equals the reference bitwise (:func:`equivalence.diff`; the reference runs
under a do-nothing dispatch mode, or plain eager where a neighbour needs that).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from torch import nn

import opwatch
from opwatch import checks as opwatch_checks
from opwatch.checks import nonfinite as nonfinite_check
from opwatch.modes import interceptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import equivalence as eq  # noqa: E402
from equivalence import assert_transparent, ops, opwatch_warnings, run_reference  # noqa: E402

HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def line_of(marker: str) -> int:
    """The line of this file that holds ``marker`` (exactly one)."""
    with open(HERE) as source:
        lines = source.read().splitlines()
    found = [number for number, line in enumerate(lines, 1) if marker in line and "line_of(" not in line]
    assert len(found) == 1, (marker, found)
    return found[0]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


# --------------------------------------------------------------------------------------------
# grad modes and autocast
# --------------------------------------------------------------------------------------------


def test_no_grad_inference_mode_and_enable_grad_inside_no_grad():
    def fn():
        model = MLP()
        x = torch.randn(3, 4)
        with torch.no_grad():
            a = model(x)
            with torch.enable_grad():
                b = model(x).sum()
                b.backward()
        with torch.inference_mode():
            c = model(x) * 2
        with torch.set_grad_enabled(False):
            d = model(x)
        return a, b, c, d, model.fc1.weight.grad, c.is_inference()

    got, w = assert_transparent(fn)
    assert got[-1] is True
    phases = [r.phase for r in w.records]
    assert phases.count("backward") > 0
    # Ops run under no_grad / inference_mode are forward ops of the model's modules.
    assert {r.module for r in w.records if r.op == "aten.addmm.default" and r.phase == "forward"} == {"fc1", "fc2"}


def test_autocast_cpu_bfloat16_forward_and_backward():
    def fn():
        model = MLP()
        x = torch.randn(3, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = out.float().pow(2).mean()
        loss.backward()
        return out, loss, model.fc1.weight.grad, model.fc2.bias.grad

    got, w = assert_transparent(fn)
    assert got[0].dtype == torch.bfloat16
    forward_addmm = [r for r in w.records if r.op == "aten.addmm.default" and r.phase == "forward"]
    # autocast's casts happen below the autocast key: the watch sees bfloat16 operands.
    assert [{m.dtype for m in r.inputs} for r in forward_addmm] == [{torch.bfloat16}, {torch.bfloat16}]
    assert [r.module for r in forward_addmm] == ["fc1", "fc2"]
    backward_mm = [r for r in w.records if r.op == "aten.mm.default" and r.phase == "backward"]
    assert backward_mm and {r.module for r in backward_mm} <= {"fc1", "fc2"}
    assert all(r.filename == HERE for r in backward_mm)


# --------------------------------------------------------------------------------------------
# activation checkpointing
# --------------------------------------------------------------------------------------------


def checkpointed_block(x):
    h = x.sin()  # @ckpt-sin
    return h.cos()  # @ckpt-cos


def _checkpoint_run(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(4, requires_grad=True)
    out = checkpoint(checkpointed_block, x, use_reentrant=use_reentrant)
    loss = out.sum()  # @ckpt-loss
    if use_reentrant:  # reentrant checkpointing does not support autograd.grad
        loss.backward()  # @ckpt-backward
        return out, loss, x.grad
    (grad,) = torch.autograd.grad(loss, x)  # @ckpt-grad
    return out, loss, grad


def test_checkpoint_non_reentrant_recomputed_forward_points_at_its_own_line():
    got, w = assert_transparent(lambda: _checkpoint_run(False))
    sin_line, cos_line = line_of("# @ckpt-sin"), line_of("# @ckpt-cos")
    forward_sin = [r for r in w.records if r.op == "aten.sin.default" and r.phase == "forward"]
    assert [r.lineno for r in forward_sin] == [sin_line]
    # The recomputation runs during backward; its ops point at the block's own line.
    recomputed = [r for r in w.records if r.op == "aten.sin.default" and r.phase == "backward" and r.lineno == sin_line]
    assert len(recomputed) == 1, [(r.op, r.where, r.phase) for r in w.records]
    assert recomputed[0].filename == HERE
    # No backward op is attributed to the line that started the backward pass.
    grad_line = line_of("# @ckpt-grad")
    assert [r for r in w.records if r.phase == "backward" and r.lineno == grad_line] == []
    # cos's backward (-sin(h) * grad) points at the cos line.
    backward_lines = {r.lineno for r in w.records if r.phase == "backward"}
    assert cos_line in backward_lines


def test_checkpoint_reentrant_recomputed_forward_points_at_its_own_line():
    got, w = assert_transparent(lambda: _checkpoint_run(True))
    sin_line, cos_line = line_of("# @ckpt-sin"), line_of("# @ckpt-cos")
    recomputed = [(r.op, r.lineno) for r in w.records if r.phase == "backward" and r.op in ("aten.sin.default", "aten.cos.default")]
    assert ("aten.sin.default", sin_line) in recomputed
    assert ("aten.cos.default", cos_line) in recomputed
    backward_line = line_of("# @ckpt-backward")
    assert [r for r in w.records if r.phase == "backward" and r.lineno == backward_line] == []


def test_checkpoint_reentrant_backward_of_the_recomputed_graph_points_at_the_block():
    """The inner backward that reentrant checkpointing runs over the recomputed graph consists
    of backward ops like any other: they carry the forward line that created them."""
    got, w = assert_transparent(lambda: _checkpoint_run(True))
    sin_line, cos_line = line_of("# @ckpt-sin"), line_of("# @ckpt-cos")
    loss_line = line_of("# @ckpt-loss")
    # AccumulateGrad detaching the gradients it stores (of x, and of the detached input of the
    # inner backward) belongs to no forward op: leave those out.
    backward = [r for r in w.records if r.phase == "backward" and r.op != "aten.detach.default"]
    unattributed = [(r.index, r.op, r.where) for r in backward if r.filename is None]
    assert unattributed == [], f"backward ops without a line: {unattributed}"
    assert {r.lineno for r in backward} <= {sin_line, cos_line, loss_line}


def test_checkpoint_of_a_submodule_keeps_module_paths():
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            h = checkpoint(self.block, x, use_reentrant=False)  # @ckpt-module
            return self.head(h)

    def fn():
        net = Net()
        loss = net(torch.randn(2, 4)).sum()
        loss.backward()
        return loss, net.block[0].weight.grad, net.head.weight.grad

    got, w = assert_transparent(fn)
    line = line_of("# @ckpt-module")
    addmm = [(r.module, r.lineno, r.phase) for r in w.records if r.op == "aten.addmm.default"]
    # forward: block.0 and head; recomputation in backward: block.0 again, same line and path.
    assert addmm == [("block.0", line, "forward"), ("head", line + 1, "forward"), ("block.0", line, "backward")]
    tanh = [(r.module, r.phase) for r in w.records if r.op == "aten.tanh.default"]
    assert tanh == [("block.1", "forward"), ("block.1", "backward")]


# --------------------------------------------------------------------------------------------
# double backward
# --------------------------------------------------------------------------------------------


def _double_backward():
    x = torch.randn(4, requires_grad=True)
    y = (x**3).sum()  # @double-pow
    (g,) = torch.autograd.grad(y, x, create_graph=True)  # @double-first
    gsum = g.sum()  # @double-gsum
    (gg,) = torch.autograd.grad(gsum, x)
    return y, g, gg


def test_double_backward_is_transparent():
    got, w = assert_transparent(_double_backward)
    torch.testing.assert_close(got[2], 6 * run_reference(lambda: torch.randn(4), plain=True))


def test_double_backward_ops_point_at_the_forward_line():
    """The graph built by the first backward (create_graph=True) is differentiated by the
    second; its nodes were made by the backward of ``x ** 3``, so their backward ops belong to
    that line, not to no line at all."""
    got, w = assert_transparent(_double_backward)
    pow_line, gsum_line = line_of("# @double-pow"), line_of("# @double-gsum")
    second = [r for r in w.records if r.phase == "backward" and r.index > next(q.index for q in w.records if q.lineno == gsum_line)]
    assert second, ops(w.records)
    unattributed = [(r.index, r.op, r.where) for r in second if r.filename is None]
    assert unattributed == [], f"double-backward ops without a line: {unattributed}"
    assert {r.lineno for r in second} <= {pow_line, gsum_line}


# --------------------------------------------------------------------------------------------
# other dispatch modes, inside and outside
# --------------------------------------------------------------------------------------------


def _small_program():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 5)
    out = (a @ b).relu().sum()
    out.backward()
    return out, a.grad


def test_fake_tensor_mode_outside_the_watch():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with opwatch.watch() as w:
                out, grad = _small_program()
        reference = _small_program()
    assert opwatch_warnings(caught) == []
    assert type(out) is FakeTensor and type(grad) is FakeTensor
    assert eq.diff(reference, (out, grad), values=False) is None
    assert w.anomalies == []
    mm = [r for r in w.records if r.op == "aten.mm.default" and r.phase == "forward"]
    assert [[tuple(m.shape) for m in r.inputs] for r in mm] == [[(3, 4), (4, 5)]]
    assert {r.phase for r in w.records} == {"forward", "backward"}


def test_fake_tensor_mode_inside_the_watch():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fn():
        with FakeTensorMode():
            return _small_program()

    got, w = assert_transparent(fn, values=False)
    assert "aten.mm.default" in ops(w.records)


def test_debug_mode_inside_the_watch():
    from torch.utils._debug_mode import DebugMode

    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with DebugMode() as alone:
        (a @ b).relu().sum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch() as w:
            with DebugMode() as inner:
                out = (a @ b).relu().sum()
    assert opwatch_warnings(caught) == []
    assert torch.equal(out, (a @ b).relu().sum())
    assert inner.debug_string() == alone.debug_string()
    assert ops(w.records) == ["aten.mm.default", "aten.relu.default", "aten.sum.default"]
    assert all(r.filename == HERE for r in w.records)


def test_debug_mode_outside_the_watch():
    from torch.utils._debug_mode import DebugMode

    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with DebugMode() as alone:
        (a @ b).relu().sum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with DebugMode() as outer:
            with opwatch.watch() as w:
                out = (a @ b).relu().sum()
    assert opwatch_warnings(caught) == []
    assert torch.equal(out, (a @ b).relu().sum())
    assert ops(w.records) == ["aten.mm.default", "aten.relu.default", "aten.sum.default"]
    # An outer mode sees the program's ops in order and nothing else: opwatch's nan/inf
    # reductions run with Python dispatch off.
    program = [line for line in alone.debug_string().splitlines() if line.strip()]
    seen = [line for line in outer.debug_string().splitlines() if line.strip()]
    assert seen == program


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_flop_counter_mode(where):
    from torch.utils.flop_counter import FlopCounterMode

    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 5)
    with FlopCounterMode(display=False) as alone:
        (a @ b).relu().sum().backward()
    a.grad = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if where == "inside":
            with opwatch.watch() as w, FlopCounterMode(display=False) as counter:
                (a @ b).relu().sum().backward()
        else:
            with FlopCounterMode(display=False) as counter, opwatch.watch() as w:
                (a @ b).relu().sum().backward()
    assert opwatch_warnings(caught) == []
    assert counter.get_total_flops() == alone.get_total_flops() > 0
    assert counter.get_flop_counts() == alone.get_flop_counts()
    assert w.anomalies == []
    assert ops(w.records).count("aten.mm.default") == 2  # forward, and the gradient for a


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------


def compiled_body_cold(a, b):
    return (a @ b).relu().sum() * 2  # @compile-cold


def compiled_body_warm(a, b):
    return (a @ b).relu().sum() * 2  # @compile-warm


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_first_called_under_the_watch(backend):
    torch._dynamo.reset()
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    expected = compiled_body_cold(a, b)
    compiled = torch.compile(compiled_body_cold, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch() as w:
            out = compiled(a, b)
    assert opwatch_warnings(caught) == []
    assert torch.equal(out, expected)
    assert w.anomalies == []
    # What opwatch records: dynamo does not compile while a Python dispatch mode is active and
    # runs the function eagerly, so the watch sees its eager ops on their own source line.
    assert ops(w.records) == ["aten.mm.default", "aten.relu.default", "aten.sum.default", "aten.mul.Tensor"]
    assert {(r.filename, r.lineno) for r in w.records} == {(HERE, line_of("# @compile-cold"))}
    torch._dynamo.reset()


def test_dynamo_compiles_no_frame_of_opwatch():
    # opwatch keeps Dynamo out of its __torch_dispatch__ and everything it calls; without that,
    # a compiled function running under the watch would trace opwatch's own frames (and break
    # graphs on them).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    a, b = torch.randn(3, 4), torch.randn(4, 5)
    compiled = torch.compile(compiled_body_cold, backend=backend)
    with opwatch.watch() as w:
        compiled(a, b)
        compiled(a, b)
    assert graphs == []
    assert sum(counters["frames"].values()) == 0, dict(counters["frames"])
    assert ops(w.records).count("aten.mm.default") == 2
    torch._dynamo.reset()


@pytest.mark.skipif(interceptor._SKIP_FRAMES is None, reason="older torch: its own wrapper imports torch._dynamo")
def test_a_watch_does_not_import_dynamo():
    # TorchDispatchMode's per-op wrapper imports torch._dynamo (about a second) on the first op;
    # opwatch keeps Dynamo out without it.
    program = (
        "import sys, torch, opwatch\n"
        "with opwatch.watch() as w:\n"
        "    (torch.ones(3) * 2).sum()\n"
        "assert [r.op for r in w.records] == ['aten.ones.default', 'aten.mul.Tensor', 'aten.sum.default']\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_torch_compile_already_compiled_outside_the_watch():
    torch._dynamo.reset()
    calls = []

    def backend(graph_module, example_inputs):
        calls.append(graph_module)
        return torch._dynamo.backends.debugging.aot_eager(graph_module, example_inputs)

    a, b = torch.randn(3, 4), torch.randn(4, 5)
    compiled = torch.compile(compiled_body_warm, backend=backend)
    outside = compiled(a, b)
    assert len(calls) == 1  # compiled once, outside
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch() as w:
            out = compiled(a, b)
    assert opwatch_warnings(caught) == []
    assert torch.equal(out, outside) and torch.equal(out, compiled_body_warm(a, b))
    assert w.anomalies == []
    assert ops(w.records) == ["aten.mm.default", "aten.relu.default", "aten.sum.default", "aten.mul.Tensor"]
    assert {r.lineno for r in w.records} == {line_of("# @compile-warm")}
    torch._dynamo.reset()


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
    assert all(r.filename == HERE for r in w.records)


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


# --------------------------------------------------------------------------------------------
# when opwatch itself breaks
# --------------------------------------------------------------------------------------------


def _program_with_every_check():
    x = torch.randn(4, 3)
    y = x + torch.ones(3)  # broadcast, dtype and device checks all apply to add
    z = (y * 2).sum(0)
    return y, z, z.sum().item()  # a host read: a nan/inf check point


class SimulatedBug(Exception):
    pass


def _raise(*args, **kwargs):
    raise SimulatedBug("simulated opwatch bug")


@pytest.mark.parametrize("target", ["device", "dtype", "broadcast", "observe", "resolve"])
@pytest.mark.parametrize("strict", [False, True])
def test_an_internal_error_becomes_one_warning_and_the_program_carries_on(monkeypatch, target, strict):
    if target in ("observe", "resolve"):
        monkeypatch.setattr(nonfinite_check.NonFiniteTracker, target, _raise)
    else:
        monkeypatch.setattr(getattr(opwatch_checks, target), "for_op", lambda func: _raise)
    expected = run_reference(_program_with_every_check, plain=True)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (opwatch.strict() if strict else opwatch.watch()) as w:
            got = _program_with_every_check()
            for _ in range(5):
                _program_with_every_check()
            after = len(w.records)
            torch.ones(2).sin()  # a watch that stopped records nothing more
            assert len(w.records) == after
    warned = opwatch_warnings(caught)
    assert eq.diff(expected, got) is None, eq.diff(expected, got)
    assert len(warned) == 1, warned
    (message,) = warned
    assert "internal error" in message and "report" in message and "issue tracker" in message
    assert "SimulatedBug: simulated opwatch bug" in message
    assert torch.__version__ in message
    assert "Traceback" in message
    assert w.anomalies == []
    # A fresh watch, with the bug gone, works again.
    monkeypatch.undo()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch() as fresh:
            _program_with_every_check()
    assert opwatch_warnings(caught) == []
    assert "aten.add.Tensor" in ops(fresh.records)


# --------------------------------------------------------------------------------------------
# user exceptions pass through unchanged
# --------------------------------------------------------------------------------------------


class UserError(Exception):
    pass


@pytest.mark.parametrize(
    "make", [lambda: UserError("mine"), lambda: KeyboardInterrupt(), lambda: SystemExit(3), lambda: GeneratorExit()],
    ids=["Exception", "KeyboardInterrupt", "SystemExit", "GeneratorExit"],
)
@pytest.mark.parametrize("strict", [False, True])
def test_user_exceptions_pass_through_as_the_same_object(make, strict):
    error = make()
    args_before = error.args
    stream = io.StringIO()
    with pytest.raises(BaseException) as caught:
        with (opwatch.strict if strict else opwatch.watch)(file=stream) as w:
            torch.ones(2).sin()
            raise error
    assert caught.value is error
    assert type(caught.value) is type(error)
    assert caught.value.args == args_before
    assert not getattr(error, "__notes__", None)  # not raised by an op: nothing added
    assert ops(w.records) == ["aten.ones.default", "aten.sin.default"]


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit, UserError])
def test_exceptions_raised_inside_a_backward_hook_pass_through(kind):
    def fn():
        x = torch.randn(3, requires_grad=True)
        y = x * 2

        def hook(grad):
            raise kind("from the hook")

        y.register_hook(hook)
        y.sum().backward()

    with pytest.raises(BaseException) as unwatched:
        fn()
    with pytest.raises(BaseException) as watched:
        with opwatch.watch(file=io.StringIO()):
            fn()
    assert type(watched.value) is type(unwatched.value) is kind
    assert str(watched.value) == str(unwatched.value)


def test_an_op_error_keeps_its_type_and_message():
    def fn():
        return torch.ones(2, 3) @ torch.ones(2, 3)

    with pytest.raises(RuntimeError) as unwatched:
        fn()
    with pytest.raises(RuntimeError) as watched:
        with opwatch.watch(file=io.StringIO()):
            fn()
    assert type(watched.value) is type(unwatched.value)
    assert str(watched.value) == str(unwatched.value)
    assert watched.value.args == unwatched.value.args


def test_module_paths_recover_after_an_exception_inside_a_module():
    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def forward(self, x):
            self.inner(x)
            raise UserError("boom")

    with pytest.raises(UserError):
        with opwatch.watch(file=io.StringIO()):
            Exploding()(torch.ones(1, 2))
    model = MLP()
    with opwatch.watch() as w:
        torch.ones(2).sin()
        model(torch.ones(1, 4))
    # Nothing is left on the module stack by the exception: ops outside modules have no path.
    assert [(r.op, r.module) for r in w.records[:3]] == [
        ("aten.ones.default", None), ("aten.sin.default", None), ("aten.ones.default", None)
    ]
    assert {r.module for r in w.records[3:]} <= {"MLP", "fc1", "fc2"}
    assert [r.module for r in w.records if r.op == "aten.addmm.default"] == ["fc1", "fc2"]


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


BAD_OPTIONS = [
    (dict(checks=["broadcast", "nope"]), ValueError, r"unknown check name.*'nope'.*valid names.*'broadcast'"),
    (dict(checks="broadcast"), TypeError, r"checks=\['broadcast'\]"),
    (dict(checks=5), TypeError, "checks"),
    (dict(max_records=-1), ValueError, "max_records"),
    (dict(max_records=0), ValueError, "max_records"),
    (dict(max_records=10.0), TypeError, "max_records"),
    (dict(max_records="10"), TypeError, "max_records"),
    (dict(max_records=True), TypeError, "max_records"),
    (dict(last=-1), ValueError, "last"),
    (dict(last=None), TypeError, "last"),
    (dict(warn="yes"), TypeError, "warn"),
    (dict(dump_on_error=1), TypeError, "dump_on_error"),
    (dict(file="opwatch.log"), TypeError, "file"),
    (dict(nonsense=1), TypeError, "nonsense"),
]


@pytest.mark.parametrize("factory", [opwatch.watch, opwatch.strict], ids=["watch", "strict"])
@pytest.mark.parametrize("options, error, pattern", BAD_OPTIONS, ids=[repr(o) for o, _, _ in BAD_OPTIONS])
def test_bad_options_are_clear_errors(factory, options, error, pattern):
    with pytest.raises(error, match=pattern):
        factory(**options)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        opwatch.watch(100)


def test_valid_options_are_accepted():
    with opwatch.watch(max_records=1, checks=(), last=0, warn=False, dump_on_error=False, file=io.StringIO()) as w:
        torch.ones(2).sin()
    assert ops(w.records) == ["aten.sin.default"]
    with opwatch.watch(checks={"nonfinite"}) as w:
        torch.ones(3) + torch.ones(3, 1)  # broadcast check off
    assert w.anomalies == []


# --------------------------------------------------------------------------------------------
# OPWATCH_DISABLE
# --------------------------------------------------------------------------------------------


def _buggy_program():
    pred = torch.randn(5, 1)
    y = torch.randn(5)
    loss = (y - pred).pow(2).mean()  # a (5,) - (5, 1) broadcast
    bad = torch.zeros(3).log()  # -inf, alive
    return loss, bad


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", " 1 ", "Yes"])
def test_opwatch_disable_turns_every_watch_into_a_no_op(monkeypatch, value):
    monkeypatch.setenv("OPWATCH_DISABLE", value)
    expected = run_reference(_buggy_program, plain=True)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch() as w:
            got = _buggy_program()
        with opwatch.strict() as s:  # would raise at the broadcast if enabled
            _buggy_program()
    assert eq.diff(expected, got) is None
    assert opwatch_warnings(caught) == []
    for watch in (w, s):
        assert watch.enabled is False
        assert watch.records == [] and watch.anomalies == [] and watch.contained == []
        assert watch.check() == []


@pytest.mark.parametrize("value", ["", "0", "false", "no", "False", " 0 "])
def test_opwatch_disable_off_values_keep_watching(monkeypatch, value):
    monkeypatch.setenv("OPWATCH_DISABLE", value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with opwatch.watch() as w:
            kept = _buggy_program()  # noqa: F841 -- the -inf must be alive at the check point
    assert w.enabled is True
    assert {a.kind for a in w.anomalies} == {"broadcast", "inf"}


@pytest.mark.parametrize("value", ["2", "on", "disable", "y", "1.0"])
def test_opwatch_disable_bad_value_is_a_value_error_naming_the_valid_ones(monkeypatch, value):
    monkeypatch.setenv("OPWATCH_DISABLE", value)
    with pytest.raises(ValueError) as caught:
        opwatch.watch()
    message = str(caught.value)
    assert "OPWATCH_DISABLE" in message and repr(value) in message
    for valid in ("'1'", "'true'", "'yes'"):
        assert valid in message
