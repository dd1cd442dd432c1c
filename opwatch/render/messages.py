"""One anomaly as users read it: the header (kind, op, line, module, phase), the line's text
with the sub-expression marked, then what is wrong, why (the ``cause:`` line, for the rules whose
check decides one: a nan/inf origin's), what was expected and a likely fix.

The three sentences come from the finding's facts: each rule's ``explain`` function, registered
with :func:`opwatch.render.rules.explains`, is called as ``explain(finding) -> (problem,
expected, fix)``.
Where each odd operand was made (``Finding.made``, provenance fact tuples, see
``opwatch.checks.provenance.Provenance.where_made``) is appended to the problem by :func:`explain`.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.notation import format_meta
from ..core.records import BACKWARD, OpRecord, short_op_name
from ..core.sites import location
from .explanations import cause_line, explainer
from .phrases import module_of, where_made

__all__ = ["render_message", "explain", "message_parts", "MessageParts"]


def explain(finding) -> tuple[str, str, str]:
    """``(problem, expected, fix)`` of ``finding``, from its facts; the problem ends with where
    the odd operands were made when the finding knows (``finding.made``)."""
    problem, expected, fix = explainer(finding.rule)(finding)
    if finding.made:
        told = "; ".join(f"{format_meta(meta)}: {where_made(made)}" for meta, made in zip(finding.odd, finding.made))
        problem = problem if problem.endswith(".") else problem + "."
        problem = f"{problem} Where the odd one came from: {told}."
    return problem, expected, fix


class MessageParts(NamedTuple):
    """An anomaly's message in its parts, for renderers that lay them out (the HTML report)."""

    header: str  # kind, op, line, module, phase
    code: list  # the line's text and a ``^^^`` line under the sub-expression (may be empty)
    note: str | None  # for a backward op: the line is the forward op's
    problem: str
    expected: str
    fix: str
    cause: str | None = None  # why (the ``cause:`` line), for the rules whose check decides one


def message_parts(finding, record: OpRecord) -> MessageParts:
    """The parts of :func:`render_message`: header, code lines, backward note, problem,
    expected, fix and cause (``None`` where the finding has none)."""
    position = record.position
    where = location(record) if position.filename or getattr(record, "label", None) else "an unknown line"
    header = f"{finding.kind} in {record.op} at {where}"
    if record.module:
        header += f", module {module_of(record)}"
    rank = getattr(record, "rank", None)
    header += f" ({record.phase})" if rank is None else f" ({record.phase}, rank {rank})"
    note = None
    if record.phase == BACKWARD and position.filename:
        if record.forward_func is not None:  # run by autograd: its line is its forward op's
            note = f"(a backward op of {short_op_name(record.forward_func)}: the line is the forward op whose gradient it computes)"
        else:
            note = "(a backward op your own code ran: a custom autograd.Function's backward, a hook, or a checkpoint recomputing its forward)"
    problem, expected, fix = explain(finding)
    return MessageParts(header, position.caret_lines(), note, problem, expected, fix, cause_line(finding))


def render_message(finding, record: OpRecord) -> str:
    """An anomaly as users read it: kind, op, line (its text, the sub-expression marked),
    module, phase, then what is wrong, why (when the check decided it), what was expected and a
    likely fix."""
    parts = message_parts(finding, record)
    lines = [parts.header]
    lines += ["    " + line for line in parts.code]
    if parts.note:
        lines.append("  " + parts.note)
    lines.append(f"  problem:  {parts.problem}")
    if parts.cause is not None:
        lines.append(f"  cause:    {parts.cause}")
    lines.append(f"  expected: {parts.expected}")
    lines.append(f"  fix:      {parts.fix}")
    return "\n".join(lines)
