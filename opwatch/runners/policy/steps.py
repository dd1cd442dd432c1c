"""An optimizer step (leave-on: torch's optimizer hooks and the trainers' callbacks), the
policy's side of those triggers, mixed into :class:`~opwatch.runners.policy.StepPolicy`: the
check before each update, the full watch that names a failure's origin (the audit, a
replay, the re-check of the next step), and the run's end."""

from __future__ import annotations

import weakref

import torch

from ...core.sites import user_line
from ...findings.anomaly import AnomalyError, OpwatchWarning
from ...render import guard as guard_words
from ...render import leave_on as words
from ..batches import FedInput
from ..guarded.ranks import BAD_INPUT, NONFINITE, WATCHED
from ..ledger import CAME_WITH_INPUT, LeftUnjudged, came_with
from ..step_verdict import shared_gradients, trained
from .outcomes import GradientsNotFinite, RunStuck, elsewhere_anomaly, origin_facts, warn, warn_at

__all__ = ["OptimizerSteps"]

_TOLD_FAILURES = 3  # failures warned (and re-checked) one by one; later ones are counted


def _scales_of(scaler) -> tuple:
    """GradScaler's scale after a skip and the scale the skipped step ran at (its scale over its
    backoff factor), one host read; ``(None, None)`` when they cannot be read."""
    try:
        scale = float(scaler.get_scale())
        return scale, scale / float(scaler.get_backoff_factor())
    except Exception:
        return None, None


def _stage(batches, called: str | None, loss: str | None, gradients_bad: bool) -> str | None:
    """Where a failure no full watch saw began, from what the step computed (``batches``: the
    trigger's :class:`~opwatch.runners.batches.FedBatches`, whose model was fed a finite batch,
    if it was called: ``called``, :meth:`~opwatch.runners.batches.FedBatches.called`): ``"model"``, its forward made them (what the model returned held them);
    with the loss ``backward()`` ran on not finite (``loss``: its kind, else ``None``),
    ``"after_model"`` when the model returned finite values, ``"forward_or_loss"`` when what it
    returned is not known; ``"backward"``, the loss was finite and the gradients are not
    (``gradients_bad``: on a process alone, with a loss kept; in a job the reduced gradients
    hold what any rank made). ``None`` when none is known."""
    output = None if called is None else batches.output_kind()
    if output not in (None, "finite"):
        return "model"
    if loss is not None and called is not None:
        return "after_model" if output == "finite" else "forward_or_loss"
    return "backward" if loss is None and gradients_bad else None


def _audit_at_next_forward(trigger) -> None:
    """Start ``trigger``'s audit when the next module's forward begins (the step's, from its start)."""
    handle = None

    def start(module, args):
        handle.remove()
        trigger.start_audit()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(start)


