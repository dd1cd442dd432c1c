"""The facts of a failed guarded call: what :func:`opwatch.guard`'s check
(:mod:`opwatch.runners.guarded.check`) fills and :mod:`opwatch.render.guard` words, read by
attribute on both sides. They live on the renderer's floor so that the runner (the top floor)
fills them and the renderer reads them with imports that go downhill."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Raised", "FailedElsewhere", "NotFinite", "Returned", "BadGrads", "Unnamed"]


class Raised(NamedTuple):
    """The step (or the op a repro runs) raised."""

    how: str  # "raised"
    error_type: str  # the exception's type name
    line: str  # the first line of its text


class FailedElsewhere(NamedTuple):
    """This rank's results were finite while another rank's were not (a distributed job
    decides each step's failure on every rank together)."""

    how: str  # "elsewhere"


class Returned(NamedTuple):
    """A returned value that is not finite."""

    kind: str  # "nan" or "inf"
    path: str  # "returned" for the value itself, else its place ("returned[0]", "returned['loss']")
    type: str  # "tensor" or "float"


class Unnamed(NamedTuple):
    """A parameter the guard knows no name of."""

    position: int  # its place among the parameters
    meta: tuple  # (shape, dtype, device, 0): core.notation.format_meta's


class BadGrads(NamedTuple):
    """The parameters whose ``.grad`` holds one kind of non-finite value."""

    kind: str  # "nan" or "inf"
    names: tuple  # each a parameter's name (str) or an :class:`Unnamed`


class NotFinite(NamedTuple):
    """The check after the step found nan/inf."""

    how: str  # "not_finite"
    returned: tuple  # Returned, ...
    grads: tuple  # BadGrads, ...
