"""One step policy for every runner: how a step is decided, whatever triggered its check.

``opwatch.guard`` (a call wrapper), ``python -m opwatch --guard`` and the trainers' guard modes
(optimizer hooks, trainer callbacks: :class:`~opwatch.runners.leave_on.LeaveOn`) differ only in
their trigger. Each hands the facts of a step to one :class:`StepPolicy`, which decides it in
one order and records every fact in the run's :class:`~opwatch.runners.ledger.RunLedger`:

1. the verdict (:class:`StepVerdict`, the one seam that answers "is this step's update finite,
   and which parameters are bad" from the step's facts: gradients and the loss ``backward()``
   ran on, one fused read);
2. in a job of several ranks, the agreement (:meth:`StepPolicy.agree`: every rank decides the
   step together, one all-reduce), and after a full watch the exchange of what each rank found;
3. the weights already bad? (:meth:`StepPolicy.poisoned`: the one poisoned-weights check, and
   :class:`ProgramWrites`: whether the program wrote them, not an optimizer step);
4. the replay or the audit that names the origin (the trigger runs it: only it knows how to
   run its step again);
5. skip, raise or apply (:meth:`StepPolicy.act`), and stop when stuck
   (:meth:`StepPolicy.stop_when_stuck`: :class:`RunStuck` after ``max_failed_in_a_row``
   failed steps in a row).

The decisions every trigger shares are here (:class:`StepPolicy`); each side a trigger brings
is a module of its own, mixed into it: :mod:`.steps` (an optimizer step: leave-on and the
trainers), :mod:`.late` (a fused optimizer's verdict, read a step late or when the counts are
read), :mod:`.calls` (a guarded call: ``opwatch.guard``); :mod:`.verdict` holds the verdict seam
and :mod:`.outcomes` what a decided step tells (its errors, its warnings, an origin's facts);
:mod:`.turns` and :mod:`.optimizers` which later steps a full watch sees (a failure's next turn,
each optimizer's own path).
"""

from __future__ import annotations

from ...core.compat import no_python_dispatch
from ..guarded.check import on_failure_option
from ..guarded.ranks import Agreement, Decision, RankOrigin
from ..ledger import MAX_FAILED_IN_A_ROW, Failure, RunLedger
from ..step_verdict import FoundInfHandOff
from ...render import leave_on as words
from .calls import GuardedCalls
from .late import LateVerdicts
from .outcomes import GradientsNotFinite, RunStuck, elsewhere_anomaly, max_failed_option, origin_facts, warn_at
from .steps import OptimizerSteps
from .optimizers import OptimizerAudits
from .turns import FailureTurns
from .verdict import ProgramWrites, StepVerdict, nonfinite_of

__all__ = ["StepPolicy", "StepVerdict", "ProgramWrites", "GradientsNotFinite", "RunStuck", "nonfinite_of", "origin_facts",
           "max_failed_option", "elsewhere_anomaly", "warn_at"]


