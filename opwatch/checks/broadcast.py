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
"""

from __future__ import annotations

import math
from functools import partial

import torch

from ..notation import format_meta, format_shape
from .finding import Finding, takes_several_tensors

__all__ = ["KIND", "for_op", "check", "broadcast_shape"]

KIND = "broadcast"

def for_op(func):
    """The check bound to ``func``, as ``check(tensors, context) -> Finding | None``; ``None``
    when it cannot fire on this op."""
    # In-place and out= variants cannot grow their destination.
    if torch.Tag.pointwise in func.tags and not func._schema.is_mutable and takes_several_tensors(func):
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


def check(func, tensors, context) -> Finding | None:
    if len(tensors) < 2:
        return None
    first = tensors[0][0]
    for meta in tensors:
        if meta[0] != first:
            break
    else:
        return None  # nothing is broadcast
    shapes = []
    widest = ()
    for meta in tensors:
        shape = meta[0]
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
        shape = meta[0]
        ndim = len(shape)
        if ndim == 0:
            continue
        if any(size > 1 for size in result[: len(result) - ndim]):
            implicit.append(meta)
        stretched = [d for d in range(-ndim, 0) if shape[d] == 1 and result[d] > 1]
        if stretched:
            deliberate = context.deliberate_dims(meta)
            undeliberate = [d for d in stretched if d not in deliberate]
            if undeliberate:
                accidental.append((meta, undeliberate))
    if not implicit or not accidental:
        return None
    if len(implicit) == 1 and len(accidental) == 1 and implicit[0] is accidental[0][0]:
        return None  # one operand grew on both counts; the other was not stretched
    return _finding(func, tensors, result, result_numel, implicit, accidental, context)


def _finding(func, tensors, result, result_numel, implicit, accidental, context) -> Finding:
    largest = max(math.prod(meta[0]) for meta in tensors)
    vector = implicit[0]
    column, dims = accidental[0]
    made_by = context.producer(column)
    made = f" (made by {made_by})" if made_by else ""
    dims_text = ", ".join(str(len(result) + d) for d in dims)
    op = func._schema.name.split("::")[-1]
    return Finding(
        kind=KIND,
        problem=(
            f"both operands were expanded: {format_meta(vector)} gets new leading dims and "
            f"{format_meta(column)}{made} is stretched along dim {dims_text}; "
            f"{op} returns {format_shape(result)}, {result_numel // largest}x more elements than its largest input"
        ),
        expected=f"operands whose shapes already agree (e.g. {format_shape(vector[0])} with {format_shape(vector[0])}), or size-1 dims made on purpose with unsqueeze / None indexing",
        fix=(
            f"drop the size-1 dim where it is made (.squeeze({dims[0]}) or .view(-1) on the "
            f"{format_shape(column[0])} operand), or give the other side the same dim with .unsqueeze({dims[0]}); "
            f"if the {format_shape(result)} result is intended, write it with unsqueeze/None on both sides"
        ),
    )
