"""opwatch beside other dispatch modes, entered inside and outside the watch (``FakeTensorMode``,
``DebugMode``, ``FlopCounterMode``), and beside ``torch.compile``: each mode sees exactly what it
sees without the watch, and a compiled function runs eagerly under the watch, with no frame of
opwatch's traced by Dynamo.

Where they apply, the common promises of :func:`equivalence.assert_transparent` are asserted:
no ``OpwatchWarning``, no anomaly, a result bitwise equal to the unwatched reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import opwatch
from opwatch.core import compat

from support import equivalence as eq  # noqa: E402
from support.equivalence import assert_transparent, ops, opwatch_warnings  # noqa: E402
from support.helpers import line_of  # noqa: E402

HERE = os.path.abspath(__file__)


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


def debug_mode():
    """torch's DebugMode, or a skip naming the torch that lacks it (it is newer than 2.6)."""
    reason = f"torch {torch.__version__} has no DebugMode (torch.utils._debug_mode; newer torch has it)"
    return pytest.importorskip("torch.utils._debug_mode", reason=reason).DebugMode


def test_debug_mode_inside_the_watch():
    DebugMode = debug_mode()

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
    DebugMode = debug_mode()

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


def assert_told_ran_eagerly(caught, name):
    """The one warning of a watch under which compiled code ran (docs/compiled.md)."""
    told = opwatch_warnings(caught)
    assert len(told) == 1 and f"compiled code uncompiled under this watch: {name} (" in told[0] and ": 1 call." in told[0], told


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
    assert_told_ran_eagerly(caught, "compiled_body_cold")
    assert torch.equal(out, expected)
    assert w.anomalies == []
    # What opwatch records: a watch runs compiled code eagerly (Dynamo's force_eager stance, so
    # that the compiled code is kept for after it), and sees its eager ops on their own line.
    assert ops(w.records) == ["aten.mm.default", "aten.relu.default", "aten.sum.default", "aten.mul.Tensor"]
    assert {(r.filename, r.lineno) for r in w.records} == {(HERE, line_of("# @compile-cold", HERE))}
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


@pytest.mark.skipif(not compat.SKIPS_DYNAMO_PER_CODE, reason="older torch: its own wrapper imports torch._dynamo")
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
    assert_told_ran_eagerly(caught, "compiled_body_warm")
    assert torch.equal(out, outside) and torch.equal(out, compiled_body_warm(a, b))
    assert w.anomalies == []
    assert ops(w.records) == ["aten.mm.default", "aten.relu.default", "aten.sum.default", "aten.mul.Tensor"]
    assert {r.lineno for r in w.records} == {line_of("# @compile-warm", HERE)}
    torch._dynamo.reset()
