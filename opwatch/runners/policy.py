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
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ..core.compat import no_python_dispatch, version_counters
from ..core.finite import nonfinite_kind
from ..core.sites import warn_at_user
from ..findings.anomaly import AnomalyError, OpwatchWarning, add_note
from ..findings.ranks import RankAnomaly
from ..render import guard as guard_words
from ..render import leave_on as words
from .guarded.check import FiniteCheck, on_failure_option
from .guarded.replay import NONFINITE as NONFINITE_KINDS, Replayed, ReproNote, StepContext, explaining, record_at
from .guarded.snapshot import put_buffers
from .guarded.ranks import NONFINITE, WATCHED, Agreement, Decision, RankOrigin, local
from .ledger import MAX_FAILED_IN_A_ROW, Failure, RunLedger
from .step_verdict import DeviceVerdict, FoundInfHandOff, StepReductions, VerdictFromStep, shared_gradients, trained

__all__ = ["StepPolicy", "StepVerdict", "ProgramWrites", "GradientsNotFinite", "RunStuck", "nonfinite_of", "origin_facts",
           "max_failed_option"]


class GradientsNotFinite(RuntimeError):
    """Raised with ``on_failure="raise"`` (the default in strict mode) when no op can be named
    as the origin of gradients that hold nan/inf: the failure did not recur in the fully
    watched next step, the script ended first, or the weights already held nan/inf. The
    optimizer step that had them did not run.

    Attributes: ``step`` (the 1-based count of the optimizer step whose gradients held
    nan/inf), ``parameters`` (``(name, kind)`` pairs, kind ``"nan"`` or ``"inf"``)."""

    def __init__(self, message: str, *, step: int, parameters: list):
        super().__init__(message)
        self.step = step
        self.parameters = parameters


class RunStuck(GradientsNotFinite):
    """Raised when ``max_failed_in_a_row`` steps in a row failed (the run would go on
    skipping every step): ``step`` and ``parameters`` are the first failure's, ``failed_in_a_row``
    how many steps failed since (it included)."""

    def __init__(self, message: str, *, step: int, parameters: list, failed_in_a_row: int):
        super().__init__(message, step=step, parameters=parameters)
        self.failed_in_a_row = failed_in_a_row


