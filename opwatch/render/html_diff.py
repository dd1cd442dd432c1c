"""The HTML page of :func:`opwatch.diff`: the report's words, then both runs side by side
around the first divergence, marked, each op in the op table's columns and each cell that
differs between the runs highlighted. Self-contained, as the report (:mod:`.html`)."""

from __future__ import annotations

from html import escape

from .diff import render_diff
from .html import page
from .table import table_row

__all__ = ["render_diff_report"]

# What a row of the side-by-side table is: the words shown in its last column.
_STATUS = {"agreed": "same", "first": "first difference", "after": "", "only_a": "only in a", "only_b": "only in b"}
_DIFFERS = '<td class="differs">'
_COLUMNS = ("op", "inputs", "outputs", "where")  # of each run, from the op table's


def render_diff_report(result, rows: list, *, title: str = "opwatch diff") -> str:
    """``result``: a :class:`opwatch.runners.divergence.Diff`; ``rows``: its
    ``(number, record in a, record in b, status)`` rows to show (:meth:`Diff.rows`)."""
    label_a, label_b = result.labels
    verdict = "The runs agree" if result.agree else ("The runs differ" if result.first is not None else "Some ops ran in one run only")
    body = [
        f'<header><h1>{escape(title)}</h1><p class="counts">{escape(verdict)}: a = {escape(str(label_a))}, b = {escape(str(label_b))}</p></header>',
        f'<nav>{"" if result.first is None else "<a href=#first>the first difference</a> "}<a href="#side-by-side">side by side</a></nav><main>',
        f'<section id="words"><h2>What differs</h2><pre class="code">{escape(render_diff(result))}</pre></section>',
        f'<section id="side-by-side"><h2>Both runs, aligned ({len(rows)} of {len(result.pairs)} ops)</h2>',
        '<div class="around-ops"><table class="ops diff"><thead><tr><th rowspan="2">#</th>'
        f'<th colspan="{len(_COLUMNS)}">a: {escape(str(label_a))}</th><th colspan="{len(_COLUMNS)}">b: {escape(str(label_b))}</th>'
        '<th rowspan="2">phase</th><th rowspan="2"></th></tr><tr>'
        + "".join(f"<th>{name}</th>" for name in _COLUMNS * 2)
        + "</tr></thead><tbody>",
    ]
    for number, record_a, record_b, status in rows:
        body.append(_row(number, record_a, record_b, status))
    body.append("</tbody></table></div></section></main>")
    return page(title, "\n".join(body))


def _cells(record) -> tuple:
    if record is None:
        return ("",) * len(_COLUMNS)
    _, op, inputs, outputs, where, *_ = table_row(record)
    return op, inputs, outputs, where


def _row(number: int, record_a, record_b, status: str) -> str:
    cells_a, cells_b = _cells(record_a), _cells(record_b)
    both = record_a is not None and record_b is not None
    row = [f"<td>{number}</td>"]
    for cells, other in ((cells_a, cells_b), (cells_b, cells_a)):
        row += [(_DIFFERS if both and cell != twin else "<td>") + f"{escape(cell)}</td>" for cell, twin in zip(cells, other)]
    phase = (record_a or record_b).phase
    row.append(f"<td>{escape(phase)}</td><td>{escape(_STATUS[status])}</td>")
    marks = {"first": ' id="first" class="this"', "only_a": ' class="only"', "only_b": ' class="only"', "after": ' class="after"'}
    return f"<tr{marks.get(status, '')}>{''.join(row)}</tr>"
