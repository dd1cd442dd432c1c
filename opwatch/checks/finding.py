"""What a check returns: the facts of one anomaly, before it is tied to a record."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Finding"]


@dataclass(frozen=True)
class Finding:
    """One anomaly as a check sees it.

    Attributes:
        kind: the anomaly kind, one of ``opwatch.KINDS``.
        problem: what is wrong, quoting the shapes/dtypes/devices involved.
        expected: what a healthy call would have looked like.
        fix: the likely fix.
        odd: the operands that stand out (the one on another device, the float64 one), as
            metadata tuples; where each was made is added to the problem when reported.
    """

    kind: str
    problem: str
    expected: str
    fix: str
    odd: tuple = ()


def takes_several_tensors(func) -> bool:
    """Whether an op can receive two or more tensors: the mismatch checks need a pair."""
    count = 0
    for arg in func._schema.arguments:
        type_name = str(arg.type)
        if "Tensor" in type_name:
            if type_name not in ("Tensor", "Tensor?"):
                return True  # a tensor list
            count += 1
    return count >= 2


def tensor_names(func, count: int) -> list[str]:
    """Names for an op's ``count`` tensor arguments, in order, taken from its schema when each
    tensor argument is a single tensor (``self``, ``mask``, ``source``); ``#1``, ``#2``, ...
    otherwise (tensor lists, optional tensors left out)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        names = [arg.name for arg in schema.arguments if str(arg.type) == "Tensor"]
        others = [arg for arg in schema.arguments if "Tensor" in str(arg.type) and str(arg.type) != "Tensor"]
        if len(names) == count and not others:
            return names
    return [f"#{i + 1}" for i in range(count)]


def describe(func, tensors) -> str:
    """``self=f32[6] cpu, mask=b8[6] meta`` for a finding's message."""
    from ..notation import format_meta

    names = tensor_names(func, len(tensors))
    return ", ".join(f"{name}={format_meta(meta)}" for name, meta in zip(names, tensors))
