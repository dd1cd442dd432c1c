"""The registry of explanations: rule name -> ``explain(finding) -> (problem, expected, fix)``.

Each render module of a check registers its rules with :func:`explains`; :mod:`.explanations`
imports them all, once, when the first message is rendered.
"""

from __future__ import annotations

__all__ = ["explains", "causes", "EXPLAIN", "CAUSES"]

EXPLAIN: dict = {}  # rule -> explain(finding) -> (problem, expected, fix)
CAUSES: dict = {}  # rule -> cause(finding) -> the ``cause:`` line, or None


def explains(*rules: str):
    """Register the decorated ``explain(finding) -> (problem, expected, fix)`` for ``rules``."""

    def register(function):
        for rule in rules:
            if rule in EXPLAIN:
                raise ValueError(f"rule {rule!r} is explained twice")
            EXPLAIN[rule] = function
        return function

    return register


def causes(*rules: str):
    """Register the decorated ``cause(finding) -> str | None``, the ``cause:`` line of a
    message (why the value is wrong, when the check decided it), for ``rules``."""

    def register(function):
        for rule in rules:
            if rule in CAUSES:
                raise ValueError(f"rule {rule!r} has its cause registered twice")
            CAUSES[rule] = function
        return function

    return register
