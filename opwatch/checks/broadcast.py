"""broadcast: a pointwise op whose result is larger than every operand because both sides grew.

The classic bug: a vector of length n meets an ``(n, 1)`` column (an ``nn.Linear(_, 1)``
output, a reshape) and ``y - pred`` silently becomes ``(n, n)``. Shapes alone cannot tell that
from a deliberate outer product, so the rule also uses how each operand got its size-1 dims.

The rule, for an op whose result has more elements than every operand:

- an operand is *implicitly* expanded when broadcasting prepends dims to it (a 1-d ``(n,)``
  against a 2-d operand);
- an operand is *explicitly* expanded along each of its own size-1 dims that the result
  stretches; such a dim is *deliberate* when the program made it with ``unsqueeze`` or ``None``
  indexing (``x[:, None]``, ``x[..., None]``), possibly followed by shape-preserving ops
  (``.float()``, ``.clone()``, unary math), or when it was made inside the same call as the
  op itself (``torch.outer`` reshapes internally);
- flagged: some operand is implicitly expanded while another is explicitly expanded along a
  dim that is not deliberate.

So ``(n,) - (n, 1)`` from a Linear is flagged; ``x - x.mean(-1, keepdim=True)`` (no growth),
masks ``(B, 1, 1, S) + (B, H, S, S)`` (no growth), ``a[:, None] - b[None]``, ``a.view(-1, 1) *
b.view(1, -1)`` (both sides explicit) and rotary ``pos[..., None].float() * inv_freq`` are not.

Limit: ``F.mse_loss`` and its kin broadcast with ``torch.broadcast_tensors`` (two ``expand``
ops) before a loss kernel that sees equal shapes; torch itself warns there, opwatch does not.

Findings hold facts only (a rule name per sentence family); their sentences are made in
:mod:`opwatch.render.broadcast`, where each rule's facts are listed.
"""

from __future__ import annotations

import math
from functools import partial
from itertools import islice
from typing import NamedTuple

import torch

from ..core.ops import facts_of
from ..core.records import E_ARGS, E_INDEX, E_SITE, M_IDENT, M_SHAPE
from .finding import Finding

__all__ = ["KIND", "for_op", "check", "broadcast_shape", "ShapeProvenance", "Expand"]

KIND = "broadcast"

