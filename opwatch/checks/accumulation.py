"""dtype_mismatch of writes into a tensor: the source's dtype against the tensor written.

Found with the installed torch as the judge (``tools/find_accumulation_dtypes.py``: each op of
the indexing/scatter family and each pair of dtypes among f32, f64, bf16, f16, i64, i32, bool),
two rules:

1. ``dtype.write_source``: the indexing/scatter writes (``index_add_``, ``index_copy_``,
   ``index_reduce_``, ``scatter_``/``scatter_add_``/``scatter_reduce_`` with a tensor source,
   ``masked_scatter_``, ``put_``, ``index_put_`` with or without ``accumulate`` (``buf[idx] =
   v``, ``buf[idx] += v``), ``lerp_``, and their functional and ``out=`` forms) raise on *any*
   dtype mismatch between ``self`` and the source on torch 2.13: a float32 expert output or
   routing weight written into a bf16 mixture-of-experts buffer, float64 edge weights
   scattered into a float32 node buffer. Reported before the kernel, with where the source was
   made. One exception, where torch casts: ``index_put_`` without ``accumulate`` of a
   one-element CPU value under a single bool (or uint8) mask (``buf[mask] = torch.tensor(x)``)
   runs as ``masked_fill_``, which takes a scalar of any dtype.
2. ``dtype.narrowing_write``: the pointwise ops that add into the tensor they write
   (``add_``/``+=``, ``sub_``/``-=``, ``addcmul_``, ``addcdiv_``, and their ``out=`` forms)
   compute in the promoted dtype and round the result into the written tensor's dtype without a
   word. A non-scalar floating operand of a *more precise* (or differently rounded) floating
   dtype than the tensor written (f32 into a bf16 accumulator, f64 into f32, f16 and bf16 into
   each other) makes every step of the accumulation lose what the written dtype cannot hold.

Inside ``torch.autocast`` both rules still apply: autocast never writes in place (it casts an
op's inputs, out of place), so a write into a bf16 tensor is the program's own. Backward ops
are judged by rule 1 (a raise is a raise) and not by rule 2 (an op of the backward pass mixes
dtypes because its forward op did).

Not flagged, on purpose: ``copy_`` (``buf.copy_(x)``, ``buf[:n] = x``, ``load_state_dict``
into a bf16 model, mixed-precision master weights copied into the model, DDP's buckets): a
copy is the documented way to cast into a preallocated tensor; ``masked_fill_``,
``index_fill_``, ``fill_`` with a 0-dim tensor value, and 0-dim operands of the pointwise ops
(scalars: one constant rounded, as the program asked); ``mul_``/``div_`` (a scaling computed
in the wider dtype and rounded once is more accurate, not less); integer or bool operands of
the pointwise ops; foreach and fused optimizer kernels (tensor lists, one dtype per group).

Which argument is ``self``, the source and the tensor written is asked of
:func:`opwatch.core.ops.facts_of`. Findings hold facts; their sentences are made in
:mod:`opwatch.render.accumulation`, where each rule's facts are listed.
"""

from __future__ import annotations

from functools import partial
from math import prod

import torch

from ..core.notation import as_meta
from ..core.ops import SOURCE_NAMES, facts_of
from ..core.records import M_DEVICE, M_DTYPE, M_SHAPE
from .dtype import KIND
from ..core.fact_tuples import RuleFacts, rule_facts
from .finding import Finding, tensor_names

__all__ = ["KIND", "for_op", "narrows", "WRITE_SOURCE", "NARROWING_WRITE", "NarrowingWrite", "WriteSource"]

WRITE_SOURCE = "dtype.write_source"
NARROWING_WRITE = "dtype.narrowing_write"


@rule_facts(WRITE_SOURCE)
class WriteSource(RuleFacts):
    op: str  # the op's short name (``index_add_``)
    target: tuple  # the written tensor's metadata
    source: tuple  # the source's
    source_name: str  # the source argument's name
    source_wider: bool  # the source's dtype is wider than the target's
    names: list  # the op's tensor arguments' names


@rule_facts(NARROWING_WRITE)
class NarrowingWrite(RuleFacts):
    op: str
    written: str  # the written argument's name
    target: tuple
    source: tuple  # the first operand wider than the target
    computed: object  # the dtype the op computes in before rounding into the target
    names: list

# Floating dtypes by precision; f16 and bf16 share a rank (each loses what the other holds).
_RANK = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_MASK_DTYPES = (torch.bool, torch.uint8)


