"""The one compact tensor notation used everywhere: ``f32[4, 1] cpu``.

Records store raw metadata tuples ``(shape, dtype, device, ident)``; this module turns them
into text only when somebody reads a table, a message or a dump.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .fact_tuples import fact_tuple

__all__ = ["TensorMeta", "format_dtype", "format_meta", "format_shape"]


@fact_tuple("meta")
class TensorMeta(NamedTuple):
    """What opwatch remembers of one tensor: never the tensor itself.

    ``ident`` is ``id()`` of the tensor object when the op saw it; opwatch uses it to follow
    data from op to op (which op produced an input) without holding a reference.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ident: int = 0

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


def format_meta(meta: tuple) -> str:
    """``(shape, dtype, device, ...)`` -> ``f32[4, 1] cpu``."""
    shape, dtype, device = meta[:3]
    return f"{format_dtype(dtype)}{format_shape(shape)} {device}"
