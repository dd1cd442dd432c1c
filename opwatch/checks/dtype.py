"""dtype_mismatch: caught before the kernel, in three shapes.

1. Ops whose kernels need one dtype for all operands (the matmul family, convolutions, fused
   attention): ``f64[5, 3] @ f32[3, 2]`` fails deep in the kernel with a terse message.
2. Mask and index arguments of the wrong dtype: ``masked_scatter_`` with an ``i64`` mask.
3. A silent promotion between two *different floating* dtypes of non-scalar tensors in a
   pointwise op (``f32 * f64 -> f64``, typically a float64 array from numpy meeting a float32
   model). It never raises; it costs speed and memory and changes every result downstream.

Integer or bool tensors mixed with floats (masks, counts) and Python or 0-dim scalars never
promote across floating dtypes and are not anomalies. Copies are deliberate casts.
"""

from __future__ import annotations

from functools import partial

import torch

from ..notation import format_dtype as _name
from .finding import Finding, describe, takes_several_tensors

__all__ = ["KIND", "for_op"]

KIND = "dtype_mismatch"

_SAME_DTYPE_OPS = {
    "aten::mm", "aten::bmm", "aten::addmm", "aten::addmv", "aten::mv", "aten::dot", "aten::vdot",
    "aten::baddbmm", "aten::addbmm", "aten::addr", "aten::convolution", "aten::_convolution",
    "aten::convolution_overrideable", "aten::linear", "aten::matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
}
_NOT_PROMOTIONS = {"aten::copy_", "aten::copy", "aten::_to_copy", "aten::to", "aten::_copy_from"}
# Argument name -> dtypes the kernel accepts there.
_ARG_DTYPES = {
    "mask": (torch.bool, torch.uint8),
    "index": (torch.int64, torch.int32),
    "indices": (torch.int64, torch.int32),
}
# Ops whose ``index``/``indices`` argument must be an integer tensor (``sparse_mask``'s
# "mask" and the like are other things of the same name).
_INDEX_ARG_OPS = {
    "aten::index_select", "aten::gather", "aten::scatter", "aten::scatter_", "aten::scatter_add",
    "aten::scatter_add_", "aten::scatter_reduce", "aten::scatter_reduce_", "aten::index_add",
    "aten::index_add_", "aten::index_copy", "aten::index_copy_", "aten::index_fill", "aten::index_fill_",
    "aten::index_reduce", "aten::index_reduce_", "aten::take", "aten::embedding",
}
_INT64_INDEX_OPS = {"aten::gather", "aten::scatter", "aten::scatter_", "aten::scatter_add", "aten::scatter_add_", "aten::scatter_reduce", "aten::scatter_reduce_"}

def for_op(func):
    """The check bound to ``func``, as ``check(tensors, context) -> Finding | None``; ``None``
    when it cannot fire on this op."""
    if not takes_several_tensors(func):
        return None
    name = func._schema.name
    if name in _SAME_DTYPE_OPS:
        return partial(_check_same, func)
    tensor_position = 0
    checks_args = name.startswith("aten::masked_") or name in _INDEX_ARG_OPS
    for arg in func._schema.arguments:
        type_name = str(arg.type)
        if type_name in ("Tensor", "Tensor?"):
            if checks_args and arg.name in _ARG_DTYPES and type_name == "Tensor":
                dtypes = (torch.int64,) if name in _INT64_INDEX_OPS else _ARG_DTYPES[arg.name]
                return partial(_check_arg, func, tensor_position, arg.name, dtypes)
            tensor_position += 1
        elif "Tensor" in type_name:
            break  # positions after a tensor list are not fixed
    if torch.Tag.pointwise in func.tags and name not in _NOT_PROMOTIONS and not func._schema.is_mutable:
        return partial(_check_promotion, func)
    return None


def _check_promotion(func, tensors, context=None) -> Finding | None:
    floating = None
    for meta in tensors:
        dtype = meta[1]
        if not meta[0] or not dtype.is_floating_point or dtype == floating:
            continue
        if floating is None:
            floating = dtype
            continue
        result = torch.promote_types(floating, dtype)
        involved = [m for m in tensors if m[0] and m[1].is_floating_point]
        return Finding(
            kind=KIND,
            problem=(
                f"silent promotion {_name(floating)} with {_name(dtype)} -> {_name(result)}: "
                f"{describe(func, tensors)}. The op runs in {_name(result)} and so does everything downstream."
            ),
            expected=f"one floating dtype for all non-scalar operands (got {len(involved)} operands in {_name(floating)} and {_name(dtype)})",
            fix=(
                f"cast where the odd tensor is made, e.g. torch.from_numpy(a).to({_name(floating)}) or "
                f".to(other.dtype); torch.set_default_dtype is not the cause when numpy made the array"
            ),
        )
    return None


def _check_same(func, tensors, context=None) -> Finding | None:
    dtypes = []
    for meta in tensors:
        if meta[1] not in dtypes:
            dtypes.append(meta[1])
    if len(dtypes) <= 1:
        return None
    return Finding(
        kind=KIND,
        problem=f"{func._schema.name.split('::')[-1]} needs one dtype for all operands, got {', '.join(_name(d) for d in dtypes)}: {describe(func, tensors)}",
        expected=f"every operand in {_name(dtypes[0])} (or all in {_name(dtypes[1])})",
        fix="cast one side where it is made (.to(x.dtype)); a stray .double() or a float64 numpy array is the usual cause",
    )


def _check_arg(func, position, arg_name, dtypes, tensors, context=None) -> Finding | None:
    if position >= len(tensors) or tensors[position][1] in dtypes:
        return None
    got = tensors[position][1]
    wanted = " or ".join(_name(d) for d in dtypes)
    return Finding(
        kind=KIND,
        problem=f"argument {arg_name!r} is {_name(got)} but {func._schema.name.split('::')[-1]} needs {wanted}: {describe(func, tensors)}",
        expected=f"{arg_name} as {wanted}",
        fix=f"build it as {wanted} (e.g. {arg_name}.to({dtypes[0]}) or dtype={dtypes[0]} where it is made)",
    )
