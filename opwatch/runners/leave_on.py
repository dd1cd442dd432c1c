"""Leave opwatch on for a whole training run: ``python -m opwatch --guard`` and the trainers'
``mode="guard"``.

Shape, dtype and device bugs belong to the code path, not to the values: one fully watched
optimizer step (the audit) sees them. After it the program runs with no dispatch mode, and
each optimizer step is preceded by one fused finiteness check of the gradients it is about to
apply (``opwatch.core.finite``, the check ``opwatch.guard`` runs too: one kernel, one host read). Steps are found through torch's global optimizer step hooks,
so any ``torch.optim`` optimizer is seen, however the loop is written.

A failing check names the step and the parameters that hold nan/inf, then does what
``on_failure`` says: ``"skip"`` (the default) skips that optimizer step (the weights stay as
they were, as GradScaler skips an overflow step) and watches the next step fully, so that a
failure that recurs is reported with the op and line that made it; ``"raise"`` (the default
with ``strict``) skips it too, watches the next step fully and raises there:
:class:`~opwatch.AnomalyError` with the origin when the failure recurs,
:class:`GradientsNotFinite` saying it did not recur otherwise; ``"apply"`` lets the optimizer
apply them. Once the weights hold nan/inf, every later step carries them and no op of a later
step is their origin: the runner says since which step, and watches no step fully again.

GradScaler calls ``optimizer.step()`` only when the unscaled gradients are finite: the steps it
skips never reach the hooks, so they are not failures (and not counted as steps).

In a job of several ranks (``torch.distributed`` initialized, world size > 1) each optimizer
step is decided on every rank together (``Agreement`` of ``opwatch.runners.guarded.ranks``, the
guard's: one all-reduce of one slot per rank, bounded): a nan/inf in one rank's gradients (a
shard under FSDP2) fails the step on every rank, every rank applies the same ``on_failure``,
watches the same next step, replays the same batch (the trainers), and after a fully watched or
replayed failure the ranks exchange what they found (through the store), so that every rank's
message names the rank that made it, its op and line.
"""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (it reads
# __tracebackhide__ in each frame's globals): opwatch's frames are not the user's story.
__tracebackhide__ = True

import sys
import weakref
import torch

from ..findings.anomaly import AnomalyError, OpwatchWarning
from ..findings.ranks import RankAnomaly
from ..core.compat import no_python_dispatch, version_counters
from ..core.finite import nonfinite_kind, tensors_in
from ..core.sites import display_path, position_of, user_frame, warn_at_user
from .guarded.audit import signature  # what an audit depends on: one definition for guard and leave-on
from .guarded.check import ON_FAILURE, on_failure_option
from ..render import guard as guard_words
from ..render import leave_on as words
from .guarded.ranks import NONFINITE, WATCHED, Agreement
from .ledger import MAX_FAILED_IN_A_ROW, Failure, RunLedger
from .step_verdict import DeviceVerdict, FoundInfHandOff, StepReductions, VerdictFromStep, shared_gradients
from ..session import Watch, strict, watch

__all__ = ["LeaveOn", "GradientsNotFinite", "RunStuck", "Failure", "ON_FAILURE", "signature", "nonfinite_names", "nonfinite_parameters"]

_NONFINITE_KINDS = ("nan", "inf")
_TOLD_FAILURES = 3  # failures warned (and re-checked) one by one; later ones are counted
_MAX_LOSSES = 64  # losses kept between two optimizer steps (gradient accumulation)


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
    """Raised when ``max_failed_in_a_row`` optimizer steps in a row failed (the run would go on
    skipping every step): ``step`` and ``parameters`` are the first failure's, ``failed_in_a_row``
    how many steps failed since (it included)."""

    def __init__(self, message: str, *, step: int, parameters: list, failed_in_a_row: int):
        super().__init__(message, step=step, parameters=parameters)
        self.failed_in_a_row = failed_in_a_row


class LeaveOn:
    """A context manager: the audit, then the fused gradient check at every optimizer step.

    ``audit="first"`` (the CLI's): a full watch from the start until the first optimizer step
    has run. ``audit="manual"`` (the trainers'): no watch until :meth:`start_audit` (or
    :meth:`audit_batch`: the first batch and each new signature), and each audit ends after the
    next optimizer step (or at :meth:`end_audit`). ``pre_hook=False``: the caller calls
    :meth:`before_step` itself after the backward (Lightning runs the forward and backward
    inside ``optimizer.step(closure)``, after torch's pre-hook) and skips the step when it
    returns ``True``. ``max_audits``: the most distinct batch signatures audited.
    ``on_failure``: ``"skip"`` (default), ``"raise"`` (default with ``strict_mode``) or
    ``"apply"``: what a step whose gradients hold nan/inf does (the module's docstring).
    ``rerun``: the command that runs the program under a full watch, named when the program
    ends before a failure could be re-checked. ``strict``, ``allow``, ``last``, ``file``,
    ``warn``, ``checks``, ``max_records`` go to the watch (:func:`opwatch.watch`); the same watch
    is re-entered for every audit, so its anomalies accumulate and warn once per line.
    """

    def __init__(self, *, strict_mode: bool = False, on_failure: str | None = None, audit: str = "first", pre_hook: bool = True,
                 max_audits: int = 8, file=None, rerun: str | None = None, max_failed_in_a_row: int | None = MAX_FAILED_IN_A_ROW,
                 **watch_options):
        if audit not in ("first", "manual"):
            raise ValueError(f"audit must be 'first' or 'manual', got {audit!r}")
        if isinstance(max_audits, bool) or not isinstance(max_audits, int) or max_audits < 1:
            raise ValueError(f"max_audits must be an int of at least 1, got {max_audits!r}")
        if max_failed_in_a_row is not None and (isinstance(max_failed_in_a_row, bool) or not isinstance(max_failed_in_a_row, int) or max_failed_in_a_row < 1):
            raise ValueError(f"max_failed_in_a_row must be an int of at least 1 or None, got {max_failed_in_a_row!r}")
        self.on_failure = on_failure_option(on_failure, "raise" if strict_mode else "skip")
        self.pre_hook = pre_hook  # read when the run starts
        self._max_audits = max_audits
        self._signatures: set = set()
        self.strict = strict_mode
        self.watch: Watch = (strict if strict_mode else watch)(file=file, **watch_options)
        self._audit_first = audit == "first"
        self._file = file
        self._rerun = rerun
        self.ledger = RunLedger()  # the run's facts: every count and summary reads them
        self.max_failed_in_a_row = max_failed_in_a_row
        self._auditing = False
        self._recheck_of: int | None = None  # the failed step the running audit re-checks
        self._before_audit: set = set()
        self._modules = weakref.WeakKeyDictionary()  # modules seen in audits: parameter names
        # The step's verdict, from what the step computed (the clip's norm, GradScaler's unscale)
        # or one fused pass where it computed nothing that covers its gradients.
        self._reductions = StepReductions()
        self.verdict = VerdictFromStep(self._reductions)
        self._hand_off = FoundInfHandOff()  # a fused optimizer's found_inf, read at its next step
        self._audit_after_step = False  # a failure told late: the step after this one runs under the full watch
        self._handles: list = []  # the optimizer hooks
        self._module_hook = None  # names the parameters; only during audits
        # Set by a trainer that can run the failing batch again from its start under a full
        # watch: called at a failed step, returns (whether it ran, the origin anomaly or None).
        self.replay = None
        self.compiled_verdict = None  # set by that replay for a step that runs compiled code (guarded.compiled)
        self._replayed_at: int | None = None
        # audit="first" (the CLI): whether a module ran forward after the last optimizer step
        # outside a full watch, seen by a one-shot hook armed after each step (one call a step).
        self._inputs_hook = None  # the model's forward pre-hook, after the first audit
        self._inputs = None  # (model, args, kwargs, user frame) of the model's latest call outside a watch: references
        self._agreement: Agreement | None = None  # in a job of 2 or more ranks (read at the first step)
        self._job_read = False
        self._watched_all_at: int | None = None  # in a job: the step every rank watched (audit or replay)
        self._decided_origin = None  # the origin told at the latest failure (in a job, maybe another rank's)
        # optimizer -> (its last step, the version counters of its parameters after it): a weight
        # whose counter moved since was written by the program, not by that optimizer step
        self._left_by_step = weakref.WeakKeyDictionary()
        self._losses: list = []  # what backward() ran on since the last optimizer step (detached views, no copy)
        self._backward = None  # torch.Tensor.backward as it was before the run
        self._forward_after_step = False

    # -- the run ------------------------------------------------------------------------------

    def __enter__(self) -> LeaveOn:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if self._handles:  # entered again (a second trainer.train())
            self._reductions.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if not self.watch.enabled:  # OPWATCH_DISABLE: the run goes on untouched
            return self
        self._handles = [register_optimizer_step_post_hook(self._after_step)]
        self._reductions.__enter__()
        self._see_losses()
        if self.pre_hook:
            self._handles.append(register_optimizer_step_pre_hook(self._before_step))
        if self._audit_first:
            self.start_audit()
        return self

    def __exit__(self, exc_type, exc, traceback_) -> bool:
        """End the run (again: nothing happens)."""
        for handle in self._handles:
            handle.remove()
        entered = bool(self._handles)
        self._handles = []
        self._unsee_losses()
        if entered:
            self._reductions.__exit__(None, None, None)
        if exc is None:  # a fused step that failed last: its flag is read now (never over the program's own error)
            self._told_late(None)
        pending = self._pending_recheck()
        self._unwatch_inputs()
        # The run's last ops ran after its last optimizer step with no watch on: no gradient
        # check followed them (a script that stops on a nan loss before backward(), an
        # evaluation pass), so this run's summary cannot speak for them.
        self.ledger.unjudged_end = self._forward_after_step and not self._auditing
        if exc is not None and self._agreement is not None:  # for the others' NoAnswer: where this rank went
            self._agreement.mark(self.steps + 1, "", "left", f"{type(exc).__name__}: {str(exc).strip().partition(chr(10))[0]}")
        self.end_audit(exc)
        if pending is not None and exc is None and pending.cause != "input":  # a bad batch was told as such
            self._recheck_of = None
            text = words.loop_ended(pending.step, pending.parameters, self._rerun, raising=self.on_failure == "raise", loss=pending.loss)
            if self.on_failure == "raise":
                raise GradientsNotFinite(text, step=pending.step, parameters=pending.parameters)
            _warn(text)
        return False

    def _see_losses(self) -> None:
        """Keep what ``Tensor.backward()`` runs on (a detached view, no copy): its finiteness is
        read in the same fused read as the gradients', so a nan loss with finite gradients (a
        batch whose every label is ignored: 0/0) fails its step too."""
        if self._backward is not None:
            return
        original = self._backward = torch.Tensor.backward
        runner = weakref.ref(self)

        def backward(tensor, *args, **kwargs):
            seen = runner()
            if seen is not None:
                if seen._reductions.after_backward():  # GradScaler skipped the step those losses made
                    seen._losses.clear()
                if len(seen._losses) < _MAX_LOSSES and tensor.is_floating_point():
                    with no_python_dispatch():
                        seen._losses.append(tensor.detach())
            return original(tensor, *args, **kwargs)

        backward.__wrapped__ = original
        torch.Tensor.backward = backward

    def _unsee_losses(self) -> None:
        if self._backward is not None and getattr(torch.Tensor.backward, "__wrapped__", None) is self._backward:
            torch.Tensor.backward = self._backward
        self._backward = None
        self._losses = []

    def _pending_recheck(self):
        """The failure whose re-check never saw another optimizer step, or ``None``."""
        if self._recheck_of is None or not self.failures or self.ledger.latest.step != self._recheck_of:
            return None
        return self.ledger.latest if self.steps == self._recheck_of else None

    # -- the counts, read from the ledger -----------------------------------------------------

    @property
    def steps(self) -> int:
        """Optimizer steps called (GradScaler's skipped ones never call it)."""
        return self.ledger.steps

    @property
    def audited(self) -> int:
        """Of them, run under the full watch."""
        return self.ledger.audited

    @property
    def failed(self) -> int:
        """Of them, failed: nan/inf in the gradients about to be applied, or a loss not finite."""
        return self.ledger.failed

    @property
    def skipped(self) -> int:
        """Of the failed ones, not run (``on_failure`` ``"skip"`` or ``"raise"``)."""
        return self.ledger.skipped

    @property
    def failures(self) -> list:
        """The failed steps (:class:`~opwatch.runners.ledger.Failure`: step, parameters, cause, origin, action)."""
        return self.ledger.failures

    @property
    def origins(self) -> list:
        """The nan/inf origins full watches named (audits, re-checks, replays), as Anomaly objects."""
        return self.ledger.origins

    @property
    def anomalies(self) -> list:
        """What the audits found, then the origins replays named that no audit holds (the
        trainers' ``callback.anomalies``)."""
        found = list(self.watch.anomalies)
        return found + [origin for origin in self.ledger.origins if all(origin is not kept for kept in found)]

    @property
    def poisoned_since(self) -> int | None:
        """The optimizer step after which the weights held nan/inf, or ``None``."""
        return self.ledger.poisoned_since

    @property
    def unjudged_end(self) -> bool:
        """The run ended with ops that nothing checked."""
        return self.ledger.unjudged_end

    @property
    def auditing(self) -> bool:
        return self._auditing

    def audit_batch(self, batch) -> bool:
        """Audit this batch if its signature (nesting, shapes, dtypes, devices) is new and
        fewer than ``max_audits`` were audited; returns whether it is audited."""
        if len(self._signatures) >= self._max_audits:
            return False
        key = signature(batch)
        if key in self._signatures:
            return False
        self._signatures.add(key)
        self.start_audit()
        return True

    def start_audit(self) -> None:
        """Run under the full watch until the next optimizer step has run."""
        if self._auditing or not self.watch.enabled or self.poisoned_since is not None:
            return  # weights that hold nan/inf would make every op that reads them look like an origin
        self._before_audit = {id(anomaly) for anomaly in self.watch.anomalies}
        self._module_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._module_seen)
        self._auditing = True
        self.watch.__enter__()

    def end_audit(self, error: BaseException | None = None) -> list:
        """Leave the full watch (``error``: the exception that ended it); returns the anomalies
        it found."""
        if not self._auditing:
            return []
        self._auditing = False
        self._module_hook.remove()
        if error is None:
            self.watch.__exit__(None, None, None)
        else:
            self.watch.__exit__(type(error), error, error.__traceback__)
        return [anomaly for anomaly in self.watch.anomalies if id(anomaly) not in self._before_audit]

    def know(self, module) -> None:
        """Name the parameters after ``module`` (the trainer's model) before any other."""
        self._modules.setdefault(module, None)

    def end_batch(self) -> None:
        """A trainer's batch ended: end an audit that saw no optimizer step (gradient
        accumulation); a re-check armed after a failed step goes on to the next step."""
        if self._recheck_of is None:
            self.end_audit()

    def _module_seen(self, module, args) -> None:
        self._modules.setdefault(module, None)

    # -- the optimizer hooks ------------------------------------------------------------------

    def _before_step(self, optimizer, args, kwargs):
        if self.before_step(optimizer):
            # The step function runs on a stand-in with no parameter in its groups: no weight,
            # momentum, weight decay or step count moves (GradScaler does not call the step).
            return (_Skipped(optimizer), *args[1:]), kwargs
        return None

    def before_step(self, optimizer) -> bool:
        """The check before ``optimizer`` applies its gradients (torch's step pre-hook, or the
        trainer's hook after the backward); returns whether the step must not run."""
        if not self.watch.enabled:
            return False
        ledger = self.ledger
        step = ledger.step(audited=self._auditing)
        self._step_ended()  # what ran since the last step is judged here
        recheck = self._recheck_of
        losses, self._losses = self._losses, []
        if self._auditing:
            try:
                self.watch.check()  # the watch's own check point: names the origin, raises in strict
            except AnomalyError as error:  # strict: the step does not run; counted if it failed
                self._failed_at_check(optimizer, step, losses, error)
                raise
        with no_python_dispatch():  # the flag's group is made at the first step, maybe in an audit
            agreement = self._job()
        if self._defers(optimizer, agreement):
            self._told_late(optimizer)  # the step before, whose flag the device has set by now
            self._hand_flag(optimizer, losses)
            ledger.passed(step)
            return False
        finite = self._verdict(optimizer, losses)
        decision = None
        shared = agreement is not None and shared_gradients(_trained(optimizer), self._modules)
        if shared and not finite and self._gradients_finite(optimizer):
            # The reduced gradients are finite on every rank, this rank's loss is not: told
            # here, and every rank applies the step alike (decided from what they share).
            _warn(words.loss_here_only(step, _loss_kind(losses), agreement.rank))
            finite = True
        if agreement is not None and not (shared and finite):
            # Every rank decides this step together (bounded: NoAnswer); with DDP's reduced
            # gradients every rank's verdict is the same, and only a failure asks which rank.
            with no_python_dispatch():
                decision = agreement.decide((0 if finite else NONFINITE) | (WATCHED if self._auditing else 0), step, "", "gradients")
            finite = not decision.failed
        if finite and recheck is not None and self.on_failure == "raise":
            failed = self.ledger.latest
            self.end_audit()
            self._recheck_of = None
            raise GradientsNotFinite(words.did_not_recur(failed.step, step, failed.parameters, loss=failed.loss),
                                     step=failed.step, parameters=failed.parameters)
        if finite:
            ledger.passed(step)
            return False
        names = self._names()
        bad = nonfinite_names(optimizer, names)
        loss = None if bad else _loss_kind(losses)
        elsewhere = _elsewhere(decision, bad)
        failure = ledger.fail(step, bad, "loss" if loss is not None and not elsewhere else "gradients", loss=loss)
        if failure.action:  # another trigger (guard_trainer's step) failed this step and told it already
            return failure.action != "applied"
        self._stop_when_stuck(failure)
        if self.poisoned_since is not None:  # told once; every later step fails: only counted
            return self._skips(failure)
        weights = nonfinite_parameters(optimizer, names)
        poisoned = bool(weights)
        if agreement is not None:  # a shard may hold them on one rank only
            with no_python_dispatch():
                poisoned = agreement.failed(poisoned, step, "", "poisoned")
        if poisoned:  # written between two optimizer steps: by the last one (from finite gradients) or by the program
            failure.cause = "weights"
            ledger.poisoned_since = step - 1
            self._stop_rechecking()
            text = words.poisoned(step - 1, weights, from_finite=True, rank=_rank(agreement), by_program=self._written_by_program(optimizer))
            if self.on_failure == "raise":
                ledger.decide(failure, "raised")
                raise GradientsNotFinite(text, step=step, parameters=bad)
            _warn(text)
            return self._skips(failure)
        bad_input = None if self._auditing or agreement is not None else self._bad_input()
        if bad_input is not None:  # the batch held them before the model ran: no op of the step made them
            return self._input_failure(failure, bad, bad_input, recheck)
        origin = self._origin() if self._auditing else None
        watched = self._auditing
        audited = watched
        found = [origin] if origin is not None else []
        # In a job every rank replays the batch, or none (its collectives, if any, must match):
        # unless every rank ran this step under a full watch.
        replay = not (decision.all_watched if decision is not None else watched) and self.replay is not None and self._told()
        if replay:
            if watched:  # this rank audited it, another did not: the audit ends, the replay runs here too
                found = [anomaly for anomaly in self.end_audit() if anomaly.kind in _NONFINITE_KINDS]
                audited = False
            self.compiled_verdict = None
            ran, replayed = self.replay()  # the batch again, from its start, under a full watch
            self._losses = []  # the replay's own backward() is not the next step's
            watched = ran or watched
            origin = replayed if replayed is not None else origin
            found = [replayed] if replayed is not None else found
            if ran or decision is not None:
                self._replayed_at = step
        verdict, self.compiled_verdict = self.compiled_verdict, None
        if verdict is not None:
            ledger.verdicts.append(verdict)
        if decision is not None:  # watched means: on every rank (what the ranks do next must be the same)
            watched = decision.all_watched or replay
        if decision is not None and watched and self._told():
            self._watched_all_at = step
            ranks, first = self._exchange(str(step), found)  # every rank's findings: the first origin anywhere
            if first is not None and ranks.origin is not None and ranks.origin.rank != ranks.rank:
                origin = _elsewhere_anomaly(first, ranks, step, bad)
        ledger.explain(failure, origin, replayed=replay and watched)
        self._decided_origin = origin
        if self.on_failure == "raise" and watched:
            # The step ran under the full watch: its origin is known now, or no op made them.
            self._stop_rechecking()
            ledger.decide(failure, "raised")
            if origin is not None:
                error = AnomalyError(origin)
                if verdict is not None:
                    error.add_note(guard_words.replayed_verdict(verdict))
                raise error
            if verdict is not None:
                raise GradientsNotFinite(guard_words.leave_on_only_compiled(step, words.parameters(bad), verdict), step=step, parameters=bad)
            raise GradientsNotFinite(words.no_origin(step, bad, recheck, elsewhere=elsewhere, loss=loss), step=step, parameters=bad)
        if recheck is None and self._told():
            last = len(self.failures) == _TOLD_FAILURES
            text = words.failure(step, bad, self.on_failure, audited=watched and audited, replayed=watched and not audited,
                                 origin=_facts(origin), last=last, elsewhere=elsewhere, rank=_rank(agreement), loss=loss)
            _warn(text if verdict is None else f"{text}\n{guard_words.replayed_verdict(verdict)}")
        return self._skips(failure)

    def _input_failure(self, failure, bad, bad_input, recheck) -> bool:
        """A failed step whose batch held nan/inf when it entered the model: told (or raised)
        with the line that fed it, cause ``input``; the next step is re-checked as after any
        failure (a batch torch made recurs there with the op and line that made it)."""
        if self.on_failure == "raise":
            self._stop_rechecking()
        failure.cause = "input"
        text = words.bad_input(failure.step, bad, self.on_failure, *bad_input, rerun=self._rerun if self.on_failure == "raise" else None)
        if self.on_failure == "raise":
            self.ledger.decide(failure, "raised")
            raise GradientsNotFinite(text, step=failure.step, parameters=bad)
        if self._told():
            _warn(text)
        return self._skips(failure)

    def _verdict(self, optimizer, losses: list) -> bool:
        """Whether the step may run: the one source of the step's verdict
        (:class:`~opwatch.runners.step_verdict.VerdictFromStep`: GradScaler's unscale, the clip's
        total norm, or one fused pass over the gradients about to be applied, with the losses
        backward() ran on; at most one host read)."""
        with no_python_dispatch():  # an audit's watch may be open: the check is not the program's
            return self.verdict.finite(gradients(optimizer), losses, optimizer)

    def _gradients_finite(self, optimizer) -> bool:
        with no_python_dispatch():
            return self.verdict.gradients_finite(gradients(optimizer), optimizer)

    # -- a fused optimizer: the verdict handed over as found_inf, read at the next step ---------

    def _defers(self, optimizer, agreement) -> bool:
        """Whether this step's verdict goes to ``optimizer`` as ``found_inf`` (it skips a failing
        step on the device) and is read at the next step: a fused optimizer that GradScaler did
        not hand a flag, outside audits and re-checks, in a process of its own, when failing
        steps are skipped or raised."""
        return (agreement is None and self.on_failure != "apply" and not self._auditing and self._recheck_of is None
                and self.poisoned_since is None and self._hand_off.takes(optimizer))

    def _hand_flag(self, optimizer, losses) -> None:
        with no_python_dispatch():
            verdict = self.verdict.device_flag(gradients(optimizer), losses, optimizer)
        if verdict is None:  # no gradient, or on several devices: the host read of the other optimizers
            self._hand_off.forget(optimizer)
            grads = gradients(optimizer)
            if not grads or self._verdict(optimizer, losses):
                return
            first, *_ = grads
            verdict = DeviceVerdict(torch.ones((), device=first.device), torch.ones(2, device=first.device))
        self._hand_off.hand(optimizer, verdict, self.steps, losses)

    def _told_late(self, optimizer) -> None:
        """Read the flag handed to ``optimizer`` at its last step (``None``: every optimizer's,
        at the end of the run); a set flag is a failed step the device skipped, told now."""
        for late in self._hand_off.failed(optimizer):
            loss = _loss_kind(late.losses)
            failure = self.ledger.fail(late.step, [], "loss" if loss is not None and not late.gradients else "gradients", loss=loss)
            text = words.failed_late(late.step, None if optimizer is None else self.steps, self.on_failure, loss=loss, gradients=late.gradients)
            if self.on_failure == "raise":  # the device skipped it; the run stops here
                self.ledger.decide(failure, "raised")
                raise GradientsNotFinite(text, step=late.step, parameters=[])
            self.ledger.decide(failure, "skipped")  # on the device, by the fused optimizer
            if self._told():
                _warn(text)
                self._audit_after_step = optimizer is not None  # the next step under the full watch: a failure that recurs is named
            self._stop_when_stuck(failure)

    def _failed_at_check(self, optimizer, step: int, losses: list, error: AnomalyError) -> None:
        """A strict audit raised at this step's check point: the ledger counts the step as
        failed (with the origin the error names) when its gradients or loss are not finite."""
        if self._verdict(optimizer, losses):
            return
        with no_python_dispatch():
            bad = nonfinite_names(optimizer, self._names())
            failure = self.ledger.fail(step, bad, "gradients" if bad else "loss", loss=None if bad else _loss_kind(losses))
        self.ledger.explain(failure, error.anomaly)
        self.ledger.decide(failure, "raised")

    def failed_in_batch(self, fact) -> None:
        """A trigger that runs inside the batch (``guard_trainer``'s guarded training step)
        failed it: the optimizer step that follows counts as failed, with ``fact``'s origin and
        action (a :class:`~opwatch.runners.ledger.Failure` of that trigger's own ledger)."""
        failure = self.ledger.fail(self.ledger.steps + 1, fact.parameters, fact.cause, loss=fact.loss)
        self.ledger.explain(failure, fact.origin, replayed=fact.origin is not None)
        self.ledger.decide(failure, fact.action or "applied")
        self._stop_when_stuck(failure)

    def _stop_when_stuck(self, failure) -> None:
        """Raise :class:`RunStuck` once ``max_failed_in_a_row`` steps in a row failed."""
        ledger = self.ledger
        if not ledger.stuck(self.max_failed_in_a_row):
            return
        first = ledger.first_in_a_row
        self._stop_rechecking()
        ledger.decide(failure, "raised")
        text = words.stuck(first.step, failure.step, ledger.failed_in_a_row, first.parameters, _facts(ledger.first_origin()),
                           poisoned_since=ledger.poisoned_since, loss=first.loss, limit=self.max_failed_in_a_row,
                           applied=self.on_failure == "apply")
        raise RunStuck(text, step=first.step, parameters=first.parameters, failed_in_a_row=ledger.failed_in_a_row)

    def _job(self) -> Agreement | None:
        """The agreement of this run in a job of 2 or more ranks (read at the first step)."""
        if not self._job_read:
            self._job_read = True
            self._agreement = Agreement.start()
        return self._agreement

    def _exchange(self, key: str, found: list):
        """Publish this rank's nan/inf findings of a watched (or replayed) failing step and
        read the others' (bounded): ``(RankOrigin, the first origin's row or None)``."""
        agreement = self._agreement
        anomalies = [anomaly for anomaly in found if anomaly.kind in _NONFINITE_KINDS and getattr(anomaly, "record", None) is not None]
        try:
            return agreement.origins(f"leave-on/{key}", anomalies)
        except Exception:
            from .guarded.ranks import RankOrigin

            others = tuple(rank for rank in range(agreement.world) if rank != agreement.rank)
            return RankOrigin(agreement.rank, None, others, agreement.wait_s), None

    def _skips(self, failure) -> bool:
        """Whether the failed step does not run (counted)."""
        if self.on_failure == "apply":
            self.ledger.decide(failure, "applied")
            return False
        self.ledger.decide(failure, "skipped")
        return True

    def _origin(self):
        """The first nan/inf origin the running audit found, or ``None``."""
        found = [anomaly for anomaly in self.watch.anomalies if id(anomaly) not in self._before_audit and anomaly.kind in _NONFINITE_KINDS]
        return found[0] if found else None

    def _stop_rechecking(self) -> None:
        self._recheck_of = None
        self.end_audit()

    def _told(self) -> bool:
        """Whether the newest failure is one of those warned and re-checked one by one."""
        return len(self.failures) <= _TOLD_FAILURES

    def _written_by_program(self, optimizer) -> bool:
        """Whether a parameter holding nan/inf was written in place after ``optimizer``'s last
        step left it (its version counter moved), or before its first step: the program wrote it."""
        left = self._left_by_step.get(optimizer)
        if left is None:
            return True  # no optimizer step ran yet: an init or a load wrote them
        parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        if len(parameters) != len(left):
            return False  # groups changed: no fact to tell
        with torch.no_grad(), no_python_dispatch():
            return any(now != then and nonfinite_kind(parameter) is not None
                       for parameter, now, then in zip(parameters, version_counters(parameters), left))

    def decide_at_clip(self, optimizer, on_skip) -> None:
        """Decide ``optimizer``'s step when the program's clip has its total norm (Lightning clips
        after the callback's hook, right before the update): the norm then stands for the
        gradients; ``on_skip()`` drops the gradients of a step that must not run. A step whose
        clip never came is decided after it, at torch's post-hook."""
        runner = weakref.ref(self)

        def decide():
            seen = runner()
            if seen is not None:
                with torch.enable_grad():  # the clip runs under no_grad; a failing batch's replay runs a backward
                    if seen.before_step(optimizer):
                        on_skip()

        self._reductions.on_norm = decide

    def _after_step(self, optimizer, args, kwargs) -> None:
        undecided, self._reductions.on_norm = self._reductions.on_norm, None
        if undecided is not None:  # the clip the step was to be decided at never came
            undecided()
        self._hand_off.after_step(optimizer)  # GradScaler's contract: the flag lives for one step
        self._reductions.after_step(optimizer)
        # The parameters' version counters as this step left them (a Python read each, no kernel).
        self._left_by_step[optimizer] = version_counters([parameter for group in optimizer.param_groups for parameter in group["params"]])
        self._judge_step(optimizer)
        if self._audit_after_step:
            self._audit_after_step = False
            self.start_audit()
        self._watch_inputs()

    def _watch_inputs(self) -> None:
        """After the first audit: a forward pre-hook on the model alone (the outermost module
        the audit saw, or the trainer's), never a global one: it keeps a reference to what the
        step fed the model (no copy) and where, and sees a forward after the run's last step."""
        if self._inputs_hook is not None or not self._modules:
            return
        model = next(iter(self._modules))  # outermost first
        self._inputs_hook = model.register_forward_pre_hook(self._fed, with_kwargs=True)

    def _fed(self, module, args, kwargs) -> None:
        self._forward_after_step = True
        if not self._auditing:
            self._inputs = (module, args, kwargs, user_frame(sys._getframe(1)))

    def _judge_step(self, optimizer) -> None:
        """After the optimizer step: end an audit or re-check, and start the re-check of a failure."""
        failed_now = bool(self.failures) and self.ledger.latest.step == self.steps
        auditing = self._auditing
        # A failure of a fully watched (or replayed) step was told with its origin; in a job,
        # only when every rank watched it (the ranks re-check the next step together).
        audited_now = self._auditing or self._replayed_at == self.steps
        if self._agreement is not None:
            audited_now = self._watched_all_at == self.steps
        if auditing:
            recheck, self._recheck_of = self._recheck_of, None
            origin = self._origin() if recheck is not None else None
            if recheck is not None and self._agreement is not None:  # every rank re-checked this step
                if failed_now:  # found and exchanged at the check before it
                    origin = self._decided_origin
                else:
                    ranks, first = self._exchange(f"{self.steps}/recheck", [origin] if origin is not None else [])
                    if first is not None and ranks.origin is not None and ranks.origin.rank != ranks.rank:
                        origin = _elsewhere_anomaly(first, ranks, self.steps, [])
            if origin is not None and not failed_now:  # a failing re-check kept it already
                self.ledger.explain(next((failure for failure in self.failures if failure.step == recheck), None), origin)
            self.end_audit()
            rechecked = next((failure for failure in self.failures if failure.step == recheck), None)
            # A bad batch told as such needs no "did not recur": only an origin the re-check found is news.
            quiet = rechecked is not None and rechecked.cause == "input" and origin is None
            if recheck is not None and not quiet:
                _warn(words.recheck(recheck, self.steps, _facts(origin), failed_again=failed_now, rank=_rank(self._agreement)))
        if not failed_now or self.poisoned_since is not None:
            return
        if self.on_failure == "apply":
            weights = nonfinite_parameters(optimizer, self._names())
            poisoned = bool(weights)
            if self._agreement is not None:  # a shard may hold them on one rank only
                with no_python_dispatch():
                    poisoned = self._agreement.failed(poisoned, self.steps, "", "poisoned")
            if poisoned:  # from now on every step carries them: no op of a later step is the origin
                self.ledger.poisoned_since = self.steps
                _warn(words.poisoned(self.steps, weights, from_finite=False, rank=_rank(self._agreement)))
                return
        newest = self.ledger.latest
        if self._told() and not audited_now and newest.origin is None:  # guard_trainer's replay may have named it
            self._recheck_of = self.steps
            self.start_audit()

    def _step_ended(self) -> None:
        self._forward_after_step = False

    def _unwatch_inputs(self) -> None:
        if self._inputs_hook is not None:
            self._inputs_hook.remove()
        self._inputs_hook = self._inputs = None

    def _bad_input(self):
        """``(module name, argument, kind, where)`` when what the step fed the model holds
        nan/inf (read after a failed check only), else ``None``."""
        if self._inputs is None:
            return None
        module, args, kwargs, (code, lasti, _) = self._inputs
        named = [(f"argument {position}", value) for position, value in enumerate(args)] + list(kwargs.items())
        with torch.no_grad(), no_python_dispatch():
            for name, value in named:
                for tensor in tensors_in(value):
                    kind = nonfinite_kind(tensor) if tensor.is_floating_point() or tensor.is_complex() else None
                    if kind is not None:
                        position = position_of(code, lasti)
                        where = None if code is None else f"{display_path(position.filename)}:{position.lineno}"
                        return type(module).__name__, (name, tensor.dtype, tuple(tensor.shape), str(tensor.device)), kind, where
        return None

    # -- names --------------------------------------------------------------------------------

    def _names(self) -> dict:
        names = {}
        for module in list(self._modules):  # outermost first: a module's hook runs before its children's
            for name, parameter in module.named_parameters():
                names.setdefault(id(parameter), name)
        return names

    def summary(self, *, rerun: str | None = None) -> str:
        """The counts; for a run that ended with ops no check saw (:attr:`unjudged_end`), a
        line saying so, with ``rerun``, the command that checks every op."""
        ledger = self.ledger
        losses = sum(failure.cause == "loss" for failure in ledger.failures)
        text = words.summary(ledger.steps, ledger.audited, ledger.failed, self.watch.enabled, ledger.skipped, losses=losses)
        if self.unjudged_end:
            text += "\n" + words.unjudged_end(self.steps, rerun)
        return text

    def watch_summary(self) -> str:
        """The audits' summary; where it would say "no anomalies" alone while a step failed or
        the run ended unjudged, a line that says what the ledger holds instead."""
        text = self.watch.summary()
        if self.ledger.clean or self.watch.anomalies:
            return text
        return words.no_op_named(text, self.ledger.failed, self.ledger.unjudged_end, _facts(self.ledger.first_origin()))

    def print_summary(self, prefix: str = "", *, watch_summary: bool = False, rerun: str | None = None) -> None:
        """Print the counts (after the audits' summary with ``watch_summary``)."""
        text = prefix + self.summary(rerun=rerun)
        if watch_summary:
            text = prefix + self.watch_summary() + "\n" + text
        print(text, file=self._file if self._file is not None else sys.stderr)


