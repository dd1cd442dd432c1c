"""dtype_mismatch: caught before the kernel, in five shapes.

1. Ops whose kernels need one dtype for all operands (the matmul family, convolutions, fused
   attention): ``f64[5, 3] @ f32[3, 2]`` fails deep in the kernel with a terse message. The
   CPU attention kernels also take a float32 or bool ``attn_mask`` with half-precision q, k, v.
2. Mask and index arguments of a dtype the kernel rejects: ``masked_scatter_`` with an ``i64``
   mask; ``gather``/``scatter``/``index_select``/``index_add``/``embedding`` indices that are
   neither ``i64`` nor ``i32``; ``index_copy``/``index_fill``/``take`` indices that are not
   ``i64``; tensors used as indices (``x[idx]``, ``x[idx] = v``) that are neither integer
   (``i64``, ``i32``, ``u8``) nor ``bool``.
3. A silent promotion between two *different floating* dtypes of non-scalar tensors in a
   pointwise op (``f32 * f64 -> f64``, typically a float64 array from numpy meeting a float32
   model), or in ``cat``/``stack``. It never raises; it costs speed and memory and changes
   every result downstream. Judged as the program wrote it: an op inside one call of a
   composite function (the math ``scaled_dot_product_attention`` upcasting float16 q, k, v to
   float32 and adding the caller's float16 mask) counts only if the tensors the program passed
   to that call mix floating dtypes (``CheckContext.call_tensors``); and the finding is
   reported where the op's result is first used, not when the op runs: a result cast straight
   back to the narrower dtype is deliberate (:mod:`opwatch.checks.promotions`).
4. An elementwise loss (``mse_loss``, ``smooth_l1_loss``, ``huber_loss``, ``soft_margin_loss``,
   ``binary_cross_entropy[_with_logits]``) whose target has another floating dtype than its
   input: ``F.mse_loss(f32, f64)`` silently runs the loss and its backward in float64,
   ``huber_loss`` raises only in backward, for an integer target too (``nn.HuberLoss()(out,
   i64_target)``: *Found dtype Long but expected Float*), flagged at the loss line in forward.
   The ``binary_cross_entropy`` losses also need a floating target (an ``i64`` multi-hot target
   raises a cryptic cast error).
5. Class-index targets of ``nll_loss``/``cross_entropy`` that are not ``i64`` (or ``u8``, which
   torch accepts): float labels, ``i32`` labels from numpy.

Integer or bool tensors mixed with floats (masks, counts, an ``i64`` regression target) and
Python or 0-dim scalars never promote across floating dtypes and are not anomalies. Copies are
deliberate casts.

Mixed precision: inside a ``torch.autocast`` region, float32 meeting the autocast dtype
(``bfloat16``/``float16``) is the design (a float32 residual stream plus a lower-precision
sublayer output, ``x + attn(x)``) and is not an anomaly for rules 3 and 4; float64 still is,
and outside autocast nothing changes. Promotions in backward ops are not judged (rules 3 and
4): an op of the backward pass mixes dtypes because its forward op did, and that forward
promotion was judged when it ran (reported there, or allowed by autocast, whose region the
backward pass runs outside). Limit: dtype mixes written in the program's own backward code
(a custom ``autograd.Function.backward``, a tensor hook) are not judged either.

Findings hold facts only (a rule name per sentence family); their sentences are made in
:mod:`opwatch.render.dtype`, where each rule's facts are listed.
"""

from __future__ import annotations

from functools import partial

import torch

from ..core.compat import restore_caller_state
from ..core.notation import as_meta
from ..core.ops import facts_of
from ..core.records import M_DEVICE, M_DTYPE, M_IDENT, M_SHAPE
from ..core.fact_tuples import RuleFacts, rule_facts
from .finding import Finding, tensor_names

__all__ = [
    "KIND", "for_op", "autocast_allows",
    "ArgDtype", "ClassTarget", "IndexDtype", "LossFloatingTarget", "LossTarget", "OneDtype", "SilentUpcast",
]


@rule_facts("dtype.silent_upcast")
class SilentUpcast(RuleFacts):
    first: object  # the floating dtype met first
    second: object  # the other one
    dtypes: list  # every floating dtype of the non-scalar operands, sorted by name
    result: object  # the dtype the op computes in
    count: int  # how many operands take part
    names: list  # the op's tensor arguments' names
    common: object  # the dtype most operands have