def max_failed_option(value) -> int | None:
    """``max_failed_in_a_row`` checked: an int of at least 1, or ``None`` (never stop)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_failed_in_a_row must be an int of at least 1 or None, got {value!r}")
    return value


def nonfinite_of(named, of) -> list:
    """``(name, "nan" | "inf")`` of each ``(name, parameter)`` of ``named`` whose ``of(parameter)``
    (its gradient, or itself) is not finite: read after a failed verdict only, one host read each.
    A DTensor is read on its local shard."""
    bad = []
    with torch.no_grad():
        for name, parameter in named:
            value = of(parameter)
            if value is None:
                continue
            value = local(value)  # a DTensor's shard, taken before its dispatch is off
            with no_python_dispatch():
                kind = nonfinite_kind(value)
            if kind is not None:
                bad.append((name, kind))
    return bad


class StepVerdict:
    """The verdict of one step: whether its update is finite, and which parameters are bad.

    The one seam between a runner and how a step's health is read: :meth:`finite` answers from
    the step's facts (the gradients about to be applied, the losses ``backward()`` ran on) from
    what the step already computed (:class:`~opwatch.runners.step_verdict.VerdictFromStep`:
    GradScaler's unscale, the clip's total norm kept by :attr:`reductions`) or one fused pass,
    at most one host read; :meth:`device_flag` gives it on the device, no host read (a fused
    optimizer's ``found_inf``); :meth:`bad_gradients` and :meth:`loss_kind` say what failed,
    read only after a failed verdict."""

    def __init__(self, scaler=None):
        self.reductions = StepReductions()  # what the step computed; the trigger enters it for its run (or call)
        self.returned = FiniteCheck(scaler, self.reductions)  # a call wrapper's: what the step returned, and the gradients
        self.check = self.returned.tensors  # one FusedFiniteCheck, its flags kept from step to step
        self.from_step = VerdictFromStep(self.reductions, self.check)

    @property
    def source(self) -> str | None:
        """Where the last verdict came from: ``"scaler"``, ``"clip"`` or ``"fused pass"``."""
        return self.returned.source if self.from_step.source is None else self.from_step.source

    def finite(self, gradients, losses=(), optimizer=None) -> bool:
        """An optimizer step's: the gradients about to be applied and the losses."""
        with no_python_dispatch():  # an audit's watch may be open: the check is not the program's
            return self.from_step.finite(gradients, list(losses), optimizer)

    def gradients_finite(self, gradients, optimizer=None) -> bool:
        """The gradients' part alone, read after a failed :meth:`finite` (DDP: a loss that is
        not finite on this rank only)."""
        with no_python_dispatch():
            return self.from_step.gradients_finite(gradients, optimizer)

    def device_flag(self, gradients, losses, optimizer) -> DeviceVerdict | None:
        with no_python_dispatch():
            return self.from_step.device_flag(gradients, losses, optimizer)

    def step_finite(self, result, params) -> bool:
        """A guarded call's: what it returned (tensors, floats) and the parameters' gradients
        (the clip norms the call computed, when one covers them, read in their place)."""
        try:
            return self.returned.all_finite(result, params)
        finally:
            self.reductions.forget()  # the norms' ids name this call's gradients only

    @staticmethod
    def bad_gradients(named) -> list:
        """``(name, kind)`` of each ``(name, parameter)`` whose gradient holds nan/inf."""
        return nonfinite_of(named, lambda parameter: parameter.grad)

    @staticmethod
    def loss_kind(losses) -> str | None:
        """``"nan"`` or ``"inf"``: the first loss that is not finite."""
        with torch.no_grad(), no_python_dispatch():
            return next((kind for kind in map(nonfinite_kind, losses) if kind is not None), None)


class ProgramWrites:
    """Whether weights that hold nan/inf were written by the program rather than by an optimizer
    step: the parameters' version counters as each optimizer step left them (a Python read
    each, no kernel). A counter that moved since, or a parameter no optimizer step touched yet,
    was written by the program (an assignment such as ``w[i] = ...``, a state-dict load, an init)."""

    def __init__(self):
        self._left = weakref.WeakKeyDictionary()  # optimizer -> (its parameters, their counters after its step)

    def stepped(self, optimizer) -> None:
        """``optimizer`` finished a step (torch's optimizer step post-hook)."""
        parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        self._left[optimizer] = (parameters, version_counters(parameters))

    def by_program(self, parameters) -> bool:
        """Whether one of ``parameters`` (those that hold nan/inf) was written after the last
        optimizer step that holds it left it, or is held by no optimizer that stepped."""
        wanted = list(parameters)
        now = dict(zip(map(id, wanted), version_counters(wanted)))
        seen = set()
        for held, counters in list(self._left.values()):
            for parameter, then in zip(held, counters):
                if id(parameter) in now:
                    seen.add(id(parameter))
                    if now[id(parameter)] != then:
                        return True
        return len(seen) < len(now)


# -- an optimizer step (leave-on: torch's optimizer hooks and the trainers' callbacks) -------------

_TOLD_FAILURES = 3  # failures warned (and re-checked) one by one; later ones are counted


def _warn(text: str) -> None:
    """Warn, attributed to the user's line that called the optimizer step (or ended the run)."""
    warn_at_user(OpwatchWarning(text))


class OptimizerSteps:
    """The policy's side of a trigger that sees optimizer steps (mixed into :class:`StepPolicy`).

    The trigger (``LeaveOn``) hands each step's facts to :meth:`check_step` before the update and
    calls :meth:`step_done` after it; it answers, for the policy: ``auditing``,
    ``start_audit()``, ``end_audit()``, ``audit_origin()`` (the first nan/inf origin the running
    audit found), ``replay`` (``None`` or a callable that runs the batch again under a full
    watch: ``(ran, origin)``), ``compiled_verdict``, ``bad_input()`` (``(module, argument,
    kind, where)`` of a batch that held nan/inf when it entered the model) and ``rerun``."""

    def told(self) -> bool:
        """Whether the newest failure is one of those warned and re-checked one by one."""
        return len(self.ledger.failures) <= _TOLD_FAILURES

    def stop_rechecking(self, trigger) -> None:
        self.recheck_of = None
        trigger.end_audit()

    def check_step(self, step: int, named, gradients: list, losses: list, trigger, *, optimizer=None, modules=()) -> bool:
        """Decide optimizer step ``step`` (``named()``: its parameters, ``(name, parameter)``,
        made only for a failed step;
        the ``gradients`` it is about to apply, the ``losses`` ``backward()`` ran on since the
        last step; ``optimizer``: the one stepping; ``modules``: the models the run saw, whose
        DDP wrappers make the gradients the same on every rank); returns whether the step must
        not run."""
        ledger = self.ledger
        self.raise_held(trigger)  # a late failure a read of the counts took in, raised at this check
        recheck = self.recheck_of
        if optimizer is not None and self.hands_over(optimizer, trigger):
            self.told_late(optimizer, step, trigger)  # the step before, whose flag the device has set by now
            self.hand_over(optimizer, gradients, losses, step)
            ledger.passed(step)
            return False
        finite = self.verdict.finite(gradients, losses, optimizer)
        # What every rank shares: DDP's reduced gradients, or FSDP2's clip norm reduced across
        # the ranks (the clip's own all-reduce): their verdict is the same on every rank.
        shared = optimizer is not None and self.agreement is not None and (
            self.verdict.from_step.shared or shared_gradients(trained(optimizer), modules))
        if shared and not finite and self.verdict.gradients_finite(gradients, optimizer):
            # The shared gradients are finite on every rank, this rank's loss is not: told
            # here, and every rank applies the step alike (decided from what they share).
            _warn(words.loss_here_only(step, self.verdict.loss_kind(losses), self.rank))
            finite = True
        # Every rank decides the step together (bounded: NoAnswer); with DDP's reduced
        # gradients every rank's verdict is the same, and only a failure asks which rank.
        decision = None if shared and finite else self.agree((0 if finite else NONFINITE) | (WATCHED if trigger.auditing else 0), step, "", "gradients")
        if decision is not None:
            finite = not decision.failed
        if finite and recheck is not None and self.on_failure == "raise":
            failed = ledger.latest
            self.stop_rechecking(trigger)
            raise GradientsNotFinite(words.did_not_recur(failed.step, step, failed.parameters, loss=failed.loss),
                                     step=failed.step, parameters=failed.parameters)
        if finite:
            ledger.passed(step)
            return False
        named = named()
        bad = self.verdict.bad_gradients(named)
        loss = None if bad else self.verdict.loss_kind(losses)
        elsewhere = () if decision is None or bad else decision.nonfinite
        failure = ledger.fail(step, bad, "loss" if loss is not None and not elsewhere else "gradients", loss=loss)
        if failure.action:  # another trigger (guard_trainer's step) failed this step and told it already
            return failure.action != "applied"
        if ledger.poisoned_since is not None:  # told once; every later step fails: only counted
            failure.cause = "weights"
        self.stop_when_stuck(failure, trigger)
        if ledger.poisoned_since is not None:
            return self.act(failure)
        weights = self.poisoned(named, step)
        if weights is not None:  # written between two optimizer steps: by the last one (from finite gradients) or by the program
            failure.cause = "weights"
            self.stop_rechecking(trigger)
            text = words.poisoned(step - 1, weights, from_finite=True, rank=self.rank, by_program=self.by_program(named, weights))
            if self.on_failure == "raise":
                raise self.raised(failure, GradientsNotFinite(text, step=step, parameters=bad))
            _warn(text)
            return self.act(failure)
        bad_input = None if trigger.auditing or decision is not None else trigger.bad_input()
        if bad_input is not None:  # the batch held them before the model ran: no op of the step made them
            return self._input_failure(failure, bad, bad_input, trigger)
        return self._explained(failure, bad, loss, elsewhere, decision, recheck, trigger)

    # -- a fused optimizer: the verdict handed over as found_inf, read at the next step -------

    def hands_over(self, optimizer, trigger) -> bool:
        """Whether this step's verdict goes to ``optimizer`` as ``found_inf`` (it skips a failing
        step on the device) and is read at its next step: a fused optimizer that GradScaler did
        not hand a flag, outside audits and re-checks, in a process of its own, when failing
        steps are skipped or raised."""
        return (self.on_failure != "apply" and not trigger.auditing and self.recheck_of is None and self.ledger.poisoned_since is None
                and self.agreement is None and self.hand_off.takes(optimizer))

    def hand_over(self, optimizer, gradients, losses, step: int) -> None:
        verdict = self.verdict.device_flag(gradients, losses, optimizer)
        if verdict is None:  # no gradient, or on several devices: the host read of the other optimizers
            self.hand_off.forget(optimizer)
            if not gradients or self.verdict.finite(gradients, losses, optimizer):
                return
            first, *_ = gradients
            verdict = DeviceVerdict(torch.ones((), device=first.device), torch.ones(2, device=first.device))
        self.hand_off.hand(optimizer, verdict, step, losses)

    def told_late(self, optimizer, now, trigger, *, wait: bool = True, read: bool = False) -> None:
        """Read the flag handed to ``optimizer`` at its last step (``None``: every optimizer's,
        at the end of the run, ``now`` ``None``, or at a read of the counts after step ``now``,
        ``read``: only the flags the device finished unless ``wait``); a set flag is a failed
        step the device skipped, counted and told now; the step after this one then runs under
        the full watch. A read never raises: what ``on_failure="raise"`` or a stuck run raises
        is held until the next check (:meth:`raise_held`)."""
        for late in self.hand_off.failed(optimizer, wait=wait):
            loss = self.verdict.loss_kind(late.losses)
            failure = self.ledger.fail(late.step, [], "loss" if loss is not None and not late.gradients else "gradients", loss=loss)
            text = words.failed_late(late.step, now, self.on_failure, loss=loss, gradients=late.gradients, read=read)
            self.ledger.decide(failure, "skipped")  # on the device, by the fused optimizer
            if self.on_failure == "raise":  # the device skipped it; the run stops here
                self._held = self.raised(failure, GradientsNotFinite(text, step=late.step, parameters=[]))
            else:
                if self.told():
                    _warn(text)
                    self.audit_next = now is not None  # a failure that recurs is named
                try:
                    self.stop_when_stuck(failure, trigger)
                except RunStuck as stuck:
                    self._held = stuck
            if not read:
                self.raise_held(trigger)

    def settle(self, wait: bool = True) -> None:
        """The ledger's :attr:`~opwatch.runners.ledger.RunLedger.unsettled`: before its counts
        are read (a log, a summary, the run's end), the verdicts still on the device are taken in."""
        if self.hand_off.pending():
            self.told_late(None, self.ledger.steps, None, wait=wait, read=True)

    def raise_held(self, trigger=None) -> None:
        """Raise what a read of the counts held (a late failure under ``on_failure="raise"``, a stuck run)."""
        held, self._held = self._held, None
        if held is not None:
            if trigger is not None:
                self.stop_rechecking(trigger)
            raise held

    def _explained(self, failure, bad, loss, elsewhere, decision, recheck, trigger) -> bool:
        """A failed step whose origin a full watch may name: the audit's, or a replay's."""
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
                                 origin=origin_facts(origin), last=last, elsewhere=elsewhere, rank=self.rank, loss=loss)
            _warn(text if verdict is None else f"{text}\n{guard_words.replayed_verdict(verdict)}")
        return self.act(failure)

    def _input_failure(self, failure, bad, bad_input, trigger) -> bool:
        """A failed step whose batch held nan/inf when it entered the model: told (or raised)
        with the line that fed it, cause ``input``; the next step is re-checked as after any
        failure (a batch torch made recurs there with the op and line that made it)."""
        raising = self.on_failure == "raise"
        if raising:
            self.stop_rechecking(trigger)
        failure.cause = "input"
        text = words.bad_input(failure.step, bad, self.on_failure, *bad_input, rerun=trigger.rerun if raising else None)
        if raising:
            raise self.raised(failure, GradientsNotFinite(text, step=failure.step, parameters=bad))
        if self.told():
            _warn(text)
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
        if optimizer is not None:
            self.hand_off.after_step(optimizer)  # GradScaler's contract: the flag lives for one step
            self.verdict.reductions.after_step(optimizer)
        self._step_done(step, named, trigger)
        if self.audit_next:  # a failure told late: the step after this one under the full watch
            self.audit_next = False
            trigger.start_audit()

    def _step_done(self, step: int, named, trigger) -> None:
        ledger = self.ledger
        failed_now = bool(ledger.failures) and ledger.latest.step == step
        # A failure of a fully watched (or replayed) step was told with its origin; in a job,
        # only when every rank watched it (the ranks re-check the next step together).
        audited_now = trigger.auditing or self._replayed_at == step
        if self._agreement is not None:
            audited_now = self._watched_all_at == step
        if trigger.auditing:
            self._rechecked(step, failed_now, trigger)
        if not failed_now or ledger.poisoned_since is not None:
            return
        if self.on_failure == "apply":
            weights = self.poisoned(named(), step, since=step)
            if weights is not None:  # from now on every step carries them: no op of a later step is the origin
                _warn(words.poisoned(step, weights, from_finite=False, rank=self.rank))
                return
        if self.told() and not audited_now and ledger.latest.origin is None:  # guard_trainer's replay may have named it
            self.recheck_of = step
            trigger.start_audit()

    def _rechecked(self, step: int, failed_now: bool, trigger) -> None:
        """The audit of ``step`` ends; when it re-checked a failure, what it found is told."""
        recheck, self.recheck_of = self.recheck_of, None
        origin = trigger.audit_origin() if recheck is not None else None
        if recheck is not None and self._agreement is not None:  # every rank re-checked this step
            if failed_now:  # found and exchanged at the check before it
                origin = self._decided_origin
            else:
                ranks, first = self.exchange(f"{step}/recheck", [origin] if origin is not None else [])
                if first is not None and ranks.origin is not None and ranks.origin.rank != ranks.rank:
                    origin = elsewhere_anomaly(first, ranks, step, [])
        rechecked = next((failure for failure in self.ledger.failures if failure.step == recheck), None)
        if origin is not None and not failed_now:  # a failing re-check kept it already
            self.ledger.explain(rechecked, origin)
        trigger.end_audit()
        # A bad batch told as such needs no "did not recur": only an origin the re-check found is news.
        quiet = rechecked is not None and rechecked.cause == "input" and origin is None
        if recheck is not None and not quiet:
            _warn(words.recheck(recheck, step, origin_facts(origin), failed_again=failed_now, rank=self.rank))

    def run_ended(self, steps: int, error, trigger) -> None:
        """The run ended (``error``: what ended it): a failure whose re-check never saw another
        optimizer step is told (or raised) as such."""
        ledger = self.ledger
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
            _warn(text)


