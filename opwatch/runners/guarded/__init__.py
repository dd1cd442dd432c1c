"""``opwatch.guard``: eager speed on healthy steps, a full watch on the calls worth auditing,
and a failing step replayed under a full watch, its origin named, with a one-op repro.

The way of one guarded call:

1. what the step starts from is kept (:mod:`.snapshot`): the RNG states, a copy of the
   model's buffers, which parameters held a ``.grad`` (no copy of the gradients), the version
   counters of the parameters and of the tensor arguments;
2. ``train_step`` runs as it is, with no dispatch mode; or, when the call is audited
   (:mod:`.audit`: the first call, each new signature of the arguments, every N-th call),
   under a full watch with every check, whose findings are kept and warned (or raised);
3. one finiteness check of what it returned and of the gradients (:mod:`.check`): the clip's
   total norm when the step clipped every gradient (:mod:`opwatch.runners.step_verdict`), else
   one fused pass;
4. a step that raised or failed the check is replayed under a full watch (:mod:`.replay`,
   with :mod:`.repro`'s one-op repro), or judged from its audit's watch when it had one;
5. the buffers are left as one run of the step left them, the ``.grad`` dropped (the
   optimizer never sees the bad gradients), and :class:`~opwatch.AnomalyError`
   names the origin; or, with ``on_failure="skip"``, the step is undone and skipped.

Every sentence it says is made in :mod:`opwatch.render.guard`.

Importing ``opwatch.guard`` the package binds it as ``opwatch``'s attribute ``guard`` (Python
does so for every submodule); ``opwatch.guard`` and ``from opwatch import guard`` give the
function as long as the package is first imported through them (``opwatch/__init__.py`` loads
it lazily and then binds the function).
"""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (it reads
# __tracebackhide__ in each frame's globals): opwatch's frames are not the user's story.
__tracebackhide__ = True

import functools
import os
import warnings
from collections import deque

import torch

from ...findings.anomaly import Anomaly, AnomalyError, OpwatchWarning, add_note
from ...render import guard as words
from ...session import Watch, _disabled_by_environment
from . import compiled as compiled_steps
from .audit import Audits
from .check import FailedElsewhere, Raised, not_finite, on_failure_option
from .scaler import ScalerSteps
from .ranks import NONFINITE as NONFINITE_CODE, RAISED, Agreement, raised_where
from . import replay as replays
from .replay import NONFINITE, allow_option, first_line, judge
from .snapshot import Snapshots, changed_arguments
from ..ledger import MAX_FAILED_IN_A_ROW
from ..step_verdict import shared_gradients
from .. import policy as step_policy  # the module, not its names: policy imports guarded's rooms too

__all__ = ["guard", "Guarded"]

# Exceptions a replay cannot explain: raised as they are.
_NOT_REPLAYED = (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else ()
_Tensor = torch.Tensor
_MAX_KEPT = 100  # failures and audit findings kept on a Guarded


def guard(
    train_step,
    model,
    *,
    audit="new",
    max_audits: int = 8,
    strict: bool = False,
    checks=None,
    allow=(),
    on_failure: str = "raise",
    repro: bool = True,
    repro_dir=None,
    repro_max_bytes: int = 128 * 2**20,
    last: int = 10,
    max_records: int = 10_000,
    scaler=None,
    max_failed_in_a_row: int | None = MAX_FAILED_IN_A_ROW,
) -> Guarded:
    """Run ``train_step`` at eager speed; when a step goes wrong, replay it under a full watch.

    Example::

        step = opwatch.guard(train_step, model)   # model: an nn.Module, or its parameters
        for batch in loader:
            optimizer.zero_grad()
            loss = step(batch)                    # train_step(batch): forward and backward
            optimizer.step()

    A healthy step runs ``train_step`` with no dispatch mode, then one check that the
    tensors (and floats) it returned and the parameters' gradients are finite, one host read
    (kept on purpose: the call decides before it returns): a step that clipped every gradient
    (``clip_grad_norm_``) is judged by the clip's total norm, any other by the fused check
    GradScaler runs (a loss that is a CPU scalar is read where it lies). A step that raised, or whose check found nan/inf, is run
    again from where it started (RNG states of the CPU and every CUDA device, the model's
    buffers, the ``.grad`` it found zeroed: no copy of the gradients is kept) on the same arguments, under a watch that
    checks every op's outputs as it goes. :class:`~opwatch.AnomalyError` then names the op that
    made the first nan/inf, or the anomaly at (or before) the op that raised, with everything a
    strict watch reports; the step's own exception is chained. ``error.anomaly.repro`` is a
    folder with that op's inputs and a ``repro.py`` that runs the op alone.

    Audits: shape, dtype and device bugs (a ``(B, 1)`` prediction minus a ``(B,)`` target, a
    float64 numpy weight upcasting the loss, a tensor left on another device) raise nothing and
    make no nan: the fused check cannot see them. They belong to the code path and to the
    arguments' signature (nesting structure, shapes, dtypes, devices), not to their values, so
    the first call and every call whose signature is new run under a full watch with every
    check (``checks=``): an *audit*. Its findings land in ``.anomalies`` and are warned once per
    (kind, file, line) as ``watch()`` does, or raise :class:`~opwatch.AnomalyError` after the
    step with ``strict=True`` (the ``.grad`` put back as the step found them). A nan/inf that
    fails an audited step is reported from that audit's watch (no replay, no repro). An audited
    step gives bitwise the results of an eager one; it costs what ``watch()`` costs, once per
    signature, for at most ``max_audits`` signatures.

    Afterwards the model's buffers are as one run of the step left them (updated once) and
    the ``.grad`` dropped (``None``; gradients it accumulated onto are lost with it, as
    GradScaler loses an overflowing step's), so the optimizer never sees the bad gradients.

    ``train_step`` must leave the parameters alone (``optimizer.step()`` goes after the guarded
    call): a step that changes them is refused with a ``ValueError`` at its first call, since
    it could not be replayed. A failing step that changed one of its tensor arguments in place
    is refused as well.

    When a replay may not reproduce the failure: nondeterministic kernels (CUDA atomics in
    ``index_add``/``scatter_add``/some convolution backward algorithms), steps that read data
    or state that changes (data loading inside ``train_step``, a counter, a random source other
    than torch's generators), other devices' RNGs, side effects (logging, a global step count,
    which then happen twice). When the replay finds nothing, the error says so plainly.
    Out-of-memory errors are raised as they are, never replayed. In a distributed job (world
    size > 1) the failure flag is all-reduced once per step (``MAX``, bounded by
    ``$OPWATCH_COLLECTIVE_TIMEOUT`` or the process group's timeout), so every rank replays the same
    steps with matching collectives and applies the same ``on_failure``; after the replay the
    ranks exchange what they found and every error names the rank that made the nan/inf. A
    step that raises on one rank stops every rank: that rank re-raises its exception, the
    others raise :class:`~opwatch.runners.guarded.ranks.RaisedElsewhere` naming its rank,
    exception and line (no rank replays it). With
    ``torch.amp.GradScaler``, scaled gradients overflow now and then by design: pass the
    scaler (``scaler=``) and the gradients are left to it (it skips such steps and lowers its
    scale); only what the step returned is checked then. Without it, each overflow step would
    be replayed (slowly) and raise, or be skipped with ``on_failure="skip"``.

    Options (keyword-only):

    audit
        Which calls run under a full watch: ``"new"`` (default): the first call and each call
        whose arguments' signature is new; ``N`` (an int >= 1): those and every N-th call;
        ``"never"``: none (healthy steps are only checked for nan/inf).
        ``guard(step, model, audit=100)``.
    max_audits
        The most distinct signatures audited (default 8), so that variable-length batches do
        not audit for ever; calls due under ``audit=N`` are audited still.
        ``guard(step, model, max_audits=32)``.
    strict
        Raise :class:`~opwatch.AnomalyError` for an audit's first finding instead of warning.
        ``guard(step, model, strict=True)``.

    checks
        The checks audits and the replay run (``opwatch.watch``'s names); without ``"nonfinite"`` a
        healthy step is not checked at all and only steps that raise are replayed.
        ``guard(step, model, checks=["device_mismatch", "dtype_mismatch"])``.
    allow
        Anomalies the replay accepts (``opwatch.Allow`` entries, as ``watch(allow=...)``).
        ``guard(step, model, allow=[opwatch.Allow(kind="broadcast")])``.
    on_failure
        What a step that made nan/inf does once its replay named the origin (the same words as
        ``python -m opwatch --guard --on-failure`` and the trainers' guard modes): ``"raise"``
        (default) raises :class:`~opwatch.AnomalyError`; ``"skip"`` undoes the step (buffers
        as they were before it, ``.grad`` dropped; ``None`` grads make ``optimizer.step()`` leave
        the parameters alone, as a step GradScaler skips), warns once per origin line, keeps
        it in ``.failures``, and the call returns ``None``; ``"apply"`` warns the same way and
        leaves the step's non-finite gradients for the optimizer (the call returns what the
        step returned). Steps that raise always raise. Once the parameters themselves hold
        nan/inf, a failing step is not replayed (every op that reads them would look like an
        origin): that is said once, with the call whose gradients were applied.
        ``guard(step, model, on_failure="skip")``.
    repro
        Write a one-op repro of the origin (and, for a step only the compiled run fails, a
        one-file repro of the failing graph on its saved inputs). ``guard(step, model, repro=False)``.
    repro_dir
        Where repro folders go (a new folder each); the system's temporary folder when
        ``None``. ``guard(step, model, repro_dir="repros")``.
    repro_max_bytes
        The most tensor data a repro saves; inputs beyond it are left out (the repro fills
        them with zeros and says so). ``guard(step, model, repro_max_bytes=2**30)``.
    last
        How many of the replay's ops, up to the origin, the error's note shows.
        ``guard(step, model, last=30)``.
    max_records
        Size of the replay's op log (``opwatch.watch``'s option). ``guard(step, model, max_records=50_000)``.
    scaler
        The ``torch.amp.GradScaler`` of an fp16 loop: its overflow steps are its business, not
        failures; a loss that is not finite still is. A call skipped with ``on_failure="skip"``
        leaves its ``.grad`` filled with nan for the scaler, whose ``step()`` then skips the
        update (with no ``.grad`` it would fail). The steps the scaler skips are counted
        (``ledger.scaler_skipped``), seen at the next call; after ``max_failed_in_a_row`` in a
        row, the last at a scale below 1, the next call runs under a full watch and
        :class:`~opwatch.runners.leave_on.RunStuck` names the op that made them.
        ``guard(step, model, scaler=scaler)``.
    max_failed_in_a_row
        With ``on_failure="skip"`` or ``"apply"``: after that many failed calls in a row the
        guard raises :class:`~opwatch.runners.leave_on.RunStuck` naming the first of them and its
        origin (default 10; ``None``: never). ``guard(step, model, on_failure="skip", max_failed_in_a_row=50)``.

    ``OPWATCH_DISABLE=1`` makes the guarded step call ``train_step`` and nothing else.
    """
    return Guarded(
        train_step, model, audit=audit, max_audits=max_audits, strict=strict, checks=checks, allow=allow,
        on_failure=on_failure, repro=repro, repro_dir=repro_dir, repro_max_bytes=repro_max_bytes,
        last=last, max_records=max_records, scaler=scaler, max_failed_in_a_row=max_failed_in_a_row,
    )


class Guarded:
    """The result of :func:`guard`: call it as you would ``train_step``.

    Attributes:
        calls: how many times it was called.
        audits: how many calls were audited (run under a full watch).
        anomalies: what audits found (at most 100, oldest dropped): device, dtype, broadcast
            findings and the like, each an :class:`~opwatch.Anomaly`.
        failures: the anomalies of failed steps (at most 100, oldest dropped), each with
            ``.repro``: the repro folder, or ``None``.
        skipped: steps skipped with ``on_failure="skip"``.
        last_replay: the :class:`~opwatch.Watch` of the latest replay, or of the audit a
            failure was reported from (``table()``, ``records``, ``anomalies``), or ``None``.
        last_audit: the :class:`~opwatch.Watch` of the latest audit, or ``None``.
        last_verdict: for the latest replayed failure of a step that runs ``torch.compile``d
            code, a :class:`~opwatch.runners.guarded.compiled.CompiledVerdict` (eager fails
            too, or only the compiled step: the compiler stages run, the first graph node the
            failing backend gets wrong and its line, inductor's settings, the graph's repro),
            else ``None``.
    """

    def __init__(self, train_step, model, *, checks, allow, on_failure, repro, repro_dir, repro_max_bytes, last, max_records,
                 scaler=None, audit="new", max_audits=8, strict=False, max_failed_in_a_row=MAX_FAILED_IN_A_ROW):
        _validate(train_step, checks, allow, on_failure, repro, repro_dir, repro_max_bytes, last, max_records, scaler, strict)
        self._audits = Audits(audit, max_audits)
        self._strict = strict
        self._scaler = scaler
        self._step = train_step
        self._model = model if isinstance(model, torch.nn.Module) else None
        self._given_params = None if self._model is not None else _parameters(model)
        if self._model is not None:
            _check_some(list(self._model.parameters()))
        self._checks = checks
        self._allow = allow
        self._check_results = checks is None or "nonfinite" in checks
        self._on_failure = on_failure
        # The one policy of every runner: its ledger holds the facts of the guarded calls.
        self.policy = step_policy.StepPolicy(on_failure=on_failure, max_failed_in_a_row=max_failed_in_a_row, scaler=scaler, unit="guarded calls")
        self.ledger = self.policy.ledger
        self._applied_at: int | None = None  # the latest call whose failing gradients were left for the optimizer
        self._repro = repro
        self._repro_dir = None if repro_dir is None else os.fspath(repro_dir)
        self._repro_max_bytes = repro_max_bytes
        self._last = last
        self._max_records = max_records
        self._enabled = not _disabled_by_environment()
        self._scaler_steps = ScalerSteps(scaler) if scaler is not None and self._enabled else None  # what it did with each call's gradients
        self._snapshots: Snapshots | None = None  # made on the first call
        self._agreement: Agreement | None = None  # in a job of 2 or more ranks (read at the first call)
        self._warned: set = set()  # (kind, file, line) of skipped steps already warned
        self._warned_audit: set = set()  # (kind, file, line) of audit findings already warned
        self._told_internal_error = False
        self._finite_here = True  # this rank's own check passed (the step failed on another rank)
        self._raised_elsewhere = None  # the error naming another rank whose step raised (set by the flag)
        self.calls = 0
        self.anomalies: deque[Anomaly] = deque(maxlen=_MAX_KEPT)
        self.failures: deque[Anomaly] = deque(maxlen=_MAX_KEPT)
        self.last_replay: Watch | None = None
        self.last_audit: Watch | None = None
        self.last_verdict = None
        functools.update_wrapper(self, train_step, updated=())

    @property
    def audits(self) -> int:
        return self._audits.count

    @property
    def skipped(self) -> int:
        """Steps skipped with ``on_failure="skip"`` (read from :attr:`ledger`)."""
        return self.ledger.skipped

    # -- a call ----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if not self._enabled:
            return self._step(*args, **kwargs)
        stuck = self.policy.scaler_verdict(self)  # GradScaler skipped the steps of the latest calls for good
        self.calls += 1
        if self._snapshots is None:
            self._snapshots = self._collect()
            self.policy.verdict.returned.sharded = any(type(param).__name__ == "DTensor" for param in self._snapshots.params)
            self._agreement = Agreement.start() if self._check_results else None
            self.policy.join(self._agreement)
            # A DDP model: its reduced gradients decide a healthy call alike on every rank.
            self._shared = self._agreement is not None and shared_gradients(self._snapshots.params, [self._model])
            self._see_writes()
        audit = self._audit_watch() if stuck or self._audits.wanted(self.calls, args, kwargs) else None
        self.ledger.step(audited=audit is not None, optimizer_step=False)
        start = self._snapshots.take(args, kwargs)
        try:
            if audit is None:
                with self.policy.verdict.reductions:  # the clip norms this call computes
                    result = self._step(*args, **kwargs)
            else:
                self.last_audit = audit
                with audit, self.policy.verdict.reductions:
                    result = self._step(*args, **kwargs)
        except _NOT_REPLAYED as error:
            if self._agreement is not None:
                self._raised_in_job(start, error)
            raise  # out of memory: a replay under a watch would only run out again, slower
        except Exception as error:
            if self._agreement is not None:  # the others learn at the flag that this rank raised, and where
                self._raised_in_job(start, error)
            if self._snapshots.changed_parameters(start):
                self._refuse_changed_parameters(start, error=error)
            return self.policy.failed_call(self, start, args, kwargs, Raised("raised", type(error).__name__, first_line(error)), error=error)
        # A step that changes the parameters could not be replayed: refused at its first call
        # (and at audits; a failing step is looked at in _failed). Healthy steps skip the look.
        if (self.calls == 1 or audit is not None) and self._snapshots.changed_parameters(start):
            self._refuse_changed_parameters(start)
        # In a job of several ranks every call meets the others at the flag, checked or not (a
        # check that failed once is off on this rank only).
        if (self._check_results or self._agreement is not None) and not self._healthy(result):
            if self._raised_elsewhere is not None:  # another rank's step raised: every rank stops here
                self._snapshots.drop_grads()
                raise self._raised_elsewhere
            if self._finite_here:
                failure = FailedElsewhere("elsewhere")
            else:
                failure = not_finite(result, self._snapshots.params, self._parameter_names())
            if self._on_failure != "apply":
                del result  # not kept alive through the replay
                result = None
            if audit is not None:
                self._audited(audit, start, may_raise=False)  # the failure is what raises
            return self.policy.failed_call(self, start, args, kwargs, failure, audit=audit, result=result)
        if audit is not None:
            self._audited(audit, start)
        self.ledger.passed(self.calls)
        if stuck:
            self.policy.stuck_after_call(audit)
        return result

    def _collect(self) -> Snapshots:
        """The parameters and where the buffers live (read once)."""
        if self._model is None:
            return Snapshots(self._given_params)
        return Snapshots(list(self._model.parameters()), self._model)

    def _audit_watch(self) -> Watch:
        return Watch(strict=False, max_records=self._max_records, checks=self._checks, dump_on_error=False,
                     last=0, file=None, warn=False, **allow_option(self._allow))

    def _audited(self, audit, start, may_raise=True) -> None:
        """Keep and warn an audit's findings (nan/inf count only through the fused check: with
        a GradScaler, overflow is its business); with ``strict``, raise the first."""
        found = [anomaly for anomaly in audit.anomalies if anomaly.kind not in NONFINITE]
        if not found:
            return
        self.anomalies.extend(found)
        if self._strict and may_raise:
            self._snapshots.drop_grads()  # the optimizer never sees this step's gradients
            raise AnomalyError(found[0])
        for anomaly in found:
            key = (anomaly.kind, anomaly.filename, anomaly.lineno)
            if key not in self._warned_audit:
                self._warned_audit.add(key)
                step_policy.warn_at(OpwatchWarning(anomaly.message), anomaly)

    # -- the check of a healthy step -----------------------------------------------------------

    def _healthy(self, result) -> bool:
        """The fused check; in a distributed job, reduced across the ranks (one all-reduce of
        one slot per rank), so that every rank replays the same steps with matching collectives;
        a step that raised on another rank leaves its error in ``_raised_elsewhere``."""
        healthy = self._checked(result) if self._check_results else True
        healthy = healthy or self._shared and self.policy.returned_here_only(self)  # DDP: decided from what the ranks share
        self._finite_here = healthy
        self._raised_elsewhere = None
        if self._agreement is None or healthy and self._shared:
            return healthy  # DDP: every rank read the same reduced gradients; a failure asks the others
        decision = self._agreement.decide(0 if healthy else NONFINITE_CODE, self.calls, self._name())
        if decision.raised:
            self._raised_elsewhere = self._agreement.raised_elsewhere(decision, self.calls, self._name())
        return not decision.failed

    def _raised_in_job(self, start, error) -> None:
        """A step that raised on this rank, in a job of several ranks: say where (one store
        key), take part in the flag (the others raise :class:`RaisedElsewhere` naming this rank
        and line instead of waiting), put the ``.grad`` back, re-raise with a note. Not
        replayed: a replay would run collectives the other ranks do not."""
        agreement, name = self._agreement, self._name()
        line = first_line(error)
        agreement.mark(self.calls, name, "raised", f"{type(error).__name__}: {line}", error_type=type(error).__name__,
                       where=raised_where(error), line=line)
        if self._shared:  # DDP: the others meet no flag on a healthy step, none to wait at
            self.policy.raised_shared(self, error)
        decision = agreement.decide(RAISED, self.calls, name)  # NoAnswer (bounded) when another rank never comes
        self._snapshots.drop_grads()
        add_note(error, words.raised_here_note(agreement.rank, decision.raised, agreement.world))
        raise error

    def _checked(self, result) -> bool:
        """Whether the step's results are finite; an error of the check itself (a tensor kind
        it does not know) is opwatch's problem: one warning, and the step counts as healthy."""
        try:
            return self.policy.verdict.step_finite(result, self._snapshots.params)
        except Exception as error:
            if not self._told_internal_error:
                self._told_internal_error = True
                warnings.warn(OpwatchWarning(words.check_failed(type(error).__name__, str(error))), stacklevel=3)
            self._check_results = False
            return True

    # -- a failing step ------------------------------------------------------------------------

    def _see_writes(self) -> None:
        """Which optimizer step left the weights (one global optimizer step post-hook for the
        process, a Python read of each parameter's version counter per step): weights that
        turn nan/inf with no optimizer step writing them were written by the program."""
        self.policy.writes.follow_steps()

    def replayed(self, args, kwargs, error):
        """The step run again under a full watch on ``args``/``kwargs`` (its start restored by
        the policy): ``(Replay, (origin or None, repro folder, repro note))``."""
        replay = replays.run(self._step, args, kwargs, checks=self._checks, allow=self._allow, max_records=self._max_records,
                             repro_max_bytes=self._repro_max_bytes, keep_values=self._repro)
        self.last_replay = replay.watch
        return replay, judge(replay, error, repro=self._repro, repro_dir=self._repro_dir, repro_max_bytes=self._repro_max_bytes)

    def _compiled_verdict(self, replay, anomaly, error, start, args, kwargs):
        """For a step that made nan/inf and runs compiled code: eager fails too, or only the
        compiled step (then the compiler's stages in turn, each from the step's start, the
        first wrong graph node, inductor's settings and a one-file repro: ``compiled.explain``)."""
        if error is not None or replay.error is not None:
            return None
        verdict = compiled_steps.verdict(replay.watch, anomaly)
        if verdict is None or verdict.eager_fails:
            return verdict
        snapshots = self._snapshots
        return compiled_steps.explain(
            verdict, self._step, args, kwargs, restore=lambda: snapshots.restore(start),
            finite=lambda result: self.policy.verdict.step_finite(result, snapshots.params),
            max_bytes=self._repro_max_bytes, repro_dir=self._repro_dir, repro=self._repro,
        )

    # -- refusals and notes ----------------------------------------------------------------------

    def _name(self) -> str:
        return getattr(self._step, "__qualname__", None) or repr(self._step)

    def _parameter_names(self) -> dict:
        if self._model is None:
            return {}
        return {id(param): name for name, param in self._model.named_parameters()}

    def _refuse_changed_parameters(self, start, error=None):
        names = self._parameter_names()
        params = self._snapshots.params
        changed = [names.get(id(params[position])) or f"parameter {position}" for position in self._snapshots.changed_parameters(start)]
        refusal = ValueError(words.changed_parameters(getattr(self._step, "__qualname__", "train_step"), changed))
        if error is not None:
            raise refusal from error
        raise refusal

    def _refuse_changed_arguments(self, start, failure, error) -> None:
        changed = changed_arguments(start)
        if not changed:
            return
        refusal = ValueError(words.changed_arguments(self.calls, getattr(self._step, "__qualname__", "train_step"), failure, changed))
        if error is not None:
            raise refusal from error
        raise refusal

    def _ops_note(self, records, record, audited) -> str | None:
        if not self._last:
            return None
        records = [older for older in records if older.index <= record.index][-self._last :]
        return words.ops_note(records, record.index, audited=audited) if records else None

    def __repr__(self) -> str:
        return words.guarded_repr(getattr(self._step, "__qualname__", self._step), self.calls, len(self.failures), self.audits)


# -- helpers -------------------------------------------------------------------------------------


def _validate(train_step, checks, allow, on_failure, repro, repro_dir, repro_max_bytes, last, max_records, scaler, strict) -> None:
    if not callable(train_step):
        raise TypeError(f"train_step must be callable, got {type(train_step).__name__}")
    # Validates checks, allow and max_records as a watch does (never entered).
    Watch(strict=False, max_records=max_records, checks=checks, dump_on_error=False, last=0, file=None, warn=False, **allow_option(allow))
    on_failure_option(on_failure, "raise")
    if not isinstance(repro, bool):
        raise TypeError(f"repro must be True or False, got {repro!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    if repro_dir is not None and not isinstance(repro_dir, (str, os.PathLike)):
        raise TypeError(f"repro_dir must be a folder path (str or os.PathLike) or None, got {type(repro_dir).__name__}")
    _check_int("repro_max_bytes", repro_max_bytes, 0)
    _check_int("last", last, 0)
    if scaler is not None and not (callable(getattr(scaler, "is_enabled", None)) and callable(getattr(scaler, "unscale_", None))):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (or None), got {type(scaler).__name__}")


def _parameters(model) -> list:
    if isinstance(model, _Tensor):
        raise TypeError("model must be an nn.Module or an iterable of parameters; for one tensor, pass [tensor]")
    try:
        params = list(model)
    except TypeError:
        raise TypeError(f"model must be an nn.Module or an iterable of parameters, got {type(model).__name__}") from None
    unique = {}
    for param in params:
        if not isinstance(param, _Tensor):
            raise TypeError(f"model must be an nn.Module or an iterable of parameters; it holds a {type(param).__name__}")
        unique.setdefault(id(param), param)
    _check_some(unique)
    return list(unique.values())


def _check_some(params) -> None:
    """Refuse a model without parameters: a guard checks the gradients of what the step trains."""
    if not params:
        raise ValueError(
            "model holds no parameters; guard checks the gradients of the parameters the step trains: "
            "pass the nn.Module or its parameters, e.g. guard(step, model) or guard(step, model.parameters())"
        )


def _check_int(name, value, least) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")
