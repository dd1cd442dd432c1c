""":func:`opwatch.diff` of a compiled run (``watch(fingerprints=True, compiled=BACKEND)``,
``opwatch.modes.compiled_graphs``) against an eager one, at the level both can see.

The compiled run's records are what its graphs made (every node under the AOT backends, each
graph's outputs under inductor) and the eager ops outside them. Each one with a fingerprint is
paired with an eager op of the same source line (file name and text), phase, output sizes
(numbers of elements) and dtypes, not paired before:

- the same op first, the one whose fingerprint is nearest (two layers on one line, two steps of
  a loop: the nearest values tell them apart); a pair that differs beyond the tolerance is a
  divergence;
- else (inductor's graphs are decomposed: ``aten.mean`` where eager ran ``aten.mse_loss``), the
  nearest eager op of another name *that agrees* within the tolerance; when none agrees, the
  record is not compared (listed as having no eager counterpart): a decomposed op is never
  paired with an unrelated op of the same shape.

Eager ops no graph record pairs with are not visible in the compiled run (fused into a kernel,
decomposed); they are counted, not reported. The runs *agree* when no pair differs.

The default tolerance (no ``rtol``/``atol`` given) is the outputs' dtype's, as
``torch.testing.assert_close`` has it (float32: ``rtol=1.3e-06, atol=1e-05``), not bitwise: a
compiled kernel sums in another order than eager, and its last bits differ.
"""

from __future__ import annotations

from ..core.records import BACKWARD, FORWARD
from ..modes.compiled_graphs import is_graph_record

__all__ = ["compiled_side", "pair_compiled", "compiled_tolerance"]


def compiled_side(run_a, run_b) -> str | None:
    """``"a"`` or ``"b"``: the run recorded under ``watch(compiled=...)`` (``a`` when both
    were); ``None`` when neither was."""
    for name, run in (("a", run_a), ("b", run_b)):
        if any(is_graph_record(record) for record in run.records):
            return name
    return None


def _key(run, step: int) -> tuple:
    record = run.records[step]
    _, base, text, _, phase = run.keys[step]
    outputs = record.outputs or ()
    # A compiled graph runs the optimizer's update and the clipping inside it, where no step hook
    # marks their phase: only forward and backward tell its ops from eager's.
    return (base, text, phase if phase == BACKWARD else FORWARD, tuple(_numel(meta.shape) for meta in outputs), tuple(str(meta.dtype) for meta in outputs))


def _numel(shape) -> int:
    """Outputs are paired by their number of elements, not their shape: a graph's output may be
    a view of its op's (a bias gradient ``sum(..., keepdim=True)`` flattened); the statistics
    and the hash of a contiguous tensor's values do not depend on its shape."""
    count = 1
    for size in shape or ():
        count *= size
    return count


def _distance(print_a, print_b, gaps) -> float:
    """How far two outputs' fingerprints are: 0 for equal bits, else the largest relative gap."""
    if print_a.hash == print_b.hash:
        return 0.0
    return max((gap / scale if scale else (0.0 if not gap else float("inf"))) for gap, scale in gaps(print_a, print_b))


def pair_compiled(compiled, eager, tolerance, gaps) -> list[tuple]:
    """``(step in compiled, step in eager or None)`` for each record of the compiled run with
    fingerprints, in its stream order (see the module's docstring)."""
    by_key: dict = {}
    for step in range(len(eager.records)):
        if eager.fingerprints(step):
            by_key.setdefault(_key(eager, step), []).append(step)
    used: set = set()
    pairs = []
    for step, record in enumerate(compiled.records):
        prints = compiled.fingerprints(step)
        if not prints or all(found is None for found in prints):
            continue
        candidates = [other for other in by_key.get(_key(compiled, step), ()) if other not in used]
        same = [other for other in candidates if eager.records[other].op == record.op]
        chosen = _nearest(compiled, eager, step, same, gaps)
        if chosen is None and is_graph_record(record):
            near = _nearest(compiled, eager, step, candidates, gaps)
            if near is not None and _agree(compiled, eager, step, near, tolerance):
                chosen = near
        if chosen is not None:
            used.add(chosen)
        pairs.append((step, chosen))
    return pairs


def _nearest(compiled, eager, step: int, candidates: list, gaps):
    best, best_distance = None, None
    prints = compiled.fingerprints(step)
    for other in candidates:
        others = eager.fingerprints(other)
        distance = 0.0
        for x, y in zip(prints, others):
            if x is not None and y is not None:
                distance = max(distance, _distance(x, y, gaps))
        if best is None or distance < best_distance:
            best, best_distance = other, distance
    return best


def _agree(compiled, eager, step: int, other: int, tolerance) -> bool:
    return all(x is None or y is None or tolerance.close(x, y) for x, y in zip(compiled.fingerprints(step), eager.fingerprints(other)))


def _rtol(defaults: dict, name: str) -> float:
    rtol, _ = defaults[name]
    return rtol


def compiled_tolerance(compiled, dtype_name, defaults: dict):
    """``(rtol, atol, dtype name)``: the lowest precision among the compiled run's graph
    outputs, by ``defaults`` (dtype name -> (rtol, atol)); float32's when none is known."""
    lowest = None
    for record in compiled.records:
        if not is_graph_record(record):
            continue
        for meta in record.outputs or ():
            name = dtype_name(meta.dtype)
            if name in defaults and (lowest is None or _rtol(defaults, name) > _rtol(defaults, lowest)):
                lowest = name
    lowest = lowest or "float32"
    return (*defaults[lowest], lowest)