@rule_facts("dtype.one_dtype")
class OneDtype(RuleFacts):
    op: str
    dtypes: list
    names: list
    common: object


@rule_facts("dtype.arg_dtype")
class ArgDtype(RuleFacts):
    op: str
    arg: str  # the argument of the wrong dtype
    got: object
    accepted: list  # the dtypes it takes
    names: list


@rule_facts("dtype.index_dtype")
class IndexDtype(RuleFacts):
    op: str
    position: int  # which index (from 1)
    index: tuple  # the index tensor's metadata
    indexed: tuple  # the indexed tensor's


@rule_facts("dtype.loss_floating_target")
class LossFloatingTarget(RuleFacts):
    op: str
    got: object  # the target's dtype
    wanted: object  # the input's
    names: list


@rule_facts("dtype.loss_target")
class LossTarget(RuleFacts):
    op: str
    got: object
    wanted: object
    names: list
    promoted: object  # the dtype the loss then runs in


@rule_facts("dtype.class_target")
class ClassTarget(RuleFacts):
    got: object  # the class target's dtype
    floating: bool
    target_shape: tuple
    input_shape: tuple
    names: list

KIND = "dtype_mismatch"

_SAME_DTYPE_OPS = {
    "aten::mm", "aten::bmm", "aten::addmm", "aten::addmv", "aten::mv", "aten::dot", "aten::vdot",
    "aten::baddbmm", "aten::addbmm", "aten::addr", "aten::convolution", "aten::_convolution",
    "aten::convolution_overrideable", "aten::linear", "aten::matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
}
# Attention kernels that take a float32 (or bool) ``attn_mask`` with float16/bfloat16 q, k, v,
# as torch documents ("bool or float or the query's dtype"): the CPU flash kernel, the math
# path. CUDA's memory-efficient kernel raises for it ("invalid dtype for bias") and stays
# judged like the rest.
_FLOAT_MASK_ATTENTION = {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"}
_MASK_POSITION = 3  # q, k, v, then the mask
_NOT_PROMOTIONS = {"aten::copy_", "aten::copy", "aten::_to_copy", "aten::to", "aten::_copy_from"}
_INT_INDEX = (torch.int64, torch.int32)
# Argument name -> dtypes the kernel accepts there.
_ARG_DTYPES = {
    "mask": (torch.bool, torch.uint8),
    "index": _INT_INDEX,
    "indices": _INT_INDEX,
}
# Ops whose ``index``/``indices`` argument must be an integer tensor (``sparse_mask``'s
# "mask" and the like are other things of the same name).
_INDEX_ARG_OPS = {
    "aten::index_select", "aten::gather", "aten::scatter", "aten::scatter_", "aten::scatter_add",
    "aten::scatter_add_", "aten::scatter_reduce", "aten::scatter_reduce_", "aten::index_add",
    "aten::index_add_", "aten::index_copy", "aten::index_copy_", "aten::index_fill", "aten::index_fill_",
    "aten::index_reduce", "aten::index_reduce_", "aten::take", "aten::embedding",
}
# Of those, the ones whose kernels still take int64 indices only (torch 2.13: "index_copy_():
# Expected a long tensor for index"); gather, scatter*, index_select, index_add, index_reduce
# and embedding accept int32 too.
_INT64_INDEX_OPS = {"aten::index_copy", "aten::index_copy_", "aten::index_fill", "aten::index_fill_", "aten::take"}
# Advanced indexing: ``self``, then the index tensors (``Tensor?[] indices``), then ``values``
# for the writing variants.
_ADVANCED_INDEXING = {
    "aten::index", "aten::_unsafe_index", "aten::index_put", "aten::index_put_",
    "aten::_index_put_impl_", "aten::_unsafe_index_put",
}
_INDEXING_DTYPES = frozenset({torch.int64, torch.int32, torch.uint8, torch.bool})
# Arguments whose kernel needs the dtype of another argument: op -> (argument, the one it must
# match). ``EmbeddingBag(...).half()`` given float32 ``per_sample_weights`` raises "Expected
# tensor for argument #1 'weight' to have the same type as tensor for argument #1
# 'per_sample_weights'".
_MATCHING_ARGS = {
    "aten::_embedding_bag": ("per_sample_weights", "weight"),
    "aten::_embedding_bag_forward_only": ("per_sample_weights", "weight"),
    "aten::embedding_bag": ("per_sample_weights", "weight"),
}
_CONCATENATIONS = {"aten::cat", "aten::stack"}
# Elementwise losses seen as one op ``(input, target, ...)`` (what a target of another floating
# dtype does in each is told in opwatch.render.dtype). l1_loss, kl_div, poisson_nll_loss and
# gaussian_nll_loss decompose into pointwise ops, where the promotion rule sees them.
_ELEMENTWISE_LOSSES = {
    "aten::mse_loss", "aten::smooth_l1_loss", "aten::binary_cross_entropy_with_logits", "aten::huber_loss",
    "aten::soft_margin_loss", "aten::binary_cross_entropy",
}
_FLOATING_TARGET_LOSSES = {"aten::binary_cross_entropy", "aten::binary_cross_entropy_with_logits"}
# Losses whose backward takes the target as it is and needs it in the input's dtype: an integer
# target passes their forward (promoted there) and raises in backward ("Found dtype Long but
# expected Float"). The others convert an integer target exactly (mse_loss, smooth_l1_loss,
# soft_margin_loss) or need a floating one (above).
_INPUT_DTYPE_TARGET_LOSSES = {"aten::huber_loss"}
# Class-index losses: ``(input, target, weight?, ...)``; the kernel takes int64 or uint8 targets.
_CLASS_INDEX_LOSSES = {"aten::nll_loss_forward", "aten::nll_loss2d_forward", "aten::nll_loss", "aten::nll_loss2d", "aten::nll_loss_nd"}
_CLASS_INDEX_DTYPES = frozenset({torch.int64, torch.uint8})

# torch turns autocast off while a dispatch mode's ``__torch_dispatch__`` runs: read the
# caller's state through compat.restore_caller_state (a RuntimeError outside dispatch: a module
# hook, a unit test, where the state is the caller's already).
_RESTORE_CALLER_STATE = restore_caller_state


def for_op(func):
    """The check bound to ``func``, as ``check(tensors, context) -> Finding | None``; ``None``
    when it cannot fire on this op."""
    if not facts_of(func).takes_several_tensors:
        return None
    name = func._schema.name
    if name in _FLOAT_MASK_ATTENTION:
        return partial(_check_attention, func)
    if name in _SAME_DTYPE_OPS:
        return partial(_check_same, func)
    if name in _CONCATENATIONS:
        return partial(_check_promotion, func)
    if name in _ELEMENTWISE_LOSSES:
        return partial(_check_loss_target, func, name)
    if name in _CLASS_INDEX_LOSSES:
        return partial(_check_class_target, func)
    if name in _ADVANCED_INDEXING:
        return partial(_check_indices, func, "put" in name)
    if name in _MATCHING_ARGS:
        return _matching_arg_check(func, *_MATCHING_ARGS[name])
    tensor_position = 0
    checks_args = name.startswith("aten::masked_") or name in _INDEX_ARG_OPS
    for arg in func._schema.arguments:
        type_name = str(arg.type)
        if type_name in ("Tensor", "Tensor?"):
            if checks_args and arg.name in _ARG_DTYPES and type_name == "Tensor":
                dtypes = (torch.int64,) if name in _INT64_INDEX_OPS else _ARG_DTYPES[arg.name]
                return partial(_check_arg, func, tensor_position, arg.name, dtypes, frozenset(dtypes))
            tensor_position += 1
        elif "Tensor" in type_name:
            break  # positions after a tensor list are not fixed
    if torch.Tag.pointwise in func.tags and name not in _NOT_PROMOTIONS and not func._schema.is_mutable:
        return partial(_check_promotion, func)
    return None


def autocast_allows(dtypes, device: torch.device) -> bool:
    """Whether ``torch.autocast`` is on for ``device``'s type where the op was called, and every
    dtype in ``dtypes`` is float32 or the autocast dtype: the mix autocast makes by design.
    Asked only once a mix is found, never on a healthy op's path."""
    low = _autocast_dtype(device.type)
    if low is None:
        return False
    return all(d == low or d == torch.float32 for d in dtypes)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        if _RESTORE_CALLER_STATE is not None:
            try:
                with _RESTORE_CALLER_STATE():
                    return _autocast_dtype_here(device_type)
            except RuntimeError:
                pass  # not inside __torch_dispatch__: the thread state is the caller's already
        return _autocast_dtype_here(device_type)
    except RuntimeError:
        return None  # a device type autocast does not know (meta)


def _autocast_dtype_here(device_type: str) -> torch.dtype | None:
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _in_backward(context) -> bool:
    return getattr(context, "phase", "forward") == "backward"


def _short(func) -> str:
    """``aten::index_put_`` -> ``index_put_``: the op's name in a finding's facts."""
    return func._schema.name.split("::")[-1]


def _check_promotion(func, tensors, context=None) -> Finding | None:
    floating = None
    for meta in tensors:
        dtype = meta[M_DTYPE]
        if not meta[M_SHAPE] or not dtype.is_floating_point or dtype == floating:
            continue
        if floating is None:
            floating = dtype
            continue
        # Two floating dtypes: the rare path.
        if _in_backward(context):
            return None
        involved = [m for m in tensors if m[M_SHAPE] and m[M_DTYPE].is_floating_point]
        dtypes = {m[M_DTYPE] for m in involved}
        if autocast_allows(dtypes, involved[0][M_DEVICE]):
            return None
        if _inside_a_call_of_one_dtype(involved, context):
            return None
        result = floating
        for other in dtypes:
            result = torch.promote_types(result, other)
        odd = _minority(involved)
        facts = SilentUpcast(
            first=floating, second=dtype, dtypes=sorted(dtypes, key=str), result=result,
            count=len(involved), names=tensor_names(func, len(tensors)), common=_common(involved, odd),
        )
        return Finding(KIND, "dtype.silent_upcast", facts, operands=tuple(tensors), odd=odd)
    return None


def _inside_a_call_of_one_dtype(involved, context) -> bool:
    """Whether the promoting op runs inside one call of a composite function (torch's math
    ``scaled_dot_product_attention`` upcasts float16 q, k, v to float32 and adds the caller's
    float16 mask) whose tensors, as the program passed them, all have one floating dtype: the
    promotion is torch's own, not the program's. Asked only once a promotion is found."""
    call = getattr(context, "call_tensors", None)
    if call is None:
        return False
    made, passed = call()
    if not any(meta[M_IDENT] in made for meta in involved):
        return False  # every operand came from the program: the op is the program's own
    floating = {m[M_DTYPE] for m in (*passed, *involved) if m[M_IDENT] not in made and m[M_SHAPE] and m[M_DTYPE].is_floating_point}
    return len(floating) <= 1


def _common(involved, odd) -> torch.dtype:
    """The dtype the rest of the program uses: the most frequent floating dtype of the operands
    that are not odd (the narrowest in a tie), whichever side the odd operand is on."""
    odd_dtypes = {meta[M_DTYPE] for meta in odd}
    counts: dict = {}
    for meta in involved:
        if meta[M_DTYPE] not in odd_dtypes:
            counts[meta[M_DTYPE]] = counts.get(meta[M_DTYPE], 0) + 1
    if not counts:
        return min(odd_dtypes, key=lambda dtype: dtype.itemsize)
    return max(counts, key=lambda dtype: (counts[dtype], -dtype.itemsize))


def _check_loss_target(func, name, tensors, context=None) -> Finding | None:
    if len(tensors) < 2:
        return None
    source, target = tensors[0], tensors[1]
    got, wanted = target[M_DTYPE], source[M_DTYPE]
    if got == wanted or not wanted.is_floating_point:
        return None
    names = tensor_names(func, len(tensors))
    if not got.is_floating_point and name in _FLOATING_TARGET_LOSSES:
        facts = LossFloatingTarget(op=_short(func), got=got, wanted=wanted, names=names)
        return Finding(KIND, "dtype.loss_floating_target", facts, operands=tuple(tensors))
    if not got.is_floating_point and name not in _INPUT_DTYPE_TARGET_LOSSES:
        return None  # an integer target of mse_loss is converted exactly; not an anomaly
    if _in_backward(context) or autocast_allows((got, wanted), source[M_DEVICE]):
        return None
    facts = LossTarget(op=_short(func), got=got, wanted=wanted, names=names, promoted=torch.promote_types(wanted, got))
    return Finding(KIND, "dtype.loss_target", facts, operands=tuple(tensors))


def _check_class_target(func, tensors, context=None) -> Finding | None:
    if len(tensors) < 2 or tensors[1][M_DTYPE] in _CLASS_INDEX_DTYPES:
        return None
    source, target = tensors[0], tensors[1]
    got = target[M_DTYPE]
    facts = ClassTarget(
        got=got, floating=got.is_floating_point, target_shape=target[M_SHAPE],
        input_shape=source[M_SHAPE], names=tensor_names(func, len(tensors)),
    )
    return Finding(KIND, "dtype.class_target", facts, operands=tuple(tensors))


def _check_indices(func, writes, tensors, context=None) -> Finding | None:
    indices = tensors[1:-1] if writes else tensors[1:]
    for position, meta in enumerate(indices, 1):
        if meta[M_DTYPE] not in _INDEXING_DTYPES:
            facts = IndexDtype(op=_short(func), position=position, index=as_meta(meta), indexed=as_meta(tensors[0]))
            return Finding(KIND, "dtype.index_dtype", facts, operands=tuple(tensors))
    return None


def _minority(tensors) -> tuple:
    """The operands of the least common dtype (the widest ones in a tie): the odd ones out."""
    counts: dict = {}
    for meta in tensors:
        counts[meta[M_DTYPE]] = counts.get(meta[M_DTYPE], 0) + 1
    fewest = min(counts.values())
    candidates = [dtype for dtype, count in counts.items() if count == fewest]
    odd_dtype = max(candidates, key=lambda dtype: (dtype.is_floating_point, dtype.itemsize))
    return tuple(meta for meta in tensors if meta[M_DTYPE] == odd_dtype)


def _check_same(func, tensors, context=None) -> Finding | None:
    dtypes = []
    for meta in tensors:
        if meta[M_DTYPE] not in dtypes:
            dtypes.append(meta[M_DTYPE])
    if len(dtypes) <= 1:
        return None
    odd = _minority(tensors)
    facts = OneDtype(op=_short(func), dtypes=dtypes, names=tensor_names(func, len(tensors)), common=_common(tensors, odd))
    return Finding(KIND, "dtype.one_dtype", facts, operands=tuple(tensors), odd=odd)


def _check_attention(func, tensors, context=None) -> Finding | None:
    if len(tensors) > _MASK_POSITION and tensors[_MASK_POSITION][M_DTYPE] in (torch.float32, torch.bool):
        return _check_same(func, tensors[:_MASK_POSITION], context)  # the mask is legal
    return _check_same(func, tensors, context)


def _matching_arg_check(func, arg_name, other_name):
    """The check that ``arg_name`` has the dtype of ``other_name`` (both tensor arguments before
    any tensor list, so their positions among the op's tensors are fixed)."""
    positions = {}
    for arg in func._schema.arguments:
        type_name = str(arg.type)
        if type_name in ("Tensor", "Tensor?", "Optional[Tensor]"):
            positions[arg.name] = len(positions)
        elif "Tensor" in type_name:
            break
    if arg_name not in positions or other_name not in positions:
        return None
    return partial(_check_matching_arg, func, positions[arg_name], arg_name, positions[other_name])


def _check_matching_arg(func, position, arg_name, other_position, tensors, context=None) -> Finding | None:
    if position >= len(tensors) or other_position >= len(tensors):
        return None
    wanted = tensors[other_position][M_DTYPE]
    if tensors[position][M_DTYPE] == wanted:
        return None
    return _check_arg(func, position, arg_name, (wanted,), frozenset((wanted,)), tensors, context)


def _check_arg(func, position, arg_name, dtypes, accepted, tensors, context=None) -> Finding | None:
    if position >= len(tensors) or tensors[position][M_DTYPE] in accepted:
        return None
    facts = ArgDtype(
        op=_short(func), arg=arg_name, got=tensors[position][M_DTYPE], accepted=list(dtypes),
        names=tensor_names(func, len(tensors)),
    )
    return Finding(KIND, "dtype.arg_dtype", facts, operands=tuple(tensors))