_UNSQUEEZE = "aten::unsqueeze"
_EXPAND = "aten::expand"
# ShapeProvenance's entries: (shape, deliberate dims, site id).
_K_SHAPE, _K_DELIBERATE, _K_SITE = 0, 1, 2
# Ops whose output keeps its input's shape and meaning: size-1 dims made on purpose stay so.
_SHAPE_PRESERVING = {"aten::_to_copy", "aten::clone", "aten::contiguous", "aten::detach", "aten::alias", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::to"}

def for_op(func):
    """The check bound to ``func``, as ``check(tensors, context) -> Finding | None``; ``None``
    when it cannot fire on this op."""
    if func._schema.name == _EXPAND:
        return partial(_check_expand, func)
    # In-place and out= variants cannot grow their destination.
    if torch.Tag.pointwise in func.tags and not func._schema.is_mutable and facts_of(func).takes_several_tensors:
        return partial(check, func)
    return None


def broadcast_shape(shapes) -> tuple[int, ...] | None:
    """The broadcast of ``shapes``, or ``None`` when they do not broadcast."""
    ndim = max(len(shape) for shape in shapes)
    result = [1] * ndim
    for shape in shapes:
        offset = ndim - len(shape)
        for i, size in enumerate(shape):
            current = result[offset + i]
            if size == current or size == 1:
                continue
            if current == 1:
                result[offset + i] = size
            else:
                return None
    return tuple(result)


def _fits(shape, into) -> bool:
    """Whether ``shape`` broadcasts to ``into`` without changing it (right-aligned, each dim
    equal or 1): then ``into`` is the result and nothing grew beyond it."""
    offset = len(into) - len(shape)
    if offset < 0:
        return False
    for i, size in enumerate(shape):
        if size != 1 and size != into[offset + i]:
            return False
    return True


def check(func, tensors, context, *, made_by_broadcast_tensors: bool = False) -> Finding | None:
    if len(tensors) < 2:
        return None
    first = tensors[0][M_SHAPE]
    for meta in tensors:
        if meta[M_SHAPE] != first:
            break
    else:
        return None  # nothing is broadcast
    shapes = []
    widest = ()
    for meta in tensors:
        shape = meta[M_SHAPE]
        if shape is None:
            return None  # nested tensors have no single shape
        shapes.append(shape)
        if len(shape) > len(widest):
            widest = shape
    for shape in shapes:
        if shape != widest and not _fits(shape, widest):
            break
    else:
        # Nothing grew beyond the widest operand: a bias, a mask, a keepdim statistic
        # meeting the full tensor.
        return None
    result = broadcast_shape(shapes)
    if result is None:
        return None  # the kernel raises its own error
    result_numel = math.prod(result)
    if result_numel <= max(math.prod(shape) for shape in shapes):
        return None
    implicit = []
    accidental = []
    for meta in tensors:
        shape = meta[M_SHAPE]
        ndim = len(shape)
        if ndim == 0:
            continue
        if any(size > 1 for size in result[: len(result) - ndim]):
            implicit.append(meta)
        stretched = [d for d in range(-ndim, 0) if shape[d] == 1 and result[d] > 1]
        if stretched:
            deliberate = context.shapes.deliberate_dims(meta, context.site)
            undeliberate = [d for d in stretched if d not in deliberate]
            if undeliberate:
                accidental.append((meta, undeliberate))
    if not implicit or not accidental:
        return None
    if len(implicit) == 1 and len(accidental) == 1 and implicit[0] is accidental[0][0]:
        return None  # one operand grew on both counts; the other was not stretched
    return _finding(func, tensors, result, result_numel, implicit, accidental, context, made_by_broadcast_tensors)


def _check_expand(func, tensors, context) -> Finding | None:
    """``torch.broadcast_tensors`` (inside ``F.mse_loss``, ``F.l1_loss``, ``F.smooth_l1_loss``,
    ``F.huber_loss``, ...) expands each operand in turn, and the kernel then sees equal shapes:
    judge the operands as they were, at the last of those ``expand`` ops."""
    if not tensors or context.site == 0:
        return None
    previous = context.shapes.expand_before(context.site)
    if previous is None:
        return None  # not the second expand of one call
    first, target = previous.operand, previous.target
    second = tensors[0]
    if first[M_IDENT] == second[M_IDENT] or first[M_SHAPE] is None or second[M_SHAPE] is None:
        return None
    size = _expand_size(context.args)
    if size is None or len(size) != len(target):
        return None
    # -1 keeps the operand's own size (counted from the right).
    offset = len(size) - len(second[M_SHAPE])
    resolved = tuple(second[M_SHAPE][i - offset] if wanted == -1 and i >= offset else wanted for i, wanted in enumerate(size))
    if resolved != target:
        return None
    return check(func, (first, second), context, made_by_broadcast_tensors=True)


def _expand_size(args):
    """The ``size`` argument of ``aten.expand(self, size)`` from the flat other arguments."""
    for key, value in zip(args[::2], args[1::2]):
        if key == 1 or key == "size":
            return value if isinstance(value, tuple) else tuple(value)
    return None


def _finding(func, tensors, result, result_numel, implicit, accidental, context, made_by_broadcast_tensors=False) -> Finding:
    largest = max(math.prod(meta[M_SHAPE]) for meta in tensors)
    column, dims = accidental[0]
    facts = {
        "op": func._schema.name.split("::")[-1],
        "vector": implicit[0],  # gets new leading dims
        "column": column,  # stretched along its own size-1 dims
        "made_by": context.producer(column),  # a Place, or None
        "dims": list(dims),  # the column's stretched dims, negative (from the right)
        "result": result,
        "growth": result_numel // largest,  # times more elements than the largest operand
    }
    rule = "broadcast.tensors" if made_by_broadcast_tensors else "broadcast.implicit"
    return Finding(KIND, rule, facts, operands=tuple(tensors))


class Expand(NamedTuple):
    """An ``expand`` op as the tracker remembers it: the first half of a ``broadcast_tensors``
    pair."""

    site: int  # its source site id
    operand: tuple  # its input's metadata
    target: tuple  # the shape it expanded to
    index: int  # its op index


class ShapeProvenance:
    """The broadcast check's memory: how each live tensor with size-1 dims got them, and the
    last ``expand`` (the first half of a ``broadcast_tensors`` pair).

    Fed after every op (:meth:`for_op` gives the observer). A dim is *deliberate* when the
    program made it with ``unsqueeze`` (``x[:, None]`` is one too), possibly followed by ops
    that keep shapes and meaning (``.float()``, ``.clone()``, unary math); outputs of views
    are remembered with no deliberate dims but their site, for the same-call rule; anything
    else forgets what it overwrote (an id is reused once its tensor dies).

    Kept bounded: past ``limit`` tensors the oldest half is dropped, part of the fixed memory
    cost of ``max_records``.
    """

    def __init__(self, limit: int, log):
        # ident of a tensor with size-1 dims -> (shape, deliberate dims, site id of its op),
        # read with _K_SHAPE, _K_DELIBERATE, _K_SITE
        self._known: dict = {}
        self._limit = limit
        self._entries = log.entries  # the op log's entries: which op was logged last
        self._last_expand: Expand | None = None

    def for_op(self, func):
        """The observer for ``func``'s outputs, called as ``observe(entry, inputs, outputs, metas)``."""
        name = func._schema.name
        if name == _UNSQUEEZE:
            return self._after_unsqueeze
        if name == _EXPAND:
            return self._after_expand
        if name in _SHAPE_PRESERVING or torch.Tag.pointwise in func.tags:
            return self._after_shape_preserving_view if func.is_view else self._after_shape_preserving
        if func.is_view:
            return self._after_view
        return self._after_other

    def deliberate_dims(self, meta, site: int) -> frozenset[int]:
        """Deliberate size-1 dims of ``meta`` for an op issued at ``site``."""
        known = self._entry(meta)
        if known is None:
            return frozenset()
        if known[_K_SITE] == site and site != 0:
            # Made inside the same call as this op (torch.outer reshapes internally).
            return frozenset(range(-len(meta[M_SHAPE]), 0))
        return frozenset(known[_K_DELIBERATE])

    def expand_before(self, site: int) -> Expand | None:
        """The ``expand`` op logged just before the op being checked, when it was issued at
        ``site`` too (the first half of a ``broadcast_tensors`` pair); ``None`` when the op
        before was another one (the last expand of the same line one step earlier is no pair)."""
        last, entries = self._last_expand, self._entries
        if last is None or not entries or last.site != site or entries[-1][E_INDEX] != last.index:
            return None
        return last

    def _entry(self, meta):
        known = self._known.get(meta[M_IDENT])
        # An id is reused once its tensor dies; a different shape means another tensor.
        if known is None or known[_K_SHAPE] != meta[M_SHAPE]:
            return None
        return known

    def _after_unsqueeze(self, entry, inputs, outputs, metas) -> None:
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is None or 1 not in shape:
                continue
            args = entry[E_ARGS]
            dim = args[1] if args else 0
            ndim = len(shape)
            new_dim = (dim if dim >= 0 else dim + ndim) - ndim
            # The input's deliberate dims, moved past the new one (negative: from the right).
            known = self._entry(inputs[0]) if inputs else None
            kept = known[_K_DELIBERATE] if known is not None else ()
            deliberate = tuple(sorted({d if d > new_dim else d - 1 for d in kept} | {new_dim}))
            self._remember(meta, deliberate, entry)

    def _after_shape_preserving(self, entry, inputs, outputs, metas) -> None:
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is None or 1 not in shape:
                continue
            deliberate = self._inherited(inputs, shape)
            if deliberate:
                self._remember(meta, deliberate, entry)
            else:
                self._known.pop(meta[M_IDENT], None)

    def _after_shape_preserving_view(self, entry, inputs, outputs, metas) -> None:
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is not None and 1 in shape:
                self._remember(meta, self._inherited(inputs, shape), entry)

    def _after_view(self, entry, inputs, outputs, metas) -> None:
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is not None and 1 in shape:
                self._remember(meta, (), entry)

    def _after_expand(self, entry, inputs, outputs, metas) -> None:
        self._after_view(entry, inputs, outputs, metas)
        if inputs and metas:
            self._last_expand = Expand(entry[E_SITE], inputs[0], metas[0][M_SHAPE], entry[E_INDEX])

    def _after_other(self, entry, inputs, outputs, metas) -> None:
        known = self._known
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is not None and 1 in shape:
                known.pop(meta[M_IDENT], None)  # an older tensor's entry under a reused id

    def _remember(self, meta, deliberate, entry) -> None:
        known = self._known
        known[meta[M_IDENT]] = (meta[M_SHAPE], deliberate, entry[E_SITE])
        if len(known) > self._limit:
            for ident in list(islice(known, len(known) // 2)):
                del known[ident]

    def _inherited(self, inputs, shape) -> tuple[int, ...]:
        dims = set()
        for meta in inputs:
            known = self._entry(meta)
            if known is not None:
                dims.update(d for d in known[_K_DELIBERATE] if -len(shape) <= d and shape[d] == 1)
        return tuple(dims)
