"""What the nan/inf check checks, and which values are deliberate.

Only dense strided tensors of float16/bfloat16/float32/float64/float8/complex dtypes on a real
device are checked (float8 ones through a float16 copy, :func:`opwatch.core.finite.readable`):
meta, fake, sparse, nested, quantized, zero tensors and subclasses are skipped.
What an op *is* (a view, a lift, value-preserving, masking, ...) is asked of
:func:`opwatch.core.ops.facts_of`; this module holds only what is particular to nan/inf.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...core.compat import is_zerotensor
from ...core.finite import CHECKED_DTYPES, FLOAT8_DTYPES
from ...core.fact_tuples import fact_tuple
from ...core.records import E_ARGS, M_DTYPE, M_IDENT, M_SHAPE

__all__ = [
    "NAME", "RISK_KIND", "KINDS", "CHECKED_DTYPES", "FLOAT8_DTYPES", "COMPLEX", "PLAIN_TYPES", "STRIDED", "FLOAT16",
    "SENTINELS", "SENTINEL", "HEADROOM_FACTOR", "HEADROOM_LIMIT", "checkable", "has_sentinel_constant",
    "ValueRange", "largest_magnitude", "moved_range", "read_ranges", "written_inputs", "ScoreBound", "attention_scores",
]

NAME = "nonfinite"
RISK_KIND = "overflow_risk"
KINDS = ("nan", "inf", RISK_KIND)

COMPLEX = frozenset((torch.complex64, torch.complex128))
_REAL = CHECKED_DTYPES - COMPLEX  # CHECKED_DTYPES: opwatch.core.finite's, the one list
PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
STRIDED = torch.strided
FLOAT16 = torch.float16

# The largest finite values of each floating dtype: ``torch.finfo(dtype).min`` in a mask is a
# deliberate "minus infinity", and overflowing it (to -inf in float16) is deliberate too. Not
# float8's: 448 and 57344 are where quantisation saturates, and plain numbers a float32 holds.
SENTINELS = frozenset(sign * torch.finfo(dtype).max for dtype in _REAL - FLOAT8_DTYPES for sign in (1.0, -1.0))
SENTINEL = "sentinel"  # the flag of a finite output holding one of them

# fp16 headroom: a forward float16 output whose largest magnitude reaches 1/8 of the largest
# float16 (65504 / 8 = 8188) is one step from overflowing: a residual sum of a few such values,
# or a product with a weight above 8, is inf. Healthy fp16 activations stay far below (layer
# norms keep them near 1; logits and attention scores in the tens or hundreds).
HEADROOM_FACTOR = 8
HEADROOM_LIMIT = torch.finfo(torch.float16).max / HEADROOM_FACTOR


def checkable(tensor, dtype) -> bool:
    """The tensors the tracker reduces: dense, floating, non-empty, a plain tensor on a device."""
    return (
        dtype in CHECKED_DTYPES
        and type(tensor) in PLAIN_TYPES
        and not tensor.is_meta
        and tensor.layout is STRIDED
        and not tensor.is_nested
        and tensor.numel() > 0
        and not is_zerotensor(tensor)
    )


def has_sentinel_constant(entry) -> bool:
    """An explicit non-finite or ``finfo.max``/``finfo.min`` constant among an entry's
    arguments (``full(-inf)``, ``masked_fill(mask, -inf)``, ``where(c, x, finfo.min)``)."""
    for value in entry[E_ARGS][1::2]:
        if type(value) is float and (not math.isfinite(value) or value in SENTINELS):
            return True
    return False


@fact_tuple("value_range")
class ValueRange(NamedTuple):
    """The values of a floating tensor: ``low`` and ``high`` its min and max, or, ``within``, a
    bound its values lie within (carried through a value-moving op that keeps only some of its
    input's values: ``cat``, ``index``, ``repeat``, a slice). A fact of a nan/inf origin's
    ``input_ranges``."""

    low: float
    high: float
    within: bool = False


_EXACT = frozenset(("same", "neg", "abs"))  # range maps that keep all of one input's values


def largest_magnitude(value_range) -> float:
    """The largest magnitude a :class:`ValueRange` holds."""
    return max(abs(value_range.low), abs(value_range.high))


def moved_range(facts, ranges) -> ValueRange:
    """The range of the output of a value-moving op (its ``OpFacts``, see ``range_map``) whose
    floating inputs had ``ranges`` (:class:`ValueRange`): exact for a view or copy of all of
    one input's values (mapped: ``neg``, ``abs``); else the hull of theirs, ``within`` (``cat``,
    ``index``, ``repeat``, a slice hold some of them)."""
    how = facts.range_map
    if len(ranges) == 1:
        (known,) = ranges
        if how == "same":
            return known  # a view or a copy of all its values: the most of them
        low, high, within = known
    else:
        low, high, within = min(known.low for known in ranges), max(known.high for known in ranges), True
    if how == "neg":
        low, high = -high, -low
    elif how == "abs":
        low, high = (low, high) if low >= 0 else (-high, -low) if high <= 0 else (0.0, max(-low, high))
    elif how == "with_zero":
        low, high = min(low, 0.0), max(high, 0.0)
    return ValueRange(low, high, within or how not in _EXACT)


def written_inputs(inputs, outputs) -> frozenset:
    """The idents of the inputs an op wrote its result into: those that are also its outputs
    (``x.sqrt_()``, ``buf.copy_(src)``, ``out=``); an op that makes new tensors has none (a new
    tensor cannot take the id of an input alive while it runs). Metas, as records hold them."""
    if not outputs:
        return frozenset()
    made = {meta[M_IDENT] for meta in outputs}
    return frozenset(meta[M_IDENT] for meta in inputs if meta[M_IDENT] in made)


def read_ranges(name, ranges) -> list:
    """Of the floating inputs' ``ranges`` (in order) of op ``name`` (short, ``copy``), those the
    op reads: ``copy_`` overwrites its destination, the first, without reading it."""
    ranges = list(ranges)
    return ranges[1:] if name == "copy" and len(ranges) > 1 else ranges


# The fused attention kernels' backward ops: query and key are their second and third floating
# inputs, after the output's gradient. (Their forward ops keep a running max of the scores and
# stay finite at any scale: measured up to 1e15 on torch 2.13's CPU flash kernel.)
_ATTENTION_BACKWARD = frozenset((
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_backward", "_efficient_attention_backward",
))


class ScoreBound(NamedTuple):
    """What a fused attention kernel's query and key ranges allow its scores to reach."""

    bound: float  # the largest |query . key| * scale the ranges allow
    query: float  # the largest |query| value
    key: float  # the largest |key| value
    head_dim: int
    dtype: torch.dtype  # the dtype the kernel computes its scores and softmax in
    limit: float  # past it, one rounding step of a score is more than exp takes


