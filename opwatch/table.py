"""The op log as a table, formatted only when asked (tabulate is imported here, not at import)."""

from __future__ import annotations

from .anomaly import display_path
from .notation import format_meta
from .records import OpRecord, entry_inputs, entry_outputs, short_op_name

__all__ = ["render_table", "render_failure"]

HEADERS = ("#", "op", "inputs", "outputs", "where", "code", "module", "phase", "flags")
_MAX_TENSORS = 3  # per cell; the rest are counted
_MAX_CODE = 40


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
                record.where,
                _code(record),
                record.module or "",
                record.phase,
                ",".join(record.flags),
            )
        )
    return tabulate(rows, headers=HEADERS, tablefmt=tablefmt, disable_numparse=True)


def render_failure(records: list[OpRecord], failed: OpRecord | None, error: BaseException) -> str:
    """The dump printed when a watched block raises: the last ops, the failing one last."""
    lines = [f"opwatch: the watched block raised {type(error).__name__}; the last {len(records)} ops:"]
    lines.append(render_table(records, mark=failed.index if failed else None))
    if failed is not None:
        position = failed.position
        lines.append("")
        lines.append(f"failing op #{failed.index}: {failed.signature()}")
        if position.filename:
            lines.append(f"  at {display_path(position.filename)}:{position.lineno}" + (f", module {failed.module}" if failed.module else ""))
            lines += ["    " + line for line in position.caret_lines()]
    return "\n".join(lines)


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
