"""The op table: one row per record, formatted only when somebody reads it (tabulate is
imported here, on first use)."""

from __future__ import annotations

from ..core.notation import format_meta
from ..core.records import BaseRecord, short_op_name
from ..core.sites import location
from .phrases import module_of

__all__ = ["TABLE_HEADERS", "DUMP_WIDTH", "render_table", "table_row"]

TABLE_HEADERS = ("#", "op", "inputs", "outputs", "where", "code", "module", "phase", "flags")
_MAX_TENSORS = 3  # per table cell; the rest are counted
_MAX_CODE = 40
# The compact table's width where the terminal's is unknown (a file, a pipe, a captured stream):
# fixed, so that logs and goldens do not depend on the terminal that wrote them.
DUMP_WIDTH = 120
# Compact table: the rows kept apart on each side of the marked one (its neighbours).
_NEIGHBOURS = 2
# Compact table: the columns that give up width when the table is too wide, and the narrowest
# each may become.
_SHRINK = {"code": 12, "module": 8, "inputs": 16, "outputs": 16, "op": 16, "where": 24}


# -- the op table ---------------------------------------------------------------------------


def render_table(records: list[BaseRecord], *, mark: int | None = None, tablefmt: str = "simple", width: int | None = None) -> str:
    """One row per record (live or saved: read through :class:`~opwatch.core.records.BaseRecord`);
    the record whose index is ``mark`` is marked ``>>``.

    ``width``: the compact table, at most ``width`` columns wide: consecutive ops alike (same
    op, line, module, phase and flags) fold into one row (``8-11``, ``aten._to_copy x4``),
    except the marked op and its neighbours; empty columns are left out, and the widest cells
    are cut (``...``) until the table fits."""
    from tabulate import TableFormat, tabulate, tabulate_formats

    if not isinstance(tablefmt, (str, TableFormat)):
        raise TypeError(f"tablefmt must be the name of one of tabulate's formats, got {type(tablefmt).__name__}")
    if isinstance(tablefmt, str) and tablefmt not in tabulate_formats:
        raise ValueError(f"tablefmt must be one of tabulate's formats ({', '.join(sorted(tabulate_formats))}), got {tablefmt!r}")
    rows = []
    for record in records:
        row = table_row(record)
        rows.append((f">> {row[_NUMBER]}" if record.index == mark else row[_NUMBER], *row[_OP:]))
    if width is None:
        return tabulate(rows, headers=TABLE_HEADERS, tablefmt=tablefmt, disable_numparse=True)
    marked = next((i for i, record in enumerate(records) if record.index == mark), None)
    folded = _folded(rows, marked)
    headers, rows = _fitted(TABLE_HEADERS, folded, width)
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def table_row(record: BaseRecord) -> tuple:
    """One record's cells, in the columns ``TABLE_HEADERS`` names (the HTML report's too)."""
    return (
        str(record.index),
        short_op_name(record.func),
        _tensors(record.inputs),
        _outputs(record.outputs),
        location(record),
        _code(record),
        module_of(record) or "",
        record.phase,
        ",".join(record.flags),
    )


# A table row's columns, as TABLE_HEADERS names them: the number, the op, the inputs, the
# outputs, then where, code, module, phase and flags.
_NUMBER, _OP, _INPUTS, _OUTPUTS, _PLACE = 0, 1, 2, 3, 4


