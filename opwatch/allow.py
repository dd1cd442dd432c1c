"""``Allow``: an anomaly the user knows about and accepts, matched by kind, op, module and line."""

from __future__ import annotations

from fnmatch import fnmatchcase

__all__ = ["Allow", "parse_allow"]

FIELDS = ("kind", "op", "module", "where")


class Allow:
    """One entry of ``watch(allow=[...])``: an anomaly matching every given field is *allowed*:
    kept in ``Watch.allowed``, never an anomaly, a warning or a raise in ``strict()``.

    Each field is optional; strings are glob patterns (``*``, ``?``, ``[...]``), matched
    case-sensitively:

    kind
        One of the anomaly kinds (``opwatch.KINDS``): ``Allow(kind="broadcast")``.
    op
        The op, as records name it (``"aten.sub.Tensor"``) or without its overload
        (``"aten.sub"``): ``Allow(op="aten.log*")``.
    module
        The module path: ``Allow(module="encoder.*.attn")``.
    where
        The user's line as messages show it (``"train.py:42"``, ``"src/train.py:4?"``); a
        pattern without a folder also matches the file's base name.

    ``Allow()`` with no field allows everything. Unknown fields or kinds are a ``ValueError``
    naming the accepted ones.
    """

    __slots__ = FIELDS

    def __init__(self, **fields):
        unknown = [name for name in fields if name not in FIELDS]
        if unknown:
            raise ValueError(f"unknown Allow field(s) {', '.join(map(repr, unknown))}; the fields are {', '.join(map(repr, FIELDS))}")
        for name in FIELDS:
            value = fields.get(name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"Allow({name}=...) must be a string pattern or None, got {type(value).__name__}")
            object.__setattr__(self, name, value)
        from .checks import KINDS

        if self.kind is not None and not any(fnmatchcase(kind, self.kind) for kind in KINDS):
            raise ValueError(f"Allow(kind={self.kind!r}) matches no anomaly kind; the kinds are {', '.join(map(repr, KINDS))}")

    def __setattr__(self, name, value):
        raise AttributeError("Allow is immutable")

    def matches(self, anomaly) -> bool:
        """Whether ``anomaly`` (an :class:`~opwatch.Anomaly`) matches every given field."""
        if self.kind is not None and not fnmatchcase(anomaly.kind, self.kind):
            return False
        if self.op is not None:
            op = anomaly.op
            if not (fnmatchcase(op, self.op) or fnmatchcase(op.rsplit(".", 1)[0], self.op)):
                return False
        if self.module is not None and not fnmatchcase(anomaly.module or "", self.module):
            return False
        if self.where is not None:
            where = anomaly.record.where
            if not fnmatchcase(where, self.where):
                base = where.replace("\\", "/").rsplit("/", 1)[-1]
                if "/" in self.where or not fnmatchcase(base, self.where):
                    return False
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, Allow) and all(getattr(self, name) == getattr(other, name) for name in FIELDS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, name) for name in FIELDS))

    def __repr__(self) -> str:
        given = ", ".join(f"{name}={getattr(self, name)!r}" for name in FIELDS if getattr(self, name) is not None)
        return f"Allow({given})"


def parse_allow(text: str) -> Allow:
    """``"kind=broadcast,where=train.py:42"`` (the CLI's ``--allow``) -> ``Allow``."""
    fields = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--allow takes FIELD=PATTERN pairs separated by commas (fields: {', '.join(FIELDS)}), got {text!r}")
        fields[name.strip()] = value.strip()
    return Allow(**fields)