class OptimizerSteps:
    """The policy's side of a trigger that sees optimizer steps (mixed into :class:`StepPolicy`).

    The trigger (``LeaveOn``) hands each step's facts to :meth:`check_step` before the update and
    calls :meth:`step_done` after it; it answers, for the policy: ``auditing``,
    ``start_audit()``, ``end_audit()``, ``audit_origin()`` (the first nan/inf origin the running
    audit found), ``replay`` (``None`` or a callable that runs the batch again under a full
    watch: ``(ran, origin)``), ``compiled_verdict``, ``bad_input()`` (the
    :class:`~opwatch.runners.batches.FedInput` of a batch that held nan/inf when it entered the
    model, or ``None``), ``batches`` (its :class:`~opwatch.runners.batches.FedBatches`: what the
    model returned) and ``rerun``."""

    def scaler_skipped(self, scaler, optimizer=None, *, modules=(), after: int | None = None, in_kernel: bool = False,
                       loss: str | None = None) -> bool:
        """GradScaler ``scaler`` skipped ``optimizer``'s step (seen at the next backward, at the
        next guarded call, or at the run's end; ``None``: none was skipped): count it
        (``after``: the steps that ran before it, the ledger's count by default; ``in_kernel``:
        a fused optimizer's step that ran, counted, and skipped inside its kernel; ``loss``:
        ``"nan"`` or ``"inf"`` when the step's loss was not finite before it was scaled,
        :meth:`tell_scaler_skipped_loss`). Returns
        whether the run is stuck now: ``max_failed_in_a_row`` skipped in a row, the last at a
        scale below 1 (read on a skipped step only), where every rank skips alike (then the
        trigger calls :meth:`stuck_in_scaler_skips`)."""
        if scaler is None:
            return False
        ledger = self.ledger
        if in_kernel:
            ledger.skipped_in_kernel(*_scales_of(scaler), on_loss=loss is not None)
        else:
            ledger.skipped_by_scaler(*_scales_of(scaler), after=after, on_loss=loss is not None)
        return ledger.stuck_in_scaler_skips(self.max_failed_in_a_row) and self._skips_alike(scaler, optimizer, modules)

    def scaler_loss_of_the_job(self, kind: str | None, skips: list, modules=()) -> str | None:
        """Whether the loss of the step GradScaler skipped was not finite before it was scaled
        on any rank (``kind``: this rank's, :meth:`StepVerdict.loss_kind`, ``scaled``; ``skips``:
        the :class:`~opwatch.runners.step_verdict.ScalerSkip` of that step): in a job whose ranks
        skip alike (DDP's reduced gradients: every rank is here at the same backward), one
        all-reduce at a skipped step only, so that every rank counts it alike and the summary
        printed once speaks for the job; ``"nan/inf"`` where only another rank's was."""
        if self.agreement is None or not skips or not all(self._skips_alike(skip.scaler, skip.optimizer, modules) for skip in skips):
            return kind
        decision = self.agree(NONFINITE if kind is not None else 0, self.ledger.steps, "", "scaler_loss")
        return kind if kind is not None else "nan/inf" if decision.nonfinite else None

    def tell_scaler_skipped_loss(self, kind: str, batches, *, rerun: str | None = None) -> None:
        """GradScaler skipped a step whose loss held ``kind`` before it was scaled (the trigger
        read it: :meth:`StepVerdict.loss_kind`, ``scaled``): no overflow, and none of GradScaler's
        scales mends it. Told at the first such skip of a streak of skips, with the batch when
        it held nan/inf (``batches``: the trigger's :class:`~opwatch.runners.batches.FedBatches`,
        read now), else the command that names the op (``rerun``), by the ranks whose loss it
        was; the summary counts them."""
        ledger = self.ledger
        if self._scaler_loss_told == ledger.scaler_streak_after:
            return
        self._scaler_loss_told = ledger.scaler_streak_after
        fed = batches.bad_input() if batches.watching else None
        text = words.scaler_skipped_loss(ledger.scaler_streak_after, ledger.scaler_in_a_row, kind, fed, batch_finite=batches.watching and fed is None,
                                         rerun=rerun if fed is None else None, rank=self.rank)
        warn(text)

    def stop_stuck_in_scaler_skips(self, trigger, *, rerun: str | None = None) -> None:
        """A run GradScaler skips for good (:meth:`scaler_skipped` said so), stopped with the op a
        full watch of its skipped steps names (no optimizer step came to judge them, so the
        watch is judged now). With no audit running, one starts at the model's next forward
        (a module's: a one-time global pre-hook) and the run is stopped at the backward after
        it, once the audit watched that whole skipped step; with the weights poisoned, at once."""
        ledger = self.ledger
        streak = ledger.scaler_streak_after
        if not trigger.auditing and self._stuck_watched != streak and ledger.poisoned_since is None:
            self._stuck_watched, self._stuck_watched_from = streak, ledger.scaler_in_a_row
            _audit_at_next_forward(trigger)
            return
        if self._stuck_watched == streak and ledger.scaler_in_a_row < self._stuck_watched_from + 2:
            return
        if trigger.auditing:
            trigger.watch.check()
        # the last skipped step's (it ran under the watch from its start; a trainer's audit ends with its batch)
        origin = trigger.audit_origin(last=True) if trigger.auditing or self._stuck_watched == streak else None
        self.stuck_in_scaler_skips(rerun=rerun, origin=origin)

    def stuck_in_scaler_skips(self, *, rerun: str | None = None, origin=None):
        """Raise :class:`RunStuck` for a run GradScaler skips for good; ``origin``: the nan/inf
        origin a full watch of those steps named, or ``None``."""
        ledger = self.ledger
        text = words.stuck_in_scaler_skips(ledger.scaler_streak_after, ledger.scaler_in_a_row, ledger.scale, rerun=rerun,
                                           limit=self.max_failed_in_a_row, command_line=self.command_line,
                                           origin=origin_facts(origin), unit=self.unit)
        raise RunStuck(text, step=ledger.scaler_streak_after + 1, parameters=[], failed_in_a_row=ledger.scaler_in_a_row)

    def evaluations_of_the_job(self, every_rank) -> int:
        """The calls with gradients off that returned nan: this rank's, and where it prints the
        job's combined summary (``every_rank``: the job's anomalies, from every rank) the other
        ranks' too, which each checked and told on its own (steps are decided together; the
        evaluations are not)."""
        count, agreement = self.ledger.evaluations_nan, self.joined
        if every_rank is None or agreement is None or every_rank.missing:
            return count
        return count + agreement.evaluations_elsewhere()

    def evaluations_read(self, evaluations, rerun: str | None = None) -> None:
        """The calls with gradients off since the last read (``evaluations``: the trigger's
        :class:`~opwatch.runners.evaluations.EvaluationCalls`), read now (at an optimizer
        step's check or the run's end): each that returned nan is counted and told, once per
        line and cause, on this rank alone; never a failed step (no gradient holds it)."""
        if not evaluations.pending:
            return
        ledger = self.ledger
        for told in evaluations.read():
            ledger.evaluations_nan += 1
            ledger.evaluations_from_input += told.argument is not None
            since = ledger.poisoned_since
            poisoned = since if since is not None and told.argument is None and told.after_step >= since else None
            key = ("evaluation", told.where, told.argument is not None, poisoned is not None)
            if key not in self.told_evaluations:
                self.told_evaluations.add(key)
                text = words.evaluation_nan(told, rerun=rerun, rank=self.rank, poisoned_since=poisoned)
                warn_at(OpwatchWarning(text), told)  # at the evaluation's line

    def _skips_alike(self, scaler, optimizer, modules) -> bool:
        """Whether every rank's GradScaler skips the same steps: a process on its own, DDP's
        reduced gradients, FSDP2's ShardedGradScaler (it reduces its flag across the ranks).
        Ranks with their own gradients may not: one raising alone would leave the others
        waiting in their next collective."""
        if self.agreement is None or type(scaler).__name__ == "ShardedGradScaler":
            return True
        return optimizer is not None and shared_gradients(trained(optimizer), modules)

    def told(self) -> bool:
        """Whether the newest failure is one of those warned and re-checked one by one."""
        return len(self.ledger.failures) <= _TOLD_FAILURES

    def stop_rechecking(self, trigger) -> None:
        self.recheck_of = None
        trigger.end_audit()

    def check_step(self, step: int, named, gradients: list, losses: list, trigger, *, optimizer=None, modules=(),
                   fresh: bool = True) -> bool:
        """Decide optimizer step ``step`` (``named()``: its parameters, ``(name, parameter)``,
        made only for a failed step;
        the ``gradients`` it is about to apply, the ``losses`` ``backward()`` ran on since the
        last step; ``optimizer``: the one stepping; ``modules``: the models the run saw, whose
        DDP wrappers make the gradients the same on every rank; ``fresh``: a backward or the
        model ran since the last optimizer step, whose batch this step is not); returns whether
        the step must not run."""
        ledger = self.ledger
        self._same_backward = not fresh
        if self._held is not None:
            self.raise_held(trigger)  # a late failure a read of the counts took in, raised at this check
        recheck = self.recheck_of
        if optimizer is not None and self.hands_over(optimizer, trigger):
            self.told_late(optimizer, step, trigger)  # the step before, whose flag the device has set by now
            self.hand_over(optimizer, gradients, losses, step)  # passed or failed when its flag is read
            return False
        finite = self.verdict.finite(gradients, losses, optimizer)
        if finite and recheck is None and self.agreement is None:  # a healthy step of a process on its own
            ledger.passed(step)
            return False
        # What every rank shares: DDP's reduced gradients, or FSDP2's clip norm reduced across
        # the ranks (the clip's own all-reduce): their verdict is the same on every rank.
        shared = optimizer is not None and self.agreement is not None and (
            self.verdict.from_step.shared or shared_gradients(trained(optimizer), modules))
        if shared and not finite and self.verdict.gradients_finite(gradients, optimizer):
            # The shared gradients are finite on every rank, this rank's loss is not: told
            # here, and every rank applies the step alike (decided from what they share).
            warn(words.loss_here_only(step, self.verdict.loss_kind(losses), self.rank))
            finite = True
        # What the step fed the model, read only when it failed outside an audit (an audit's
        # watch judges the batch itself). In a job, what it held goes to the store before the
        # flag, which tells every rank whose batch held nan/inf.
        own_input = None if finite or trigger.auditing else trigger.bad_input()
        if own_input is not None and self.agreement is not None:
            self.agreement.publish_input(step, own_input.facts())
        # Every rank decides the step together (bounded: NoAnswer); with DDP's reduced
        # gradients every rank's verdict is the same, and only a failure asks which rank.
        code = (0 if finite else NONFINITE) | (WATCHED if trigger.auditing else 0) | (BAD_INPUT if own_input is not None else 0)
        decision = None if shared and finite else self.agree(code, step, "", "gradients")
        if decision is not None:
            finite = not decision.failed
        if finite and recheck is not None and fresh and self.on_failure == "raise":
            failed = ledger.latest
            self.stop_rechecking(trigger)
            raise GradientsNotFinite(words.did_not_recur(failed.step, step, failed.parameters, loss=failed.loss, stage=failed.stage,
                                                         rerun=trigger.rerun),
                                     step=failed.step, parameters=failed.parameters)
        if finite:
            ledger.passed(step)
            return False
        named = named()
        bad = self.verdict.bad_gradients(named)
        loss = None if bad else self.verdict.loss_kind(losses)
        elsewhere = () if decision is None or bad else decision.nonfinite
        before = ledger.latest
        failure = ledger.fail(step, bad, "loss" if loss is not None and not elsewhere else "gradients", loss=loss)
        if failure.action:  # another trigger (guard_trainer's step) failed this step and told it already
            return failure.action != "applied"
        if ledger.poisoned_since is not None:  # told once; every later step fails: only counted
            failure.cause = "weights"
        self.stop_when_stuck(failure, trigger)
        if ledger.poisoned_since is not None:
            return self.act(failure)
        if not fresh and before is not None and before.step == step - 1:  # the step before failed on this backward's gradients
            return self._same_backward_failure(failure, before, bad)
        weights = self.poisoned(named, step)
        if weights is not None:  # written between two optimizer steps: by the last one (from finite gradients) or by the program
            failure.cause = "weights"
            self.stop_rechecking(trigger)
            text = words.poisoned(step - 1, weights, from_finite=True, rank=self.rank, by_program=self.by_program(named, weights))
            if self.on_failure == "raise":
                raise self.raised(failure, GradientsNotFinite(text, step=step, parameters=bad))
            warn(text)
            return self.act(failure)
        fed = self._fed_input(own_input, decision, step)
        if fed is not None:  # a batch held them before the model ran: no op of the step made them
            return self._input_failure(failure, bad, fed, elsewhere, trigger)
        called = trigger.batches.called()
        if not trigger.auditing and self.told():  # where it began, read once a told failure
            failure.stage = _stage(trigger.batches, called, self.verdict.loss_kind(losses), bool(losses and bad and decision is None))
        return self._explained(failure, bad, loss, elsewhere, decision, recheck, trigger, called=called)

    def _fed_input(self, own: FedInput | None, decision, step: int):
        """The batch that held nan/inf when it entered the model: ``(what it held, the ranks
        whose batch did)``, else ``None``. Alone: this rank's own (ranks ``None``). In a job,
        every rank takes this path alike (the decision holds each rank's ``BAD_INPUT`` bit;
        none when a rank ran the step under a full watch, which judges its batch): the first
        such rank's batch, read from the store key it wrote before the flag (``None`` if it
        did not arrive)."""
        if decision is None:
            return None if own is None else (own, None)
        ranks = decision.ranks(BAD_INPUT)
        if not ranks or decision.ranks(WATCHED):
            return None
        first = min(ranks)
        if first == self.rank:
            return own, ranks
        facts = self.agreement.input_of(first, step)
        return (None if facts is None else FedInput.from_facts(facts)), ranks

    def _explained(self, failure, bad, loss, elsewhere, decision, recheck, trigger, called=None) -> bool:
        """A failed step whose origin a full watch may name: the audit's, or a replay's.
        ``called``: the model the step called, and where (:meth:`FedBatches.called`)."""
        ledger, step = self.ledger, failure.step
        watched = audited = trigger.auditing
        origin = trigger.audit_origin() if watched else None
        found = [origin] if origin is not None else []
        # In a job every rank replays the batch, or none (its collectives, if any, must match):
        # unless every rank ran this step under a full watch.
        replay = not (decision.all_watched if decision is not None else watched) and trigger.replay is not None and self.told()
        if replay:
            if watched:  # this rank audited it, another did not: the audit ends, the replay runs here too
                found = [anomaly for anomaly in trigger.end_audit() if anomaly.kind in ("nan", "inf")]
                audited = False
            trigger.compiled_verdict = None
            ran, replayed = trigger.replay()  # the batch again, from its start, under a full watch
            trigger.replayed()
            watched = ran or watched
            origin = replayed if replayed is not None else origin
            found = [replayed] if replayed is not None else found
            if ran or decision is not None:
                self._replayed_at = step
        verdict, trigger.compiled_verdict = trigger.compiled_verdict, None
        if verdict is not None:
            ledger.verdicts.append(verdict)
        if decision is not None:  # watched means: on every rank (what the ranks do next must be the same)
            watched = decision.all_watched or replay
        if decision is not None and watched and self.told():
            self._watched_all_at = step
            ranks, first = self.exchange(str(step), found)  # every rank's findings: the first origin anywhere
            if first is not None and ranks.origin is not None and ranks.origin.rank != ranks.rank:
                origin = elsewhere_anomaly(first, ranks, step, bad)
        ledger.explain(failure, origin, replayed=replay and watched)
        self._decided_origin = origin
        if self.on_failure == "raise" and watched:
            # The step ran under the full watch: its origin is known now, or no op made them.
            self.stop_rechecking(trigger)
            if origin is not None:
                error = AnomalyError(origin)
                if verdict is not None:
                    error.add_note(guard_words.replayed_verdict(verdict))
                raise self.raised(failure, error)
            if verdict is not None:
                text = guard_words.leave_on_only_compiled(step, words.parameters(bad), verdict)
            else:
                text = words.no_origin(step, bad, recheck, elsewhere=elsewhere, loss=loss)
            raise self.raised(failure, GradientsNotFinite(text, step=step, parameters=bad))
        if recheck is None and self.told():
            last = len(ledger.failures) == _TOLD_FAILURES
            text = words.failure(step, bad, self.on_failure, audited=watched and audited, replayed=watched and not audited,
                                 origin=origin_facts(origin), last=last, elsewhere=elsewhere, rank=self.rank, loss=loss,
                                 stage=failure.stage, called=called)
            warn(text if verdict is None else f"{text}\n{guard_words.replayed_verdict(verdict)}")
        return self.act(failure)

    def _input_failure(self, failure, bad, fed, elsewhere, trigger) -> bool:
        """A failed step whose batch held nan/inf when it entered the model (``fed``: what
        :meth:`_fed_input` found): told (or raised) with the line that fed it (and, in a job,
        the rank), cause ``input``; the next step is re-checked as after any failure (a batch
        torch made recurs there with the op and line that made it)."""
        raising = self.on_failure == "raise"
        if raising:
            self.stop_rechecking(trigger)
        failure.cause = "input"
        found, ranks = fed
        failure.batch = {**({} if found is None else found.facts()), "rank": min(ranks) if ranks else None}
        text = words.bad_input(failure.step, bad, self.on_failure, found, rerun=trigger.rerun if raising else None, rank=self.rank,
                               ranks=ranks, elsewhere=elsewhere)
        if raising:
            raise self.raised(failure, GradientsNotFinite(text, step=failure.step, parameters=bad))
        if self.told():
            warn(text)
        return self.act(failure)

    def _same_backward_failure(self, failure, before, bad) -> bool:
        """A failed step whose gradients came from the backward the step before (``before``, a
        failure) failed on: several optimizers stepping after one backward. It takes that
        failure's cause and origin and is told in one line; the next batch's step re-checks both."""
        failure.cause, failure.batch, failure.stage = before.cause, before.batch, before.stage
        self.ledger.explain(failure, before.origin)
        if self.told():
            warn(words.same_backward(failure.step, before.step, bad, self.on_failure, rank=self.rank))
        return self.act(failure)

    def failed_at_check(self, step: int, named, gradients: list, losses: list, error: AnomalyError) -> None:
        """A strict audit raised at this step's check point: the ledger counts the step as
        failed (with the origin the error names) when its gradients or loss are not finite."""
        if self.verdict.finite(gradients, losses):
            return
        bad = self.verdict.bad_gradients(named())
        failure = self.ledger.fail(step, bad, "gradients" if bad else "loss", loss=None if bad else self.verdict.loss_kind(losses))
        self.ledger.explain(failure, error.anomaly)
        self.ledger.decide(failure, "raised")

    def failed_in_batch(self, fact, trigger) -> None:
        """A trigger that runs inside the batch (``guard_trainer``'s guarded training step)
        failed it: the optimizer step that follows counts as failed, with ``fact``'s origin and
        action (a :class:`~opwatch.runners.ledger.Failure` of that trigger's own ledger)."""
        failure = self.ledger.fail(self.ledger.steps + 1, fact.parameters, fact.cause, loss=fact.loss)
        self.ledger.explain(failure, fact.origin, replayed=fact.origin is not None)
        self.ledger.decide(failure, fact.action or "applied")
        self.stop_when_stuck(failure, trigger)

    def decide_at_clip(self, optimizer, trigger, on_skip) -> None:
        """Decide ``optimizer``'s step when the program's clip has its total norm (Lightning clips
        after the callback's hook, right before the update): the norm then stands for the
        gradients; ``on_skip()`` drops the gradients of a step that must not run. A step whose
        clip never came is decided after it (:meth:`decide_undecided`, at torch's post-hook)."""
        trigger_ref = weakref.ref(trigger)

        def decide():
            seen = trigger_ref()
            if seen is not None:
                with torch.enable_grad():  # the clip runs under no_grad; a failing batch's replay runs a backward
                    if seen.before_step(optimizer):
                        on_skip()

        self.verdict.reductions.on_norm = decide

    def decide_undecided(self, trigger) -> None:
        undecided, self.verdict.reductions.on_norm = self.verdict.reductions.on_norm, None
        if undecided is not None:
            undecided()

    def step_done(self, step: int, named, trigger, optimizer=None) -> None:
        """After optimizer step ``step``: end an audit or re-check, and start the re-check of a failure."""
        self.decide_undecided(trigger)  # a step to be decided at a clip that never came (Lightning's)
        if self.buffers is not None:
            self.buffers.keep()  # what the next step's forward writes is put back if that step does not run
        if optimizer is not None:
            self.hand_off.after_step(optimizer)  # GradScaler's contract: the flag lives for one step
            self.verdict.reductions.after_step(optimizer)
        self._step_done(step, named, trigger, optimizer)
        if self.audit_next:  # a failure told late: the step after this one under the full watch
            self.audit_next = False
            trigger.start_audit()

    def _step_done(self, step: int, named, trigger, optimizer) -> None:
        ledger = self.ledger
        failed_now = bool(ledger.failures) and ledger.latest.step == step
        # A failure of a fully watched (or replayed) step was told with its origin; in a job,
        # only when every rank watched it (the ranks re-check the next step together).
        audited_now = trigger.auditing or self._replayed_at == step
        if self._agreement is not None:
            audited_now = self._watched_all_at == step
        same_backward, self._same_backward = self._same_backward, False
        if optimizer is not None:
            self.optimizer_audits.stepped(optimizer, watched=trigger.auditing, same_backward=same_backward)
        if same_backward and trigger.auditing and self.recheck_of is not None:
            return  # a step on the re-checked failure's backward: the re-check waits for the next batch
        if trigger.auditing and self.optimizer_audits.goes_on(optimizer, may=not failed_now and self.recheck_of is None):
            return  # an audit armed for another optimizer, whose path no watch has seen yet
        if trigger.auditing:
            self._rechecked(step, failed_now, trigger)
        if not failed_now:
            if ledger.poisoned_since is None and not trigger.auditing:
                failed = self.turns.due(step)
                if failed is not None:
                    self._watch_turn(failed, trigger)
                elif optimizer is not None and self.optimizer_audits.arm(optimizer):
                    trigger.start_audit()  # this optimizer's path, watched until its next step
            return
        if ledger.poisoned_since is not None:
            return
        if self.on_failure == "apply":
            weights = self.poisoned(named(), step, since=step)
            if weights is not None:  # from now on every step carries them: no op of a later step is the origin
                warn(words.poisoned(step, weights, from_finite=False, rank=self.rank))
                return
        if audited_now or ledger.latest.origin is not None:  # guard_trainer's replay may have named it
            self.turns.named()
        elif self.told():
            self.turns.failed(step, ledger.latest.cause)
            self.recheck_of, self._recheck_line = step, user_line()  # where a run that ends first is told
            trigger.start_audit()

    def _watch_turn(self, failed: int, trigger) -> None:
        """The step after this one is the turn of failed step ``failed``, whose failure recurred
        at a steady interval (:class:`~opwatch.runners.policy.turns.FailureTurns`): watched
        fully, from its start, as that failure's re-check."""
        self._turn = (self.turns.before, self.turns.every)
        self.recheck_of, self._recheck_line = failed, user_line()
        trigger.start_audit()

    def _rechecked(self, step: int, failed_now: bool, trigger) -> None:
        """The audit of ``step`` ends; when it re-checked a failure, what it found is told."""
        recheck, self.recheck_of = self.recheck_of, None
        turn, self._turn = self._turn, None
        origin = trigger.audit_origin() if recheck is not None else None
        if recheck is not None and self._agreement is not None:  # every rank re-checked this step
            if failed_now:  # found and exchanged at the check before it
                origin = self._decided_origin
            else:
                ranks, first = self.exchange(f"{step}/recheck", [origin] if origin is not None else [])
                if first is not None and ranks.origin is not None and ranks.origin.rank != ranks.rank:
                    origin = elsewhere_anomaly(first, ranks, step, [])
        if origin is not None and not failed_now and came_with(origin) == CAME_WITH_INPUT:
            # The re-checked step passed: a nan that came in with a tensor made before its watch
            # is what the failed step left (its loss kept for the log), not a recurrence.
            origin = None
        rechecked = next((failure for failure in self.ledger.failures if failure.step == recheck), None)
        if origin is not None and not failed_now:  # a failing re-check kept it already
            for failure in self.ledger.failures:  # with the steps that failed on the same backward
                if recheck <= failure.step < step:
                    self.ledger.explain(failure, origin)
        trigger.end_audit()
        # A bad batch told as such needs no "did not recur": only an origin the re-check found is news.
        quiet = rechecked is not None and rechecked.cause == "input" and origin is None
        if recheck is not None and not quiet:
            warn(words.recheck(recheck, step, origin_facts(origin), failed_again=failed_now, rank=self.rank, turn=turn))

    def ended_unjudged(self, trigger, losses: list, *, unjudged: bool) -> None:
        """The run ends; ``unjudged``: with ops after its last optimizer step that no check saw
        (a script that stops on a nan loss, or on the clip's error over nan gradients; an
        evaluation pass). The ledger says so, with what they left, read now while it is alive
        (``losses``: what ``backward()`` ran on since the step): the batch the model was fed,
        held nan/inf; or where they began (:func:`_stage`); or only the loss's kind
        (:class:`~opwatch.runners.ledger.LeftUnjudged`)."""
        ledger = self.ledger
        ledger.unjudged_end, ledger.unjudged_left = unjudged, None
        if not unjudged:
            return
        fed, loss, called = trigger.bad_input(), self.verdict.loss_kind(losses), trigger.batches.called()
        stage = None if fed is not None else _stage(trigger.batches, called, loss, False)
        if fed is not None or stage is not None or loss is not None:
            ledger.unjudged_left = LeftUnjudged(fed, stage, loss, called)

    def run_ended(self, steps: int, error, trigger) -> None:
        """The run ended (``error``: what ended it): a failure whose re-check never saw another
        optimizer step is told (or raised) as such. In a job, this rank's count of evaluations
        that returned nan goes to the others (:meth:`evaluations_of_the_job`)."""
        ledger = self.ledger
        if self.joined is not None:
            self.joined.publish_evaluations(ledger.evaluations_nan)
        latest = ledger.latest
        pending = latest if self.recheck_of is not None and latest is not None and latest.step == self.recheck_of == steps else None
        if error is not None and self._agreement is not None:  # for the others' NoAnswer: where this rank went
            self._agreement.mark(steps + 1, "", "left", f"{type(error).__name__}: {next(iter(str(error).strip().splitlines()), '')}")
        trigger.end_audit(error)
        if error is None:  # a fused step that failed last: its flag is read now (never over the program's own error)
            self.told_late(None, None, trigger)
            self.raise_held(trigger)
        if pending is not None and error is None and pending.cause != "input":  # a bad batch was told as such
            self.recheck_of = None
            text = words.loop_ended(pending.step, pending.parameters, trigger.rerun, raising=self.on_failure == "raise", loss=pending.loss)
            if self.on_failure == "raise":
                raise GradientsNotFinite(text, step=pending.step, parameters=pending.parameters)
            warn(text, self._recheck_line)
