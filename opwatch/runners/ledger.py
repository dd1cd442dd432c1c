"""The run ledger: what happened to a guarded run, kept as facts, one place for every runner.

``python -m opwatch --guard`` and the trainers' guard mode (:class:`~opwatch.runners.leave_on.LeaveOn`),
:func:`opwatch.guard` (:class:`~opwatch.runners.guarded.Guarded`) and the Hugging Face
``guard_trainer`` write the same facts here: each optimizer step, each audit, each failed step
with its cause (``"gradients"``: nan/inf in the gradients about to be applied; ``"loss"``: the
loss ``backward()`` ran on is not finite while the gradients are; ``"weights"``: the weights
held nan/inf before the step; ``"raised"``: the step raised), its origin once a full watch named
one, and what was done with it (skipped, applied, raised). Every count a user reads (the
summary line, the trainers' metrics, ``.anomalies``, the JSON Lines rows of a ``--jsonl`` run
and the HTML report) is read from here, so no two of them can disagree.

A run is *stuck* when ``max_failed_in_a_row`` optimizer steps in a row failed: the runner then
raises :class:`RunStuck` (the command line exits non-zero), naming the first of them and its
origin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..findings.anomaly import CAME_WITH_INPUT, CAME_WITH_WEIGHTS

__all__ = ["RunLedger", "Failure", "LeftUnjudged", "MAX_FAILED_IN_A_ROW", "CAUSES", "CAME_WITH_INPUT", "CAME_WITH_WEIGHTS", "came_with"]


def came_with(origin) -> str | None:
    """:data:`CAME_WITH_INPUT` or :data:`CAME_WITH_WEIGHTS` when ``origin`` (an anomaly) says
    its op read the values from an input made before the step (data, a batch) or from a
    parameter, no op of the step making them; else ``None``. Another rank's anomaly carries what
    its own rank found (:attr:`~opwatch.findings.anomaly.BaseAnomaly.came_with`), so every rank
    tells and counts it alike."""
    return getattr(origin, "came_with", None)


MAX_FAILED_IN_A_ROW = 10  # the default of LeaveOn(max_failed_in_a_row=) and --max-failed-steps
CAUSES = ("gradients", "loss", "weights", "input", "raised")
_KEPT = 1000  # failures kept one by one (the counts go on)


@dataclass
class Failure:
    """An optimizer step that failed (``LeaveOn.failures``, ``RunLedger.failures``).

    ``step``: its 1-based count; ``parameters``: ``(name, kind)`` pairs of what held nan/inf
    (kind ``"nan"`` or ``"inf"``); ``cause``: one of :data:`CAUSES`; ``origin``: the
    :class:`~opwatch.Anomaly` a full watch (audit, re-check or replay) named for it, or ``None``;
    ``action``: ``"skipped"``, ``"applied"`` or ``"raised"`` once decided, ``""`` before;
    ``batch``: for cause ``"input"``, what the batch held (``model``, ``argument`` as ``[name,
    dtype, shape, device]``, ``kind``, ``where``, ``call`` as ``[number, calls]`` or ``None``,
    ``rank``: the rank whose batch it was in a job, else ``None``), else ``None``; only
    ``rank`` when another rank's facts did not arrive; ``stage``: for a told failure no full
    watch saw, where in the step it began, from what the model was fed and returned and the loss
    (``"model"``: its forward; ``"after_model"``: between its output and the loss;
    ``"forward_or_loss"``: one of the two, its output not kept; ``"backward"``), else ``None``."""

    step: int
    parameters: list
    cause: str = "gradients"
    origin: object = None
    action: str = ""
    loss: str | None = field(default=None)  # "nan" or "inf": the loss, when it was not finite
    batch: dict | None = field(default=None)
    stage: str | None = field(default=None)


class LeftUnjudged(NamedTuple):
    """What the ops a run ended with, after its last optimizer step and unjudged, left
    (:attr:`RunLedger.unjudged_left`): ``fed``, the model's batch that held nan/inf (a
    :class:`~opwatch.runners.batches.FedInput`), or ``None``; ``stage``, where a finite batch's
    nan/inf began (:attr:`Failure.stage`'s values), or ``None``; ``loss``, ``"nan"`` or ``"inf"``
    when the loss ``backward()`` ran on was not finite; ``called``, the model and where it was
    called (``Sequential at train.py:12``)."""

    fed: object
    stage: str | None
    loss: str | None
    called: str | None


class RunLedger:
    """The facts of one run; the runners write, every reader reads."""

    def __init__(self):
        self.steps = 0  # optimizer steps called (GradScaler's skipped ones never call it)
        self.audited = 0  # of them, run under the full watch
        self.failed = 0  # of them, failed (any cause)
        self.skipped = 0  # of the failed ones, not run
        self.failures: list[Failure] = []  # the first _KEPT, one by one
        self.origins: list = []  # the nan/inf origins full watches named (Anomaly objects)
        self.verdicts: list = []  # compiled verdicts of replayed failing steps
        self.replays = 0  # failing steps run again from their start under a full watch
        self.latest: Failure | None = None  # the newest failure (kept one by one or not)
        self.failed_in_a_row = 0
        self.first_in_a_row: Failure | None = None  # the first failure of the running streak
        self.poisoned_since: int | None = None  # the optimizer step after which the weights held nan/inf
        self.unjudged_end = False  # the run ended with ops that nothing checked
        self.unjudged_left: LeftUnjudged | None = None  # what they left, when it says something
        # Optimizer steps GradScaler skipped (they never call the step, so they are none of the
        # above): all of them, the running streak, the steps that ran before it began, and the
        # scale GradScaler fell to at its latest skip.
        self.scaler_skipped = 0
        self.scaler_skipped_loss = 0  # of them, those whose loss was not finite before it was scaled
        self.scaler_in_a_row = 0
        self.scaler_streak_after = 0
        self.scale: float | None = None
        self.skipped_at_scale: float | None = None  # the scale the latest skipped step ran at
        # Calls of the model with gradients off (evaluations) that returned nan, and of them those
        # whose batch held nan/inf: no step's, never failures.
        self.evaluations_nan = 0
        self.evaluations_from_input = 0
        self._last_step = (False, 0)  # the latest step counted: audited, GradScaler's streak before it
        # Set by the policy: reads the verdicts still on the device (a fused optimizer's
        # found_inf, read a step late) into this ledger; called with whether to wait for them.
        self.unsettled = None

    # -- written by the runners ----------------------------------------------------------------

    def step(self, *, audited: bool, optimizer_step: bool = True) -> int:
        """A step begins its check; returns its 1-based count. ``optimizer_step``: it is an
        optimizer step that runs (GradScaler's skips never call it), not a guarded call (whose
        step GradScaler judges after it)."""
        self.steps += 1
        self.audited += bool(audited)
        self._last_step = (bool(audited), self.scaler_in_a_row)
        if optimizer_step:
            self.scaler_stepped()
        return self.steps

    def skipped_in_kernel(self, scale: float | None, checked_at: float | None = None, *, on_loss: bool = False) -> None:
        """The latest step counted ran a fused optimizer that skipped its update inside its
        kernel (GradScaler handed it ``found_inf``, read a step later): a step GradScaler
        skipped, as it skips any other optimizer's by not calling its step. It is taken off
        the steps that ran, and GradScaler's streak of skips goes on from where it was."""
        audited, in_a_row = self._last_step
        self.steps -= 1
        self.audited -= audited
        self.scaler_in_a_row = in_a_row
        self._last_step = (False, in_a_row)
        self.skipped_by_scaler(scale, checked_at, on_loss=on_loss)

    def skipped_by_scaler(self, scale: float | None, checked_at: float | None = None, *, after: int | None = None,
                          on_loss: bool = False) -> None:
        """GradScaler skipped an optimizer step: its gradients were not finite at the scale
        ``checked_at``, which it lowered to ``scale``; ``after``: the steps that ran before it
        (:attr:`steps` by default); ``on_loss``: its loss was not finite before it was scaled."""
        if not self.scaler_in_a_row:
            self.scaler_streak_after = self.steps if after is None else after
        self.scaler_skipped += 1
        self.scaler_skipped_loss += on_loss
        self.scaler_in_a_row += 1
        self.scale, self.skipped_at_scale = scale, checked_at

    def scaler_stepped(self) -> None:
        """GradScaler let an optimizer step run: its streak of skips ends."""
        self.scaler_in_a_row = 0

    def passed(self, step: int) -> None:
        """``step`` passed its check: the streak of failed steps ends (unless another trigger,
        ``guard_trainer``'s, failed it already)."""
        if self.latest is not None and self.latest.step == step:
            return
        self.failed_in_a_row = 0
        self.first_in_a_row = None

    def fail(self, step: int, parameters: list, cause: str = "gradients", *, loss: str | None = None) -> Failure:
        """``step`` failed; the same step failing twice (two triggers) is one failure."""
        if cause not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES}, got {cause!r}")
        if self.latest is not None and self.latest.step == step:
            return self.latest
        failure = Failure(step, parameters, cause, loss=loss)
        self.failed += 1
        self.latest = failure
        if self.failed <= _KEPT:
            self.failures.append(failure)
        self.failed_in_a_row += 1
        if self.first_in_a_row is None:
            self.first_in_a_row = failure
        return failure

    def decide(self, failure: Failure, action: str) -> None:
        """What was done with ``failure``: ``"skipped"``, ``"applied"`` or ``"raised"``."""
        if failure.action == action:
            return
        if failure.action != "skipped" and action in ("skipped", "raised"):
            self.skipped += 1  # a step that raises before it runs does not run either
        failure.action = action

    def explain(self, failure: Failure | None, origin, *, replayed: bool = False) -> None:
        """A full watch named ``origin`` (an Anomaly) for ``failure`` (or for the run). When no
        op of the step made the values (the origin says they came in with an input made before
        the step), the cause of a failure told as nan/inf in the gradients is ``input``: the
        same as when the batch check named it before the model ran, whichever runner found it."""
        self.replays += bool(replayed)
        if origin is None:
            return
        if all(origin is not kept for kept in self.origins):
            self.origins.append(origin)
        if failure is not None and failure.origin is None:
            failure.origin = origin
            if failure.cause == "gradients" and came_with(origin) == CAME_WITH_INPUT:
                failure.cause = "input"

    # -- read ----------------------------------------------------------------------------------

    def settle(self, *, wait: bool = True) -> None:
        """Take in the verdicts still on the device before the counts are read, so that a read
        holds every step that ran: ``wait``, the run's end, a summary, a saved log and a
        trainer's log wait for the device; a count read during the run (``wait=False``) takes
        those the device has finished (on the CPU, all of them), never a wait."""
        if self.unsettled is not None:
            self.unsettled(wait)

    @property
    def clean(self) -> bool:
        """Whether nothing failed, no evaluation returned nan, GradScaler skipped no step on a
        loss that was not finite, and every op was judged: only then may a summary say "no
        anomalies" alone (settled first)."""
        self.settle()
        return not self.failed and not self.unjudged_end and not self.evaluations_nan and not self.scaler_skipped_loss

    def causes(self) -> dict:
        """How many kept failures had each cause, the first seen first."""
        counts: dict = {}
        for failure in self.failures:
            counts[failure.cause] = counts.get(failure.cause, 0) + 1
        return counts

    def unnamed(self) -> int:
        """The kept failures no full watch named an origin for and no batch explains (cause
        ``gradients`` or ``loss``: a batch that failed once, whose re-check passed)."""
        return sum(failure.origin is None and failure.cause in ("gradients", "loss") for failure in self.failures)

    def stuck(self, limit: int | None) -> bool:
        return limit is not None and self.failed_in_a_row >= limit

    def stuck_in_scaler_skips(self, limit: int | None) -> bool:
        """``limit`` steps in a row skipped by GradScaler, the last at a scale below 1: its
        gradients were not finite unscaled either (or the loss was not), which no scale mends. A
        healthy float16 run skips a few steps in a row while the scale (65536 at first) finds
        its level."""
        at = self.skipped_at_scale
        return limit is not None and self.scaler_in_a_row >= limit and at is not None and at < 1

    def first_origin(self):
        """The origin of the first failure of the streak, else of any failure, else ``None``."""
        if self.first_in_a_row is not None and self.first_in_a_row.origin is not None:
            return self.first_in_a_row.origin
        return next((failure.origin for failure in self.failures if failure.origin is not None), None)

    def counts(self, *, wait: bool = True) -> dict:
        """``steps``, ``audited``, ``failed``, ``skipped``: every count a summary, a metric or a
        log shows (the trainers' ``opwatch/<count>``), settled first (:meth:`settle`)."""
        self.settle(wait=wait)
        return {"steps": self.steps, "audited": self.audited, "failed": self.failed, "skipped": self.skipped}

    def log(self) -> dict:
        """:meth:`counts`, the steps GradScaler skipped, the calls with gradients off that
        returned nan, and :meth:`rows`: what a ``--jsonl`` log keeps of the run (``write_jsonl(guard=)``)."""
        return {**self.counts(), "scaler_skipped": self.scaler_skipped, "scaler_skipped_loss": self.scaler_skipped_loss,
                "evaluations_nan": self.evaluations_nan,
                "failures": self.rows()}

    def rows(self) -> list[dict]:
        """The failures as plain rows (the JSON Lines log and the HTML report), settled first."""
        self.settle()
        rows = []
        for failure in self.failures:
            origin = failure.origin
            rows.append({
                "step": failure.step, "cause": failure.cause, "action": failure.action or "applied",
                "parameters": [list(pair) for pair in failure.parameters[:8]], "loss": failure.loss, "batch": failure.batch, "stage": failure.stage,
                "origin": None if origin is None else {
                    "kind": origin.kind, "op": origin.op, "where": origin.where, "phase": origin.phase, "came_with": came_with(origin),
                    "message": next(iter(origin.message.splitlines()), "")},
            })
        return rows


