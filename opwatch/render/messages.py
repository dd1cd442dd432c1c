"""One anomaly as users read it: the header (kind, op, line, module, phase), the line's text
with the sub-expression marked, then what is wrong, what was expected and a likely fix.

The three sentences come from the finding's facts: each rule's ``explain`` function, registered
with :func:`opwatch.render.rules.explains`, is called as ``explain(finding) -> (problem,
expected, fix)``.
Facts that name another op are :class:`~opwatch.checks.finding.Place` tuples, shown with
:func:`place`. Where each odd operand was made (``Finding.made``, provenance fact tuples, see
``opwatch.checks.CheckContext.where_made``) is appended to the problem by :func:`explain`.
"""

from __future__ import annotations

from ..notation import format_meta
from ..records import BACKWARD, OpRecord, short_op_name
from ..sites import display_path, location

__all__ = ["render_message", "explain", "describe", "named", "place", "where_made"]


def explain(finding) -> tuple[str, str, str]:
    """``(problem, expected, fix)`` of ``finding``, from its facts; the problem ends with where
    the odd operands were made when the finding knows (``finding.made``)."""
    from .explanations import explainer

    problem, expected, fix = explainer(finding.rule)(finding)
    if finding.made:
        told = "; ".join(f"{format_meta(meta)}: {where_made(made)}" for meta, made in zip(finding.odd, finding.made))
        problem = problem if problem.endswith(".") else problem + "."
        problem = f"{problem} Where the odd one came from: {told}."
    return problem, expected, fix


def where_made(made) -> str:
    """One provenance fact tuple (see ``CheckContext.where_made``) as a clause."""
    how = made[0]
    if how == "attribute":
        _, cls, name, path = made
        return (
            f"{cls}.{name} is a plain tensor attribute of module {path}: .to() and .cuda() do not move it; "
            f"make it a buffer (self.register_buffer({name!r}, ...))"
        )
    if how in ("parameter", "buffer"):
        return f"it is {how} {made[1]}.{made[2]}"
    if how == "before_watch":
        return "it was made before the watch (or outside torch ops, e.g. torch.from_numpy)"
    text = f"made by {place(made[1])}"
    factory = made[2] if len(made) > 2 else None
    if factory is None:
        return text
    if factory[0] == "default_device":
        return text + f" on the default device ({factory[1]}): give it device= (or make it with *_like / new_*)"
    given, default = factory[1], factory[2]
    return text + (f" with dtype={given}" if given is not None else f" in the default dtype ({default})")


def place(where) -> str:
    """``aten.addmm at train.py:23`` for a :class:`~opwatch.checks.finding.Place` (or the list
    a JSON round trip makes of one)."""
    from ..checks.finding import Place  # not at import: opwatch.checks imports opwatch.render

    if not isinstance(where, Place):
        where = Place(*where)
    op = short_op_name(where.op)
    if where.filename is None:
        at = where.label or ("autograd" if where.phase == BACKWARD else "?")
    else:
        at = f"{display_path(where.filename)}:{where.lineno}"
    return f"{op} at {at}"


def describe(func, tensors) -> str:
    """``self=f32[6] cpu, mask=b8[6] meta`` for a finding's message."""
    from ..checks.finding import tensor_names

    return named(tensor_names(func, len(tensors)), tensors)


def named(names, metas) -> str:
    """``self=f32[6] cpu, mask=b8[6] meta``: tensor argument names (a finding's
    ``facts["names"]``) with their metadata."""
    return ", ".join(f"{name}={format_meta(meta)}" for name, meta in zip(names, metas))


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
