"""Compiled code as it really runs, under ``watch(compiled=BACKEND)``: for :func:`opwatch.diff`
of a compiled run against an eager one, at the level both can see.

A plain watch runs compiled code eagerly (:mod:`opwatch.modes.compiled`). With ``compiled=``
every ``torch.compile``d function in the block compiles with a recording wrapper of that backend
(TorchDynamo's ``force_backend`` stance: compiled once more, kept beside its own code) and runs
compiled; the watch's dispatch mode stands aside while Dynamo compiles and while the compiled
graphs run (``ignore_compile_internals``), and the wrapper logs what the graphs make into the
watch's log, one record per op at the user's line (the node's ``stack_trace``), with
fingerprints:

- the AOT backends (``"aot_eager"``, or a backend made with ``aot_autograd(...)``, whose compiler
  returns the FX graph to run as it is): *every node* of the forward and backward graphs, run
  through an ``torch.fx.Interpreter`` (after the backend's own passes: a pass that changes a
  node's math shows at that node);
- ``"inductor"`` (and an AOT backend whose compiler returns anything but the graph): the
  *outputs* of each compiled forward and backward graph (what the step returns and saves for
  backward; the gradients), each recorded as the op of the graph that made it.

The records carry the module ``"torch.compile graph N (forward)"``, by which :func:`opwatch.diff`
knows a compiled run. Ops outside the graphs (Dynamo's graph breaks, AOTAutograd's runtime
wrappers) are logged by the watch as usual.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
from time import perf_counter_ns
from typing import NamedTuple

import torch

from ..core.compat import (
    aot_backend_parts,
    aot_backend_with,
    aot_eager_with,
    force_backend_stance,
    graph_module_behind,
    inductor_with_inner,
    no_python_dispatch,
)
from ..core.bounded import BoundedCache
from ..core.ops import facts_of
from ..core.records import BACKWARD, FORWARD, tensor_metas
from .interceptor import OpInterceptor

__all__ = ["GRAPH_MODULE", "BACKENDS", "check_backend", "GraphsInterceptor", "hold", "release", "is_graph_record"]

GRAPH_MODULE = "torch.compile graph"  # the module of a graph's records: "torch.compile graph 3 (backward)"
BACKENDS = ("inductor", "aot_eager")  # by name; or an aot_autograd(...) backend object


def is_graph_record(record) -> bool:
    """Whether ``record`` was made by a compiled graph under ``watch(compiled=...)``."""
    module = record.module
    return isinstance(module, str) and module.startswith(GRAPH_MODULE)


def check_backend(backend):
    """``backend`` if ``watch(compiled=...)`` accepts it, else a ``ValueError``/``TypeError``
    naming what it accepts."""
    if isinstance(backend, str):
        if backend in BACKENDS:
            return backend
        raise ValueError(
            f"compiled must be one of {', '.join(map(repr, BACKENDS))} or a backend made with "
            f"torch._dynamo.backends.common.aot_autograd(...), got {backend!r}"
        )
    if aot_backend_parts(backend) is None:
        raise TypeError(
            f"compiled must be one of {', '.join(map(repr, BACKENDS))} or a backend made with "
            f"torch._dynamo.backends.common.aot_autograd(...), got {type(backend).__name__}"
        )
    return backend


class GraphsInterceptor(OpInterceptor):
    """The watch's dispatch mode under ``watch(compiled=...)``: Dynamo compiles with it on the
    stack (it stands aside while Dynamo compiles); the compiled graphs' own ops are logged by
    the recording backend, with python dispatch off."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def is_infra_mode(cls) -> bool:
        # torch 2.6 has no ignore_compile_internals: there Dynamo skips a frame whenever a mode
        # that is no "infra" mode is on the stack, and the step would run eagerly.
        return True


# -- which watch records, per thread -----------------------------------------------------------


