"""A guarded call (``opwatch.guard``: a call wrapper), the policy's side of that trigger, mixed
into :class:`~opwatch.runners.policy.StepPolicy`: a call that raised or failed its check is
judged from its audit or a replay under a full watch, the model left as the docs say, and the
call raises, skips or applies."""

from __future__ import annotations

import warnings

from ...findings.anomaly import AnomalyError, OpwatchWarning, add_note
from ...findings.ranks import RankAnomaly
from ...render import guard as guard_words
from ...render import leave_on as words
from ..guarded.replay import NONFINITE as NONFINITE_KINDS, Replayed, ReproNote, StepContext, explaining, record_at
from ..guarded.snapshot import put_buffers
from .outcomes import RunStuck, warn, warn_at

__all__ = ["GuardedCalls"]


class GuardedCalls:
    """The policy's side of a call wrapper (mixed into :class:`StepPolicy`): a guarded call
    (``Guarded``) that raised or failed its check is handed to :meth:`failed_call`, which
    judges it from its audit or a replay under a full watch, leaves the model as the docs say
    and raises, skips or applies. The call wrapper answers, for the policy: its step and
    options (``_step``, ``_checks``, ``_allow``, ``_repro``...), ``_snapshots`` (what the call
    started from), ``calls``, ``_name()``, ``_parameter_names()``, its refusals and notes, and
    keeps ``failures``, ``last_replay`` and ``last_verdict`` for its user.

    """

    def returned_here_only(self, guarded) -> bool:
        """DDP, a call whose check failed on this rank: whether the reduced gradients (the same
        on every rank) are finite, so that only what this rank returned is not: then it is told
        here, and every rank goes on alike (decided from what they share)."""
        if not self.verdict.returned.all_finite(None, guarded._snapshots.params):
            return False
        warnings.warn(OpwatchWarning(guard_words.returned_here_only(guarded.calls, guarded._name(), self.rank)), stacklevel=4)
        return True

    def raised_shared(self, guarded, error) -> None:
        """DDP, a call that raised on this rank: no flag to meet (the ranks meet none on a healthy
        call); its gradients dropped, its error re-raised with a note saying so."""
        guarded._snapshots.drop_grads()
        add_note(error, guard_words.raised_here_shared_note(self.rank, self._agreement.world))
        raise error

    def scaler_verdict(self, guarded) -> bool:
        """At a guarded call's start, with ``scaler=``: what GradScaler did with the latest
        call's gradients (:class:`~opwatch.runners.guarded.scaler.ScalerSteps`). A step it
        skipped is counted; one it let run ends the streak. Returns whether the run is stuck
        (:meth:`stuck_in_scaler_skips`): then this call runs under a full watch, which names the
        op before :meth:`stuck_after_call` stops the run."""
        steps = guarded._scaler_steps
        if steps is None:
            return False
        skipped, stepped = steps.since_last_call()
        if skipped is None:
            if stepped:
                self.ledger.scaler_stepped()
            return False
        modules = () if guarded._model is None else (guarded._model,)
        return self.scaler_skipped(steps.scaler, skipped, modules=modules, after=guarded.calls - 1)

    def stuck_after_call(self, audit) -> None:
        """Stop a run GradScaler skips for good, after the call ``audit`` watched: its first
        nan/inf origin named, its message in the error's note (the audit's findings judged now:
        no check of the guard's judges its scaled gradients)."""
        audit.check()
        origin = next((anomaly for anomaly in audit.anomalies if anomaly.kind in NONFINITE_KINDS), None)
        try:
            self.stuck_in_scaler_skips(origin=origin)
        except RunStuck as stuck:
            if origin is not None:
                add_note(stuck, origin.message)  # its problem, cause and fix, as an AnomalyError shows them
            raise

    def failed_call(self, guarded, start, args, kwargs, failure, *, error=None, audit=None, result=None):
        """Judge the step (from its audit, or a replay), leave the model as the docs say, raise
        (or skip, or apply), and keep the facts in :attr:`ledger`. ``failure``: what went wrong
        (facts); ``error``: the step's exception; ``result``: what the step returned (kept for
        ``on_failure="apply"``)."""
        fact = self.ledger.fail(guarded.calls, [], "raised" if error is not None else "gradients")
        try:
            result = self._judged(guarded, start, args, kwargs, failure, error=error, audit=audit, result=result)
        except BaseException:
            self.ledger.decide(fact, "raised")
            raise
        self.ledger.decide(fact, "skipped" if self.on_failure == "skip" else "applied")
        self.stop_when_stuck(fact)
        return result

    def _judged(self, guarded, start, args, kwargs, failure, *, error=None, audit=None, result=None):
        snapshots = guarded._snapshots
        name = guarded._name()
        if error is None and not snapshots.changed_parameters(start) and self._weights_poisoned(guarded, name):
            return self._after_poisoned(guarded, start, result)
        # In a distributed job a failing step is always replayed, never judged from its audit:
        # every rank then runs the step's collectives again, whether its call was audited or not.
        found = audit is not None and error is None and self._agreement is None and any(anomaly.kind in NONFINITE_KINDS for anomaly in audit.anomalies)
        after = None
        ranks = first_made = None
        if found:
            replay = None
            guarded.last_replay = audit
            anomaly = explaining(audit.anomalies, None, None, None)
            repro, note, context = None, ReproNote("audit"), StepContext(name, failure, None, True)
        else:
            if snapshots.changed_parameters(start):
                guarded._refuse_changed_parameters(start, error=error)
            guarded._refuse_changed_arguments(start, failure, error)
            after = snapshots.buffers_now()  # the buffers as this run of the step left them
            snapshots.restore(start)
            replay, (anomaly, repro, note) = guarded.replayed(args, kwargs, error)
            guarded.last_verdict = guarded._compiled_verdict(replay, anomaly, error, start, args, kwargs)
            context = StepContext(name, failure, len(start.buffers), False)
            if self._agreement is not None and error is None:  # a step that raised replays on its rank alone
                ranks, first_made = self._origins(guarded, replay)
        # Steps that raise always raise; "skip" and "apply" are for steps that made nan/inf.
        go_on = None if error is not None or self.on_failure == "raise" else self.on_failure
        # The optimizer never sees this step's gradients (unless on_failure="apply": those of
        # the replay, a second run of the step from its start); the buffers are as one run left
        # them, or as they were before it when the step is skipped.
        if go_on != "apply":
            self._drop_grads(guarded, skipped=go_on == "skip")
        if go_on == "skip":
            snapshots.put_start_buffers(start)
        elif after is not None:
            put_buffers(*after)
        if go_on == "apply":
            guarded._applied_at = guarded.calls
        if anomaly is None:
            if ranks is not None and ranks.origin is not None and ranks.origin.rank != ranks.rank and replay.error is None:
                problem = self._made_elsewhere(guarded, ranks, first_made, failure, len(start.buffers))
            else:
                problem = self._not_found(guarded, replay, error, failure, len(start.buffers), repro)
            if go_on is not None and replay.error is None:
                warnings.warn(OpwatchWarning(guard_words.skipped_unexplained(str(problem), go_on)), stacklevel=3)
                return result
            raise problem
        return self._report(guarded, Replayed(anomaly, step=guarded.calls, context=context, repro=repro, repro_note=note, ranks=ranks), go_on, error,
                            audit.records if found else None, result)

    @staticmethod
    def _drop_grads(guarded, *, skipped: bool) -> None:
        """A failed call's gradients, kept from the optimizer: dropped (``None``), or for a
        skipped call under an enabled GradScaler, left to it filled with nan (it skips the
        update; with no ``.grad`` at all its ``step()`` would fail)."""
        steps = guarded._scaler_steps
        if not (skipped and steps is not None and steps.leave_to_scaler(guarded._snapshots.params)):
            guarded._snapshots.drop_grads()

    def _origins(self, guarded, replay):
        """``(RankOrigin, the first origin's row)``: every rank's replay findings exchanged
        (bounded, the policy's exchange)."""
        return self.exchange(guarded.calls, list(replay.watch.anomalies))

    def _made_elsewhere(self, guarded, ranks, first, failure, buffers):
        """The error of a rank whose replay found no origin while another rank made it: an
        :class:`~opwatch.AnomalyError` whose anomaly is that rank's (``.rank``, ``.op``, ``.lineno``)."""
        text = guard_words.failed_elsewhere(guarded.calls, guarded._name(), failure, buffers, ranks)
        return AnomalyError(RankAnomaly(**{**first.fields(), "message": text}, rank=first.rank))

    def _weights_poisoned(self, guarded, name) -> bool:
        """Whether the parameters hold nan/inf themselves (the policy's one check, read only
        after a failed check): then no op of this step is the origin, and a replay would name
        the first that reads them. Told once; ``on_failure="raise"`` raises."""
        if self.ledger.poisoned_since is not None:
            self.ledger.latest.cause = "weights"
            return True
        names = guarded._parameter_names()
        named = [(names.get(id(param)) or f"parameter {position}", param) for position, param in enumerate(guarded._snapshots.params)]
        bad = self.poisoned(named, guarded.calls, name)
        if bad is None:
            return False
        self.ledger.latest.cause = "weights"
        shown = words.parameters(bad) if bad else guard_words.poisoned_elsewhere()
        by_program = guarded._applied_at is None and self.by_program(named, bad)
        text = guard_words.poisoned_weights(guarded.calls, name, guarded._applied_at, shown, self.on_failure, by_program=by_program)
        if self.on_failure == "raise":
            raise RuntimeError(text)
        warn(text)  # at the user's line that called the guarded step
        return True

    def _after_poisoned(self, guarded, start, result):
        """A failing step with poisoned weights: skipped (``.grad`` and buffers as they were)
        or applied, counted, not replayed."""
        if self.on_failure == "skip":
            self._drop_grads(guarded, skipped=True)
            guarded._snapshots.put_start_buffers(start)
        return result

    def _report(self, guarded, replayed, go_on, error, records, result=None):
        guarded.failures.append(replayed)
        self.ledger.explain(self.ledger.latest, replayed, replayed=records is None)
        if go_on is not None:
            key = (replayed.kind, replayed.filename, replayed.lineno)
            if key not in guarded._warned:
                guarded._warned.add(key)
                warn_at(OpwatchWarning(guard_words.skipped_step(replayed.message, go_on)), replayed)
            return result
        raised = AnomalyError(replayed)
        audited = records is not None
        note = guarded._ops_note(records if audited else guarded.last_replay.records, replayed.record, audited)
        if note:
            raised.add_note(note)
        if not audited and guarded.last_verdict is not None:
            raised.add_note(guard_words.compiled_verdict(guarded.last_verdict))
        if error is not None:
            raise raised from error
        raise raised

    def _not_found(self, guarded, replay, error, failure, buffers, repro) -> BaseException:
        """What to raise when the replay found no anomaly that explains the failure."""
        allowed = list(getattr(replay.watch, "allowed", ()))
        if error is not None:
            failed = record_at(replay.watch, replay.raised_at) if replay.error is not None else None
            add_note(error, guard_words.replay_raised_note(
                guarded.calls, guarded._name(), buffers, again=type(replay.error) is type(error), original=type(error).__name__,
                replay_raised=None if replay.error is None else type(replay.error).__name__, allowed=len(allowed),
                failed_record=failed, repro=repro,
            ))
            return error
        if replay.error is not None:
            mismatch = RuntimeError(guard_words.replay_raised_instead(guarded.calls, guarded._name(), failure, type(replay.error).__name__))
            mismatch.__cause__ = replay.error
            return mismatch
        if guarded.last_verdict is not None and not guarded.last_verdict.eager_fails:
            return RuntimeError(guard_words.only_compiled(guarded.calls, guarded._name(), failure, buffers, guarded.last_verdict))
        allowed_nonfinite = [anomaly for anomaly in allowed if anomaly.kind in NONFINITE_KINDS]
        if allowed_nonfinite:
            return RuntimeError(guard_words.only_allowed(guarded.calls, guarded._name(), failure, buffers, len(allowed_nonfinite), allowed_nonfinite[0].message))
        return RuntimeError(guard_words.nothing_found(guarded.calls, guarded._name(), failure, buffers, len(allowed)))
