"""``Allow``: an anomaly the user knows about and accepts, matched by kind, op, module and line."""

from __future__ import annotations

import os
from fnmatch import fnmatchcase

from ..render.phrases import module_of

__all__ = ["Allow", "parse_allow", "where_matches"]

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
        The module path: ``Allow(module="encoder.*.attn")``; a module labelled ``net.0 (Linear)``
        is matched by ``"net.0"`` too.
    where
        The user's line, ``FILE:LINE`` (``"train.py:42"``, ``"src/train.py:4?"``), or a file
        alone (``"src/train.py"``: any of its lines). ``FILE`` is matched against the end of
        the file's absolute path, one path component against one (``*`` stays within a
        component): ``"train.py:42"`` matches ``/home/me/proj/train.py`` line 42 from any
        working directory, ``"src/train.py:42"`` matches ``.../src/train.py`` but not
        ``.../tools/train.py``, and a pattern starting with ``/`` is the whole path. A pattern
        also matches the location as messages show it (``where``, relative to the working
        directory, or a named place such as ``"DDP bucket*"`` or ``"autograd"``).

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
        from ..checks import KINDS

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
        if self.module is not None:
            # The path (``net.0``) or the label messages show (``net.0 (Linear)``).
            path = anomaly.module or ""
            if not (fnmatchcase(path, self.module) or fnmatchcase(module_of(anomaly) or "", self.module)):
                return False
        if self.where is not None and not where_matches(self.where, anomaly.filename, anomaly.lineno, anomaly.where):
            return False
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, Allow) and all(getattr(self, name) == getattr(other, name) for name in FIELDS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, name) for name in FIELDS))

    def __repr__(self) -> str:
        given = ", ".join(f"{name}={getattr(self, name)!r}" for name in FIELDS if getattr(self, name) is not None)
        return f"Allow({given})"


def where_matches(pattern: str, filename: str | None, lineno: int | None, shown: str) -> bool:
    """Whether ``pattern`` (``FILE:LINE`` or ``FILE``, globs allowed) names the line ``lineno``
    of ``filename``, or the location ``shown`` as messages show it (see :class:`Allow`)."""
    if fnmatchcase(shown, pattern):
        return True
    if filename is None:
        return False
    path, sep, line = pattern.rpartition(":")
    if not sep or "/" in line or "\\" in line:  # no line given (or a Windows drive's colon)
        path, line = pattern, "*"
    if lineno is None or not fnmatchcase(str(lineno), line):
        return False
    wanted = path.replace("\\", "/").split("/")
    anchored = wanted[0] == "" and len(wanted) > 1  # "/abs/train.py": the whole path
    wanted = [part for part in wanted if part not in ("", ".")]
    parts = os.path.abspath(filename).replace("\\", "/").split("/")
    parts = [part for part in parts if part]
    if not wanted or len(wanted) > len(parts) or (anchored and len(wanted) != len(parts)):
        return False
    return all(fnmatchcase(have, want) for have, want in zip(parts[len(parts) - len(wanted) :], wanted))


def parse_allow(text: str) -> Allow:
    """``"kind=broadcast,where=train.py:42"`` (the CLI's ``--allow``) -> ``Allow``."""
    fields = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--allow takes FIELD=PATTERN pairs separated by commas (fields: {', '.join(FIELDS)}), got {text!r}")
        fields[name.strip()] = value.strip()
    return Allow(**fields)
