"""The registry of explanations: rule name -> ``explain(finding) -> (problem, expected, fix)``.

Each render module of a check registers its rules with :func:`explains`; :mod:`.explanations`
imports them all, once, when the first message is rendered.
"""

from __future__ import annotations

__all__ = ["explains", "EXPLAIN"]

EXPLAIN: dict = {}  # rule -> explain(finding) -> (problem, expected, fix)


def explains(*rules: str):
    """Register the decorated ``explain(finding) -> (problem, expected, fix)`` for ``rules``."""

    def register(function):
        for rule in rules:
            if rule in EXPLAIN:
                raise ValueError(f"rule {rule!r} is explained twice")
            EXPLAIN[rule] = function
        return function

    return register