def _folded(rows: list[tuple], marked: int | None) -> list[tuple]:
    """Runs of consecutive rows alike in op, where, code, module, phase and flags as one row
    each (``8-11``, ``aten._to_copy x4``; tensors that differ as the first's, then ``, ..``); the
    marked row and its neighbours stay rows of their own."""

    def key(i):
        row = rows[i]
        kept = marked is not None and abs(i - marked) <= _NEIGHBOURS
        return ("kept", i) if kept else (row[_OP], *row[_PLACE:])

    folded, start = [], 0
    for end in range(1, len(rows) + 1):
        if end < len(rows) and key(end) == key(start):
            continue
        run = rows[start:end]
        first, last = run[0], run[-1]
        if len(run) == 1:
            folded.append(first)
        else:
            number = f"{first[_NUMBER]}-{last[_NUMBER]}"
            op = f"{first[_OP]} x{len(run)}"
            tensors = [first[i] if all(row[i] == first[i] for row in run) else f"{first[i]}, .." for i in (_INPUTS, _OUTPUTS)]
            folded.append((number, op, *tensors, *first[_PLACE:]))
        start = end
    return folded


def _fitted(headers: tuple, rows: list[tuple], width: int) -> tuple[tuple, list[tuple]]:
    """``headers`` and ``rows`` without their empty columns, the widest cells cut (``...``)
    until the table is at most ``width`` wide: the code first (the where column names its
    line), then the module and tensor columns (the failing op's tensors are in its exception),
    then the code column goes, and the op names and places are cut last, a place keeping its
    end (``.../unit/train.py:83``: a long absolute path). Each column keeps a narrowest width
    (``_SHRINK``): below about 110 columns the table is as narrow as it gets, not ``width``."""
    keep = [i for i, header in enumerate(headers) if header in ("#", "op") or any(row[i] for row in rows)]
    headers = tuple(headers[i] for i in keep)
    rows = [tuple(row[i] for i in keep) for row in rows]
    for names in (("code",), ("module", "inputs", "outputs"), None, ("op", "where")):
        widths = [max([len(header) + 2] + [len(row[i]) for row in rows]) for i, header in enumerate(headers)]  # tabulate pads headers by 2
        excess = sum(widths) + 2 * (len(widths) - 1) - width
        if excess <= 0:
            break
        if names is None:  # still too wide: the code column goes
            if "code" in headers:
                gone = headers.index("code")
                headers = headers[:gone] + headers[gone + 1 :]
                rows = [row[:gone] + row[gone + 1 :] for row in rows]
            continue
        lowest = {headers.index(name): max(len(name) + 2, _SHRINK[name]) for name in names if name in headers}
        while excess > 0:
            shrinkable = [i for i, least in lowest.items() if widths[i] > least]
            if not shrinkable:
                break
            widths[max(shrinkable, key=lambda i: widths[i])] -= 1
            excess -= 1
        # A list of tensors is cut at a tensor's end, often shorter than its column allows.
        place = headers.index("where") if "where" in headers else None
        rows = [tuple((_cut_front if i == place else _cut)(cell, widths[i]) if i in lowest else cell for i, cell in enumerate(row)) for row in rows]
    return headers, rows


def _cut(cell: str, width: int) -> str:
    """``cell`` in at most ``width`` characters: whole tensors of a list and ``..``, else cut
    with ``...``."""
    if len(cell) <= width:
        return cell
    parts = _items(cell)
    for count in range(len(parts) - 1, 0, -1):
        shown = ", ".join(parts[:count]) + ", .."
        if len(shown) <= width:
            return shown
    return cell[: width - 3] + "..."


def _cut_front(place: str, width: int) -> str:
    """``place`` (``path:line``) in at most ``width`` characters: its end after ``...``, from a
    folder's start where one fits (``.../unit/train.py:83``)."""
    if len(place) <= width:
        return place
    tail = place[len(place) - (width - 3) :]
    slash = tail.find("/")
    if slash >= 0:  # start the shown part at a folder's or the file's name
        tail = tail[slash:]
    return "..." + tail


def _items(cell: str) -> list[str]:
    """The tensors of a cell: ``f32[4, 1] cpu, f64[] cpu`` -> two, split outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(cell):
        depth += (char == "[") - (char == "]")
        if depth == 0 and cell.startswith(", ", i):
            items.append(cell[start:i])
            start = i + 2
    return items + [cell[start:]]


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


