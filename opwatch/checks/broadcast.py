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

Two kinds of broadcast are judged by how their result is used (:class:`ShapeProvenance`
follows the result through pointwise ops; a step more than ``_STRAIGHT_AWAY`` ops after the one
before ends the wait):

- flagged as above, but the stretched column's size-1 dims were made by a ``keepdim=True``
  reduction: ``(N, 1)`` norms plus ``(M,)`` norms may be a pairwise table. Combined next with a
  tensor of its own shape made otherwise (the ``(N, M)`` matmul of ``x_norm + y_norm - 2 * x @
  y.T``): deliberate, dropped; reduced straight away by ``mean``/``sum``: reported there;
- ``broadcast.paired``: not flagged above because the column's size-1 dims were made with
  ``unsqueeze``, but the column shares no dim with the vector and its own size equals the
  vector's leading one, so the result holds it twice (``(B, 1, 1)`` positives plus ``(B, K)``
  negatives give ``(B, B, K)``; ``(B, 1)`` positive scores against ``(B,)`` negative ones give
  ``(B, B)``): reported when reduced straight away by ``mean``/``sum``. Against a 1-d vector
  only when the column was made from other values: ``t[:, None] - t`` and ``labels[:, None] ==
  labels`` are one set's pairwise table.

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

from ..core.notation import as_meta
from ..core.ops import facts_of
from ..core.records import E_ARGS, E_INDEX, E_SITE, M_IDENT, M_SHAPE, OpRecord
from ..core.fact_tuples import RuleFacts, rule_facts
from .finding import Finding, Place

__all__ = ["KIND", "for_op", "check", "broadcast_shape", "ShapeProvenance", "Expand", "Paired", "Stretched"]


@rule_facts("broadcast.implicit", "broadcast.tensors")
class Stretched(RuleFacts):
    op: str  # the op's short name
    vector: tuple  # the operand that gets new leading dims (its metadata)
    column: tuple  # the operand stretched along its own size-1 dims
    made_by: Place | None  # the op that made the column, when known
    dims: list  # the column's stretched dims, negative (from the right)
    result: tuple  # the result's shape
    growth: int  # times more elements than the largest operand
    at: object = None  # for a result reduced straight away: where it was made
    reduced_by: str | None = None  # and the reduction's op


@rule_facts("broadcast.paired")
class Paired(RuleFacts):
    op: str
    vector: tuple
    column: tuple
    dims: list
    size: int  # the size the result holds twice
    result: tuple
    growth: int
    at: object = None
    reduced_by: str | None = None

KIND = "broadcast"