class StepPolicy(OptimizerSteps, LateVerdicts, GuardedCalls):
    """Decides a failed step the same way for every runner and keeps its facts in :attr:`ledger`.

    ``on_failure``: ``"skip"``, ``"raise"`` or ``"apply"``; ``max_failed_in_a_row``: the streak
    of failed steps after which :class:`RunStuck` is raised (``None``: never)."""

    def __init__(self, *, on_failure: str, max_failed_in_a_row: int | None = MAX_FAILED_IN_A_ROW, scaler=None, unit: str = "optimizer steps"):
        self.on_failure = on_failure_option(on_failure, "raise")
        self.max_failed_in_a_row = max_failed_option(max_failed_in_a_row)
        self.ledger = RunLedger()
        self.verdict = StepVerdict(scaler)
        self.unit = unit  # what a step is, in the stuck message: "optimizer steps", "guarded calls"
        self.command_line = False  # the stuck message names --max-failed-steps, not the keyword
        self.writes = ProgramWrites()
        self.hand_off = FoundInfHandOff()  # a fused optimizer's found_inf, read at its next step
        self.audit_next = False  # a failure told late: the step after the running one is watched fully
        self._held: BaseException | None = None  # what a read of the counts found to raise, raised at the next check
        self.ledger.unsettled = self.settle
        self._agreement: Agreement | None = None
        self._job_read = False
        # The optimizer-step triggers' state (leave-on): the failed step the running audit
        # re-checks, and the line of the program that stepped it (core.sites.UserLine: a run
        # that ends before the re-check is told there); the step a trainer replayed; in a job,
        # the step every rank watched (audit or replay); the origin told at the latest failure
        # (in a job, maybe another rank's).
        self.recheck_of: int | None = None
        self._recheck_line = None
        self._replayed_at: int | None = None
        self._watched_all_at: int | None = None
        self._decided_origin = None
        self._same_backward = False  # the step being decided applies the gradients the step before did
        self.turns = FailureTurns()  # a failure that recurs every k steps: its next turn watched fully
        self._turn: tuple[int, int] | None = None  # (the failed step before, the interval) of the turn being watched
        self.optimizer_audits = OptimizerAudits()  # each optimizer's path audited, not only the first's
        # The GradScaler streak a full watch was started for (its first step's count), and the
        # skips in a row then: the run stops once that watch saw a whole skipped step.
        self._stuck_watched: int | None = None
        self._stuck_watched_from = 0
        self._scaler_loss_told: int | None = None  # the streak of GradScaler's skips whose non-finite loss was told
        self.told_evaluations: set = set()  # (kind, line, from the batch) of the evaluations told
        # The trigger's runners.written_buffers.WrittenBuffers (leave-on and the trainers), or None
        # (opwatch.guard restores a failing call's buffers from its own start): put back when a
        # step does not run, so that its forward's BatchNorm statistics go with its update.
        self.buffers = None

    # -- ranks ----------------------------------------------------------------------------------

    @property
    def agreement(self) -> Agreement | None:
        """The agreement of this run in a job of 2 or more ranks, else ``None`` (read once, at
        the first step: the job is set up by then)."""
        if not self._job_read:
            self._job_read = True
            with no_python_dispatch():  # the flag's group is made at the first step, maybe in an audit
                self._agreement = Agreement.start()
        return self._agreement

    def agree(self, code: int, step, name: str = "", waited: str = "flag") -> Decision | None:
        """Every rank's slot of this step's decision (bounded: ``NoAnswer``), or ``None`` alone."""
        agreement = self.agreement
        if agreement is None:
            return None
        with no_python_dispatch():
            return agreement.decide(code, step, name, waited)

    def agreed(self, flag: bool, step, name: str = "", waited: str = "flag") -> bool:
        """``flag`` on any rank (a shard may hold what fails on one rank only)."""
        agreement = self.agreement
        if agreement is None:
            return flag
        with no_python_dispatch():
            return agreement.failed(flag, step, name, waited)

    def exchange(self, key, found: list):
        """Publish this rank's nan/inf findings of a watched (or replayed) failing step and read
        the others' (bounded): ``(RankOrigin, the first origin's row or None)``; an exchange that
        fails names every other rank as missing."""
        agreement = self.agreement
        anomalies = [anomaly for anomaly in found if anomaly.kind in ("nan", "inf") and getattr(anomaly, "record", None) is not None]
        try:
            return agreement.origins(key, anomalies)
        except Exception:
            others = tuple(rank for rank in range(agreement.world) if rank != agreement.rank)
            return RankOrigin(agreement.rank, None, others, agreement.wait_s), None

    @property
    def rank(self) -> int | None:
        return None if self._agreement is None else self._agreement.rank

    def join(self, agreement: Agreement | None) -> None:
        """Use ``agreement`` (read by the trigger at its first step) from now on."""
        self._agreement, self._job_read = agreement, True

    @property
    def joined(self) -> Agreement | None:
        """The agreement if the job was read already (never starts one)."""
        return self._agreement

    # -- the weights ----------------------------------------------------------------------------

    def poisoned(self, named, step: int, name: str = "", *, since: int | None = None) -> list | None:
        """The one poisoned-weights check, read after a failed verdict: ``(name, kind)`` of each
        parameter of ``named`` (``(name, parameter)`` pairs) that holds nan/inf itself (``[]``
        when only another rank's do), or ``None`` when the weights are finite on every rank.
        Poisoned weights make every op that reads them look like an origin: no step is
        replayed or watched fully again (:attr:`RunLedger.poisoned_since`: ``since``, by
        default the step before ``step``)."""
        named = list(named)
        bad = nonfinite_of(named, lambda parameter: parameter)
        if not self.agreed(bool(bad), step, name, "poisoned"):
            return None
        self.ledger.poisoned_since = step - 1 if since is None else since
        return bad

    def by_program(self, named, bad) -> bool:
        """Whether the parameters named in ``bad`` were written by the program, not an optimizer step."""
        names = {name for name, _ in bad}
        return bool(names) and self.writes.by_program([parameter for name, parameter in named if name in names])

    # -- what is done ---------------------------------------------------------------------------

    def act(self, failure: Failure) -> bool:
        """Skip or apply ``failure`` as ``on_failure`` says (``"raise"`` skips it: its trigger
        raises); returns whether the step does not run."""
        if self.on_failure == "apply":
            self.ledger.decide(failure, "applied")
            return False
        self.ledger.decide(failure, "skipped")
        self._put_back_buffers()
        return True

    def _put_back_buffers(self) -> None:
        if self.buffers is not None:
            self.buffers.put_back()

    def raised(self, failure: Failure, error: BaseException) -> BaseException:
        """``failure`` raises ``error`` (returned, for ``raise policy.raised(...)``): its step
        does not run, and the buffers its forward wrote are put back too."""
        self.ledger.decide(failure, "raised")
        self._put_back_buffers()
        return error

    def stop_when_stuck(self, failure: Failure, trigger=None) -> None:
        """Raise :class:`RunStuck` once ``max_failed_in_a_row`` steps in a row failed."""
        ledger = self.ledger
        if not ledger.stuck(self.max_failed_in_a_row):
            return
        first = ledger.first_in_a_row
        if trigger is not None:
            self.stop_rechecking(trigger)
        text = words.stuck(first.step, failure.step, ledger.failed_in_a_row, first.parameters, origin_facts(ledger.first_origin()),
                           poisoned_since=ledger.poisoned_since, loss=first.loss, limit=self.max_failed_in_a_row,
                           applied=self.on_failure == "apply", unit=self.unit,
                           command_line=self.command_line, cause=first.cause)
        raise self.raised(failure, RunStuck(text, step=first.step, parameters=first.parameters, failed_in_a_row=ledger.failed_in_a_row))
