"""The HTML report: one self-contained page (inline CSS, JS and SVG; nothing fetched) of a watch
or a saved log, built from its records and findings with the same renderers as the text.

- the findings first, grouped by place as the summary groups them (kind, line, op, phase) with
  their counts: the line's text with the sub-expression marked, the problem, its cause (where
  the check decided one), what was expected, a likely fix (:func:`opwatch.render.messages.message_parts`); a button under each shows the
  ops around it;
- two pictures: the module tree (ops and anomalies per module) and, when the log holds more
  than one training step, the anomalies per step;
- every op, in the columns of the op table (:func:`opwatch.render.table.table_row`).

The ops travel as one compact JSON array (each distinct cell once, rows of numbers into it):
the page's script draws the rows a reader asks for, a page at a time, so a log of tens of
thousands of ops opens at once. Every text from the log is escaped (``html.escape``, and
``<`` in the JSON) so that nothing in it can become markup.
"""

from __future__ import annotations

import json
from html import escape

from ..checks.nonfinite.origin import OriginFacts
from ..core.records import BACKWARD, M_IDENT, short_op_name
from ..core.sites import location
from .leave_on import NamedOrigin, batch_words, evaluations_nan, origin_words, scaler_skips, stage_words
from .messages import message_parts
from .phrases import module_of
from .summary import count_places
from .table import TABLE_HEADERS, table_row

__all__ = ["render_report", "report_written", "page", "module_tree_svg", "steps_svg", "training_steps", "guard_section", "guard_steps_svg"]

_SECTIONS = (
    ("anomalies", "Findings"),
    ("contained", "Contained nan/inf origins"),
    ("allowed", "Allowed findings"),
)
_AROUND = 6  # ops shown either side of a finding's op
_TREE_ROWS = 200  # module tree rows drawn at most
_STEP_BARS = 120  # bars of the steps chart at most (steps are binned beyond)


def render_report(source, *, title: str = "opwatch report") -> str:
    """The report of ``source`` (a :class:`~opwatch.Watch` or a saved log: anything with
    ``records``, ``anomalies``, ``contained`` and ``allowed``) as one HTML page."""
    records = list(source.records)
    groups = {name: list(getattr(source, name, ())) for name, _ in _SECTIONS}
    header = getattr(source, "header", None) or {}
    body = [f"<header><h1>{escape(title)}</h1>{_overview(records, groups, header)}</header>"]
    body.append('<nav><a href="#findings">findings</a> <a href="#pictures">pictures</a> <a href="#ops">every op</a></nav>')
    body.append('<main>')
    number, positions = 0, {record.index: i for i, record in enumerate(records)}
    for name, heading in _SECTIONS:
        if name != "anomalies" and not groups[name]:
            continue
        section, number = _findings_section(name, heading, groups[name], number, (records, positions))
        body.append(section)
    guarded = getattr(source, "guard", None)
    if isinstance(guarded, dict):  # a --guard run's ledger, as its log saved it
        body.append(guard_section(guarded))
    body.append('<section id="pictures"><h2>Where the ops ran</h2>')
    body.append(module_tree_svg(records, groups["anomalies"]))
    steps = training_steps(records)
    if len(steps) > 1:
        body.append("<h2>Anomalies per training step</h2>")
        body.append(steps_svg(steps, records, groups["anomalies"]))
    body.append("</section>")
    body.append(
        f'<section id="ops"><h2>Every op ({len(records)})</h2>'
        '<div class="tools"><input id="filter" type="search" placeholder="filter: op, line, module, shape..." aria-label="filter">'
        ' <label><input id="flagged" type="checkbox"> flagged ops only</label>'
        ' <button id="prev" type="button">&larr; newer</button> <span id="page"></span> <button id="next" type="button">older &rarr;</button></div>'
        f'<table class="ops"><thead>{_header_row()}</thead><tbody id="all-ops"></tbody></table></section>'
    )
    body.append("</main>")
    return page(title, "\n".join(body), data=_ops_data(records), script=_JS)