_UNSQUEEZE = "aten::unsqueeze"
_EXPAND = "aten::expand"
# ShapeProvenance's entries: (shape, deliberate dims, site id).
_K_SHAPE, _K_DELIBERATE, _K_SITE = 0, 1, 2
# Ops whose output keeps its input's shape and meaning: size-1 dims made on purpose stay so.
# Reductions that judge a broadcast result waiting for its use (see ShapeProvenance.reduced).
_REDUCTIONS = {"aten::mean", "aten::sum"}
# How many views and copies back the source of an operand is looked for.
_SOURCE_STEPS = 6
# A waiting broadcast result is judged only if each next step on it comes within this many ops.
_STRAIGHT_AWAY = 8
_PENDING_LIMIT = 64
_SHAPE_PRESERVING = {"aten::_to_copy", "aten::clone", "aten::contiguous", "aten::detach", "aten::alias", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::to"}

def for_op(func):
    """The check bound to ``func``, as ``check(tensors, context) -> Finding | None``; ``None``
    when it cannot fire on this op."""
    if func._schema.name == _EXPAND:
        return partial(_check_expand, func)
    if func._schema.name in _REDUCTIONS:
        return partial(_check_reduced, func)
    # In-place and out= variants cannot grow their destination.
    if torch.Tag.pointwise in func.tags and not func._schema.is_mutable and facts_of(func).takes_several_tensors:
        return partial(check, func)
    return None


def _op_name(func) -> str:
    """``sub`` for ``aten::sub``."""
    return func._schema.name.split("::")[-1]


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
    if not implicit:
        return None
    memory = context.shapes
    if not accidental:
        if not made_by_broadcast_tensors and len(tensors) == 2:
            paired = _paired(func, tensors, result, result_numel, implicit, context)
            if paired is not None:
                memory.defer(paired, result, tensors)  # judged by its use
        return None
    if len(implicit) == 1 and len(accidental) == 1 and implicit[0] is accidental[0][0]:
        return None  # one operand grew on both counts; the other was not stretched
    finding = _finding(func, tensors, result, result_numel, implicit, accidental, context, made_by_broadcast_tensors)
    if not made_by_broadcast_tensors and all(memory.kept(meta) for meta, _ in accidental):
        # Size-1 dims a keepdim reduction made: a pairwise table ((N, 1) norms + (M,) norms,
        # then combined with an (N, M) matmul) or a bug; its use tells.
        memory.defer(finding, result, tensors)
        return None
    return finding


def _paired(func, tensors, result, result_numel, implicit, context) -> Finding | None:
    """The ``broadcast.paired`` finding, waiting for its use, when a column whose size-1 dims
    were all made on purpose meets a vector with at least two dims and shares none of them:
    the column's own size sits only over the vector's new leading dims and equals the vector's
    leading size (``(B, 1, 1)`` against ``(B, K)`` gives ``(B, B, K)``: B twice)."""
    vector, *_ = implicit
    column = next(meta for meta in tensors if meta is not vector)
    shape, own = column[M_SHAPE], vector[M_SHAPE]
    if not own or len(shape) != len(result):
        return None
    lead, *_ = own
    covered = len(result) - len(own)  # result dims the vector does not have
    if any(size != 1 for size in shape[covered:]):
        return None  # the operands share a dim: a per-row comparison (k-means, distances)
    if lead not in shape[:covered]:
        return None
    if len(own) == 1 and context.shapes.same_source(column, vector):
        return None  # one set against itself (t[:, None] - t, labels[:, None] == labels): a table
    facts = Paired(
        op=_op_name(func),
        vector=as_meta(vector),
        column=as_meta(column),
        dims=[d for d in range(-len(shape), 0) if shape[d] == 1 and result[d] > 1],
        size=lead,  # the size the result holds twice
        result=result,
        growth=result_numel // max(math.prod(meta[M_SHAPE]) for meta in tensors),
    )
    return Finding(KIND, "broadcast.paired", facts, operands=tuple(tensors))


def _check_reduced(func, tensors, context) -> Finding | None:
    """``mean``/``sum`` of a broadcast result waiting for its use: reduced straight away, it was
    a loss computed over the mismatched pairs too."""
    memory = context.shapes
    if memory is None or not memory.waiting:
        return None
    return memory.reduced(tensors, _op_name(func))


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
    facts = Stretched(
        op=_op_name(func),
        vector=as_meta(implicit[0]),  # gets new leading dims
        column=as_meta(column),  # stretched along its own size-1 dims
        made_by=context.producer(column),  # a Place, or None
        dims=list(dims),  # the column's stretched dims, negative (from the right)
        result=result,
        growth=result_numel // largest,  # times more elements than the largest operand
    )
    rule = "broadcast.tensors" if made_by_broadcast_tensors else "broadcast.implicit"
    return Finding(KIND, rule, facts, operands=tuple(tensors))


class Expand(NamedTuple):
    """An ``expand`` op as the tracker remembers it: the first half of a ``broadcast_tensors``
    pair."""

    site: int  # its source site id
    operand: tuple  # its input's metadata
    target: tuple  # the shape it expanded to
    index: int  # its op index


class Waiting(NamedTuple):
    """A broadcast result whose finding waits for its use (see :meth:`ShapeProvenance.defer`)."""

    shape: tuple  # its shape (an id is reused once its tensor dies)
    finding: Finding
    index: int  # op index of its last step (the broadcast, or a pointwise op on it since)
    at: object  # the broadcast op, a Place


class Deferred(NamedTuple):
    """A finding of the op being checked, to wait on its output once the kernel ran."""

    finding: Finding
    result: tuple  # the broadcast shape
    inputs: tuple  # the op's input idents


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
        self._log = log
        self._last_expand: Expand | None = None
        # ident -> shape of tensors whose size-1 dims a keepdim reduction made
        self._kept: dict = {}
        # Broadcast results judged by their use: ident -> Waiting. A result combined with an
        # independent tensor of its own shape is a table (dropped); reduced straight away by
        # mean/sum (through pointwise steps), its finding is reported there.
        self._pending: dict = {}
        self._deferring: Deferred | None = None

    @property
    def waiting(self) -> bool:
        """Whether a broadcast result waits for its use."""
        return bool(self._pending)

    def kept(self, meta) -> bool:
        """Whether ``meta``'s size-1 dims were made by a ``keepdim=True`` reduction."""
        return self._kept.get(meta[M_IDENT]) == meta[M_SHAPE]

    def defer(self, finding: Finding, result, tensors) -> None:
        """Let ``finding`` of the op being checked wait on its output, judged by its use."""
        self._deferring = Deferred(finding, result, tuple(meta[M_IDENT] for meta in tensors))

    def reduced(self, tensors, op: str) -> Finding | None:
        """The finding of a waiting broadcast result that ``mean``/``sum`` reduces now."""
        pending = self._pending
        last = next(reversed(self._entries), None)
        for meta in tensors:
            waiting = pending.get(meta[M_IDENT])
            if waiting is None or waiting.shape != meta[M_SHAPE]:
                continue
            del pending[meta[M_IDENT]]
            if last is not None and last[E_INDEX] + 1 - waiting.index > _STRAIGHT_AWAY:
                continue
            finding = waiting.finding
            facts = finding.facts.replace(at=waiting.at, reduced_by=op)
            return Finding(finding.kind, finding.rule, facts, operands=finding.operands)
        return None

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
        names = [argument.name for argument in func._schema.arguments]
        if "keepdim" in names:
            return partial(self._after_reduction, names.index("keepdim"))
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

    def same_source(self, first, second) -> bool:
        """Whether two tensors hold the same values: one is the other, or both were made from
        one tensor by views and copies (``t[:, None]``, ``t.unsqueeze(1).float()``), as the op
        log shows (slow: asked only for a broadcast about to be judged)."""
        return not self._sources(first).isdisjoint(self._sources(second))

    def _sources(self, meta) -> set:
        """``meta``'s ident and those of the tensors it was made from by views and copies."""
        idents = {meta[M_IDENT]}
        for _ in range(_SOURCE_STEPS):
            record = self._log.producer_of(meta[M_IDENT], like=meta)
            if record is None or not record.inputs:
                break
            name = record.func._schema.name
            if not (record.func.is_view or name in _SHAPE_PRESERVING or name == _UNSQUEEZE):
                break
            meta, *_ = record.inputs
            idents.add(meta[M_IDENT])
        return idents

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
        if self._deferring is not None or self._pending:
            self._follow(entry, inputs, metas)
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is None or 1 not in shape:
                continue
            deliberate = self._inherited(inputs, shape)
            if deliberate:
                self._remember(meta, deliberate, entry)
            else:
                self._known.pop(meta[M_IDENT], None)
                self._kept.pop(meta[M_IDENT], None)

    def _after_shape_preserving_view(self, entry, inputs, outputs, metas) -> None:
        if self._deferring is not None or self._pending:
            # A view (detach: autograd saving relu's output) leaves its input waiting as well.
            self._follow(entry, inputs, metas, keep=True)
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is not None and 1 in shape:
                self._remember(meta, self._inherited(inputs, shape), entry)

    def _after_view(self, entry, inputs, outputs, metas) -> None:
        source = next(iter(inputs), None)
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is not None and 1 in shape:
                # A view of its input's own shape (the full slice torch 2.6 dispatches for the
                # ``:`` in ``x[:, None, :]``) has its size-1 dims where the input has them.
                same = source is not None and source[M_SHAPE] == shape
                self._remember(meta, self._inherited((source,), shape) if same else (), entry)

    def _after_expand(self, entry, inputs, outputs, metas) -> None:
        self._after_view(entry, inputs, outputs, metas)
        if inputs and metas:
            self._last_expand = Expand(entry[E_SITE], inputs[0], metas[0][M_SHAPE], entry[E_INDEX])

    def _after_other(self, entry, inputs, outputs, metas) -> None:
        known, kept = self._known, self._kept
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is not None and 1 in shape:
                known.pop(meta[M_IDENT], None)  # an older tensor's entry under a reused id
                kept.pop(meta[M_IDENT], None)

    def _after_reduction(self, position, entry, inputs, outputs, metas) -> None:
        """A reduction with a ``keepdim`` argument: its size-1 dims are kept when it is true."""
        self._after_other(entry, inputs, outputs, metas)
        args = entry[E_ARGS]
        values = args[1::2]
        # Most calls pass no True at all: one C-level scan (1 == True only sends a call on to
        # the exact test).
        if True not in values or not any(value is True and key in (position, "keepdim") for key, value in zip(args[::2], values)):
            return
        kept = self._kept
        for meta in metas:
            shape = meta[M_SHAPE]
            if shape is not None and 1 in shape:
                kept[meta[M_IDENT]] = shape
        if len(kept) > self._limit:
            for ident in list(islice(kept, len(kept) // 2)):
                del kept[ident]

    def _follow(self, entry, inputs, metas, keep=False) -> None:
        """A pointwise op: the broadcast results waiting for their use that it takes, and the
        one its own check deferred. ``keep``: the inputs wait still (the op was a view)."""
        index = entry[E_INDEX]
        pending = self._pending
        carried = None
        for meta in inputs:
            waiting = pending.get(meta[M_IDENT])
            if waiting is None or waiting.shape != meta[M_SHAPE]:
                continue
            if not keep:
                del pending[meta[M_IDENT]]
            if index - waiting.index > _STRAIGHT_AWAY:
                continue  # not straight away: no longer judged
            partners = [other for other in inputs if other is not meta and other[M_SHAPE] == meta[M_SHAPE]]
            if partners and not any(self._waits(other) for other in partners):
                continue  # combined with a tensor of its own shape made otherwise: a table
            carried = waiting
        deferring, self._deferring = self._deferring, None
        if deferring is not None and deferring.inputs == tuple(meta[M_IDENT] for meta in inputs):
            at = Place.of(OpRecord(entry, self._log))
            carried = Waiting(deferring.result, deferring.finding, index, at)
        if carried is None:
            return
        for meta in metas:
            if meta[M_SHAPE] == carried.shape:
                pending[meta[M_IDENT]] = carried._replace(index=index)
        if len(pending) > _PENDING_LIMIT:
            for ident in list(islice(pending, len(pending) // 2)):
                del pending[ident]

    def _waits(self, meta) -> bool:
        waiting = self._pending.get(meta[M_IDENT])
        return waiting is not None and waiting.shape == meta[M_SHAPE]

    def _remember(self, meta, deliberate, entry) -> None:
        self._kept.pop(meta[M_IDENT], None)
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
