"""Narrowing a compiled-only nan/inf down to the graph node that makes it.

When a guarded step makes nan/inf compiled and its eager replay is finite, the step runs again
from its start with a backend that keeps a copy of each FX graph Dynamo hands it, and that
graph's example inputs (:class:`Capture`), then compiles it with the backend that failed (a stage
of :data:`~.compiled.STAGES`, or the frame's own backend, read from Dynamo's cache).
:func:`first_wrong_node` then runs each captured graph eagerly node by node
(``torch.fx.Interpreter``, every node's output kept) and through the failing backend cut short
at node *k* (the graph's prefix, its output that node's), and bisects over *k* for the first
node whose compiled output is not finite where eager's is, or is outside ``opwatch.diff``'s
dtype-aware tolerance (:data:`opwatch.runners.divergence.DEFAULT_TOLERANCES`). Nodes whose
eager value depends on the random numbers (their value changes with the RNG state) are compared
for nan/inf only: a backend may draw other random numbers than eager by design.

When every captured graph's forward outputs agree, :func:`first_wrong_node` turns to their
backward: each graph runs with autograd, eagerly and through the failing backend (which compiles
its backward too: AOTAutograd's graph, inductor's kernels), a gradient of ones on its outputs,
and the gradients of its inputs are compared the same way. When they differ, the same bisection
over *k* runs on the graph's prefixes (a prefix's backward is the backward of the nodes up to
*k*, a gradient of ones on node *k*'s output): the first node whose backward the failing backend
gets wrong, and the input (a parameter, by its name in the model) whose gradient shows it.

What it covers: the graphs Dynamo captured, forward and backward, on the inputs of their first
call in the step. Not a later call of the same graph in the step, nor a backward that goes wrong
only with the step's own output gradients (a gradient of ones stands for them). The bisection
assumes that once a node is wrong, the nodes after it that read it are wrong too (the usual
case: nan propagates).
"""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

import torch
from torch import fx

from ...core.compat import NODE_STACK_TRACE, compiled_code_set_aside, force_backend_stance, frame_backends, inductor_settings
from ...core.sites import display_path
from ..divergence import DEFAULT_TOLERANCES

__all__ = ["Captured", "Capture", "Value", "NodeFact", "Narrowed", "run_with", "first_wrong_node", "settings_runs", "SETTINGS"]

# Inductor settings that make a compiled step closer to eager, each run on its own.
SETTINGS = ("emulate_precision_casts", "fallback_random")

# Node metadata kept on a copied graph: where a node came from (the rest, fake tensors of
# Dynamo's trace, belongs to the trace and would confuse a later compile).
_KEPT_META = (NODE_STACK_TRACE, "nn_module_stack", "source_fn_stack")
_FRAME = re.compile(r'\s*File "(.+)", line ([0-9]+)')  # a frame's head line; its code is the next line


class Captured(NamedTuple):
    """One FX graph Dynamo handed the backend: ``graph`` (a ``GraphModule`` copied before the
    backend saw it), ``inputs`` (its example inputs, tensors cloned; ``None`` when they were
    over the byte limit), ``rng`` (the CPU RNG state when it was compiled), ``backend`` (the
    callable that compiled it) and ``input_names`` (each input as the program knows it:
    ``fc1.weight``, ``args[0]``; from Dynamo's sources, ``""`` where none is known)."""

    graph: object
    inputs: tuple | None
    rng: object
    backend: object
    input_names: tuple = ()


class Capture:
    """A torch.compile backend that keeps a copy of each graph and of its example inputs (at
    most ``max_bytes`` of tensor data in all), then compiles it with ``inner``; with ``inner``
    ``None``, with the backend the frame was compiled with by the program (the first of its
    Dynamo cache entries that is no ``Capture``; for a frame the program's cache does not know,
    such as the resume function of a graph break in a copy of its code, the backend of the
    frame compiled before it in this run)."""

    def __init__(self, inner=None, *, max_bytes: int):
        self.inner = inner
        self.graphs: list[Captured] = []
        self._budget = max_bytes
        self._own = None  # the own backend found last

    def __call__(self, gm, example_inputs):
        inner = self.inner
        if inner is None:
            inner = next((backend for backend in frame_backends() if not isinstance(backend, Capture)), self._own)
            if inner is None:
                raise RuntimeError("opwatch.guard: the compiled frame's own backend was not found in Dynamo's cache")
            self._own = inner
        size = sum(value.numel() * value.element_size() for value in example_inputs if isinstance(value, torch.Tensor))
        inputs = None
        if size <= self._budget:
            self._budget -= size
            inputs = tuple(_fresh(value) for value in example_inputs)
        self.graphs.append(Captured(copy_graph(gm), inputs, torch.get_rng_state(), inner, input_names(gm)))
        return inner(gm, example_inputs)