def gradients(optimizer) -> list:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _trained(optimizer) -> list:
    """The parameters of ``optimizer`` that have a gradient."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def nonfinite_names(optimizer, names: dict, *, of=lambda parameter: parameter.grad) -> list:
    """``(name, "nan" | "inf")`` of each parameter whose gradient (or ``of(parameter)``) is
    not finite (read after a failed check, so one host read per parameter is fine); a parameter
    the audit did not see in a module is named by its place in ``optimizer.param_groups``."""
    bad = []
    with torch.no_grad(), no_python_dispatch():
        for number, group in enumerate(optimizer.param_groups):
            for position, parameter in enumerate(group["params"]):
                grad = of(parameter)
                kind = None if grad is None else nonfinite_kind(grad)
                if kind is None:
                    continue
                bad.append((names.get(id(parameter), f"param_groups[{number}]['params'][{position}]"), kind))
    return bad


def nonfinite_parameters(optimizer, names: dict) -> list:
    """``(name, kind)`` of each parameter of ``optimizer`` that holds nan/inf itself."""
    # The parameter itself (nonfinite_kind detaches what it reads): detached here, under
    # no_python_dispatch, a DTensor would lose its local shard.
    return nonfinite_names(optimizer, names, of=lambda parameter: parameter)


class _Skipped:
    """What an optimizer's step function gets as ``self`` at a skipped step: the optimizer,
    seen through groups that hold no parameter, so that its update touches nothing (a closure
    passed to the step still runs)."""

    def __init__(self, optimizer):
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["param_groups"] = [{**group, "params": []} for group in optimizer.param_groups]

    def __getattr__(self, name):
        return getattr(self.__dict__["_optimizer"], name)


def _facts(origin):
    """``(kind, op, where, phase)`` of an origin anomaly, or ``None``; ``(kind, op, where,
    phase, rank)`` for an origin made on another rank."""
    if origin is None:
        return None
    facts = (origin.kind, origin.op, origin.where, origin.phase)
    return facts + (origin.rank,) if isinstance(origin, RankAnomaly) else facts


def _loss_kind(losses) -> str | None:
    """``"nan"`` or ``"inf"``: the first loss that is not finite (read after a failed check)."""
    with torch.no_grad(), no_python_dispatch():
        return next((kind for kind in map(nonfinite_kind, losses) if kind is not None), None)


def _rank(agreement) -> int | None:
    return None if agreement is None else agreement.rank


def _elsewhere(decision, bad) -> tuple:
    """The ranks whose gradients failed when this rank's own were finite (in a job), else ``()``."""
    if decision is None or bad:
        return ()
    return decision.nonfinite


def _elsewhere_anomaly(first, ranks, step: int, bad) -> RankAnomaly:
    """The origin another rank made, as this rank raises and tells it: that rank's facts
    (``.rank``, ``.op``, ``.lineno``) with a message saying where this rank stood."""
    text = words.made_elsewhere(ranks.rank, step, ranks.origin, bool(bad), ranks.missing, ranks.timeout, first.message)
    return RankAnomaly(**{**first.fields(), "message": text}, rank=first.rank)


def _warn(text: str) -> None:
    """Warn, attributed to the user's line that called the optimizer step (or ended the run)."""
    warn_at_user(OpwatchWarning(text))