def attention_scores(name, input_ranges, scale=None) -> ScoreBound | None:
    """For a fused attention kernel's backward op ``name`` (short:
    ``_scaled_dot_product_flash_attention_backward``; ``input_ranges``: ``(meta, ValueRange or
    None)`` per floating input, in order; ``scale`` the op's own, ``None`` for the default
    ``1/sqrt(head_dim)``), the scores' bound when it passes the kernel's limit, else ``None``.
    The backward recomputes the scores and exp(score - logsumexp) in float32 (float64 for
    float64 inputs); a score of magnitude ``s`` is rounded by up to ``s * eps``, and once that
    passes log(finfo.max) (88.7 in float32: scores past about 7.4e8) the recomputed exp
    overflows where the exact one is at most 1, and inf * 0 or inf - inf is nan, with or
    without a mask."""
    if name not in _ATTENTION_BACKWARD:
        return None
    pairs = list(input_ranges)[1:3]  # after the output's gradient
    if len(pairs) < 2 or any(value_range is None for _, value_range in pairs):
        return None
    (query_meta, query_range), (_, key_range) = pairs
    *_, head_dim = query_meta[M_SHAPE] or (None,)
    if head_dim is None:
        return None
    if scale is None:
        scale = 1 / math.sqrt(head_dim) if head_dim else 1.0
    query, key = largest_magnitude(query_range), largest_magnitude(key_range)
    bound = query * key * head_dim * abs(scale)
    dtype = torch.float64 if query_meta[M_DTYPE] == torch.float64 else torch.float32
    info = torch.finfo(dtype)
    limit = math.log(info.max) / info.eps
    if not bound > limit:  # a nan bound too (inf * 0)
        return None
    return ScoreBound(bound, query, key, head_dim, dtype, limit)
