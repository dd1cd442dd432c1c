"""TRANSITIONAL: findings whose sentences the check wrote itself (rule ``"text"``)."""

from __future__ import annotations

from .rules import explains


@explains("text")
def explain_text(finding) -> tuple[str, str, str]:
    facts = finding.facts
    return facts["problem"], facts["expected"], facts["fix"]
