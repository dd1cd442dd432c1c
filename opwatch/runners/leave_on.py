"""Leave opwatch on for a whole training run: ``python -m opwatch --guard`` and the trainers'
``mode="guard"``.

Shape, dtype and device bugs belong to the code path, not to the values: one fully watched
optimizer step (the audit) sees them, one per optimizer stepped on its own loss
(``opwatch.runners.policy.optimizers``). After it the program runs with no dispatch mode, and
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
skips never reach the hooks, so they are not failures (and not counted as steps). They are
counted apart, told at the next ``backward()``; a run that GradScaler skips for good (its scale
below 1 after ``max_failed_in_a_row`` skips in a row) is stuck all the same.

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
from collections import Counter
from functools import partial

import torch

from ..core.compat import MODIFIED_SAVED_TENSOR, compiled_module_inner, module_class_name, run_uncompiled, unseen_by_dispatch_modes
from ..core.sites import file_line, user_frame
from ..findings.anomaly import AnomalyError, add_note
from ..render import leave_on as words
from ..session import Watch, strict, watch
from .guarded.audit import signature  # what an audit depends on: one definition for guard and leave-on
from .guarded.check import ON_FAILURE, on_failure_option
from .batches import FedBatches
from .written_buffers import WrittenBuffers
from .step_verdict import trained
from .evaluations import EvaluationCalls
from .ledger import MAX_FAILED_IN_A_ROW, Failure, LedgerCounts
from .policy import GradientsNotFinite, RunStuck, StepPolicy, nonfinite_of, origin_facts

__all__ = ["LeaveOn", "GradientsNotFinite", "RunStuck", "Failure", "ON_FAILURE", "signature", "nonfinite_names", "nonfinite_parameters"]

_MAX_LOSSES = 64  # losses kept between two optimizer steps (gradient accumulation)


class LeaveOn(LedgerCounts):
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
    ``max_failed_in_a_row``: :class:`RunStuck` after that many failed steps in a row (``None``:
    never). ``rerun``: the command that runs the program under a full watch, named when the
    program ends before a failure could be re-checked. ``strict``, ``allow``, ``last``, ``file``,
    ``warn``, ``checks``, ``max_records`` go to the watch (:func:`opwatch.watch`); the same watch
    is re-entered for every audit, so its anomalies accumulate and warn once per line.

    Every decision is the run's :class:`~opwatch.runners.policy.StepPolicy`'s (:attr:`policy`);
    this class is its trigger: the hooks, the audits, the batch it keeps a reference to.
    """

    def __init__(self, *, strict_mode: bool = False, on_failure: str | None = None, audit: str = "first", pre_hook: bool = True,
                 max_audits: int = 8, file=None, rerun: str | None = None, max_failed_in_a_row: int | None = MAX_FAILED_IN_A_ROW,
                 **watch_options):
        if audit not in ("first", "manual"):
            raise ValueError(f"audit must be 'first' or 'manual', got {audit!r}")
        if isinstance(max_audits, bool) or not isinstance(max_audits, int) or max_audits < 1:
            raise ValueError(f"max_audits must be an int of at least 1, got {max_audits!r}")
        self.policy = StepPolicy(on_failure=on_failure_option(on_failure, "raise" if strict_mode else "skip"),
                                 max_failed_in_a_row=max_failed_in_a_row)
        self.ledger = self.policy.ledger  # the run's facts: every count and summary reads them
        self.pre_hook = pre_hook  # read when the run starts
        self._max_audits = max_audits
        self._signatures: set = set()
        self.strict = strict_mode
        self.watch: Watch = (strict if strict_mode else watch)(file=file, **watch_options)
        self._audit_first = audit == "first"
        self._file = file
        self.rerun = rerun
        self.policy.command_line = rerun is not None  # the CLI names the command that reruns the script
        self._auditing = False
        self._before_audit: set = set()
        self._modules = weakref.WeakKeyDictionary()  # modules seen in audits: parameter names
        self._handles: list = []  # the optimizer hooks
        self._module_hook = None  # names the parameters; only during audits
        # Set by a trainer that can run the failing batch again from its start under a full
        # watch: called at a failed step, returns (whether it ran, the origin anomaly or None).
        self.replay = None
        self.unreplayed = None  # a trainer that never replays a failing batch: "transformers" or "lightning" (words.no_op_named)
        self.compiled_verdict = None  # set by that replay for a step that runs compiled code (guarded.compiled)
        self.batches = FedBatches(lambda: self._auditing)  # what each step fed the model, after the first audit
        self.policy.buffers = WrittenBuffers(lambda: list(self._modules))  # what a step that does not run wrote, put back
        self.evaluations = EvaluationCalls(lambda: self._auditing, lambda: self.ledger.steps,  # what it returned with gradients off
                                           lambda: self.policy.evaluations_read(self.evaluations, self.rerun))
        self._losses: list = []  # what backward() ran on since the last optimizer step (detached views, no copy)
        self._backward = None  # torch.Tensor.backward as it was before the run

    @property
    def on_failure(self) -> str:
        """The policy's: ``"skip"``, ``"raise"`` or ``"apply"``."""
        return self.policy.on_failure

    # -- the run ------------------------------------------------------------------------------

    def __enter__(self) -> LeaveOn:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        for handle in self._handles:  # entered again (a second trainer.train())
            handle.remove()
        self._handles = []
        if not self.watch.enabled:  # OPWATCH_DISABLE: the run goes on untouched
            return self
        self._handles = [register_optimizer_step_post_hook(run_uncompiled(self._after_step))]
        self._see_losses()
        if self.pre_hook:
            self._handles.append(register_optimizer_step_pre_hook(run_uncompiled(self._before_step)))
        if self._audit_first:
            self.start_audit()
        return self

    def __exit__(self, exc_type, exc, traceback_) -> bool:
        """End the run (again: nothing happens)."""
        while self._handles:
            self._handles.pop().remove()
        # The run's last ops ran after its last optimizer step with no watch on: no gradient
        # check followed them (a script that stops on a nan loss, an evaluation pass), so this
        # run's summary cannot speak for them; what they left is read before the hooks go.
        self.policy.ended_unjudged(self, self._losses, unjudged=self.batches.after_step and not self._auditing)
        self.batches.unwatch()
        self.evaluations.unwatch()
        self.policy.evaluations_read(self.evaluations, self.rerun)  # an evaluation pass that ended the run
        self.scaler_skipped(at_end=True)  # the last step's, if skipped
        self.policy.run_ended(self.ledger.steps, exc, self)
        self._unsee_losses()
        return False

    def _see_losses(self) -> None:
        """Keep what ``Tensor.backward()`` runs on (a detached view, no copy) for the length of
        the run, restored on exit: its finiteness is read in the same fused read as the
        gradients', so a nan loss with finite gradients (a batch whose every label is ignored:
        0/0) fails its step too."""
        if self._backward is not None:
            return
        self.policy.verdict.reductions.__enter__()  # and the clip norms and GradScaler unscales the run computes
        original = self._backward = torch.Tensor.backward
        torch.Tensor.backward = _keeping_losses(weakref.ref(self), original)

    def _unsee_losses(self) -> None:
        if self._backward is not None:
            self.policy.verdict.reductions.__exit__(None, None, None)
            if getattr(torch.Tensor.backward, "__wrapped__", None) is self._backward:
                torch.Tensor.backward = self._backward
        self._backward = None
        self._losses = []

    @property
    def anomalies(self) -> list:
        """What the audits found, then the origins replays named that no audit holds (the
        trainers' ``callback.anomalies``)."""
        found = list(self.watch.anomalies)
        return found + [origin for origin in self.ledger.origins if all(origin is not kept for kept in found)]

    @property
    def auditing(self) -> bool:
        return self._auditing

    # -- audits -------------------------------------------------------------------------------

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
        if self._auditing or not self.watch.enabled or self.ledger.poisoned_since is not None:
            return  # weights that hold nan/inf would make every op that reads them look like an origin
        if self.ledger.failures:  # what the told failures left (a loss summed for the log) is not this audit's to name
            self.watch._failure_told()
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

    def audit_origin(self, *, last: bool = False):
        """The first (``last``: the latest) nan/inf origin the running audit found, or ``None``."""
        found = [anomaly for anomaly in self.watch.anomalies if id(anomaly) not in self._before_audit and anomaly.kind in ("nan", "inf")]
        return (found[-1] if last else found[0]) if found else None

    def know(self, module) -> None:
        """Name the parameters after ``module`` (the trainer's model) before any other; its
        buffers are kept as the run starts with them."""
        self._modules.setdefault(module, None)
        self.policy.buffers.start()

    def end_batch(self) -> None:
        """A trainer's batch ended: end an audit that saw no optimizer step (gradient
        accumulation); a re-check armed after a failed step goes on to the next step."""
        if self.policy.recheck_of is None and not self.policy.optimizer_audits.armed:
            self.end_audit()

    def _module_seen(self, module, args) -> None:
        if self._modules.get(module) is None:  # not seen, or known (the trainer's model) and called at last
            # Where it was first called (code, offset): told only beside a name two parameters share.
            code, lasti, _ = user_frame(sys._getframe(1))
            self._modules[module] = (code, lasti)
            if self.ledger.steps == 0:  # the run's first forward: its buffers as the run starts with them
                self.policy.buffers.start()

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
        step = self.ledger.step(audited=self._auditing)
        fresh = self.batches.judged() or bool(self._losses)  # a batch since the last step, judged here
        losses, self._losses = self._losses, []
        named = partial(_named, optimizer, self._names)
        try:
            if self._auditing:
                try:
                    self.watch.check()  # the watch's own check point: names the origin, raises in strict
                except AnomalyError as error:  # strict: the step does not run; counted if it failed
                    self.policy.failed_at_check(step, named, gradients(optimizer), losses, error)
                    raise
            return self.policy.check_step(step, named, gradients(optimizer), losses, self, optimizer=optimizer, modules=self._modules, fresh=fresh)
        finally:
            self.batches.step_judged()  # the next step's batches are its own
            self.policy.evaluations_read(self.evaluations, self.rerun)  # an evaluation pass since the last step, once it is judged

    def replayed(self) -> None:
        """The trainer's replay ran: its own ``backward()`` is not the next step's."""
        self._losses = []

    def failed_in_batch(self, fact) -> None:
        """A trigger that runs inside the batch (``guard_trainer``'s guarded training step)
        failed it: the optimizer step that follows counts as failed (:meth:`StepPolicy.failed_in_batch`)."""
        self.policy.failed_in_batch(fact, self)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.policy.writes.stepped(optimizer)
        self.policy.step_done(self.ledger.steps, lambda: _named(optimizer, self._names()), self, optimizer)
        model = None if self.batches.watching else self.batches.trained_model(self._modules, optimizer)
        if model is not None:
            self.batches.watch(model)
            self.evaluations.watch(model)

    # -- the batch ----------------------------------------------------------------------------

    def bad_input(self):
        """What the step fed the model that held nan/inf (:meth:`FedBatches.bad_input`)."""
        return self.batches.bad_input()

    # -- names and summaries ------------------------------------------------------------------

    def _names(self) -> dict:
        """``{id(parameter): name}`` of the modules seen (:func:`parameter_names`)."""
        return parameter_names(self._modules)

    def scaler_skipped(self, *, at_end: bool = False) -> None:
        """GradScaler skipped the step before this backward (``at_end``: the run's last step,
        if it did): the policy counts each optimizer's, tells one whose loss was not finite
        before it was scaled (the losses kept for that step: one host read, on a skipped step
        only), and stops a stuck run with the op a full watch of the skipped steps names."""
        reductions, policy = self.policy.verdict.reductions, self.policy
        skips = reductions.skipped if not at_end or reductions.skipped_since() else []  # at the end: the last step's, read now
        own = policy.verdict.loss_kind(self._losses, scaled=True) if skips else None
        loss = own if at_end else policy.scaler_loss_of_the_job(own, skips, self._modules)  # at the end a rank may be gone
        # Each optimizer step skipped is counted (several optimizers after one backward).
        stuck = [policy.scaler_skipped(skip.scaler, skip.optimizer, modules=self._modules, in_kernel=skip.in_kernel, loss=loss)
                 for skip in skips]
        if own is not None and not self._auditing:  # an audit's watch names what made it
            policy.tell_scaler_skipped_loss(own, self.batches, rerun=self.rerun)
        if any(stuck) and not at_end:
            policy.stop_stuck_in_scaler_skips(self, rerun=self.rerun)

    def summary(self, *, rerun: str | None = None) -> str:
        """The counts; for a run that ended with ops no check saw (:attr:`unjudged_end`), a
        line saying so, with ``rerun``, the command that checks every op."""
        ledger = self.ledger
        steps, audited, failed, skipped = ledger.counts().values()  # settled: every step that ran
        text = words.summary(steps, audited, failed, self.watch.enabled, skipped, causes=ledger.causes(),
                             scaler=(ledger.scaler_skipped, ledger.scaler_in_a_row, ledger.scale, ledger.scaler_skipped_loss),
                             evaluations=(ledger.evaluations_nan, ledger.evaluations_from_input))
        if ledger.unjudged_end:
            text += "\n" + words.unjudged_end(steps, rerun, ledger.scaler_in_a_row, left=ledger.unjudged_left)
        return text

    def watch_summary(self, every_rank=None) -> str:
        """The audits' summary (``every_rank``: the job's :class:`~opwatch.findings.ranks.AllAnomalies`
        instead, whose combined summary follows the guard's lines; the ranks decide each step
        together, so this rank's ledger counts for all); where it would say "no anomalies"
        alone while a step failed, an evaluation returned nan (on any rank) or the run ended
        unjudged, a line that says what the ledger holds instead."""
        found = self.watch.anomalies if every_rank is None else every_rank
        text = self.watch.summary() if every_rank is None else every_rank.summary()
        evaluations = self.policy.evaluations_of_the_job(every_rank)  # each rank's own
        if (self.ledger.clean and not evaluations) or found:
            return text
        origin = self.ledger.first_origin()
        return words.no_op_named(text, self.ledger.failed, self.ledger.unjudged_end, origin_facts(origin), world=getattr(every_rank, "world", None),
                                 told=getattr(origin, "message", None), evaluations=evaluations, rerun=self.rerun if self.ledger.unnamed() else None,
                                 scaler_losses=self.ledger.scaler_skipped_loss, trainer=self.unreplayed if self.ledger.unnamed() else None)

    def print_summary(self, prefix: str = "", *, watch_summary: bool = False, rerun: str | None = None) -> None:
        """Print the counts (after the audits' summary with ``watch_summary``)."""
        text = prefix + self.summary(rerun=rerun)
        if watch_summary:
            text = prefix + self.watch_summary() + "\n" + text
        print(text, file=self._file if self._file is not None else sys.stderr)