class _Recording:
    """Where a thread's graphs log: the watch's log (which numbers their ops), its fingerprints
    (``prints``, or ``None``) and its interceptor (its ``inert`` switch and ``internal_error``)."""

    __slots__ = ("interceptor", "log", "prints", "thread")

    def __init__(self, interceptor, prints):
        self.interceptor = interceptor
        self.log = interceptor.log
        self.prints = prints
        self.thread = threading.get_ident()

    def record(self, func, site: int, module: tuple, phase: str, inputs, outputs, start: int, end: int) -> None:
        """Log one op of a graph: ``inputs``/``outputs`` the tensors. An error of opwatch's own
        here makes the watch inert with one warning; the graph runs on."""
        interceptor = self.interceptor
        if interceptor.inert:
            return
        try:
            self._record(func, site, module, phase, inputs, outputs, start, end)
        except Exception as error:
            interceptor.internal_error(error)

    def _record(self, func, site: int, module: tuple, phase: str, inputs, outputs, start: int, end: int) -> None:
        log = self.log
        in_metas = tensor_metas(inputs, log)
        out_metas = tensor_metas(outputs, log)
        entry = log.log_call(func, site, module, phase, in_metas, start_ns=start, end_ns=end, outputs=out_metas)
        prints = self.prints
        if prints is not None and outputs:
            observe = prints.for_op(func)
            if observe is not None:
                observe(entry, in_metas, outputs, out_metas)


_RECORDING: list = []  # _Recording of the active watch(compiled=...) blocks
_LOCK = threading.Lock()


def _current() -> _Recording | None:
    thread = threading.get_ident()
    for recording in reversed(_RECORDING):
        if recording.thread == thread:
            return recording
    return None


class _Held:
    """What ``hold`` set: the stance to put back and the recording to drop."""

    __slots__ = ("recording", "put_back")

    def __init__(self, recording, put_back):
        self.recording, self.put_back = recording, put_back


def hold(backend, interceptor, *, prints=None) -> _Held:
    """Make every compiled function compile with the recording wrapper of ``backend`` and log
    into ``interceptor``'s log from this thread, feeding the fingerprints tracker ``prints``
    (or none); ``release`` undoes it."""
    recording = _Recording(interceptor, prints)
    put_back = force_backend_stance(_recording_backend(backend))
    with _LOCK:
        _RECORDING.append(recording)
    return _Held(recording, put_back)


def release(held: _Held) -> None:
    with _LOCK:
        if held.recording in _RECORDING:
            _RECORDING.remove(held.recording)
    if held.put_back is not None:
        held.put_back()


# -- the recording backends ----------------------------------------------------------------------

_MADE = BoundedCache(64)  # backend (name or object id) -> (backend, its recording wrapper): one per backend
_GRAPHS = itertools.count(1)


class _Made(NamedTuple):
    backend: object  # kept alive: the cache is keyed by its id
    wrapper: object


def _recording_backend(backend):
    """The recording wrapper of ``backend``, the same one each time (Dynamo keeps one compiled
    code per forced backend: a second watch reuses the first one's)."""
    key = backend if isinstance(backend, str) else id(backend)
    made = _MADE.get(key)
    if made is None or made.backend is not backend:
        if backend == "inductor":
            wrapper = inductor_with_inner(lambda gm, compiled: _compiler(lambda *_: compiled, _phase_of(gm))(gm, None))
        elif backend == "aot_eager":
            wrapper = aot_eager_with(_compiler(None, FORWARD), _compiler(None, BACKWARD))
        else:
            parts = aot_backend_parts(backend)
            forward = parts["fw_compiler"]
            parts["fw_compiler"] = _compiler(forward, FORWARD)
            parts["bw_compiler"] = _compiler(parts.get("bw_compiler") or forward, BACKWARD)
            if parts.get("inference_compiler") is not None:
                parts["inference_compiler"] = _compiler(parts["inference_compiler"], FORWARD)
            wrapper = aot_backend_with(parts)
        made = _MADE.put(key, _Made(backend, wrapper))
    return made.wrapper


def _phase_of(gm) -> str:
    """Inductor's inner compiler is told nothing of the phase: a backward graph's inputs are
    named ``tangents_*``."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            return BACKWARD
    return FORWARD


def _compiler(inner, phase: str):
    """An AOTAutograd graph compiler that compiles with ``inner`` (``None``: run the graph as it
    is) and returns a boxed callable that records what the graph makes under a recording watch."""

    def compile_graph(gm, example_inputs):
        compiled = None if inner is None else inner(gm, example_inputs)
        graph = gm if inner is None else graph_module_behind(compiled)
        module = (f"{GRAPH_MODULE} {next(_GRAPHS)} ({phase})", None)  # a name, no module class (core.records.MODULE_PATH)
        if graph is not None:
            return _boxed(_NodesRun(graph, module, phase))
        return _boxed(_OutputsRun(gm, compiled, module, phase))

    return compile_graph


def _boxed(run):
    def call(args):
        return run(args)

    call._boxed_call = True
    return call


class _NodesRun:
    """Runs a graph as it is; under a recording watch node by node, each node's outputs logged."""

    def __init__(self, graph, module: tuple, phase: str):
        self.graph, self.module, self.phase = graph, module, phase
        self.sites = {}  # node -> (filename, lineno) or None

    def __call__(self, args):
        recording = _current()
        if recording is None:
            return self.graph(*args)
        caller = _caller_line()
        with no_python_dispatch():
            return _Recorder(self, recording, caller).run(*args)


