"""What users read when something is wrong: ``Anomaly``, ``AnomalyError``, ``OpwatchWarning``."""

from __future__ import annotations

from .checks.finding import Finding
from .records import OpRecord

__all__ = ["Anomaly", "AnomalyError", "OpwatchWarning"]


class OpwatchWarning(UserWarning):
    """Warned once per (kind, file, line) by ``watch()``; also how internal errors are told."""


class Anomaly:
    """One anomaly, tied to the op that caused it.

    Attributes:
        kind: one of ``opwatch.KINDS``: ``"device_mismatch"``, ``"dtype_mismatch"``,
            ``"broadcast"``, ``"nan"``, ``"inf"``, ``"overflow_risk"``, ``"collective_mismatch"``.
        op: the op's name (``"aten.sub.Tensor"``).
        filename / lineno: the user's source line; for backward ops, the forward line.
        where: ``train.py:23``, as every message shows it (or a named place, ``DDP bucket [...]``).
        module: the ``nn.Module`` path, or ``None``.
        phase: ``"forward"`` or ``"backward"``.
        index: the op's index in the watch's log.
        rank: the rank that found it in a ``torch.distributed`` job, else ``None``.
        received: a nan/inf that arrived through a collective rather than made on this rank.
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
    rank = property(lambda self: self.record.rank)
    where = property(lambda self: self.record.where)

    @property
    def received(self) -> bool:
        """Whether this is a nan/inf that reached this rank through a collective (its own inputs
        to the collective were finite): another rank made it, or the collective itself did."""
        from .ops import is_collective_op

        return self.finding.kind in ("nan", "inf") and is_collective_op(self.record.func)

    @property
    def message(self) -> str:
        if self._message is None:
            from .render import render_message

            self._message = render_message(self.finding, self.record)
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