def parameter_names(modules) -> dict:
    """``{id(parameter): name}``: its name in the outermost module seen that holds it
    (``modules``: module -> where it was first called, outermost first). Where modules called
    one by one (``model[0](x)``, then ``model[2](h)``) give two parameters one name, each is
    told with its module's class and where that was first called: ``weight (Linear at
    train.py:8)``."""
    names, owners = {}, {}
    for module, site in list(modules.items()):  # outermost first: a module's hook runs before its children's
        module = compiled_module_inner(module) or module  # torch.compile's wrapper: the model's own names, no _orig_mod.
        for name, parameter in module.named_parameters():
            if id(parameter) not in names:
                names[id(parameter)], owners[id(parameter)] = name, (module, site)
    taken = Counter(names.values())
    for ident, name in names.items():
        if taken[name] > 1:
            module, site = owners[ident]
            where = None if site is None else file_line(*site)
            names[ident] = f"{name} ({module_class_name(module)}" + (f" at {where}" if where else "") + ")"
    return names


def _keeping_losses(runner, original):
    """``Tensor.backward`` (``original``) wrapped to keep each loss it runs on in the
    ``runner``'s (a weak reference to a :class:`LeaveOn`) ``_losses``."""
    running = None  # the tensor whose backward() runs now

    def backward(tensor, *args, **kwargs):
        nonlocal running
        seen = runner()
        # Under a function mode (the program's, or the watch's in an audit) torch's
        # Tensor.backward hands the call to the mode as Tensor.backward, which is this wrapper
        # again, for the same tensor: its loss is kept once.
        if seen is None or running is tensor:
            return original(tensor, *args, **kwargs)
        if seen.policy.verdict.reductions.after_backward():  # GradScaler skipped the step those losses made
            seen.scaler_skipped()  # RunStuck when stuck
            seen._losses = []
        elif seen.batches.gradients_dropped():  # the program skipped that step itself: those losses made no gradient now
            seen._losses = []
        if len(seen._losses) < _MAX_LOSSES and tensor.is_floating_point():
            seen._losses.append(unseen_by_dispatch_modes(tensor.detach))
        running = tensor
        try:
            return original(tensor, *args, **kwargs)
        except RuntimeError as error:
            if MODIFIED_SAVED_TENSOR in str(error) and not seen.auditing:  # an audit's watch names the ops itself
                add_note(error, words.overwritten_unwatched(seen.rerun))
            raise
        finally:
            running = None
            seen.batches.backward_ended()

    backward.__wrapped__ = original
    return backward