def page(title: str, body: str, *, data=None, script: str = "") -> str:
    """One self-contained HTML page: ``body`` (markup, its texts escaped), the style, ``data``
    as JSON in ``<script id="opwatch-data">`` and ``script``, all inline."""
    scripts = ""
    if data is not None:
        scripts += f'\n<script type="application/json" id="opwatch-data">{_json_for_script(data)}</script>'
    if script:
        scripts += f"\n<script>{script}</script>"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        f"{body}{scripts}</body></html>\n"
    )


def report_written(path) -> str:
    """The command line's line after it wrote a report."""
    return f"opwatch: report written to {path}"


# -- the findings ---------------------------------------------------------------------------


def _overview(records: list, groups: dict, header: dict) -> str:
    found = groups["anomalies"]
    facts = [f"{len(records)} ops recorded"]
    facts.append(f"{count_of_places(found)}" if found else "no anomalies")
    if groups["contained"]:
        facts.append(f"{len(groups['contained'])} nan/inf origin(s) absorbed before they mattered")
    if groups["allowed"]:
        facts.append(f"{len(groups['allowed'])} finding(s) matched an allow entry")
    versions = [f"{name} {header[name]}" for name in ("opwatch", "torch", "python") if header.get(name)]
    if header.get("rank") is not None:
        versions.append(f"rank {header['rank']}")
    line = f'<p class="versions">{escape(", ".join(versions))}</p>' if versions else ""
    return f'<p class="counts">{escape("; ".join(facts))}</p>{line}'


def group_by_place(anomalies: list) -> dict:
    """``{key: [first anomaly, [op indices]]}``, keyed as the summary groups them."""
    groups: dict = {}
    for anomaly in anomalies:
        key = (anomaly.kind, anomaly.filename, anomaly.lineno, anomaly.op, anomaly.phase)
        if key not in groups:
            groups[key] = (anomaly, [])
        _, indices = groups[key]
        indices.append(anomaly.index)
    return groups


def count_of_places(anomalies: list) -> str:
    return count_places({key: (first, len(indices)) for key, (first, indices) in group_by_place(anomalies).items()})


def _findings_section(name: str, heading: str, anomalies: list, number: int, log: tuple) -> tuple[str, int]:
    html = [f'<section id="{"findings" if name == "anomalies" else name}" class="{name}"><h2>{escape(heading)}</h2>']
    if not anomalies:
        html.append('<p class="none">No anomalies: every op passed every check that ran.</p>')
    else:
        html.append(f'<p class="counts">{escape(count_of_places(anomalies))}</p>')
    for first, indices in group_by_place(anomalies).values():
        number += 1
        html.append(_finding(first, indices, number, log))
    html.append("</section>")
    return "\n".join(html), number


def _finding(anomaly, indices: list, number: int, log: tuple) -> str:
    record = anomaly.record
    parts = message_parts(anomaly.finding, record)
    count = f'<span class="count">x{len(indices)}</span>' if len(indices) > 1 else ""
    head = (
        f'<div class="head"><span class="kind k-{escape(anomaly.kind)}">{escape(anomaly.kind)}</span> '
        f'<code class="op">{escape(record.op)}</code> at <code class="where">{escape(location(record))}</code>'
        f'{_field("module", module_of(record))}{_field("phase", record.phase)}{count}</div>'
    )
    lines = [head]
    if parts.code:
        lines.append(f'<pre class="code">{marked_code(parts.code)}</pre>')
    if parts.note:
        lines.append(f'<p class="note">{escape(parts.note)}</p>')
    lines.append(
        '<dl class="words">'
        f"<dt>problem</dt><dd>{escape(parts.problem)}</dd>"
        + (f"<dt>cause</dt><dd>{escape(parts.cause)}</dd>" if parts.cause is not None else "")
        + f"<dt>expected</dt><dd>{escape(parts.expected)}</dd>"
        f"<dt>fix</dt><dd>{escape(parts.fix)}</dd></dl>"
    )
    way = _way(anomaly, *log)
    if way:
        lines.append(way)
    shown = len(indices) if len(indices) <= 50 else 50
    lines.append(
        f'<button class="around" type="button" aria-expanded="false" data-ops="{",".join(map(str, indices[:shown]))}">'
        f"the ops around it (op #{anomaly.index}{'' if len(indices) == 1 else f', first of {len(indices)}'})</button>"
        '<div class="around-ops" hidden></div>'
    )
    return f'<article class="finding" id="finding-{number}">{"".join(lines)}</article>'


