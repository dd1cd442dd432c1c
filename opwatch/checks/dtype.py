"""dtype_mismatch: caught before the kernel, in five shapes.

1. Ops whose kernels need one dtype for all operands (the matmul family, convolutions, fused
   attention): ``f64[5, 3] @ f32[3, 2]`` fails deep in the kernel with a terse message.
2. Mask and index arguments of a dtype the kernel rejects: ``masked_scatter_`` with an ``i64``
   mask; ``gather``/``scatter``/``index_select``/``index_add``/``embedding`` indices that are
   neither ``i64`` nor ``i32``; ``index_copy``/``index_fill``/``take`` indices that are not
   ``i64``; tensors used as indices (``x[idx]``, ``x[idx] = v``) that are neither integer
   (``i64``, ``i32``, ``u8``) nor ``bool``.
3. A silent promotion between two *different floating* dtypes of non-scalar tensors in a
   pointwise op (``f32 * f64 -> f64``, typically a float64 array from numpy meeting a float32
   model), or in ``cat``/``stack``. It never raises; it costs speed and memory and changes
   every result downstream.
4. An elementwise loss (``mse_loss``, ``smooth_l1_loss``, ``huber_loss``, ``soft_margin_loss``,
   ``binary_cross_entropy[_with_logits]``) whose target has another floating dtype than its
   input: ``F.mse_loss(f32, f64)`` silently runs the loss and its backward in float64,
   ``huber_loss`` raises only in backward. The ``binary_cross_entropy`` losses also need a
   floating target (an ``i64`` multi-hot target raises a cryptic cast error).
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
"""

from __future__ import annotations

from functools import partial

import torch

from ..compat import restore_caller_state
from ..notation import format_dtype as _name
from ..notation import format_meta
from ..render.messages import describe
from .finding import Finding, text_finding, takes_several_tensors

__all__ = ["KIND", "for_op", "autocast_allows"]

KIND = "dtype_mismatch"

_SAME_DTYPE_OPS = {
    "aten::mm", "aten::bmm", "aten::addmm", "aten::addmv", "aten::mv", "aten::dot", "aten::vdot",
    "aten::baddbmm", "aten::addbmm", "aten::addr", "aten::convolution", "aten::_convolution",
    "aten::convolution_overrideable", "aten::linear", "aten::matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
}
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
_CONCATENATIONS = {"aten::cat", "aten::stack"}
# Elementwise losses seen as one op ``(input, target, ...)``, and what a target of another
# floating dtype does there (torch 2.13, CPU). l1_loss, kl_div, poisson_nll_loss and
# gaussian_nll_loss decompose into pointwise ops, where the promotion rule sees them.
_ELEMENTWISE_LOSSES = {
    "aten::mse_loss": "promotes silently: the loss and its backward run in {promoted}",
    "aten::smooth_l1_loss": "promotes silently: the loss and its backward run in {promoted}",
    "aten::binary_cross_entropy_with_logits": "takes the target's dtype: the loss and its backward run in {target}",
    "aten::huber_loss": "passes in forward, then the backward raises 'Found dtype {target_torch} but expected {input_torch}'",
    "aten::soft_margin_loss": "converts the target to {input} on every call",
    "aten::binary_cross_entropy": "raises 'Found dtype {target_torch} but expected {input_torch}'",
}
_FLOATING_TARGET_LOSSES = {"aten::binary_cross_entropy", "aten::binary_cross_entropy_with_logits"}
# Class-index losses: ``(input, target, weight?, ...)``; the kernel takes int64 or uint8 targets.
_CLASS_INDEX_LOSSES = {"aten::nll_loss_forward", "aten::nll_loss2d_forward", "aten::nll_loss", "aten::nll_loss2d", "aten::nll_loss_nd"}
_CLASS_INDEX_DTYPES = frozenset({torch.int64, torch.uint8})
_TORCH_NAMES = {torch.float64: "Double", torch.float32: "Float", torch.bfloat16: "BFloat16", torch.float16: "Half"}

# torch turns autocast off while a dispatch mode's ``__torch_dispatch__`` runs: read the
# caller's state through compat.restore_caller_state (a RuntimeError outside dispatch: a module
# hook, a unit test, where the state is the caller's already).
_RESTORE_CALLER_STATE = restore_caller_state


def for_op(func):
    """The check bound to ``func``, as ``check(tensors, context) -> Finding | None``; ``None``
    when it cannot fire on this op."""
    if not takes_several_tensors(func):
        return None
    name = func._schema.name
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


def _check_promotion(func, tensors, context=None) -> Finding | None:
    floating = None
    for meta in tensors:
        dtype = meta[1]
        if not meta[0] or not dtype.is_floating_point or dtype == floating:
            continue
        if floating is None:
            floating = dtype
            continue
        # Two floating dtypes: the rare path.
        if _in_backward(context):
            return None
        involved = [m for m in tensors if m[0] and m[1].is_floating_point]
        dtypes = {m[1] for m in involved}
        if autocast_allows(dtypes, involved[0][2]):
            return None
        result = floating
        for other in dtypes:
            result = torch.promote_types(result, other)
        names = sorted(_name(d) for d in dtypes) if len(dtypes) > 2 else [_name(floating), _name(dtype)]
        return text_finding(
            kind=KIND,
            problem=(
                f"silent promotion {' with '.join(names)} -> {_name(result)}: "
                f"{describe(func, tensors)}. The op runs in {_name(result)} and so does everything downstream."
            ),
            expected=f"one floating dtype for all non-scalar operands (got {len(involved)} operands in {', '.join(names[:-1])} and {names[-1]})",
            fix=(
                f"cast where the odd tensor is made, e.g. torch.from_numpy(a).to({_name(floating)}) or "
                f".to(other.dtype); torch.set_default_dtype is not the cause when numpy made the array"
            ),
            odd=_minority(involved),
        )
    return None


