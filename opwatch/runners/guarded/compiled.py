"""The verdict on a failing guarded step that runs compiled code.

The failing run was compiled (a healthy call runs with no dispatch mode); its replay under the
full watch ran the same step eagerly (a watch runs compiled code uncompiled:
:mod:`opwatch.modes.compiled`), from the same start, on the same inputs. So either the replay
found the nan/inf origin (*eager also fails*: the bug is in the program, at that op), or the
replay stayed finite (*only the compiled step makes nan/inf*). In that second case the step is
run again from the same start with Dynamo's backends in turn, each one stage more of the
compiler (``eager``: Dynamo's graph run as it is; ``aot_eager``: AOTAutograd's forward and
backward graphs; ``aot_eager_decomp_partition``: with inductor's decompositions and the
partitioner), and the first stage whose step is not finite is named; when all are finite, the
step's own backend (inductor, or a custom one) is the first. Then :mod:`.narrow` names the
first graph node the failing backend gets wrong and its source line, inductor's settings that
bring a step closer to eager are tried one by one, and :mod:`.graph_repro` writes a one-file
repro of the failing graph on its saved inputs.
"""

from __future__ import annotations

from typing import NamedTuple

from ...core.compat import compiled_code_set_aside, is_inductor, registered_backend
from .graph_repro import backend_spec, write_graph_repro
from .narrow import Capture, Narrowed, NodeFact, first_wrong_node, run_with, settings_runs

__all__ = ["STAGES", "CompiledVerdict", "verdict", "narrow", "explain"]

# Dynamo's registered backends, each one stage further from eager than the one before.
STAGES = ("eager", "aot_eager", "aot_eager_decomp_partition")


class CompiledVerdict(NamedTuple):
    """The facts of a failing step that runs compiled code: ``compiled`` (the
    ``EagerCompiled`` facts of what its replay ran eagerly), ``eager_fails``, ``origin`` (the
    replay's origin: ``(op, where)``, or ``None``) and ``stages`` (``(backend, outcome)`` per
    stage run: ``"finite"``, ``"nan/inf"``, ``"raised <Type>"``, ``"not run"`` (no
    ``set_stance`` in this torch) or ``"not apart"`` (no way in this torch to keep the runs'
    compiles out of the program's compiled code)).

    For a step only the compiled run fails: ``backend`` (the failing backend: a stage's name,
    a registered backend's name such as ``"inductor"``, or a custom backend's
    ``module:qualname``), ``own`` (the outcome of the run with the frames' own backends, when
    every stage was finite), ``node`` (the first graph node the failing backend gets wrong, a
    :class:`~opwatch.runners.guarded.narrow.NodeFact`, or ``None``), ``narrowed`` (``"found"``,
    or why no node: ``"outputs_agree"``, ``"no_graph"``, ``"too_large"``, ``"raised <Type>"``), ``settings``
    (``(setting, outcome)`` per inductor setting run, when the failing backend is inductor) and
    ``repro`` (the one-file repro's path, or ``None``)."""

    compiled: tuple
    eager_fails: bool
    origin: tuple | None
    stages: tuple
    backend: str | None = None
    own: str | None = None
    node: NodeFact | None = None
    narrowed: str | None = None
    settings: tuple = ()
    repro: str | None = None


def verdict(watch, anomaly, stages=()) -> CompiledVerdict | None:
    """The verdict from the watch that ran the step eagerly (a replay's, or an audit's) and the
    anomaly it found (``None``: it found none); ``None`` when the step ran no compiled code."""
    compiled = tuple(getattr(watch, "compiled_eagerly", ()) or ())
    if not compiled:
        return None
    origin = None if anomaly is None else (anomaly.op, anomaly.where)
    return CompiledVerdict(compiled, anomaly is not None, origin, tuple(stages))


def narrow(step, args, kwargs, *, restore, finite, max_bytes=128 * 2**20, apart=None) -> tuple:
    """Run ``step`` with each of :data:`STAGES` as every compiled function's backend, each from
    the step's start (``restore()``), until one is not finite (``finite(result)``); when all
    are, once more with each frame's own backend. Every run keeps the graphs Dynamo hands the
    backend (:class:`~.narrow.Capture`). Returns ``(stages, own, failing, graphs)``:
    ``((backend, outcome), ...)`` for the stages run, the own backends' outcome (or ``None``),
    the failing backend's name (or ``None``) and the graphs of the failing run. The caller puts
    the start back after. Every run compiles beside the program's compiled code and leaves it as
    it was (:func:`~.narrow.run_with`; ``apart``, where the caller made it)."""
    apart = compiled_code_set_aside() if apart is None else apart
    outcomes = []
    for backend in STAGES:
        capture = Capture(registered_backend(backend), max_bytes=max_bytes)
        outcome = run_with(capture, step, args, kwargs, restore=restore, finite=finite, apart=apart)
        outcomes.append((backend, outcome))
        if outcome in ("not run", "not apart"):
            return tuple(outcomes), None, None, ()
        if outcome != "finite":
            return tuple(outcomes), None, backend, tuple(capture.graphs)
    capture = Capture(max_bytes=max_bytes)
    own = run_with(capture, step, args, kwargs, restore=restore, finite=finite, apart=apart)
    graphs = tuple(capture.graphs)
    first = next(iter(graphs), None)
    failing = backend_spec(first.backend) if first is not None and own != "finite" else None
    return tuple(outcomes), own, failing, graphs if own != "finite" else ()


def explain(found: CompiledVerdict, step, args, kwargs, *, restore, finite, max_bytes, repro_dir, repro=True) -> CompiledVerdict:
    """The stages (:func:`narrow`), then the first wrong node of the failing run's graphs, the
    inductor settings (when the failing backend is inductor) and the one-file repro. opwatch's
    own failure here (never the step's: :func:`~.narrow.run_with` keeps those as outcomes)
    leaves the verdict as far as it got, with ``narrowed`` saying what raised."""
    try:
        return _explain(found, step, args, kwargs, restore=restore, finite=finite, max_bytes=max_bytes, repro_dir=repro_dir, repro=repro)
    except Exception as error:
        return found._replace(narrowed=f"raised {type(error).__name__}")


def _explain(found, step, args, kwargs, *, restore, finite, max_bytes, repro_dir, repro):
    apart = compiled_code_set_aside()  # the functions found once for every run of the verdict
    stages, own, failing, graphs = narrow(step, args, kwargs, restore=restore, finite=finite, max_bytes=max_bytes, apart=apart)
    found = found._replace(stages=stages, own=own, backend=failing)
    if failing is None:
        return found
    try:  # opwatch's own work: a failure here leaves the verdict without it, never the step's error
        narrowed = first_wrong_node(graphs) if graphs else Narrowed(None, "no_graph", None)
    except Exception as error:
        narrowed = Narrowed(None, f"raised {type(error).__name__}", None)
    found = found._replace(node=narrowed.node, narrowed=narrowed.reason)
    if own not in (None, "finite") and graphs and any(is_inductor(captured.backend) for captured in graphs):
        try:
            found = found._replace(settings=settings_runs(step, args, kwargs, restore=restore, finite=finite, max_bytes=max_bytes, apart=apart))
        except Exception as error:
            found = found._replace(settings=(("settings", f"raised {type(error).__name__}"),))
    captured = narrowed.captured
    if repro and captured is not None and captured.inputs is not None:
        try:
            path = write_graph_repro(captured, failing, repro_dir, node=narrowed.node, graphs=len(graphs))
        except Exception:
            path = None
        found = found._replace(repro=path)
    return found