def _way(anomaly, records: list, positions: dict) -> str:
    """A nan/inf's way from the op that made it to the last op it reached by the check point
    (the finding's ``spread`` and ``last`` facts), followed through the log: each op that read a
    tensor the way had made. Empty for other findings, or when the origin left the log."""
    facts = anomaly.finding.facts
    if not isinstance(facts, OriginFacts):
        return ""
    spread, last = facts.spread, facts.last
    start = positions.get(anomaly.index)
    if not spread or last is None or start is None:
        return ""
    tainted = {meta[M_IDENT] for meta in records[start].outputs or ()}
    way = [records[start]]
    for record in records[start + 1 :]:
        if len(way) > spread:
            break
        if any(meta[M_IDENT] in tainted for meta in record.inputs):
            way.append(record)
            tainted.update(meta[M_IDENT] for meta in record.outputs or ())
            if (record.op, record.filename, record.lineno) == (last.op, last.filename, last.lineno):
                break
    steps = [
        f'<li><code>#{record.index} {escape(short_op_name(record.func))}</code> <span class="field">{escape(location(record))}</span></li>'
        for record in way
    ]
    return f'<div class="way"><b>its way</b>, from the op that made it to the last it reached<ol>{"".join(steps)}</ol></div>'


def _field(name: str, value) -> str:
    return f' <span class="field">{name} <b>{escape(str(value))}</b></span>' if value else ""


def marked_code(code: list) -> str:
    """The line's text (``code``'s first line) with the sub-expression under the carets of its
    second line in ``<mark>``, escaped."""
    text, under, *_ = [*code, ""]
    if "^" not in under:
        return escape(text)
    start = len(under) - len(under.lstrip(" "))
    end = start + under.count("^")
    return f"{escape(text[:start])}<mark>{escape(text[start:end])}</mark>{escape(text[end:])}"


def _header_row() -> str:
    return "<tr>" + "".join(f"<th>{escape(name)}</th>" for name in TABLE_HEADERS) + "</tr>"


# -- the ops, for the page's script -----------------------------------------------------------


def _ops_data(records: list) -> dict:
    """``{"cells": [distinct cell texts], "rows": [[op index, cell number per column...]]}``:
    each text once, however many ops share it."""
    cells: dict[str, int] = {}
    rows = []
    for record in records:
        row = table_row(record)
        numbers = [record.index]
        for cell in row[1:]:
            number = cells.get(cell)
            if number is None:
                number = cells[cell] = len(cells)
            numbers.append(number)
        rows.append(numbers)
    return {"headers": list(TABLE_HEADERS), "cells": list(cells), "rows": rows, "around": _AROUND}


