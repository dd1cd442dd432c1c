"""Phrases the check renderers share: another op's place (``aten.addmm at train.py:23``),
tensor arguments with their metadata, where an odd operand was made.

Facts that name another op are :class:`~opwatch.checks.finding.Place` tuples (a JSON round
trip restores them, see :mod:`opwatch.core.fact_tuples`).
"""

from __future__ import annotations

from ..checks.finding import Place
from ..core.notation import format_meta
from ..core.records import BACKWARD, short_op_name
from ..core.sites import display_path

__all__ = ["module_label", "module_of", "named", "place", "place_location", "where_made"]


def module_label(path: str, cls: str | None) -> str:
    """A module as users know it: its path, with its class where the path ends in an index
    (the children of ``nn.Sequential`` and ``nn.ModuleList``): ``0 (Linear)``,
    ``blocks.3 (Block)``; a named one by its path alone (``encoder.attn``), and a name with no
    class behind it as it is (``torch.compile graph 3 (forward)``)."""
    _, _, last = path.rpartition(".")
    return f"{path} ({cls})" if cls is not None and last.isdigit() else path


def module_of(record) -> str | None:
    """The module of a record (or an anomaly) as messages and tables show it: its
    :func:`module_label`, ``None`` outside modules."""
    path = record.module
    return None if path is None else module_label(path, record.module_class)


def where_made(made) -> str:
    """One provenance fact (see ``opwatch.checks.provenance.Provenance.where_made``: an
    :class:`~opwatch.checks.finding.Attribute`, ``Owned``, ``MadeBy`` (with its ``detail``) or
    ``BeforeWatch``) as a clause."""
    how = made.how
    if how == "attribute":
        _, cls, name, path = made
        return (
            f"{cls}.{name} is a plain tensor attribute of module {module_label(path, cls)}: .to() and .cuda() do not move it; "
            f"make it a buffer (self.register_buffer({name!r}, ...))"
        )
    if how in ("parameter", "buffer"):
        if made.cls is None:
            return f"it is {how} {made.path}.{made.name}"
        return f"it is {_held(how, made.cls, made.name, made.path)}"
    if how == "before_watch":
        return "it was made before the watch (or outside torch ops, e.g. torch.from_numpy)"
    text = f"made by {place(made.place)}"
    detail = made.detail
    if detail is None:
        return text
    if detail.how == "python_data":
        lifted = detail.lifted
        data = f"made by {_call(detail.expression)} at {place_location(made.place if lifted is None else lifted)} (Python or NumPy data entering torch)"
        return data if lifted is None else f"{data}, then taken by {place(made.place)}"
    if detail.how == "from_module":
        return f"taken from {_held(detail.kind, detail.cls, detail.name, detail.path)} by {place(made.place)}"
    if detail.how == "computed_from":
        return f"{text}, computed from {_held(detail.kind, detail.cls, detail.name, detail.path)}"
    if detail.how == "default_device":
        return text + f" on the default device ({detail.device}): give it device= (or make it with *_like / new_*)"
    given, default = detail.given, detail.default
    return text + (f" with dtype={given}" if given is not None else f" in the default dtype ({default})")


_LONGEST_CALL = 60  # characters of the user's call quoted; longer ones are cut


def _call(expression) -> str:
    """The user's call that brought Python data into torch (``torch.from_numpy(a)``), or what
    it may have been where the source text is unknown (Python 3.10: no columns)."""
    if not expression:
        return "torch.tensor / torch.from_numpy / torch.as_tensor"
    if len(expression) > _LONGEST_CALL:
        expression = expression[: _LONGEST_CALL - 3] + "..."
    return expression


def _held(kind, cls, name, path) -> str:
    """``the buffer class_w of SeqClassifier (model.head)``; the path is left out where the
    module is the outermost one (named by its class)."""
    return f"the {kind} {name} of {cls}" + (f" ({path})" if path != cls else "")


def place(where) -> str:
    """``aten.addmm at train.py:23`` for a :class:`~opwatch.checks.finding.Place` (or the list
    a JSON round trip makes of one)."""
    if not isinstance(where, Place):
        where = Place(*where)
    return f"{short_op_name(where.op)} at {place_location(where)}"


def place_location(where) -> str:
    """``train.py:23`` of a :class:`Place` (or the list a JSON round trip makes of one), in
    the one location format."""
    if not isinstance(where, Place):
        where = Place(*where)
    if where.filename is None:
        return where.label or ("autograd" if where.phase == BACKWARD else "?")
    return f"{display_path(where.filename)}:{where.lineno}"


def named(names, metas) -> str:
    """``self=f32[6] cpu, mask=b8[6] meta``: tensor argument names (a finding's
    ``facts.names``) with their metadata."""
    return ", ".join(f"{name}={format_meta(meta)}" for name, meta in zip(names, metas))