def _named(optimizer, names) -> list:
    """``(name, parameter)`` of each parameter of ``optimizer``; one the audit did not see in a
    module is named by its place in ``optimizer.param_groups``. ``names``: ``{id: name}``, or
    what makes it (called only here: the names are made for a failed step only)."""
    names = names() if callable(names) else names
    return [(names.get(id(parameter), f"param_groups[{number}]['params'][{position}]"), parameter)
            for number, group in enumerate(optimizer.param_groups) for position, parameter in enumerate(group["params"])]


def gradients(optimizer) -> list:
    """The gradients of the parameters ``optimizer`` trains (those that have one)."""
    return [parameter.grad for parameter in trained(optimizer)]


def nonfinite_names(optimizer, names: dict) -> list:
    """``(name, "nan" | "inf")`` of each parameter of ``optimizer`` whose gradient is not finite."""
    return nonfinite_of(_named(optimizer, names), lambda parameter: parameter.grad)


def nonfinite_parameters(optimizer, names: dict) -> list:
    """``(name, kind)`` of each parameter of ``optimizer`` that holds nan/inf itself."""
    return nonfinite_of(_named(optimizer, names), lambda parameter: parameter)


class _Skipped:
    """What an optimizer's step function gets as ``self`` at a skipped step: the optimizer,
    seen through groups that hold no parameter, so that its update touches nothing (a closure
    passed to the step still runs)."""

    def __init__(self, optimizer):
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["param_groups"] = [{**group, "params": []} for group in optimizer.param_groups]

    def __getattr__(self, name):
        return getattr(self.__dict__["_optimizer"], name)
