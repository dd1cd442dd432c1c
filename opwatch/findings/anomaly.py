"""What users read when something is wrong: ``Anomaly``, ``AnomalyError``, ``OpwatchWarning``."""

from __future__ import annotations

from ..checks.finding import Finding
from ..checks.nonfinite.cause import DATA, INPUT, WEIGHTS
from ..core.ops import is_collective_op
from ..core.records import OpRecord

__all__ = ["BaseAnomaly", "Anomaly", "AnomalyError", "OpwatchWarning", "add_note"]


class OpwatchWarning(UserWarning):
    """Warned once per (kind, file, line) by ``watch()``; also how internal errors are told."""


# What an origin's values came in with, where no op of the watched step made them (came_with).
CAME_WITH_INPUT = "input"  # an input made before the step: its batch, or a tensor the program kept
CAME_WITH_WEIGHTS = "weights"


class BaseAnomaly:
    """The one anomaly interface, shared by live anomalies (:class:`Anomaly`), saved ones
    (:class:`opwatch.storage.jsonl.SavedAnomaly`), replayed ones (guard) and other ranks' ones.

    A subclass provides two attributes (slots, plain attributes or properties):

    - ``finding``: the :class:`~opwatch.checks.finding.Finding` (its facts);
    - ``record``: the op's record, anything with the interface of
      :class:`~opwatch.core.records.BaseRecord` (``func``, ``position``, ``phase``, ...).

    Derived here from those two: ``kind``, ``op``, ``filename``, ``lineno``, ``module``,
    ``phase``, ``index``, ``rank``, ``where``, ``received``, ``came_with`` and ``message`` (also ``str()``),
    rendered from the facts by ``opwatch.render.render_message`` on first read and kept.
    A subclass may override any of them: one that adds lines to the message overrides
    ``message`` and calls ``BaseAnomaly.message.fget(self)`` for the rendered text; one whose
    record is not at hand (another rank's anomaly) provides the derived attributes itself.
    """

    __slots__ = ()

    kind = property(lambda self: self.finding.kind)
    op = property(lambda self: self.record.op)
    filename = property(lambda self: self.record.filename)
    lineno = property(lambda self: self.record.lineno)
    module = property(lambda self: self.record.module)
    module_class = property(lambda self: self.record.module_class)
    phase = property(lambda self: self.record.phase)
    index = property(lambda self: self.record.index)
    rank = property(lambda self: self.record.rank)
    where = property(lambda self: self.record.where)

    @property
    def received(self) -> bool:
        """Whether this is a nan/inf that reached this rank through a collective (its own inputs
        to the collective were finite): another rank made it, or the collective itself did.
        False for a record whose ``func`` is only a name (an op this torch does not have)."""
        return self.finding.kind in ("nan", "inf") and is_collective_op(self.record.func)

    @property
    def came_with(self) -> str | None:
        """For a nan/inf no op of the watched step made: ``"input"`` when its op read it from an
        input made before the step (data, a batch, a tensor the program kept), ``"weights"``
        from a parameter; else ``None`` (its cause says so: ``opwatch.checks.nonfinite.cause``)."""
        finding = self.finding
        cause = None if finding is None else finding.facts.get("cause")
        if cause is None:
            return None
        if cause.kind == WEIGHTS:
            return CAME_WITH_WEIGHTS
        if cause.kind == INPUT and (cause.detail == DATA or getattr(cause.made, "how", None) == "before_watch"):
            return CAME_WITH_INPUT
        return None

    @property
    def message(self) -> str:
        # Kept in ``_message`` (a slot or an instance attribute of the subclass) once rendered.
        try:
            return self._message
        except AttributeError:
            pass
        from ..render import render_message

        message = render_message(self.finding, self.record)
        try:
            self._message = message
        except AttributeError:  # a subclass without room for it: render on every read
            pass
        return message

    def __str__(self) -> str:
        return self.message

    def _repr_html_(self) -> str | None:
        """What a notebook shows: the message as a card (the text repr is unchanged)."""
        from ..render.html_repr import anomaly_html

        if getattr(self, "record", None) is None:  # another rank's anomaly: its text only
            return None
        return anomaly_html(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self.op} at {self.where} #{self.index}>"


class Anomaly(BaseAnomaly):
    """One anomaly, tied to the op that caused it.

    Attributes:
        kind: one of ``opwatch.KINDS``: ``"device_mismatch"``, ``"dtype_mismatch"``,
            ``"broadcast"``, ``"nan"``, ``"inf"``, ``"overflow_risk"``, ``"collective_mismatch"``.
        op: the op's name (``"aten.sub.Tensor"``).
        filename / lineno: the user's source line; for backward ops, the forward line.
        where: ``train.py:23``, as every message shows it (or a named place, ``DDP bucket [...]``).
        module: the ``nn.Module`` path, or ``None``.
        phase: ``"forward"``, ``"backward"``, ``"clipping"`` (gradient clipping) or ``"optimizer"``
            (an optimizer step).
        index: the op's index in the watch's log.
        rank: the rank that found it in a ``torch.distributed`` job, else ``None``.
        received: a nan/inf that arrived through a collective rather than made on this rank.
        record: the op's :class:`~opwatch.OpRecord`.
        finding: the :class:`~opwatch.checks.finding.Finding`: the rule that fired and its facts.
        message: the full text, also ``str(anomaly)``: kind, op, line and its text with the
            sub-expression marked, module, the tensors involved, what was expected, a likely fix.
    """

    __slots__ = ("record", "finding", "_message")

    def __init__(self, finding: Finding, record: OpRecord):
        self.finding = finding
        self.record = record


class AnomalyError(RuntimeError):
    """Raised by ``strict()`` at the first anomaly; ``.anomaly`` holds it.

    What opwatch adds to it later (the guard's replay notes, a compiled verdict) is part of its
    message on every Python: ``str(error)``, what a program logs, holds the anomaly's message
    and then each note on its own lines; ``.notes`` holds the notes alone."""

    def __init__(self, anomaly: Anomaly):
        super().__init__(anomaly.message)
        self.anomaly = anomaly
        self.notes: tuple[str, ...] = ()

    def add_note(self, note: str) -> None:
        """Add ``note`` to the message (not to ``__notes__``, which a traceback would print a
        second time); also on Python 3.10, which has no exception notes."""
        if not isinstance(note, str):
            raise TypeError(f"a note must be a str, not {type(note).__name__}")
        self.notes = (*self.notes, note)
        self.args = ("\n".join((self.anomaly.message, *self.notes)),)


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to an exception opwatch re-raises: an :class:`AnomalyError` takes it into
    its message; any other exception (the program's own) gets an exception note, which the
    traceback prints on Python 3.11+. Python 3.10 has no ``add_note``: there the note goes to
    ``__notes__`` as PEP 678 defines it (pytest and the ``exceptiongroup`` backport print it),
    leaving the program's exception, its type and its message, as they were."""
    if hasattr(error, "add_note"):
        error.add_note(note)
        return
    notes = getattr(error, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
    notes.append(note)
    try:
        error.__notes__ = notes
    except (AttributeError, TypeError):  # an exception type that takes no attributes: left as it is
        pass
