"""What users read when something is wrong: ``Anomaly``, ``AnomalyError``, ``OpwatchWarning``."""

from __future__ import annotations

import os

from .checks.finding import Finding
from .records import OpRecord, short_op_name

__all__ = ["Anomaly", "AnomalyError", "OpwatchWarning", "display_path"]


class OpwatchWarning(UserWarning):
    """Warned once per (kind, file, line) by ``watch()``; also how internal errors are told."""


class Anomaly:
    """One anomaly, tied to the op that caused it.

    Attributes:
        kind: ``"device_mismatch"``, ``"dtype_mismatch"``, ``"broadcast"``, ``"nan"`` or ``"inf"``.
        op: the op's name (``"aten.sub.Tensor"``).
        filename / lineno: the user's source line; for backward ops, the forward line.
        module: the ``nn.Module`` path, or ``None``.
        phase: ``"forward"`` or ``"backward"``.
        index: the op's index in the watch's log.
        record: the op's :class:`~opwatch.OpRecord`.
        message: the full text, also ``str(anomaly)``: kind, op, line and its text with the
            sub-expression marked, module, the tensors involved, what was expected, a likely fix.
    """

    __slots__ = ("record", "finding", "_message")

    def __init__(self, finding: Finding, record: OpRecord):
        self.finding = finding
        self.record = record
        self._message = None

    kind = property(lambda self: self.finding.kind)
    op = property(lambda self: self.record.op)
    filename = property(lambda self: self.record.filename)
    lineno = property(lambda self: self.record.lineno)
    module = property(lambda self: self.record.module)
    phase = property(lambda self: self.record.phase)
    index = property(lambda self: self.record.index)

    @property
    def message(self) -> str:
        if self._message is None:
            self._message = render(self.finding, self.record)
        return self._message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"<Anomaly {self.kind} {self.record.op} at {self.record.where} #{self.index}>"


class AnomalyError(RuntimeError):
    """Raised by ``strict()`` at the first anomaly; ``.anomaly`` holds it."""

    def __init__(self, anomaly: Anomaly):
        super().__init__(anomaly.message)
        self.anomaly = anomaly


def render(finding: Finding, record: OpRecord) -> str:
    position = record.position
    where = f"{display_path(position.filename)}:{position.lineno}" if position.filename else "an unknown line"
    header = f"{finding.kind} in {record.op} at {where}"
    if record.module:
        header += f", module {record.module}"
    header += f" ({record.phase})"
    lines = [header]
    lines += ["    " + line for line in position.caret_lines()]
    if record.phase == "backward" and position.filename:
        of = f" of {short_op_name(record.forward_func)}" if record.forward_func is not None else ""
        lines.append(f"  (a backward op{of}: the line is the forward op whose gradient it computes)")
    lines.append(f"  problem:  {finding.problem}")
    lines.append(f"  expected: {finding.expected}")
    lines.append(f"  fix:      {finding.fix}")
    return "\n".join(lines)


def display_path(filename: str | None) -> str:
    """A path relative to the working directory when it lies below it; as given otherwise."""
    if not filename:
        return "?"
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative
