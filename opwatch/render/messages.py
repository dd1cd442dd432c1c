"""One anomaly as users read it: the header (kind, op, line, module, phase), the line's text
with the sub-expression marked, then what is wrong, what was expected and a likely fix.

The three sentences come from the finding's facts: each rule registers one ``explain``
function with :func:`explains`, called as ``explain(finding) -> (problem, expected, fix)``.
Facts that name another op are :class:`~opwatch.checks.finding.Place` tuples, shown with
:func:`place`.
"""

from __future__ import annotations

from ..notation import format_meta
from ..records import BACKWARD, OpRecord, short_op_name
from ..sites import display_path, location

__all__ = ["render_message", "explain", "explains", "describe", "place"]

# rule -> explain(finding) -> (problem, expected, fix)
_EXPLAIN: dict = {}


def explains(*rules: str):
    """Register the decorated ``explain(finding) -> (problem, expected, fix)`` for ``rules``."""

    def register(function):
        for rule in rules:
            if rule in _EXPLAIN:
                raise ValueError(f"rule {rule!r} is explained twice")
            _EXPLAIN[rule] = function
        return function

    return register


def explain(finding) -> tuple[str, str, str]:
    """``(problem, expected, fix)`` of ``finding``, from its facts."""
    function = _EXPLAIN.get(finding.rule)
    if function is None:
        _load_explanations()
        function = _EXPLAIN[finding.rule]
    return function(finding)


def _load_explanations() -> None:
    """The render modules that register explanations, imported on first use."""
    from . import explanations  # noqa: F401


def place(where) -> str:
    """``aten.addmm at train.py:23`` for a :class:`~opwatch.checks.finding.Place`."""
    op = short_op_name(where.op)
    if where.filename is None:
        at = where.label or ("autograd" if where.phase == BACKWARD else "?")
    else:
        at = f"{display_path(where.filename)}:{where.lineno}"
    return f"{op} at {at}"


def describe(func, tensors) -> str:
    """``self=f32[6] cpu, mask=b8[6] meta`` for a finding's message."""
    from ..checks.finding import tensor_names

    names = tensor_names(func, len(tensors))
    return ", ".join(f"{name}={format_meta(meta)}" for name, meta in zip(names, tensors))


def render_message(finding, record: OpRecord) -> str:
    """An anomaly as users read it: kind, op, line (its text, the sub-expression marked),
    module, phase, then what is wrong, what was expected and a likely fix."""
    position = record.position
    where = location(record) if position.filename or getattr(record, "label", None) else "an unknown line"
    header = f"{finding.kind} in {record.op} at {where}"
    if record.module:
        header += f", module {record.module}"
    rank = getattr(record, "rank", None)
    header += f" ({record.phase})" if rank is None else f" ({record.phase}, rank {rank})"
    lines = [header]
    lines += ["    " + line for line in position.caret_lines()]
    if record.phase == BACKWARD and position.filename:
        of = f" of {short_op_name(record.forward_func)}" if record.forward_func is not None else ""
        lines.append(f"  (a backward op{of}: the line is the forward op whose gradient it computes)")
    problem, expected, fix = explain(finding)
    lines.append(f"  problem:  {problem}")
    lines.append(f"  expected: {expected}")
    lines.append(f"  fix:      {fix}")
    return "\n".join(lines)
