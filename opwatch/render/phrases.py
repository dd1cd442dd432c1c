"""Phrases the check renderers share: another op's place (``aten.addmm at train.py:23``),
tensor arguments with their metadata, where an odd operand was made.

Facts that name another op are :class:`~opwatch.checks.finding.Place` tuples (a JSON round
trip restores them, see :mod:`opwatch.fact_tuples`).
"""

from __future__ import annotations

from ..checks.finding import Place
from ..notation import format_meta
from ..records import BACKWARD, short_op_name
from ..sites import display_path

__all__ = ["named", "place", "where_made"]


def where_made(made) -> str:
    """One provenance fact (see ``CheckContext.where_made``: an
    :class:`~opwatch.checks.finding.Attribute`, ``Owned``, ``MadeBy`` or ``BeforeWatch``) as a clause."""
    how = made.how
    if how == "attribute":
        _, cls, name, path = made
        return (
            f"{cls}.{name} is a plain tensor attribute of module {path}: .to() and .cuda() do not move it; "
            f"make it a buffer (self.register_buffer({name!r}, ...))"
        )
    if how in ("parameter", "buffer"):
        return f"it is {how} {made.path}.{made.name}"
    if how == "before_watch":
        return "it was made before the watch (or outside torch ops, e.g. torch.from_numpy)"
    text = f"made by {place(made.place)}"
    factory = made.factory
    if factory is None:
        return text
    if factory.how == "default_device":
        return text + f" on the default device ({factory.device}): give it device= (or make it with *_like / new_*)"
    given, default = factory.given, factory.default
    return text + (f" with dtype={given}" if given is not None else f" in the default dtype ({default})")


def place(where) -> str:
    """``aten.addmm at train.py:23`` for a :class:`~opwatch.checks.finding.Place` (or the list
    a JSON round trip makes of one)."""
    if not isinstance(where, Place):
        where = Place(*where)
    op = short_op_name(where.op)
    if where.filename is None:
        at = where.label or ("autograd" if where.phase == BACKWARD else "?")
    else:
        at = f"{display_path(where.filename)}:{where.lineno}"
    return f"{op} at {at}"


def named(names, metas) -> str:
    """``self=f32[6] cpu, mask=b8[6] meta``: tensor argument names (a finding's
    ``facts["names"]``) with their metadata."""
    return ", ".join(f"{name}={format_meta(meta)}" for name, meta in zip(names, metas))
