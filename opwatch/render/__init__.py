"""Every string a user reads, built here from records and findings' facts.

- :mod:`.table`: the op table;
- :mod:`.messages`: one anomaly's message, from a :class:`~opwatch.checks.finding.Finding`;
- :mod:`.phrases`: the pieces the check renderers share (another op's place, named tensors,
  where an odd operand was made);
- :mod:`.rules` and :mod:`.explanations`: the registry rule -> ``explain(finding)``, and the
  import of every module that registers one;
- one module per check's rules: :mod:`.device`, :mod:`.dtype`, :mod:`.broadcast`,
  :mod:`.module_calls`, :mod:`.nonfinite`, :mod:`.ranks` (also every rank's anomalies in one
  summary);
- :mod:`.summary`: the summary, the dump after a failing block, the exception note;
- the runners' lines: :mod:`.notices` (CLI, pytest, self-reports), :mod:`.guard`,
  :mod:`.leave_on`, :mod:`.diff`.

The one location format (``train.py:23``) is :func:`opwatch.core.sites.location`, below the records
so that a record can say where it is without importing its renderer. Formatting happens only
when somebody reads.
"""

from __future__ import annotations

from ..core.sites import display_path, location
from .messages import render_message
from .ranks import format_ranks, render_combined_summary
from .summary import exception_note, overwritten_save_note, render_failure, render_summary, tagged
from .table import TABLE_HEADERS, render_table

__all__ = [
    "display_path",
    "location",
    "render_table",
    "render_message",
    "render_summary",
    "render_failure",
    "exception_note",
    "overwritten_save_note",
    "render_combined_summary",
    "format_ranks",
    "tagged",
    "TABLE_HEADERS",
]
