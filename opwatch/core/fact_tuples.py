"""Named tuples of facts that keep their type through the JSONL export.

A finding's facts are plain data, and the ones with several parts are small named tuples read
by field (a :class:`~opwatch.checks.finding.Place`, a :class:`~opwatch.core.notation.TensorMeta`,
where an odd operand was made). ``@fact_tuple("place")`` registers such a class under a tag:
the export codec (:func:`opwatch.storage.codec.encode`) writes an instance as ``{"place": [items]}``
and :func:`opwatch.load` reads it back as the same class, so a saved finding is rendered by
the same code as a live one. A tuple type that is not registered is written as its items and
read back as a plain tuple.
"""

from __future__ import annotations

__all__ = ["CLASSES", "TAGS", "fact_tuple"]

TAGS: dict[type, str] = {}  # registered class -> its tag in a saved log
CLASSES: dict[str, type] = {}  # tag -> registered class


def fact_tuple(tag: str):
    """Class decorator: register a ``typing.NamedTuple`` of facts under ``tag`` (unique)."""

    def register(cls):
        if CLASSES.setdefault(tag, cls) is not cls or not hasattr(cls, "_fields"):
            raise TypeError(f"fact_tuple({tag!r}) takes one NamedTuple class per tag, got {cls!r}")
        TAGS[cls] = tag
        return cls

    return register
