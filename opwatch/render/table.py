"""The op table: one row per record, formatted only when somebody reads it (tabulate is
imported here, on first use)."""

from __future__ import annotations

from ..notation import format_meta
from ..records import BaseRecord, short_op_name
from ..sites import location

__all__ = ["TABLE_HEADERS", "render_table"]

TABLE_HEADERS = ("#", "op", "inputs", "outputs", "where", "code", "module", "phase", "flags")
_MAX_TENSORS = 3  # per table cell; the rest are counted
_MAX_CODE = 40


# -- the op table ---------------------------------------------------------------------------


def render_table(records: list[BaseRecord], *, mark: int | None = None, tablefmt: str = "simple") -> str:
    """One row per record (live or saved: read through :class:`~opwatch.records.BaseRecord`);
    the record whose index is ``mark`` is marked ``>>``."""
    from tabulate import TableFormat, tabulate, tabulate_formats

    if not isinstance(tablefmt, (str, TableFormat)):
        raise TypeError(f"tablefmt must be the name of one of tabulate's formats, got {type(tablefmt).__name__}")
    if isinstance(tablefmt, str) and tablefmt not in tabulate_formats:
        raise ValueError(f"tablefmt must be one of tabulate's formats ({', '.join(sorted(tabulate_formats))}), got {tablefmt!r}")
    rows = []
    for record in records:
        index = f">> {record.index}" if record.index == mark else str(record.index)
        rows.append(
            (
                index,
                short_op_name(record.func),
                _tensors(record.inputs),
                _outputs(record.outputs),
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


def _code(record: BaseRecord) -> str:
    position = record.position
    text = position.expression() or position.line_text()
    if len(text) > _MAX_CODE:
        text = text[: _MAX_CODE - 3] + "..."
    return text