# -- a guarded call (opwatch.guard: a call wrapper) ---------------------------------------------


def warn_at(warning, anomaly) -> None:
    """Warn, attributed to the anomaly's line (the way Python shows its own warnings)."""
    warnings.warn_explicit(warning, OpwatchWarning, filename=anomaly.filename or "<unknown>", lineno=anomaly.lineno or 0, module="opwatch")


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
            snapshots.drop_grads()
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
        _warn(text)  # at the user's line that called the guarded step
        return True

    def _after_poisoned(self, guarded, start, result):
        """A failing step with poisoned weights: skipped (``.grad`` and buffers as they were)
        or applied, counted, not replayed."""
        if self.on_failure == "skip":
            guarded._snapshots.drop_grads()
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


class StepPolicy(OptimizerSteps, GuardedCalls):
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
        # re-checks; the step a trainer replayed; in a job, the step every rank watched (audit
        # or replay); the origin told at the latest failure (in a job, maybe another rank's).
        self.recheck_of: int | None = None
        self._replayed_at: int | None = None
        self._watched_all_at: int | None = None
        self._decided_origin = None

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
        return True

    def raised(self, failure: Failure, error: BaseException) -> BaseException:
        """``failure`` raises ``error`` (returned, for ``raise policy.raised(...)``)."""
        self.ledger.decide(failure, "raised")
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


def origin_facts(origin):
    """``(kind, op, where, phase)`` of an origin anomaly, or ``None``; ``(kind, op, where,
    phase, rank)`` for an origin made on another rank."""
    if origin is None:
        return None
    facts = (origin.kind, origin.op, origin.where, origin.phase)
    return facts + (origin.rank,) if isinstance(origin, RankAnomaly) else facts


def elsewhere_anomaly(first, ranks, step: int, bad) -> RankAnomaly:
    """The origin another rank made, as this rank raises and tells it: that rank's facts
    (``.rank``, ``.op``, ``.lineno``) with a message saying where this rank stood."""
    text = words.made_elsewhere(ranks.rank, step, ranks.origin, bool(bad), ranks.missing, ranks.timeout, first.message)
    return RankAnomaly(**{**first.fields(), "message": text}, rank=first.rank)
