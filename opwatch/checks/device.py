"""device_mismatch: tensor arguments of one op on different devices, caught before the kernel.

0-dim CPU tensors mix legally with any device (they are scalars) and are not flagged. CPU mixed
with ``meta`` is flagged even where torch lets it pass: it means a model was only half
materialised from meta init. Ops whose job is to move data between devices (copies) and ops
that take CPU index tensors by design (advanced indexing) are exempt.
"""

from __future__ import annotations

from functools import partial

from .finding import Finding, describe, takes_several_tensors

__all__ = ["KIND", "for_op"]

KIND = "device_mismatch"

_CROSS_DEVICE_OPS = {
    "aten::copy_",
    "aten::copy",
    "aten::_copy_from",
    "aten::_copy_from_and_resize",
    "aten::_to_copy",
    "aten::to",
    "aten::set_",
    "aten::_has_same_storage_numel",
    "aten::_local_scalar_dense",
}
# Advanced indexing accepts CPU index tensors whatever the device of ``self``.
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::_unsafe_index", "aten::_unsafe_index_put"}


def for_op(func):
    """The check bound to ``func``, as ``check(tensors, context) -> Finding | None``; ``None``
    when it cannot fire on this op."""
    name = func._schema.name
    if name in _CROSS_DEVICE_OPS or not takes_several_tensors(func):
        return None
    # foreach/fused optimizer kernels group their tensor lists by device themselves; nested
    # tensors carry metadata tensors (on meta or CPU) by design.
    op = name.split("::", 1)[-1]
    if op.startswith(("_foreach_", "_fused_", "_nested_")):
        return None
    if name in _INDEX_OPS:
        # Only the indexed tensor and the values written must agree; indices may live on CPU.
        return partial(_check_indexing, func, "put" in name)
    return partial(_check, func)


def _check_indexing(func, writes, tensors, context=None) -> Finding | None:
    if tensors:
        tensors = (tensors[0], tensors[-1]) if writes else tensors[:1]
    return _check(func, tensors)


def _check(func, tensors, context=None) -> Finding | None:
    device = None
    for meta in tensors:
        other = meta[2]
        if other == device:
            continue
        if not meta[0] and other.type == "cpu":
            continue  # a 0-dim CPU tensor is a scalar: legal with any device
        if device is None:
            device = other
            continue
        return _finding(func, tensors)
    return None


def _finding(func, tensors) -> Finding:
    devices = []
    for meta in tensors:
        if meta[0] or meta[2].type != "cpu":
            if str(meta[2]) not in devices:
                devices.append(str(meta[2]))
    meta_note = ""
    if "meta" in devices:
        meta_note = (
            " A 'meta' tensor has no data: a module or tensor was left on the meta device"
            " (e.g. built under torch.device('meta') and never materialised with to_empty())."
        )
    return Finding(
        kind=KIND,
        problem=f"tensor arguments on different devices ({', '.join(devices)}): {describe(func, tensors)}.{meta_note}",
        expected="every non-scalar tensor argument on one device",
        fix=f"create or move the odd one out with device=... / .to({devices[-1]!r}) where it is made",
    )
