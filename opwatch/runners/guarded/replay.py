"""Replaying a failing step under a full watch, and judging what it found.

The step runs again from its start (restored by :mod:`.snapshot`) on the same arguments under
a watch that checks each op's outputs as it goes (``Watch(check_every=1)``), with an
:class:`~opwatch.runners.guarded.repro.InputCapture` on top of it that keeps the inputs a repro needs.
The judgement: for nan/inf, the earliest nan/inf origin; for an exception, the anomaly on the
op that raised, else the first one reported (what a strict watch would have raised); and a
one-op repro of its op, or of the op that raised.
"""

from __future__ import annotations

from typing import NamedTuple

from ...findings.anomaly import Anomaly
from ...render import guard as words
from ...session import Watch
from ...core.sites import location
from .check import Raised
from .repro import InputCapture, write_repro

NONFINITE = ("nan", "inf")


class Replay:
    """One replay: its watch, its input capture, the exception it raised and the index of the
    op that raised it (``None`` when none)."""

    __slots__ = ("watch", "capture", "error", "raised_at")

    def __init__(self, watch, capture):
        self.watch = watch
        self.capture = capture
        self.error = None
        self.raised_at = None


class StepContext(NamedTuple):
    """The facts of a guarded step's failure that a :class:`Replayed` message tells."""

    name: str  # the step function's name
    failure: tuple  # a check.Raised or check.NotFinite
    buffers: int | None  # buffers the replay restored (None for an audit)
    audited: bool  # found by the audit of the call, not by a replay


class ReproNote(NamedTuple):
    """What a failure's repro runs, or why there is none (see ``render.guard.repro_note``)."""

    kind: str  # "alone", "raised_op", "capture_broken", "not_captured", "write_failed" or "audit"
    op: str | None = None  # raised_op: the op that raised
    where: str | None = None  # raised_op: its location
    why: str | None = None  # capture_broken: what broke; write_failed: the exception's text
    error_type: str | None = None  # write_failed: the exception's type name


class Replayed(Anomaly):
    """An :class:`~opwatch.Anomaly` of a guarded step that failed, found by its replay (or its
    audit): its message adds the step and the repro. Facts: ``step`` (the call number),
    ``context`` (a :class:`StepContext`), ``repro`` (the repro folder, or ``None``),
    ``repro_note`` (a :class:`ReproNote`: what the repro runs, or why there is none) and
    ``ranks`` (in a distributed job, a :class:`~opwatch.runners.guarded.ranks.RankOrigin`: the
    rank that made the nan/inf; else ``None``)."""

    __slots__ = ("repro", "step", "context", "repro_note", "ranks")

    def __init__(self, anomaly, *, step, context, repro, repro_note, ranks=None):
        super().__init__(anomaly.finding, anomaly.record)
        self.step = step
        self.repro = repro
        self.context = context
        self.repro_note = repro_note
        self.ranks = ranks

    @property
    def message(self) -> str:
        name, failure, buffers, audited = self.context
        step_context = words.context(self.step, name, failure, buffers, audited=audited)
        return words.replayed_message(Anomaly.message.fget(self), step_context, self.repro, self.repro_note, self.ranks)


def allow_option(allow) -> dict:
    """``allow`` as a keyword for :class:`Watch`, given only when set (older watches lack it)."""
    return {"allow": allow} if allow else {}


def run(step, args, kwargs, *, checks, allow, max_records, repro_max_bytes, keep_values) -> Replay:
    watch = Watch(
        strict=False, max_records=max_records, checks=checks, dump_on_error=False,
        last=0, file=None, warn=False, check_every=1, **allow_option(allow),
    )
    capture = InputCapture(max_bytes=repro_max_bytes, keep_values=keep_values, numbering=watch._next_op_index)
    replay = Replay(watch, capture)
    result = None
    try:
        with watch:
            with capture:
                result = step(*args, **kwargs)
            # ``result`` stays alive until the watch has judged: a nan only in the returned
            # loss is alive at the end of the block, so it matters.
    except Exception as error:
        replay.error = error
    del result
    return replay


def explaining(anomalies, error, replay_error, raised_at):
    """The anomaly that explains a failure (``None`` when none does)."""
    if error is None and replay_error is None:
        found = [anomaly for anomaly in anomalies if anomaly.kind in NONFINITE]
        return min(found, key=lambda anomaly: anomaly.index) if found else None
    on_op = [anomaly for anomaly in anomalies if anomaly.index == raised_at]
    return on_op[0] if on_op else (anomalies[0] if anomalies else None)


def judge(replay, error, *, repro: bool, repro_dir, repro_max_bytes):
    """``(anomaly, repro folder, repro note)``: what explains the failure, and its repro."""
    capture = replay.capture
    raised_at = None
    if capture.raised is not None and replay.error is not None:
        index, error_id = capture.raised
        raised_at = index if in_chain(replay.error, error_id) else None
    replay.raised_at = raised_at
    anomaly = explaining(replay.watch.anomalies, error, replay.error, raised_at)
    call = capture.call_for(anomaly.record) if anomaly is not None else None
    if call is None and raised_at is not None:
        call = capture.calls.get(raised_at)
    if not repro:
        return anomaly, None, None
    if call is None:
        if anomaly is None:
            return None, None, None
        return anomaly, None, ReproNote("capture_broken", why=capture.broken) if capture.broken else ReproNote("not_captured")
    same_op = anomaly is not None and anomaly.index == call.index
    record = anomaly.record if same_op else record_at(replay.watch, call.index)
    note = ReproNote("alone")
    if not same_op and record is not None:
        note = ReproNote("raised_op", record.op, location(record))
    raised = Raised("raised", type(replay.error).__name__, first_line(replay.error)) if call.raised and replay.error is not None else None
    about = words.repro_about(anomaly if same_op else None, raised, record)
    try:
        return anomaly, write_repro(call, repro_dir, about=about, max_bytes=repro_max_bytes), note
    except Exception as problem:
        return anomaly, None, ReproNote("write_failed", why=str(problem), error_type=type(problem).__name__)


def record_at(watch, index):
    if index is None:
        return None
    return next((record for record in reversed(watch.records) if record.index == index), None)


def first_line(error) -> str:
    text = str(error).strip()
    return text.split("\n", 1)[0] if text else ""


def in_chain(error, error_id) -> bool:
    """Whether the exception ``error_id`` is ``error`` or one it was raised from."""
    for _ in range(16):
        if error is None:
            return False
        if id(error) == error_id:
            return True
        error = error.__cause__ or error.__context__
    return False
