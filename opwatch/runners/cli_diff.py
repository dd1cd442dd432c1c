"""``python -m opwatch diff a.jsonl b.jsonl [--rtol X] [--atol Y] [--context N] [--html FILE]``: the
first op that made two saved runs differ (:func:`opwatch.diff`), with the aligned table around
it; ``--html``: also both runs side by side in one self-contained HTML page. Either side may be
a directory: a sharded run's per-rank logs, combined (:mod:`opwatch.runners.divergence_layouts`).

Exit status, as ``diff`` has it: 0 when the runs agree, 1 when they differ, 2 for a usage error
(a missing file, a log that is not opwatch's, one recorded without ``--fingerprints``).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["run_diff"]


def run_diff(argv: list[str], out=None) -> int:
    """Compare two logs written with ``python -m opwatch --fingerprints --jsonl PATH``."""
    from .divergence import diff
    from ..render import diff as words

    out = out if out is not None else sys.stdout
    parser = argparse.ArgumentParser(
        prog="python -m opwatch diff",
        description="Name the first op that made two runs differ, on its line in each run. Record both with "
        "python -m opwatch --fingerprints --jsonl PATH script.py. Exit status: 0 agree, 1 differ, 2 usage error.",
    )
    parser.add_argument("a", help="the first run's .jsonl log, or a directory of a sharded run's per-rank .jsonl logs")
    parser.add_argument("b", help="the second run's .jsonl log, or a directory of per-rank logs")
    parser.add_argument("--rtol", type=float, default=None, metavar="X", help="relative tolerance on each output's sum, norm, min and max (default: bitwise, or the lower precision's when the dtypes differ)")
    parser.add_argument("--atol", type=float, default=None, metavar="Y", help="absolute tolerance (default 0 when --rtol is given)")
    parser.add_argument("--context", type=int, default=5, metavar="N", help="aligned ops shown either side of the first difference (default 5)")
    parser.add_argument("--html", metavar="FILE", help="also write both runs side by side to FILE (at least 20 ops either side of the first difference, marked): one HTML page that opens offline")
    options = parser.parse_args(argv)
    if options.context < 0:
        parser.error("--context must be 0 or more")
    try:
        result = diff(options.a, options.b, rtol=options.rtol, atol=options.atol)
    except (OSError, ValueError, TypeError) as error:
        print(words.cannot_compare(error), file=sys.stderr)
        return 2
    print(result, file=out)
    if result.pairs and options.context:
        print(file=out)
        print(result.table(context=options.context), file=out)
    if options.html:
        from ..render.html import report_written

        try:
            result.report_html(options.html, context=max(options.context, 20))
        except OSError as error:
            print(words.cannot_compare(error), file=sys.stderr)
            return 2
        print(report_written(options.html), file=out)
    return 0 if result.agree else 1
