"""Every module that registers explanations (:func:`opwatch.render.rules.explains`), imported
here so that :func:`explainer` knows every rule."""

from __future__ import annotations

from . import accumulation, broadcast, device, dtype, module_calls, nonfinite, pre_dispatch, ranks  # noqa: F401
from .rules import CAUSES, EXPLAIN

__all__ = ["explainer", "cause_line"]


def explainer(rule: str):
    """The ``explain`` function of ``rule``."""
    try:
        return EXPLAIN[rule]
    except KeyError:
        raise ValueError(f"no explanation is registered for rule {rule!r}; known: {', '.join(sorted(EXPLAIN))}") from None


def cause_line(finding) -> str | None:
    """The ``cause:`` line of ``finding``, when its rule has one and the check decided it."""
    function = CAUSES.get(finding.rule)
    return None if function is None else function(finding)
