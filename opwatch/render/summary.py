"""The summary of a watch, the dump after a failing block, and the note added to its exception.
(Every rank's anomalies in one summary: :mod:`.ranks`.)"""

from __future__ import annotations

from ..records import BaseRecord
from ..sites import location
from .table import render_table

__all__ = ["render_summary", "render_disabled", "render_failure", "exception_note", "tagged", "count_places", "group_messages"]


def tagged(rank) -> str:
    """``opwatch`` outside a distributed job, ``opwatch (rank 1)`` in one."""
    return "opwatch" if rank is None else f"opwatch (rank {rank})"


# -- the summary ----------------------------------------------------------------------------


def render_summary(anomalies, contained, allowed=(), *, rank: int | None = None) -> str:
    """Distinct anomalies (one per kind, line, op and phase, with how often each fired), then a
    count of contained nan/inf origins and of allowed findings. ``rank``: the process's rank in
    a distributed job (``opwatch (rank 1): ...``)."""
    groups: dict = {}
    for anomaly in anomalies:
        key = (anomaly.kind, anomaly.filename, anomaly.lineno, anomaly.op, anomaly.phase)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [anomaly, 1]
    if not groups:
        lines = [f"{tagged(rank)}: no anomalies."]
    else:
        lines = [f"{tagged(rank)}: {count_places(groups)}:"]
        lines += group_messages(groups)
    if contained:
        lines.append("")
        lines.append(f"({len(contained)} nan/inf origin(s) were absorbed before they mattered; see Watch.contained)")
    if allowed:
        lines.append("")
        lines.append(f"({len(allowed)} finding(s) matched an allow entry; see Watch.allowed)")
    return "\n".join(lines)


def render_disabled(variable: str, value: str) -> str:
    """The summary of a watch that the kill switch turned off: it saw nothing, so it cannot
    say there were no anomalies."""
    return f"opwatch: nothing was watched ({variable}={value} turned opwatch off), so no anomalies could be found."


# -- a failing block ------------------------------------------------------------------------


def render_failure(records: list[BaseRecord], failed: BaseRecord | None, error: BaseException, *, rank: int | None = None) -> str:
    """The dump printed when a watched block raises: the last ops, the failing one marked."""
    lines = [f"{tagged(rank)}: the watched block raised {type(error).__name__}; the last {len(records)} ops:"]
    lines.append(render_table(records, mark=failed.index if failed else None))
    if failed is not None:
        position = failed.position
        lines.append("")
        lines.append(f"failing op #{failed.index}: {failed.signature()}")
        if position.filename:
            lines.append(f"  at {location(failed)}" + (f", module {failed.module}" if failed.module else ""))
            lines += ["    " + line for line in position.caret_lines()]
    return "\n".join(lines)


def exception_note(failed: BaseRecord) -> str:
    """The note added to the exception of a failing block: the op, its line and its tensors."""
    position = failed.position
    note = f"{tagged(failed.rank)}: raised in {failed.op} (op #{failed.index}) at {location(failed)}"
    code = position.expression() or position.line_text()
    if code:
        note += f": {code}"
    note += "\n  inputs: " + ", ".join(str(meta) for meta in failed.inputs)
    if failed.module:
        note += f"\n  module: {failed.module}"
    return note


def count_places(groups) -> str:
    """``3 anomalies at 2 places`` for ``{key: [anomaly, count]}``."""
    total = sum(count for _, count in groups.values())
    return f"{total} anomal{'y' if total == 1 else 'ies'} at {len(groups)} place{'' if len(groups) == 1 else 's'}"


def group_messages(groups) -> list[str]:
    """Each group's message, after a blank line, its first line marked ``[xN]`` when it fired
    N > 1 times."""
    lines = []
    for anomaly, count in groups.values():
        lines.append("")
        text = anomaly.message
        if count > 1:
            first, _, rest = text.partition("\n")
            text = f"{first} [x{count}]\n{rest}" if rest else f"{first} [x{count}]"
        lines.append(text)
    return lines


def shown_of(shown: int, total: int) -> str:
    """The note under a summary that holds only the newest ``shown`` of ``total`` anomalies."""
    return f"\n(the summary shows the last {shown} of {total} anomalies)"