def input_names(gm) -> tuple:
    """Each placeholder of Dynamo's graph as the program names it: the source Dynamo read it
    from (``L['self']._modules['fc1']._parameters['weight']``) made readable (``fc1.weight``)."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        try:
            text = name() if callable(name) else name
        except Exception:
            text = None
        names.append(readable_source(text) if isinstance(text, str) else "")
    return tuple(names)


def readable_source(text: str) -> str:
    """``L['self']._modules['fc1']._parameters['weight']`` -> ``fc1.weight``; ``L['x']`` ->
    ``x``; ``L['args'][0]`` -> ``args[0]``."""
    readable = re.sub(r"^[LG]\['(?:self|fn|mod)'\]", "", text)  # the compiled module itself
    readable = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", readable)
    readable = re.sub(r"^[LG]\['([^']+)'\]", r"\1", readable)
    return readable.lstrip(".") or text


def run_with(backend, step, args, kwargs, *, restore, finite, apart=None) -> str:
    """Run ``step`` from its start with ``backend`` as every compiled function's backend:
    ``"finite"``, ``"nan/inf"``, ``"raised <Type>"``, ``"not run"`` (no stance in this torch) or
    ``"not apart"`` (this torch gives no way to keep the run's compiles out of the
    program's compiled code: :func:`~opwatch.core.compat.compiled_code_set_aside`).

    The run compiles each frame afresh for ``backend``, on copies of the program's code objects:
    its compiles never count towards the recompile budget of the program's frames, and they are
    dropped when it ends (the program's cache entries are left as they were). ``apart``: a
    :func:`~opwatch.core.compat.compiled_code_set_aside` made for several runs (it looks for the
    functions once), else one is made for this run."""
    apart = compiled_code_set_aside() if apart is None else apart
    if apart is None:
        return "not apart"
    restore()
    with apart:
        put_back = force_backend_stance(backend)
        if put_back is None:
            return "not run"
        try:
            result = step(*args, **kwargs)
            outcome = "finite" if finite(result) else "nan/inf"
            del result
        except Exception as error:
            outcome = f"raised {type(error).__name__}"
        finally:
            put_back()
    return outcome


def settings_runs(step, args, kwargs, *, restore, finite, max_bytes, apart=None) -> tuple:
    """Run ``step`` from its start once per inductor setting of :data:`SETTINGS`, set to
    ``True`` for that run only, each compiling afresh with the frames' own backends (beside the
    program's compiled code, as :func:`run_with` says): ``((setting, outcome), ...)``."""
    apart = compiled_code_set_aside() if apart is None else apart
    outcomes = []
    for name in SETTINGS:
        patch = inductor_settings(**{name: True})
        if patch is None:
            outcomes.append((name, "not run"))
            continue
        with patch:
            outcomes.append((name, run_with(Capture(max_bytes=max_bytes), step, args, kwargs, restore=restore, finite=finite, apart=apart)))
    return tuple(outcomes)


# -- graphs --------------------------------------------------------------------------------------


def copy_graph(gm, output=None):
    """A ``GraphModule`` of ``gm``'s graph (its nodes copied, with only :data:`_KEPT_META`);
    with ``output`` (a node's name), cut after that node, which becomes its one output."""
    graph = fx.Graph()
    env: dict = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            (returned,) = node.args
            graph.output(fx.map_arg(returned, lambda arg: env[arg]))
            break
        copied = env[node] = graph.node_copy(node, lambda arg: env[arg])
        copied.meta = {key: node.meta[key] for key in _KEPT_META if key in node.meta}
        if node.name == output:
            graph.output((copied,))
            break
    return fx.GraphModule(gm, graph)


class _Recording(fx.Interpreter):
    """Runs a graph eagerly, node by node, keeping a copy of every node's tensor output by the
    node's name (a copy: a later in-place node must not change what was kept)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict = {}

    def run_node(self, node):
        value = super().run_node(node)
        self.values[node.name] = value.clone() if isinstance(value, torch.Tensor) else value
        return value


def _fresh(value):
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(value.requires_grad)


@contextlib.contextmanager
def _rng(state):
    saved = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(saved)


def _eager(captured, seed=None) -> dict:
    recording = _Recording(captured.graph)
    with _rng(captured.rng), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        recording.run(*(_fresh(value) for value in captured.inputs))
    return recording.values


def _compiled(captured, output=None) -> list:
    """The outputs of ``captured``'s graph (cut after node ``output``) compiled with its
    backend, run on its inputs from its RNG state."""
    gm = copy_graph(captured.graph, output)
    compiled = captured.backend(gm, [_fresh(value) for value in captured.inputs])
    with _rng(captured.rng):
        out = compiled(*(_fresh(value) for value in captured.inputs))
    outputs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [value.detach() if isinstance(value, torch.Tensor) else value for value in outputs]


# -- comparing a node's outputs ------------------------------------------------------------------


class Value(NamedTuple):
    """What a tensor holds: ``kind`` (``"finite"``, ``"nan"``, ``"inf"``), ``nonfinite`` (how
    many values are not), ``numel`` and ``max_abs`` (the largest finite magnitude; ``None``
    when no value is finite)."""

    kind: str
    nonfinite: int
    numel: int
    max_abs: float | None


def value_of(tensor) -> Value:
    with torch.no_grad():
        data = tensor.detach()
        finite = torch.isfinite(data)
        bad = int(data.numel() - finite.sum())
        kind = "nan" if bool(torch.isnan(data).any()) else ("inf" if bad else "finite")
        magnitudes = data[finite].abs()
        largest = float(magnitudes.max()) if magnitudes.numel() else None
    return Value(kind, bad, data.numel(), largest)


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()) and value.layout == torch.strided


def wrong(eager, compiled, *, random=False) -> tuple | None:
    """``(why, max abs difference)`` when ``compiled`` is not finite where ``eager`` is
    (``"nan/inf"``) or, unless ``random``, outside the dtype's tolerance (``"tolerance"``);
    ``None`` when it agrees (or cannot be compared: another shape, dtype or kind)."""
    if not (_floating(eager) and isinstance(compiled, torch.Tensor)) or compiled.shape != eager.shape or compiled.dtype != eager.dtype:
        return None
    with torch.no_grad():
        eager, compiled = eager.detach(), compiled.detach().to(eager.device)
        both = torch.isfinite(eager) & torch.isfinite(compiled)
        difference = (compiled - eager).abs()[both]
        largest = float(difference.max()) if difference.numel() else None
        if bool((torch.isfinite(eager) & ~torch.isfinite(compiled)).any()):
            return "nan/inf", largest
        if random or difference.numel() == 0:
            return None
        rtol, atol = _tolerance(eager.dtype)
        if bool((difference > atol + rtol * eager.abs()[both]).any()):
            return "tolerance", largest
    return None


class NodeFact(NamedTuple):
    """The first graph node whose compiled output is wrong: ``graph`` of ``graphs`` (1-based,
    in the order Dynamo captured them), the node's ``name`` and ``op`` (its target), ``where``
    (``file:line`` of the user's line that made it, from the node's stack trace, or ``None``)
    and ``code`` (that line's text), its ``eager`` and ``compiled`` :class:`Value`, ``why``
    (``"nan/inf"`` or ``"tolerance"``), ``difference`` (the largest absolute difference where
    both are finite, or ``None``), ``rtol`` and ``atol`` (its dtype's tolerance).

    ``phase`` is ``"forward"`` (the node's output is wrong) or ``"backward"`` (the node's
    output agrees; its backward is wrong): then ``gradient`` names the graph input whose
    gradient shows it (``fc1.weight``; ``input 3`` when Dynamo gave no name), and ``eager`` and
    ``compiled`` are that gradient's values."""

    graph: int
    graphs: int
    name: str
    op: str
    where: str | None
    code: str | None
    eager: Value
    compiled: Value
    why: str
    difference: float | None
    rtol: float
    atol: float
    phase: str = "forward"
    gradient: str | None = None


class Narrowed(NamedTuple):
    """What narrowing found: ``node`` (a :class:`NodeFact`, or ``None``), ``reason``
    (``"found"``; ``"no_graph"``: nothing was captured; ``"too_large"``: the inputs were over
    the byte limit; ``"outputs_agree"``: every captured graph's outputs, and its inputs'
    gradients under a gradient of ones, agree with eager on its inputs; ``"raised <Type>"``:
    compiling or running a graph raised) and
    ``captured``: the graph the repro is made of (the node's, else the first), or ``None``."""

    node: NodeFact | None
    reason: str
    captured: Captured | None


def first_wrong_node(graphs) -> Narrowed:
    """The first node, over the captured ``graphs`` in order, whose output the failing backend
    gets wrong (see the module's doc)."""
    if not graphs:
        return Narrowed(None, "no_graph", None)
    usable = [captured for captured in graphs if captured.inputs is not None]
    if not usable:
        first, *_ = graphs
        return Narrowed(None, "too_large", first)
    # The forward graphs first, then their backward (which runs after every forward graph).
    for narrow_one in (_narrow_graph, _narrow_backward):
        for position, captured in enumerate(graphs, 1):
            if captured.inputs is None:
                continue
            try:
                node = narrow_one(captured, position, len(graphs))
            except Exception as error:
                return Narrowed(None, f"raised {type(error).__name__}", captured)
            if node is not None:
                return Narrowed(node, "found", captured)
    first, *_ = usable
    return Narrowed(None, "outputs_agree", first)


def _random_nodes(captured, eager) -> set:
    """The nodes whose eager value changes with the RNG state (a random op, what reads it)."""
    reseeded = _eager(captured, seed=torch.initial_seed() + 1)
    return {name for name, value in eager.items() if _floating(value) and not _same(value, reseeded.get(name))}


def _narrow_graph(captured, position, count) -> NodeFact | None:
    eager = _eager(captured)
    random = _random_nodes(captured, eager)
    nodes = [node for node in captured.graph.graph.nodes if node.op.startswith("call") and _floating(eager.get(node.name))]
    order = {node.name: index for index, node in enumerate(nodes)}
    (output,) = [node for node in captured.graph.graph.nodes if node.op == "output"]
    (returned,) = output.args
    returned = returned if isinstance(returned, (tuple, list)) else [returned]
    outputs = _compiled(captured)
    known: dict = {}  # node index -> ((why, difference) or None, compiled value)
    for node, value in zip(returned, outputs):
        if isinstance(node, fx.Node) and node.name in order:
            found = wrong(eager[node.name], value, random=node.name in random)
            if found is not None:
                known[order[node.name]] = (found, value)
    if not known:
        return None

    def judged(index):
        if index not in known:
            name = nodes[index].name
            try:
                value, *_ = _compiled(captured, name)
            except Exception:  # a backend that cannot compile this prefix: no verdict on it
                known[index] = (None, None)
            else:
                known[index] = (wrong(eager[name], value, random=name in random), value)
        found, _ = known[index]
        return found is not None

    high = _first_judged(min(known), judged)  # the first wrong output: wrong in the whole graph
    node = nodes[high]
    (why, difference), value = known[high]
    where, code = source_line(node)
    rtol, atol = _tolerance(eager[node.name].dtype)
    return NodeFact(position, count, node.name, target_name(node), where, code, value_of(eager[node.name]), value_of(value), why,
                    difference, rtol, atol)


def _first_judged(high, judged) -> int:
    """The first index in ``0..high`` that ``judged``, bisecting (``high`` is known judged): the
    first wrong node, assuming the nodes after a wrong one are wrong too."""
    low = -1
    while high - low > 1:
        middle = (low + high) // 2
        if judged(middle):
            high = middle
        else:
            low = middle
    return high


def _tolerance(dtype) -> tuple:
    """``(rtol, atol)`` of ``opwatch.diff`` for ``dtype`` (0, 0 where it has none)."""
    return DEFAULT_TOLERANCES.get(str(dtype).removeprefix("torch."), (0.0, 0.0))


def _gradients(captured, output=None, *, compiled: bool) -> dict:
    """The gradients of ``captured``'s inputs (``{position: gradient}``) from a backward of a
    gradient of ones on its outputs (cut after node ``output``), its graph run eagerly or
    compiled with its backend (which compiles the backward too), from its RNG state."""
    gm = copy_graph(captured.graph, output)
    fn = captured.backend(gm, [_fresh(value) for value in captured.inputs]) if compiled else gm
    inputs = [_fresh(value) for value in captured.inputs]
    with _rng(captured.rng), torch.enable_grad():
        out = fn(*inputs)
        outputs = [value for value in (out if isinstance(out, (tuple, list)) else [out])
                   if _floating(value) and value.requires_grad]
        if not outputs:
            return {}
        torch.autograd.backward(outputs, [torch.ones_like(value) for value in outputs])
    return {position: value.grad.detach() for position, value in enumerate(inputs)
            if isinstance(value, torch.Tensor) and value.grad is not None}


def _wrong_gradient(captured, output, random) -> tuple | None:
    """``(position, (why, difference), eager gradient, compiled gradient)`` of the first input
    whose gradient the compiled backward (of the graph cut after ``output``) gets wrong, or
    ``None``."""
    eager = _gradients(captured, output, compiled=False)
    if not eager:
        return None
    compiled = _gradients(captured, output, compiled=True)
    for position, expected in eager.items():
        found = wrong(expected, compiled.get(position), random=random)
        if found is not None:
            return position, found, expected, compiled[position]
    return None


def _narrow_backward(captured, position, count) -> NodeFact | None:
    """The first node whose backward the failing backend gets wrong, when the graph's outputs
    agree: the whole graph's input gradients first, then a bisection over its prefixes."""
    eager = _eager(captured)
    random = _random_nodes(captured, eager)
    nodes = [node for node in captured.graph.graph.nodes if node.op.startswith("call") and _floating(eager.get(node.name))]
    whole = _wrong_gradient(captured, None, bool(random))
    if whole is None or not nodes:
        return None
    known: dict = {}

    def judged(index):
        if index not in known:
            cut = {node.name for node in nodes[:index + 1]}
            try:
                known[index] = _wrong_gradient(captured, nodes[index].name, bool(cut & random))
            except Exception:  # a backend that cannot compile this prefix: no verdict on it
                known[index] = None
        return known[index] is not None

    # The whole graph is wrong: its last node's prefix, unless the graph returns more than it.
    last = len(nodes) - 1
    if not judged(last):
        known[last] = whole
    high = _first_judged(last, judged)
    node = nodes[high]
    at, (why, difference), expected, value = known[high]
    where, code = source_line(node)
    names = captured.input_names
    name = names[at] if at < len(names) and names[at] else f"input {at}"
    rtol, atol = _tolerance(expected.dtype)
    return NodeFact(position, count, node.name, target_name(node), where, code, value_of(expected), value_of(value), why,
                    difference, rtol, atol, "backward", name)


def _same(a, b) -> bool:
    if not (isinstance(b, torch.Tensor) and a.shape == b.shape):
        return False
    return bool(torch.equal(torch.nan_to_num(a.detach()), torch.nan_to_num(b.detach())))


def source_line(node) -> tuple:
    """``(file:line, the line's text)`` of the innermost frame of the node's stack trace (the
    user's line that made it), or ``(None, None)``."""
    lines = (node.meta.get(NODE_STACK_TRACE) or "").splitlines()
    heads = [(position, match) for position, line in enumerate(lines) if (match := _FRAME.match(line))]
    if not heads:
        return None, None
    *_, (position, match) = heads
    filename, line = match.groups()
    code = lines[position + 1].strip() if position + 1 < len(lines) and not _FRAME.match(lines[position + 1]) else ""
    return f"{display_path(filename)}:{line}", code or None


def target_name(node) -> str:
    """The node's op: ``torch.sqrt``, ``operator.mul``, ``Tensor.view``, ``module fc1``."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return f"module {target}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or str(target)
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch") or getattr(torch, name, None) is target:
        return f"torch.{name}" if getattr(torch, name, None) is target else f"{module}.{name}"
    return f"{module}.{name}" if module else name
