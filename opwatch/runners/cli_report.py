"""``python -m opwatch report run.jsonl [-o report.html] [--partial]``: a saved log as one
self-contained HTML page (:func:`opwatch.render.html.render_report`).

Exit status: 0 when the report is written, 1 when the log cannot be read or the page cannot be
written.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["run_report"]


def run_report(argv: list[str], out=None) -> int:
    """Write the HTML report of a log written by ``--jsonl`` or ``Watch.export_jsonl``."""
    from ..render.html import report_written
    from ..render.notices import command_error
    from ..storage.jsonl import load

    out = out if out is not None else sys.stdout
    parser = argparse.ArgumentParser(
        prog="python -m opwatch report",
        description="Write the report of a log written by --jsonl or Watch.export_jsonl: one HTML file that opens "
        "offline in any browser (the findings, the ops around each, the module tree, every op).",
    )
    parser.add_argument("log", help="the .jsonl file")
    parser.add_argument("-o", "--output", metavar="FILE", help="the HTML file to write (default: the log's name with .html)")
    parser.add_argument("--partial", action="store_true", help="report what a log cut short holds, instead of refusing it")
    options = parser.parse_args(argv)
    root, _ = os.path.splitext(options.log)
    output = options.output or root + ".html"
    try:
        log = load(options.log, partial=options.partial)
        log.report_html(output)
    except (OSError, ValueError) as error:  # one line: a missing, foreign or cut-short log
        print(command_error(parser.prog, error), file=sys.stderr)
        return 1
    print(report_written(output), file=out)
    return 0
