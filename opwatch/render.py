"""Every string a user reads, built here from records and findings: the op table, an anomaly's
message, the summary, the dump after a failing block, the note added to its exception, and
the one location format all of them share (:func:`location`).

Formatting happens only when somebody reads; tabulate is imported here, on first use.
"""

from __future__ import annotations

import os
import sys

from .notation import format_meta
from .records import BACKWARD, OpRecord, entry_inputs, entry_outputs, short_op_name

__all__ = [
    "display_path",
    "location",
    "render_table",
    "render_message",
    "render_summary",
    "render_failure",
    "exception_note",
]

TABLE_HEADERS = ("#", "op", "inputs", "outputs", "where", "code", "module", "phase", "flags")
_MAX_TENSORS = 3  # per table cell; the rest are counted
_MAX_CODE = 40


def display_path(filename: str | None) -> str:
    """How a source file is shown everywhere: relative to the working directory when it lies
    below it; else relative to the ``sys.path`` entry it was imported from (``site-packages``:
    ``transformers/models/gpt2/modeling_gpt2.py``); else as given."""
    if not filename:
        return "?"
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        relative = ".."
    if not relative.startswith(".."):
        return relative
    best = None
    for entry in sys.path:
        if entry and filename.startswith(os.path.join(entry, "")) and (best is None or len(entry) > len(best)):
            best = entry
    if best is not None and ("site-packages" in best or "dist-packages" in best):
        return os.path.relpath(filename, best)
    return filename


def location(record: OpRecord) -> str:
    """``train.py:23``; ``autograd`` for backward ops autograd ran without a forward line
    (gradient accumulation); ``?`` when no user frame was found."""
    position = record.position
    if position.filename is None:
        return "autograd" if record.phase == BACKWARD else "?"
    return f"{display_path(position.filename)}:{position.lineno}"


# -- the op table ---------------------------------------------------------------------------


def render_table(records: list[OpRecord], *, mark: int | None = None, tablefmt: str = "simple") -> str:
    """One row per record; the record whose index is ``mark`` is marked ``>>``."""
    from tabulate import tabulate

    rows = []
    for record in records:
        index = f">> {record.index}" if record.index == mark else str(record.index)
        rows.append(
            (
                index,
                short_op_name(record.func),
                _tensors(entry_inputs(record._entry)),
                _outputs(entry_outputs(record._entry)),
                location(record),
                _code(record),
                record.module or "",
                record.phase,
                ",".join(record.flags),
            )
        )
    return tabulate(rows, headers=TABLE_HEADERS, tablefmt=tablefmt, disable_numparse=True)


def _tensors(metas) -> str:
    shown = [format_meta(meta) for meta in metas[:_MAX_TENSORS]]
    if len(metas) > _MAX_TENSORS:
        shown.append(f"... (+{len(metas) - _MAX_TENSORS})")
    return ", ".join(shown)


def _outputs(metas) -> str:
    return "not run" if metas is None else _tensors(metas)


def _code(record: OpRecord) -> str:
    position = record.position
    text = position.expression() or position.line_text()
    if len(text) > _MAX_CODE:
        text = text[: _MAX_CODE - 3] + "..."
    return text


# -- one anomaly --------------------------------------------------------------------------


def render_message(finding, record: OpRecord) -> str:
    """An anomaly as users read it: kind, op, line (its text, the sub-expression marked),
    module, phase, then what is wrong, what was expected and a likely fix."""
    position = record.position
    where = location(record) if position.filename else "an unknown line"
    header = f"{finding.kind} in {record.op} at {where}"
    if record.module:
        header += f", module {record.module}"
    header += f" ({record.phase})"
    lines = [header]
    lines += ["    " + line for line in position.caret_lines()]
    if record.phase == BACKWARD and position.filename:
        of = f" of {short_op_name(record.forward_func)}" if record.forward_func is not None else ""
        lines.append(f"  (a backward op{of}: the line is the forward op whose gradient it computes)")
    lines.append(f"  problem:  {finding.problem}")
    lines.append(f"  expected: {finding.expected}")
    lines.append(f"  fix:      {finding.fix}")
    return "\n".join(lines)


# -- the summary ----------------------------------------------------------------------------


def render_summary(anomalies, contained) -> str:
    """Distinct anomalies (one per kind, line, op and phase, with how often each fired), then a
    count of contained nan/inf origins."""
    groups: dict = {}
    for anomaly in anomalies:
        key = (anomaly.kind, anomaly.filename, anomaly.lineno, anomaly.op, anomaly.phase)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [anomaly, 1]
    if not groups:
        lines = ["opwatch: no anomalies."]
    else:
        total = sum(count for _, count in groups.values())
        lines = [f"opwatch: {total} anomal{'y' if total == 1 else 'ies'} at {len(groups)} place{'' if len(groups) == 1 else 's'}:"]
        for anomaly, count in groups.values():
            lines.append("")
            text = anomaly.message
            if count > 1:
                first, _, rest = text.partition("\n")
                text = f"{first} [x{count}]\n{rest}" if rest else f"{first} [x{count}]"
            lines.append(text)
    if contained:
        lines.append("")
        lines.append(f"({len(contained)} nan/inf origin(s) were absorbed before they mattered; see Watch.contained)")
    return "\n".join(lines)


# -- a failing block ------------------------------------------------------------------------


def render_failure(records: list[OpRecord], failed: OpRecord | None, error: BaseException) -> str:
    """The dump printed when a watched block raises: the last ops, the failing one marked."""
    lines = [f"opwatch: the watched block raised {type(error).__name__}; the last {len(records)} ops:"]
    lines.append(render_table(records, mark=failed.index if failed else None))
    if failed is not None:
        position = failed.position
        lines.append("")
        lines.append(f"failing op #{failed.index}: {failed.signature()}")
        if position.filename:
            lines.append(f"  at {location(failed)}" + (f", module {failed.module}" if failed.module else ""))
            lines += ["    " + line for line in position.caret_lines()]
    return "\n".join(lines)


def exception_note(failed: OpRecord) -> str:
    """The note added to the exception of a failing block: the op, its line and its tensors."""
    position = failed.position
    note = f"opwatch: raised in {failed.op} (op #{failed.index}) at {location(failed)}"
    code = position.expression() or position.line_text()
    if code:
        note += f": {code}"
    note += "\n  inputs: " + ", ".join(str(meta) for meta in failed.inputs)
    if failed.module:
        note += f"\n  module: {failed.module}"
    return note