class _Recorder(torch.fx.Interpreter):
    def __init__(self, run: _NodesRun, recording: _Recording, caller):
        # Values kept to the end of the run: each tensor's id names it until then (opwatch.diff
        # follows inputs to their producers by id).
        super().__init__(run.graph, garbage_collect_values=False)
        self._run, self._recording, self._caller = run, recording, caller

    def run_node(self, node):
        if node.op != "call_function" or not hasattr(node.target, "_schema") or node.target in _NOT_RECORDED:
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        start = perf_counter_ns()
        result = node.target(*args, **kwargs)
        end = perf_counter_ns()
        run = self._run
        inputs = [value for value in _flat((args, kwargs)) if isinstance(value, torch.Tensor)]
        outputs = [value for value in _flat(result) if isinstance(value, torch.Tensor)]
        site = _site(self._recording.log, node, self._caller)
        self._recording.record(node.target, site, run.module, run.phase, inputs, outputs, start, end)
        return result


# Not logged: the graph's writes of its inputs' new values (functionalization's epilogue);
# eager wrote them in place, where the op that made them is logged.
_NOT_RECORDED = frozenset((torch.ops.aten.copy_.default,))


def _flat(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flat(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flat(item)
    else:
        yield value


class _OutputsRun:
    """Runs a compiled graph (inductor's); under a recording watch each output is logged as the
    op of the graph that made it (through views, to the op that made its values)."""

    def __init__(self, gm, compiled, module: tuple, phase: str):
        self.compiled, self.module, self.phase = compiled, module, phase
        self.boxed = bool(getattr(compiled, "_boxed_call", False)) or type(compiled).__name__ == "CompiledFxGraph"
        self.makers = [_maker(node) for node in _flat(gm.graph.output_node().args)]

    def __call__(self, args):
        recording = _current()
        if recording is None or not self.makers:
            return self.compiled(args) if self.boxed else self.compiled(*args)
        start = perf_counter_ns()
        with no_python_dispatch():
            outputs = self.compiled(args) if self.boxed else self.compiled(*args)
        end = perf_counter_ns()
        log = recording.log
        flat = list(_flat(outputs))
        caller = _caller_line()
        for node, value in zip(self.makers, flat):
            if node is not None and isinstance(value, torch.Tensor):
                recording.record(node.target, _site(log, node, caller), self.module, self.phase, (), (value,), start, end)
        return outputs


def _maker(node):
    """The op node that made an output's values (views and clones followed to their input);
    ``None`` for an input passed through or a non-tensor."""
    for _ in range(64):
        if not isinstance(node, torch.fx.Node) or node.op != "call_function" or not hasattr(node.target, "_schema") or node.target in _NOT_RECORDED:
            return None
        facts = facts_of(node.target)
        if not (facts.is_view or facts.keeps_values):
            return node
        node = next((arg for arg in node.args if isinstance(arg, torch.fx.Node)), None)
    return None


# -- the user's line of a node -----------------------------------------------------------------

_FRAME = re.compile(r'File\s"([^"]+)",\sline\s(\d+),\sin\s')  # a traceback's frame line
_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
_OPWATCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")


def user_line(stack_trace: str | None) -> tuple | None:
    """``(filename, lineno)`` of the innermost frame of a node's ``stack_trace`` outside torch
    and opwatch, or ``None``."""
    if not stack_trace:
        return None
    found = None
    for filename, lineno in _FRAME.findall(stack_trace):
        if not filename.startswith((_TORCH_DIR, _OPWATCH_DIR)) and not filename.startswith("<"):
            found = (filename, int(lineno))
    return found


def _site(log, node, caller) -> int:
    """The node's user line; for a node whose trace has none (a graph Dynamo made of a torch
    function: ``optimizer.step``), the user's line that called the compiled code."""
    line = user_line(node.meta.get("stack_trace")) or caller
    return 0 if line is None else log.line_site(*line)


def _caller_line() -> tuple | None:
    """``(filename, lineno)`` of the innermost frame on the stack outside torch and opwatch."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH_DIR, _OPWATCH_DIR, "<")):
            return (filename, frame.f_lineno)
        frame = frame.f_back
    return None
