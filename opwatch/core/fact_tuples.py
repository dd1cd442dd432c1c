"""Named tuples of facts that keep their type through the JSONL export.

A finding's facts are plain data, and the ones with several parts are small named tuples read
by field (a :class:`~opwatch.checks.finding.Place`, a :class:`~opwatch.core.notation.TensorMeta`,
where an odd operand was made). ``@fact_tuple("place")`` registers such a class under a tag:
the export codec (:func:`opwatch.storage.codec.encode`) writes an instance as ``{"place": [items]}``
and :func:`opwatch.load` reads it back as the same class, so a saved finding is rendered by
the same code as a live one. A tuple type that is not registered is written as its items and
read back as a plain tuple.

A rule's facts as a whole are one :class:`RuleFacts` class per rule (``@rule_facts(rule)``),
shared by the check that makes them and the renderer that words them.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CLASSES", "RULE_FACTS", "TAGS", "RuleFacts", "fact_tuple", "facts_of_rule", "rule_facts"]

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


# -- a rule's facts ------------------------------------------------------------------------------

RULE_FACTS: dict[str, type] = {}  # rule ("dtype.silent_upcast") -> the class of its facts


class RuleFacts:
    """The base of a rule's facts: a frozen dataclass with slots, defined once beside the check
    that makes it and imported by the renderer that words it (``@rule_facts("device.mix")``).

    Read by field (``facts.devices``). A saved log stores the fields by name (``{"dict":
    {...}}``, as format 4 wrote the older dicts of facts) and :func:`facts_of_rule` reads them
    back as the class; ``facts["name"]`` and ``facts.get("name")`` read a field by name too,
    as ``anomaly.finding.facts["cause"]`` did when the facts were a dict."""

    __slots__ = ()

    def __getitem__(self, name: str):
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default=None):
        return getattr(self, name, default)

    def fields(self) -> dict:
        """The facts by name, in the order the class declares them."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def replace(self, **changes):
        """These facts with ``changes`` (a field's new value by name)."""
        return dataclasses.replace(self, **changes)


def rule_facts(*rules: str):
    """Class decorator: a frozen dataclass with slots of ``RuleFacts``, the facts of ``rules``."""

    def register(cls):
        if not issubclass(cls, RuleFacts):
            raise TypeError(f"rule_facts takes a RuleFacts subclass, got {cls!r}")
        made = dataclasses.dataclass(frozen=True, slots=True)(cls)
        for rule in rules:
            if RULE_FACTS.setdefault(rule, made) is not made:
                raise TypeError(f"rule {rule!r} already has its facts: {RULE_FACTS[rule]!r}")
        return made

    return register


def facts_of_rule(rule: str, fields: dict):
    """``rule``'s facts from their ``fields`` by name (a saved log's); a field the class does
    not know is dropped (a newer version's), a field missing takes its default. A rule with no
    class (a newer version's) keeps its dict."""
    cls = RULE_FACTS.get(rule)
    if cls is None:
        return fields
    known = {field.name for field in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in fields.items() if name in known})
