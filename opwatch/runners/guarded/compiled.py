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
step's own backend (inductor, or a custom one) is the first.
"""

from __future__ import annotations

from typing import NamedTuple

from ...core.compat import force_backend_stance

__all__ = ["STAGES", "CompiledVerdict", "verdict", "narrow"]

# Dynamo's registered backends, each one stage further from eager than the one before.
STAGES = ("eager", "aot_eager", "aot_eager_decomp_partition")


class CompiledVerdict(NamedTuple):
    """The facts of a failing step that runs compiled code: ``compiled`` (the
    ``EagerCompiled`` facts of what its replay ran eagerly), ``eager_fails``, ``origin`` (the
    replay's origin: ``(op, where)``, or ``None``) and ``stages`` (``(backend, outcome)`` per
    stage run: ``"finite"``, ``"nan/inf"``, ``"raised <Type>"`` or ``"not run"``)."""

    compiled: tuple
    eager_fails: bool
    origin: tuple | None
    stages: tuple


def verdict(watch, anomaly, stages=()) -> CompiledVerdict | None:
    """The verdict from the watch that ran the step eagerly (a replay's, or an audit's) and the
    anomaly it found (``None``: it found none); ``None`` when the step ran no compiled code."""
    compiled = tuple(getattr(watch, "compiled_eagerly", ()) or ())
    if not compiled:
        return None
    origin = None if anomaly is None else (anomaly.op, anomaly.where)
    return CompiledVerdict(compiled, anomaly is not None, origin, tuple(stages))


def narrow(step, args, kwargs, *, restore, finite) -> tuple:
    """Run ``step`` with each of :data:`STAGES` as every compiled function's backend, each from
    the step's start (``restore()``), until one is not finite (``finite(result)``); returns
    ``((backend, outcome), ...)`` for the stages run. The caller puts the start back after."""
    outcomes = []
    for backend in STAGES:
        restore()
        put_back = force_backend_stance(backend)
        if put_back is None:
            outcomes.append((backend, "not run"))
            break
        try:
            result = step(*args, **kwargs)
            outcome = "finite" if finite(result) else "nan/inf"
            del result
        except Exception as error:
            outcome = f"raised {type(error).__name__}"
        finally:
            put_back()
        outcomes.append((backend, outcome))
        if outcome != "finite":
            break
    return tuple(outcomes)
