"""``python -m opwatch merge-traces TRACE... -o FILE``: the Chrome traces of a torchrun job's
ranks (``--trace trace.json`` writes ``trace.json`` on rank 0, ``trace.rank<r>.json`` on rank r)
in one file, a process a rank, their clocks lined up
(:func:`opwatch.storage.chrome_trace.merge_chrome_traces`).

Exit status: 0 when the trace is written, 1 when a trace cannot be read or the file cannot be
written.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["run_merge_traces"]


def run_merge_traces(argv: list[str], out=None) -> int:
    """Merge traces written by ``--trace`` or ``Watch.export_chrome_trace`` into one."""
    from ..render.notices import command_error, traces_merged
    from ..storage.chrome_trace import merge_chrome_traces

    out = out if out is not None else sys.stdout
    parser = argparse.ArgumentParser(
        prog="python -m opwatch merge-traces",
        description="Put the Chrome traces of a torchrun job's ranks (--trace PATH writes PATH on rank 0, PATH with .rank<r> "
        "before its extension on rank r) into one trace: a process a rank, their clocks lined up, for Perfetto or chrome://tracing.",
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="the traces written by --trace or Watch.export_chrome_trace")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="the trace to write")
    options = parser.parse_args(argv)
    try:
        count = merge_chrome_traces(options.traces, options.output)
    except (OSError, ValueError) as error:  # one line: a missing or foreign trace, a folder that is not there
        print(command_error(parser.prog, error), file=sys.stderr)
        return 1
    print(traces_merged(count, options.output), file=out)
    return 0