class LedgerCounts:
    """The counts a runner shows, each read from its ``self.ledger`` (never kept beside it),
    after the verdicts the device has finished are taken in (:meth:`RunLedger.settle`, no wait)."""

    ledger: RunLedger

    @property
    def _read(self) -> RunLedger:
        self.ledger.settle(wait=False)
        return self.ledger

    @property
    def steps(self) -> int:
        """Optimizer steps called (GradScaler's skipped ones never call it)."""
        return self._read.steps

    @property
    def audited(self) -> int:
        """Of them, run under the full watch."""
        return self._read.audited

    @property
    def failed(self) -> int:
        """Of them, failed: nan/inf in the gradients about to be applied, a loss not finite, weights already bad, a bad batch."""
        return self._read.failed

    @property
    def skipped(self) -> int:
        """Of the failed ones, not run (``on_failure`` ``"skip"`` or ``"raise"``)."""
        return self._read.skipped

    @property
    def failures(self) -> list:
        """The failed steps (:class:`Failure`: step, parameters, cause, origin, action)."""
        return self._read.failures

    @property
    def origins(self) -> list:
        """The nan/inf origins full watches named (audits, re-checks, replays), as Anomaly objects."""
        return self._read.origins

    @property
    def poisoned_since(self) -> int | None:
        """The step after which the weights held nan/inf, or ``None``."""
        return self._read.poisoned_since

    @property
    def scaler_skipped(self) -> int:
        """Optimizer steps GradScaler skipped (an overflow in the scaled gradients): not
        counted in :attr:`steps`; a few now and then are GradScaler at work."""
        return self._read.scaler_skipped

    @property
    def evaluations_nan(self) -> int:
        """Calls of the model with gradients off (evaluations) that returned nan: never failed
        steps (no gradient holds them), told as warnings."""
        return self._read.evaluations_nan

    @property
    def unjudged_end(self) -> bool:
        """The run ended with ops that nothing checked."""
        return self._read.unjudged_end
