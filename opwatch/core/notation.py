"""The one compact tensor notation used everywhere: ``f32[4, 1] cpu``.

Records store raw metadata tuples ``(shape, dtype, device, ident)``; this module turns them
into text only when somebody reads a table, a message or a dump.

A DTensor's tuple has a fifth item, its :class:`Sharding` facts (``sharding_of``, made on the
hot path as plain tuples, the placements' facts cached per placements tuple): the tuple's shape
stays the global one that the op and the checks see, and the notation shows the local shard
first, then the global shape and the placements:
``f32[8, 16] cpu (global [16, 16], Shard(0) on 2 ranks)``; ``f32[16] cpu (Replicate() on 2
ranks)`` where the shard is the whole tensor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .bounded import BoundedCache
from .compat import dtensor_parts
from .fact_tuples import fact_tuple

__all__ = ["TensorMeta", "Sharding", "as_meta", "format_dtype", "format_meta", "format_shape", "format_sharding", "sharding_of"]


@fact_tuple("meta")
class TensorMeta(NamedTuple):
    """What opwatch remembers of one tensor: never the tensor itself.

    ``ident`` is ``id()`` of the tensor object when the op saw it; opwatch uses it to follow
    data from op to op (which op produced an input) without holding a reference. ``sharding``:
    a DTensor's :class:`Sharding` (``shape`` is then its global shape), else ``None``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ident: int = 0
    sharding: tuple | None = None

    def __str__(self) -> str:
        return format_meta(self)


_DTYPE_NAMES = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.complex32: "c32",
    torch.complex64: "c64",
    torch.complex128: "c128",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "b8",
}


def format_dtype(dtype: Any) -> str:
    """``torch.float32`` -> ``f32``; dtypes without a short name keep torch's own name."""
    name = _DTYPE_NAMES.get(dtype)
    if name is not None:
        return name
    return str(dtype).removeprefix("torch.")


def format_shape(shape: Any) -> str:
    """``(4, 1)`` -> ``[4, 1]``; unknown shapes (nested tensors) print as ``[?]``."""
    if shape is None:
        return "[?]"
    return "[" + ", ".join(str(size) for size in shape) + "]"


def as_meta(meta) -> TensorMeta:
    """A tensor's metadata tuple (the hot path's plain ``(shape, dtype, device, ident)``) as
    the :class:`TensorMeta` a finding's facts hold, read by field."""
    return meta if type(meta) is TensorMeta else TensorMeta(*meta)


def format_meta(meta: tuple) -> str:
    """``(shape, dtype, device, ...)`` -> ``f32[4, 1] cpu``; a DTensor's (with its
    :class:`Sharding`) -> ``f32[8, 16] cpu (global [16, 16], Shard(0) on 2 ranks)``."""
    shape, dtype, device = meta[:3]
    sharding = meta[_SHARDING] if len(meta) > _SHARDING else None
    if sharding is None:
        return f"{format_dtype(dtype)}{format_shape(shape)} {device}"
    local, placements, mesh = sharding[:3]
    where = format_sharding(placements, mesh)
    if tuple(local) != tuple(shape):
        where = f"global {format_shape(shape)}, {where}"
    return f"{format_dtype(dtype)}{format_shape(local)} {device} ({where})"


_SHARDING = 4  # the position of ``TensorMeta.sharding`` in a metadata tuple


@fact_tuple("sharding")
class Sharding(NamedTuple):
    """What opwatch remembers of a DTensor beside its global shape: its local shard's shape on
    this rank, its placements (one per mesh dimension: ``("shard", dim)``, ``("replicate",)``,
    ``("partial", reduce_op)``, ``("strided_shard", dim, split_factor)``, or ``(class name,)``)
    and its device mesh's shape; ``local_ident``: ``id()`` of the local shard (the nan/inf
    check follows values between a DTensor and its shard by it). Plain data, stored in the op
    log as a plain tuple."""

    local: tuple
    placements: tuple
    mesh: tuple
    local_ident: int = 0


# (placements tuple, id of the mesh) -> (the mesh, (placement facts, mesh shape)): a few per
# program. The mesh is kept by the value so that its id is not reused while the key is here.
_PLACEMENTS = BoundedCache(256)


def sharding_of(tensor, shapes) -> tuple:
    """A DTensor's :class:`Sharding` facts as a plain tuple, its local shape interned in
    ``shapes`` (a :class:`~opwatch.core.records.SharedShapes`), without running an op."""
    local, placements, mesh = dtensor_parts(tensor)
    key = (placements, id(mesh))
    known = _PLACEMENTS.get(key)
    if known is None:
        known = _PLACEMENTS.put(key, (mesh, (tuple(map(_placement_facts, placements)), tuple(mesh.shape))))
    _, (facts, mesh_shape) = known
    return (shapes[local.shape], facts, mesh_shape, id(local))


def _placement_facts(placement) -> tuple:
    name = type(placement).__name__
    if name == "_StridedShard":
        return ("strided_shard", placement.dim, placement.split_factor)
    if name == "Shard":
        return ("shard", placement.dim)
    if name == "Replicate":
        return ("replicate",)
    reduce_op = getattr(placement, "reduce_op", None)
    if isinstance(reduce_op, str):  # Partial and its kinds
        return ("partial", reduce_op)
    return (name,)


def format_sharding(placements: tuple, mesh: tuple) -> str:
    """``(("shard", 0),), (2,)`` -> ``Shard(0) on 2 ranks``; several mesh dimensions:
    ``[Shard(0), Replicate()] on 2x2 ranks``."""
    shown = ", ".join(map(_format_placement, placements))
    if len(placements) > 1:
        shown = f"[{shown}]"
    ranks = "x".join(map(str, mesh))
    return f"{shown} on {ranks} ranks"


_PLACEMENT_NAMES = {"shard": "Shard", "replicate": "Replicate", "partial": "Partial", "strided_shard": "_StridedShard"}


def _format_placement(facts: tuple) -> str:
    """``("shard", 0)`` -> ``Shard(0)``, ``("partial", "sum")`` -> ``Partial(sum)``: torch's
    names, the arguments unquoted."""
    kind, *arguments = facts
    return f"{_PLACEMENT_NAMES.get(kind, kind)}({', '.join(map(str, arguments))})"