def _check_loss_target(func, name, tensors, context=None) -> Finding | None:
    if len(tensors) < 2:
        return None
    source, target = tensors[0], tensors[1]
    got, wanted = target[1], source[1]
    if got == wanted or not wanted.is_floating_point:
        return None
    op = name.split("::")[-1]
    if not got.is_floating_point:
        if name not in _FLOATING_TARGET_LOSSES:
            return None  # an integer target of mse_loss is converted exactly; not an anomaly
        return text_finding(
            kind=KIND,
            problem=(
                f"{op} needs a floating target, got {_name(got)}: {describe(func, tensors)}. "
                f"torch raises a cast error ('result type Float can't be cast to the desired output type ...')"
            ),
            expected=f"target as {_name(wanted)}, like the input (0/1 labels as floats)",
            fix=f"target.to({wanted}) where the labels are made (multi-hot labels are often built as i64)",
        )
    if _in_backward(context) or autocast_allows((got, wanted), source[2]):
        return None
    consequence = _ELEMENTWISE_LOSSES[name].format(
        promoted=_name(torch.promote_types(wanted, got)), target=_name(got), input=_name(wanted),
        target_torch=_TORCH_NAMES.get(got, _name(got)), input_torch=_TORCH_NAMES.get(wanted, _name(wanted)),
    )
    return text_finding(
        kind=KIND,
        problem=f"{op} gets a {_name(got)} target for a {_name(wanted)} input: {describe(func, tensors)}. It {consequence}.",
        expected=f"target in the input's dtype ({_name(wanted)})",
        fix=f"cast the target where it is made, e.g. torch.from_numpy(y).to({wanted}) or target.to(pred.dtype)",
    )


def _check_class_target(func, tensors, context=None) -> Finding | None:
    if len(tensors) < 2 or tensors[1][1] in _CLASS_INDEX_DTYPES:
        return None
    source, target = tensors[0], tensors[1]
    got = target[1]
    problem = f"class-index target of nll_loss/cross_entropy is {_name(got)}, but the kernel needs i64: {describe(func, tensors)}"
    if got.is_floating_point:
        problem += (
            f". A floating target of shape {list(target[0])} holds class indices stored as floats;"
            f" cross_entropy takes floating targets only as class probabilities, shaped like the input"
        )
        fix = (
            "target.long() where the labels are made; for class probabilities (soft labels) give"
            f" cross_entropy a floating target of the input's shape {list(source[0])}"
        )
    else:
        fix = "target.long() where the labels are made (numpy int32 arrays and torch.int32 data loaders are the usual source)"
    return text_finding(
        kind=KIND,
        problem=problem + "; torch raises 'expected target dtype to be Long or Byte'",
        expected="class indices as i64",
        fix=fix,
    )


def _check_indices(func, writes, tensors, context=None) -> Finding | None:
    indices = tensors[1:-1] if writes else tensors[1:]
    for meta in indices:
        if meta[1] not in _INDEXING_DTYPES:
            position = indices.index(meta) + 1
            return text_finding(
                kind=KIND,
                problem=(
                    f"index tensor {format_meta(meta)} (index #{position}) of {func._schema.name.split('::')[-1]} "
                    f"is neither integer nor bool: indexed tensor {format_meta(tensors[0])}. torch raises "
                    f"'tensors used as indices must be long, int, byte or bool tensors'"
                ),
                expected="index tensors as i64 or i32 (positions) or bool (a mask)",
                fix=(
                    "idx.long() where the positions are computed (arange/linspace/division of floats"
                    " makes floating positions), or build a bool mask with a comparison"
                ),
            )
    return None


def _minority(tensors) -> tuple:
    """The operands of the least common dtype (the widest ones in a tie): the odd ones out."""
    counts: dict = {}
    for meta in tensors:
        counts[meta[1]] = counts.get(meta[1], 0) + 1
    fewest = min(counts.values())
    candidates = [dtype for dtype, count in counts.items() if count == fewest]
    odd_dtype = max(candidates, key=lambda dtype: (dtype.is_floating_point, dtype.itemsize))
    return tuple(meta for meta in tensors if meta[1] == odd_dtype)


def _check_same(func, tensors, context=None) -> Finding | None:
    dtypes = []
    for meta in tensors:
        if meta[1] not in dtypes:
            dtypes.append(meta[1])
    if len(dtypes) <= 1:
        return None
    return text_finding(
        kind=KIND,
        problem=f"{func._schema.name.split('::')[-1]} needs one dtype for all operands, got {', '.join(_name(d) for d in dtypes)}: {describe(func, tensors)}",
        expected=f"every operand in {_name(dtypes[0])} (or all in {_name(dtypes[1])})",
        fix="cast one side where it is made (.to(x.dtype)); a stray .double() or a float64 numpy array is the usual cause",
        odd=_minority(tensors),
    )


def _check_arg(func, position, arg_name, dtypes, accepted, tensors, context=None) -> Finding | None:
    if position >= len(tensors) or tensors[position][1] in accepted:
        return None
    got = tensors[position][1]
    wanted = " or ".join(_name(d) for d in dtypes)
    return text_finding(
        kind=KIND,
        problem=f"argument {arg_name!r} is {_name(got)} but {func._schema.name.split('::')[-1]} needs {wanted}: {describe(func, tensors)}",
        expected=f"{arg_name} as {wanted}",
        fix=f"build it as {wanted} (e.g. {arg_name}.to({dtypes[0]}) or dtype={dtypes[0]} where it is made)",
    )