def _json_for_script(data) -> str:
    """JSON that cannot end its ``<script>`` element (no ``<``, no ``&``)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# -- the pictures -----------------------------------------------------------------------------


def module_tree_svg(records: list, anomalies: list) -> str:
    """The module tree as an indented bar chart: each module's ops (its submodules' included)
    as a bar, its anomalies (submodules' included) in red beside it."""
    ops: dict[str, int] = {}
    flagged: dict[str, int] = {}
    order: list[str] = []
    for record in records:
        for path in _ancestry(module_of(record)):
            if path not in ops:
                ops[path] = 0
                order.append(path)
            ops[path] += 1
    for anomaly in anomalies:
        for path in _ancestry(module_of(anomaly)):
            flagged[path] = flagged.get(path, 0) + 1
    if not order:
        return '<p class="none">No ops were recorded.</p>'
    rows = sorted(order, key=_tree_key)
    left_out = len(rows) - _TREE_ROWS
    rows = rows[:_TREE_ROWS]
    most = max(ops.values())
    row_height, label_width, bar_width = 18, 300, 360
    height = row_height * len(rows) + 24
    parts = [
        f'<svg class="tree" width="{label_width + bar_width + 200}" height="{height}" role="img" aria-label="ops and anomalies per module">'
    ]
    for i, path in enumerate(rows):
        y = 16 + i * row_height
        depth = 0 if path == _OUTSIDE else path.count(".")
        _, _, name = path.rpartition(".")
        name = path if path == _OUTSIDE else name
        width = max(1, round(bar_width * ops[path] / most))
        bad = flagged.get(path, 0)
        parts.append(
            f'<g class="row{" bad" if bad else ""}"><title>{escape(path)}: {ops[path]} ops, {bad} anomalies</title>'
            f'<text x="{4 + 14 * depth}" y="{y}">{escape(name)}</text>'
            f'<rect x="{label_width}" y="{y - 11}" width="{width}" height="12"></rect>'
            f'<text class="n" x="{label_width + width + 6}" y="{y}">{ops[path]} ops'
            + (f'<tspan class="bad"> · {bad} anomal{"y" if bad == 1 else "ies"}</tspan>' if bad else "")
            + "</text></g>"
        )
    parts.append("</svg>")
    note = f'<p class="note">({left_out} more modules not drawn)</p>' if left_out > 0 else ""
    return "".join(parts) + note


_OUTSIDE = "(outside any module)"


def _ancestry(module: str | None) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``; ops outside modules under one row of their own."""
    if not module:
        return [_OUTSIDE]
    names = module.split(".")
    return [".".join(names[: i + 1]) for i in range(len(names))]


def _tree_key(path: str) -> tuple:
    if path == _OUTSIDE:
        return ((1,),)
    return tuple((0, int(name)) if name.isdigit() else (0, 0, name) for name in path.split("."))


def training_steps(records: list) -> list[int]:
    """The op index each training step starts at. A step ends where a backward pass ends: the
    ops after it (the optimizer's update, the next forward) start the next step; ops after the
    last backward pass join the last step."""
    starts: list[int] = []
    phase, last_start, backward_since = None, None, False
    for record in records:
        if last_start is None or (phase == BACKWARD and record.phase != BACKWARD):
            starts.append(record.index)
            last_start, backward_since = record.index, False
        phase = record.phase
        backward_since = backward_since or phase == BACKWARD
    if len(starts) > 1 and not backward_since:
        starts.pop()
    return starts


def steps_svg(starts: list[int], records: list, anomalies: list) -> str:
    """A bar per training step (steps binned when there are many): its anomalies."""
    from bisect import bisect_right

    counts = [0] * len(starts)
    for anomaly in anomalies:
        step = bisect_right(starts, anomaly.index) - 1
        if step >= 0:
            counts[step] += 1
    per_bar = -(-len(counts) // _STEP_BARS)
    bars = [sum(counts[i : i + per_bar]) for i in range(0, len(counts), per_bar)]
    most = max(max(bars), 1)
    most_width, height, left, bottom = 720, 120, 40, 24
    step_width = min((most_width - left) / len(bars), 28)
    width = max(round(left + step_width * len(bars)), 240)
    parts = [f'<svg class="steps" width="{width}" height="{height + bottom}" role="img" aria-label="anomalies per training step">']
    parts.append(f'<line x1="{left}" y1="{height}" x2="{width}" y2="{height}"></line>')
    parts.append(f'<text x="{left - 6}" y="12" text-anchor="end">{most}</text><text x="{left - 6}" y="{height}" text-anchor="end">0</text>')
    for i, count in enumerate(bars):
        first, last = i * per_bar + 1, min((i + 1) * per_bar, len(counts))
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        bar = round((height - 4) * count / most)
        parts.append(
            f'<rect x="{left + i * step_width:.1f}" y="{height - bar}" width="{max(step_width - 1, 1):.1f}" height="{bar}"><title>{steps}: {count} anomalies</title></rect>'
        )
    parts.append(f'<text x="{left}" y="{height + 16}">step 1</text><text x="{left + len(bars) * step_width:.1f}" y="{height + 16}" text-anchor="end">step {len(counts)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def guard_section(guarded: dict) -> str:
    """A ``--guard`` run's story: its counts, a row per failed or skipped optimizer step (its
    cause, what was done, its origin) and the optimizer steps chart, failed steps marked."""
    steps, failures = guarded.get("steps", 0), guarded.get("failures", [])
    parts = [
        '<section id="guard"><h2>The guarded run</h2>',
        f'<p>{steps} optimizer steps ran, {guarded.get("audited", 0)} audited under a full watch, {guarded.get("failed", 0)} failed, '
        f'{guarded.get("skipped", 0)} of them skipped{scaler_skips(guarded.get("scaler_skipped", 0), 0, None, guarded.get("scaler_skipped_loss", 0))}'
        f'{evaluations_nan(guarded.get("evaluations_nan", 0), 0)}.</p>',
    ]
    if failures:
        parts.append('<table class="guard"><thead><tr><th>step</th><th>cause</th><th>done</th><th>origin</th><th>what held nan/inf</th></tr></thead><tbody>')
        for row in failures:
            origin = row.get("origin")
            if origin:
                made = origin_words(NamedOrigin(origin["kind"], origin["op"], origin["where"], origin["phase"], came_with=origin.get("came_with")))
            else:
                where = stage_words(row.get("stage"))
                made = batch_words(row["batch"]) if row.get("batch") else f"not named; {where}" if where else "not named"
            held = ", ".join(f"{name} ({kind})" for name, kind in row.get("parameters") or []) or (f'the loss ({row["loss"]})' if row.get("loss") else "")
            parts.append(f'<tr class="bad"><td>{row["step"]}</td><td>{escape(row["cause"])}</td><td>{escape(row["action"])}</td>'
                         f"<td>{escape(made)}</td><td>{escape(held)}</td></tr>")
        parts.append("</tbody></table>")
    if steps:
        parts.append(guard_steps_svg(steps, [row["step"] for row in failures]))
    parts.append("</section>")
    return "".join(parts)


def guard_steps_svg(steps: int, failed: list[int]) -> str:
    """The optimizer steps of a guarded run (binned when there are many): a mark on each bar
    that holds a failed step."""
    per_bar = -(-steps // _STEP_BARS)
    bars = [0] * -(-steps // per_bar)
    for step in failed:
        if 1 <= step <= steps:
            bars[(step - 1) // per_bar] += 1
    height, left, bottom = 40, 40, 24
    step_width = min((720 - left) / len(bars), 28)
    width = max(round(left + step_width * len(bars)), 240)
    parts = [f'<svg class="guard-steps" width="{width}" height="{height + bottom}" role="img" aria-label="failed optimizer steps">']
    parts.append(f'<line x1="{left}" y1="{height}" x2="{width}" y2="{height}"></line>')
    for i, count in enumerate(bars):
        first, last = i * per_bar + 1, min((i + 1) * per_bar, steps)
        named = f"step {first}" if first == last else f"steps {first}-{last}"
        shown = "failed" if count else "passed"
        parts.append(f'<rect class="{shown}" x="{left + i * step_width:.1f}" y="{4 if count else height - 6}" width="{max(step_width - 1, 1):.1f}" '
                     f'height="{height - 4 if count else 6}"><title>{named}: {count} failed</title></rect>')
    parts.append(f'<text x="{left}" y="{height + 16}">step 1</text><text x="{left + len(bars) * step_width:.1f}" y="{height + 16}" text-anchor="end">step {steps}</text>')
    parts.append("</svg>")
    return "".join(parts)


# -- the page's style and script --------------------------------------------------------------

_CSS = """
:root{--fg:#1d2330;--mute:#5b6475;--line:#d9dde5;--bad:#c62828;--mark:#ffe08a;--bg:#fff;--soft:#f5f7fa}
*{box-sizing:border-box}
body{margin:0;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
header{padding:18px 28px 8px;border-bottom:1px solid var(--line);background:var(--soft)}
h1{margin:0;font-size:22px} h2{font-size:18px;margin:28px 0 10px}
nav{padding:6px 28px;border-bottom:1px solid var(--line)} nav a{margin-right:16px;color:#2857b8}
main{padding:0 28px 40px;max-width:1400px}
.counts{margin:4px 0;font-weight:600} .versions,.none,.note{color:var(--mute);margin:4px 0}
code,pre,.ops td{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px}
.finding{border:1px solid var(--line);border-left:4px solid var(--bad);border-radius:6px;padding:10px 14px;margin:12px 0;background:#fff}
.contained .finding,.allowed .finding{border-left-color:#8a94a6}
.head{display:flex;flex-wrap:wrap;gap:8px;align-items:baseline}
.kind{background:var(--bad);color:#fff;border-radius:4px;padding:1px 7px;font-size:13px;font-weight:600}
.field{color:var(--mute);font-size:13px} .count{margin-left:auto;background:#333;color:#fff;border-radius:10px;padding:0 8px;font-size:13px}
pre.code{background:var(--soft);border-radius:4px;padding:8px 10px;margin:8px 0;white-space:pre-wrap;overflow-wrap:anywhere}
mark{background:var(--mark);border-bottom:2px solid #e0a800;padding:0 1px}
dl.words{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:6px 0}
dt{font-weight:600;color:var(--mute)} dd{margin:0;overflow-wrap:anywhere}
button{font:inherit;font-size:13px;padding:2px 10px;border:1px solid var(--line);border-radius:4px;background:var(--soft);cursor:pointer}
button:hover{background:#e8ecf2}
.way{color:var(--mute);font-size:14px} .way b{color:var(--fg)} .way ol{display:flex;flex-wrap:wrap;gap:4px 0;list-style:none;padding:0;margin:4px 0 8px}
.way li+li::before{content:"\\2192";margin:0 8px;color:var(--mute)} .way li:first-child code{color:var(--bad);font-weight:600}
.around-ops{margin-top:8px;overflow-x:auto}
.around-ops .occ{margin:4px 0;font-size:13px;color:var(--mute)} .around-ops .occ button{margin:0 2px;padding:0 6px}
table.ops{border-collapse:collapse;width:100%} .ops th,.ops td{border-bottom:1px solid var(--line);padding:2px 8px;text-align:left;white-space:nowrap;vertical-align:top}
.ops th{background:var(--soft);position:sticky;top:0} .ops tr.flagged td{color:var(--bad)} .ops tr.this td{background:var(--mark)}
.diff td.differs{background:#fde2e2} .diff tr.only td{color:var(--mute);font-style:italic} .diff tr.after td{color:var(--mute)}
.diff thead tr+tr th{top:26px} .diff td{white-space:normal;font-size:12px}
.diff td:nth-child(5),.diff td:nth-child(9){overflow-wrap:anywhere;min-width:14em}
.diff td:nth-child(1),.diff td:nth-child(2),.diff td:nth-child(6),.diff td:nth-child(10),.diff td:nth-child(11){white-space:nowrap}
.tools{margin:8px 0;display:flex;gap:10px;align-items:center;flex-wrap:wrap} #filter{width:320px;font:inherit;padding:2px 6px}
#ops{overflow-x:auto}
svg text{font:12px system-ui,sans-serif;fill:var(--fg)} svg .n{fill:var(--mute)} svg .bad,svg tspan.bad{fill:var(--bad);font-weight:600}
svg.tree rect{fill:#7c9cd6} svg.tree .row.bad rect{fill:#e57373} svg.steps rect{fill:var(--bad)} svg.guard-steps rect.failed{fill:var(--bad)} svg.guard-steps rect.passed{fill:#9c9} svg line{stroke:#999}
"""

_JS = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("opwatch-data").textContent);
  var cells = data.cells, rows = data.rows, FLAGS = data.headers.length - 1;
  function find(index) {  // the row of op `index` (rows are in op order)
    var lo = 0, hi = rows.length - 1;
    while (lo <= hi) {
      var mid = (lo + hi) >> 1, at = rows[mid][0];
      if (at === index) return mid;
      if (at < index) lo = mid + 1; else hi = mid - 1;
    }
    return lo;
  }
  function tr(row, mark) {
    var el = document.createElement("tr");
    if (cells[row[FLAGS]]) el.className = "flagged";
    if (row[0] === mark) el.className += " this";
    var td = document.createElement("td");
    td.textContent = String(row[0]);
    el.appendChild(td);
    for (var i = 1; i < row.length; i++) {
      td = document.createElement("td");
      td.textContent = cells[row[i]];
      el.appendChild(td);
    }
    return el;
  }
  function table(from, to, mark) {
    var t = document.createElement("table"), head = document.querySelector("table.ops thead");
    t.className = "ops";
    t.appendChild(head.cloneNode(true));
    var body = document.createElement("tbody");
    for (var i = Math.max(from, 0); i < Math.min(to, rows.length); i++) body.appendChild(tr(rows[i], mark));
    t.appendChild(body);
    return t;
  }
  function showAround(box, indices, which) {
    var index = indices[which], at = find(index);
    box.textContent = "";
    if (indices.length > 1) {
      var occ = document.createElement("div");
      occ.className = "occ";
      occ.appendChild(document.createTextNode("occurrences: "));
      indices.forEach(function (other, k) {
        var b = document.createElement("button");
        b.type = "button";
        b.textContent = "#" + other;
        if (k === which) b.disabled = true;
        b.addEventListener("click", function () { showAround(box, indices, k); });
        occ.appendChild(b);
      });
      box.appendChild(occ);
    }
    if (at >= rows.length || rows[at][0] !== index) {
      var gone = document.createElement("p");
      gone.className = "note";
      gone.textContent = "op #" + index + " has left the log (it keeps the newest ops only).";
      box.appendChild(gone);
      return;
    }
    box.appendChild(table(at - data.around, at + data.around + 1, index));
  }
  Array.prototype.forEach.call(document.querySelectorAll("button.around"), function (button) {
    button.addEventListener("click", function () {
      var box = button.nextElementSibling, open = box.hidden;
      if (open && !box.firstChild) showAround(box, button.dataset.ops.split(",").map(Number), 0);
      box.hidden = !open;
      button.setAttribute("aria-expanded", String(open));
    });
  });
  // Every op, a page at a time (newest first), filtered on demand.
  var PAGE = 200, page = 0, shown = rows;
  var body = document.getElementById("all-ops"), label = document.getElementById("page");
  var filter = document.getElementById("filter"), flagged = document.getElementById("flagged");
  function draw() {
    var pages = Math.max(1, Math.ceil(shown.length / PAGE));
    page = Math.min(Math.max(page, 0), pages - 1);
    var end = shown.length - page * PAGE, start = Math.max(end - PAGE, 0), frag = document.createDocumentFragment();
    for (var i = end - 1; i >= start; i--) frag.appendChild(tr(shown[i], -1));
    body.textContent = "";
    body.appendChild(frag);
    label.textContent = shown.length ? "ops " + (start + 1) + "-" + end + " of " + shown.length : "no op matches";
  }
  function refilter() {
    var words = filter.value.toLowerCase().split(/\s+/).filter(Boolean), only = flagged.checked;
    var hit = cells.map(function (text) { return text.toLowerCase(); });
    shown = rows.filter(function (row) {
      if (only && !cells[row[FLAGS]]) return false;
      return words.every(function (word) {
        if (String(row[0]) === word) return true;
        for (var i = 1; i < row.length; i++) if (hit[row[i]].indexOf(word) >= 0) return true;
        return false;
      });
    });
    page = 0;
    draw();
  }
  var timer = null;
  filter.addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(refilter, 150); });
  flagged.addEventListener("change", refilter);
  document.getElementById("prev").addEventListener("click", function () { page -= 1; draw(); });
  document.getElementById("next").addEventListener("click", function () { page += 1; draw(); });
  draw();
})();
"""
