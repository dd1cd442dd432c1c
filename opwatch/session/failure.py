"""What a watch adds when the block it watched raised: a note on the exception naming the op
that failed (its line and tensors), and the dump of the last ops (the one print the user did
not ask for, after a failing block only)."""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (see opwatch.session).
__tracebackhide__ = True

import os
import shutil
import sys

from ..core.records import OpLog, OpRecord
from ..findings.anomaly import AnomalyError, add_note
from ..render import exception_note, render_failure
from ..render.table import DUMP_WIDTH

__all__ = ["tell_failure", "failed_record"]


def tell_failure(log: OpLog, failure, error: BaseException, *, dump: bool, last: int, file) -> None:
    """Note on ``error`` the op that raised it (``failure``: the interceptor's ``(op index,
    id of the error)``, or ``None``), and with ``dump`` print the last ``last`` ops to ``file``
    (``sys.stderr`` when ``None``)."""
    failed = failed_record(log, failure, error)
    if failed is not None and not isinstance(error, AnomalyError):
        add_note(error, exception_note(failed))
    if dump and last:
        records = log.records()[-last:]
        stream = file if file is not None else sys.stderr
        print(render_failure(records, failed, error, rank=log.rank, width=_width_of(stream)), file=stream)


def failed_record(log: OpLog, failure, error: BaseException) -> OpRecord | None:
    """The record of the op that raised ``error``: an anomaly's, or the op whose kernel raised
    it (``failure``), when ``error`` is that exception or wraps it."""
    if isinstance(error, AnomalyError):
        return error.anomaly.record
    if failure is None:
        return None
    index, error_id = failure
    chain = error
    for _ in range(16):  # the kernel's error, possibly wrapped by the program
        if chain is None:
            return None
        if id(chain) == error_id:
            break
        chain = chain.__cause__ or chain.__context__
    else:
        return None
    return log.find(index)


def _width_of(stream) -> int:
    """The dump's width: the terminal's when ``stream`` is one, else a fixed width (a file, a
    pipe, a captured stream: output that must not depend on the terminal that wrote it)."""
    try:
        if not stream.isatty():
            return DUMP_WIDTH
        columns = os.environ.get("COLUMNS", "")  # honoured as shutil.get_terminal_size does
        return int(columns) if columns.isdigit() and int(columns) > 0 else os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return shutil.get_terminal_size((DUMP_WIDTH, 24)).columns