def for_op(func):
    """The check bound to ``func``, as ``check(tensors, context) -> Finding | None``; ``None``
    when it cannot fire on this op."""
    facts = facts_of(func)
    if facts.source is not None:
        if facts.source < 0:  # after a list of indices: index_put and its kin
            return partial(_check_index_put, func, facts.source, _accumulate_keys(func))
        return partial(_check_source, func, facts.source)
    if facts.accumulates and torch.Tag.pointwise in func.tags:
        return partial(_check_accumulation, func, facts.written)
    return None


def narrows(source: torch.dtype, written: torch.dtype) -> bool:
    """Whether rounding ``source`` floating values into the floating dtype ``written`` loses
    something: f64 into f32, f32 into bf16 or f16, f16 and bf16 into each other."""
    if source == written or source not in _RANK or written not in _RANK:
        return False
    return _RANK[source] >= _RANK[written]


def _accumulate_keys(func) -> tuple:
    """The keys the ``accumulate`` argument of ``func`` has in ``CheckContext.args``."""
    for position, arg in enumerate(func._schema.arguments):
        if arg.name == "accumulate":
            return (position, "accumulate")
    return ()


def _check_source(func, position, tensors, context=None) -> Finding | None:
    if len(tensors) <= position:
        return None
    target, source = tensors[0], tensors[position]
    if target[M_DTYPE] == source[M_DTYPE]:
        return None
    return _write_source(func, tensors, target, source)


def _check_index_put(func, position, accumulate_keys, tensors, context=None) -> Finding | None:
    if len(tensors) < 2:
        return None
    target, source = tensors[0], tensors[position]
    if target[M_DTYPE] == source[M_DTYPE]:
        return None
    if not _accumulates(accumulate_keys, context) and _runs_as_masked_fill(target, tensors[1:position], source):
        return None
    return _write_source(func, tensors, target, source)


def _accumulates(keys, context) -> bool:
    args = getattr(context, "args", ())
    for i in range(0, len(args) - 1, 2):
        if args[i] in keys:
            return bool(args[i + 1])
    return False


def _runs_as_masked_fill(target, indices, source) -> bool:
    """torch's own shortcut (``canDispatchToMaskedFill``): one bool/uint8 mask on ``self``'s
    device, a one-element value on the CPU; the value is read as a scalar of any dtype."""
    return (
        len(indices) == 1
        and indices[0][M_DTYPE] in _MASK_DTYPES
        and indices[0][M_DEVICE] == target[M_DEVICE]
        and source[M_SHAPE] is not None
        and prod(source[M_SHAPE]) == 1
        and source[M_DEVICE].type == "cpu"
    )


def _write_source(func, tensors, target, source) -> Finding:
    names = tensor_names(func, len(tensors))
    facts = WriteSource(
        op=func._schema.name.split("::")[-1],
        target=as_meta(target),
        source=as_meta(source),
        source_name=_source_name(func),
        source_wider=narrows(source[M_DTYPE], target[M_DTYPE]),
        names=names,
    )
    return Finding(KIND, WRITE_SOURCE, facts, operands=tuple(tensors), odd=(source,))


def _source_name(func) -> str:
    for arg in func._schema.arguments:
        if arg.name in SOURCE_NAMES and str(arg.type) == "Tensor":
            return arg.name
    return "source"


def _check_accumulation(func, written, tensors, context=None) -> Finding | None:
    if len(tensors) < 2:
        return None
    target = tensors[written]
    dtype = target[M_DTYPE]
    for meta in tensors:
        if meta[M_DTYPE] != dtype and meta[M_SHAPE] and narrows(meta[M_DTYPE], dtype):
            break
    else:
        return None  # every operand in the written dtype, a scalar or widened: the common case
    if getattr(context, "phase", "forward") == "backward":
        return None
    odd = tuple(meta for meta in tensors if meta[M_SHAPE] and narrows(meta[M_DTYPE], dtype))
    names = tensor_names(func, len(tensors))
    facts = NarrowingWrite(
        op=func._schema.name.split("::")[-1],
        written=names[written],
        target=as_meta(target),
        source=as_meta(odd[0]),
        computed=torch.promote_types(dtype, odd[0][M_DTYPE]),
        names=names,
    )
    return Finding(KIND, NARROWING_WRITE, facts, operands=tuple(tensors), odd=odd)
