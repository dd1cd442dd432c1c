"""What a notebook shows for a watch, a saved log, an anomaly and a diff (their
``_repr_html_``): small HTML fragments with inline styles and no script (a notebook shows an
untrusted output's markup, not its scripts or page-wide styles), built from the same parts as
the text and the report: :func:`opwatch.render.messages.message_parts`,
:func:`opwatch.render.table.table_row`, :func:`opwatch.render.diff.render_diff`."""

from __future__ import annotations

from html import escape

from .diff import render_diff
from .html import group_by_place, marked_code, count_of_places
from .messages import message_parts
from .table import TABLE_HEADERS, table_row

__all__ = ["anomaly_html", "records_html", "watch_html", "diff_html"]

_BOX = "font-family:system-ui,sans-serif;font-size:13px;line-height:1.45"
_CARD = "border:1px solid #d9dde5;border-left:4px solid #c62828;border-radius:5px;padding:6px 10px;margin:6px 0"
_KIND = "background:#c62828;color:#fff;border-radius:3px;padding:0 6px;font-weight:600"
_MONO = "font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px"
_CELL = "text-align:left;padding:1px 8px;border-bottom:1px solid #e5e8ee;white-space:nowrap;" + _MONO
_LABEL = "color:#5b6475;font-weight:600;padding-right:10px;vertical-align:top"
_MARK = "background:#ffe08a"


def anomaly_html(anomaly, count: int = 1) -> str:
    """One anomaly as a card: kind, op, line (the sub-expression marked), problem, cause (where
    the check decided one), expected, fix."""
    record = anomaly.record
    parts = message_parts(anomaly.finding, record)
    times = f" <b>x{count}</b>" if count > 1 else ""
    _, _, place = parts.header.partition(" in ")  # the header after its kind: op, line, module, phase
    code = marked_code(parts.code).replace("<mark>", f'<mark style="{_MARK}">') if parts.code else ""
    rows = "".join(
        f'<tr><td style="{_LABEL}">{name}</td><td>{escape(text)}</td></tr>'
        for name, text in (("problem", parts.problem), ("cause", parts.cause), ("expected", parts.expected), ("fix", parts.fix))
        if text is not None
    )
    return (
        f'<div style="{_BOX};{_CARD}"><div><span style="{_KIND}">{escape(anomaly.kind)}</span> '
        f'<code style="{_MONO}">{escape(place)}</code>{times}</div>'
        + (f'<pre style="{_MONO};margin:4px 0;white-space:pre-wrap">{code}</pre>' if code else "")
        + (f'<div style="color:#5b6475">{escape(parts.note)}</div>' if parts.note else "")
        + f'<table style="border:0;margin:2px 0">{rows}</table></div>'
    )


def records_html(records: list) -> str:
    """The op table as an HTML table, in its columns (flagged ops in red)."""
    head = "".join(f'<th style="{_CELL}">{escape(name)}</th>' for name in TABLE_HEADERS)
    body = []
    for record in records:
        cells = table_row(record)
        colour = ";color:#c62828" if record.flags else ""
        body.append("<tr>" + "".join(f'<td style="{_CELL}{colour}">{escape(cell)}</td>' for cell in cells) + "</tr>")
    return f'<table style="border-collapse:collapse"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def watch_html(source, *, last: int = 10) -> str:
    """A watch or a saved log: its counts, each place's first anomaly as a card, the last
    ``last`` ops."""
    records = list(source.records)
    anomalies = list(source.anomalies)
    counts = f"{len(records)} ops recorded; " + (count_of_places(anomalies) if anomalies else "no anomalies")
    cards = "".join(anomaly_html(first, len(indices)) for first, indices in group_by_place(anomalies).values())
    shown = records[-last:] if last else []
    table = f"<div>the last {len(shown)} ops:</div>{records_html(shown)}" if shown else ""
    return f'<div style="{_BOX}"><div><b>opwatch</b>: {escape(counts)}</div>{cards}{table}</div>'


def diff_html(result, rows: list) -> str:
    """A diff: its report's words, then the aligned ops around the first difference, both runs
    side by side, the first difference marked."""
    head = "".join(f'<th style="{_CELL}">{name}</th>' for name in ("#", "op in a", "where in a", "op in b", "where in b", "phase", ""))
    body = []
    for number, record_a, record_b, status in rows:
        cells_a = table_row(record_a) if record_a is not None else ("",) * len(TABLE_HEADERS)
        cells_b = table_row(record_b) if record_b is not None else ("",) * len(TABLE_HEADERS)
        _, op_a, _, _, where_a, *_ = cells_a
        _, op_b, _, _, where_b, *_ = cells_b
        phase = (record_a or record_b).phase
        marked = f";{_MARK}" if status == "first" else ""
        said = {"first": "first difference", "only_a": "only in a", "only_b": "only in b"}.get(status, "")
        body.append("<tr>" + "".join(f'<td style="{_CELL}{marked}">{escape(str(cell))}</td>' for cell in (number, op_a, where_a, op_b, where_b, phase, said)) + "</tr>")
    table = f'<table style="border-collapse:collapse"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>' if body else ""
    return f'<div style="{_BOX}"><pre style="{_MONO};white-space:pre-wrap">{escape(render_diff(result))}</pre>{table}</div>'
