"""``opwatch.guard``: eager speed on healthy steps; a failing step replayed under a full watch,
its origin named, with a one-op repro.

The way of one guarded call:

1. what the step starts from is kept: the RNG states (CPU, and every CUDA device once CUDA is
   initialized), a copy of the model's buffers (BatchNorm running statistics), a copy of the
   parameters' ``.grad`` when they hold values (gradient accumulation), and the version
   counters of the parameters and of the tensor arguments;
2. ``train_step`` runs as it is, with no dispatch mode;
3. one fused finiteness check of the tensors it returned and of the parameters' gradients:
   the check GradScaler runs (``_amp_foreach_non_finite_check_and_unscale_`` with a scale of
   1, which writes every gradient back unchanged), given also the largest magnitude of each
   returned tensor (``linalg_vector_norm(t, inf)``); one host read;
4. a step that raised or failed the check is replayed: the start is restored and
   ``train_step`` runs again on the same arguments under a watch that checks each op's
   outputs as it goes (``Watch(check_every=1)``), with an
   :class:`~opwatch.repro.InputCapture` on top of it that keeps the inputs a repro needs;
5. the buffers are left as one run of the step left them, the ``.grad`` as the step found
   them (the optimizer never sees the bad gradients), and :class:`~opwatch.AnomalyError`
   names the origin; or, with ``on_failure="skip"``, the step is undone and skipped.

Private torch APIs come from :mod:`opwatch.compat` (``version_counter``,
``amp_non_finite_check``, ``foreach_norm``, ``foreach_copy_``).
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections import deque

import torch

from .anomaly import Anomaly, AnomalyError, OpwatchWarning
from .compat import amp_non_finite_check, foreach_copy_, foreach_norm, version_counter
from .notation import format_meta
from .render import display_path, exception_note, location, render_table
from .repro import InputCapture, write_repro
from .session import Watch, _disabled_by_environment

__all__ = ["guard", "Guarded"]

_ON_FAILURE = ("raise", "skip")
# Exceptions a replay cannot explain: raised as they are.
_NOT_REPLAYED = (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else ()
_NONFINITE = ("nan", "inf")
_CHECKED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128})
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_Tensor = torch.Tensor
_MAX_NAMES = 4  # names listed in a message; the rest are counted
_MAX_FAILURES = 100  # failures kept on a Guarded

_amp_check = amp_non_finite_check  # GradScaler's fused check; None on old torch


def guard(
    train_step,
    model,
    *,
    checks=None,
    allow=(),
    on_failure: str = "raise",
    repro: bool = True,
    repro_dir=None,
    repro_max_bytes: int = 128 * 2**20,
    last: int = 10,
    max_records: int = 10_000,
    scaler=None,
) -> Guarded:
    """Run ``train_step`` at eager speed; when a step goes wrong, replay it under a full watch.

    Example::

        step = opwatch.guard(train_step, model)   # model: an nn.Module, or its parameters
        for batch in loader:
            optimizer.zero_grad()
            loss = step(batch)                    # train_step(batch): forward and backward
            optimizer.step()

    A healthy step runs ``train_step`` with no dispatch mode, then one fused check that the
    tensors (and floats) it returned and the parameters' gradients are finite: the check
    GradScaler runs, one host read. A step that raised, or whose check found nan/inf, is run
    again from where it started (RNG states of the CPU and every CUDA device, the model's
    buffers, the parameters' ``.grad`` restored) on the same arguments, under a watch that
    checks every op's outputs as it goes. :class:`~opwatch.AnomalyError` then names the op that
    made the first nan/inf, or the anomaly at (or before) the op that raised, with everything a
    strict watch reports; the step's own exception is chained. ``error.anomaly.repro`` is a
    folder with that op's inputs and a ``repro.py`` that runs the op alone.

    Afterwards the model's buffers are as one run of the step left them (updated once) and
    the ``.grad`` as the step found them, so the optimizer never sees the bad gradients.

    ``train_step`` must leave the parameters alone (``optimizer.step()`` goes after the guarded
    call): a step that changes them is refused with a ``ValueError`` at its first call, since
    it could not be replayed. A failing step that changed one of its tensor arguments in place
    is refused as well.

    When a replay may not reproduce the failure: nondeterministic kernels (CUDA atomics in
    ``index_add``/``scatter_add``/some convolution backward algorithms), steps that read data
    or state that changes (data loading inside ``train_step``, a counter, a random source other
    than torch's generators), other devices' RNGs, side effects (logging, a global step count,
    which then happen twice). When the replay finds nothing, the error says so plainly.
    Out-of-memory errors are raised as they are, never replayed. In data-parallel training a
    replay runs the backward's collectives again: every rank must fail the same step (nan
    gradients are all-reduced, so they do), or the replaying rank waits for the others. With
    ``torch.amp.GradScaler``, scaled gradients overflow now and then by design: pass the
    scaler (``scaler=``) and the gradients are left to it (it skips such steps and lowers its
    scale); only what the step returned is checked then. Without it, each overflow step would
    be replayed (slowly) and raise, or be skipped with ``on_failure="skip"``.

    Options (keyword-only):

    checks
        The checks the replay runs (``opwatch.watch``'s names); without ``"nonfinite"`` a
        healthy step is not checked at all and only steps that raise are replayed.
        ``guard(step, model, checks=["device_mismatch", "dtype_mismatch"])``.
    allow
        Anomalies the replay accepts (``opwatch.Allow`` entries, as ``watch(allow=...)``).
        ``guard(step, model, allow=[opwatch.Allow(kind="broadcast")])``.
    on_failure
        ``"raise"`` (default), or ``"skip"``: a step that made nan/inf is undone (buffers and
        ``.grad`` as they were before it; ``None`` grads make ``optimizer.step()`` leave the
        parameters alone, as a step GradScaler skips), warned once per origin line, kept in
        ``.failures``, and the call returns ``None``. Steps that raise always raise.
        ``guard(step, model, on_failure="skip")``.
    repro
        Write a one-op repro of the origin. ``guard(step, model, repro=False)``.
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
        failures; a loss that is not finite still is. ``guard(step, model, scaler=scaler)``.

    ``OPWATCH_DISABLE=1`` makes the guarded step call ``train_step`` and nothing else.
    """
    return Guarded(
        train_step,
        model,
        checks=checks,
        allow=allow,
        on_failure=on_failure,
        repro=repro,
        repro_dir=repro_dir,
        repro_max_bytes=repro_max_bytes,
        last=last,
        max_records=max_records,
        scaler=scaler,
    )


class Guarded:
    """The result of :func:`guard`: call it as you would ``train_step``.

    Attributes:
        calls: how many times it was called.
        failures: the anomalies of failed steps (at most 100, oldest dropped), each with
            ``.repro``: the repro folder, or ``None``.
        skipped: steps skipped with ``on_failure="skip"``.
        last_replay: the :class:`~opwatch.Watch` of the latest replay (``table()``,
            ``records``, ``anomalies``), or ``None``.
    """

    def __init__(self, train_step, model, *, checks, allow, on_failure, repro, repro_dir, repro_max_bytes, last, max_records, scaler=None):
        if not callable(train_step):
            raise TypeError(f"train_step must be callable, got {type(train_step).__name__}")
        # Validates checks, allow and max_records as a watch does (never entered).
        Watch(strict=False, max_records=max_records, checks=checks, dump_on_error=False, last=0, file=None, warn=False, **_allow_option(allow))
        if on_failure not in _ON_FAILURE:
            raise ValueError(f"on_failure must be one of {', '.join(map(repr, _ON_FAILURE))}, got {on_failure!r}")
        if not isinstance(repro, bool):
            raise TypeError(f"repro must be True or False, got {repro!r}")
        if repro_dir is not None and not isinstance(repro_dir, (str, os.PathLike)):
            raise TypeError(f"repro_dir must be a folder path (str or os.PathLike) or None, got {type(repro_dir).__name__}")
        _check_int("repro_max_bytes", repro_max_bytes, 0)
        _check_int("last", last, 0)
        if scaler is not None and not (callable(getattr(scaler, "is_enabled", None)) and callable(getattr(scaler, "unscale_", None))):
            raise TypeError(f"scaler must be a torch.amp.GradScaler (or None), got {type(scaler).__name__}")
        self._scaler = scaler
        self._step = train_step
        self._model = model if isinstance(model, torch.nn.Module) else None
        self._given_params = None if self._model is not None else _parameters(model)
        self._checks = checks
        self._allow = allow
        self._check_results = checks is None or "nonfinite" in checks
        self._on_failure = on_failure
        self._repro = repro
        self._repro_dir = None if repro_dir is None else os.fspath(repro_dir)
        self._repro_max_bytes = repro_max_bytes
        self._last = last
        self._max_records = max_records
        self._enabled = not _disabled_by_environment()
        self._params: list | None = None  # read on the first call
        self._buffer_slots: list = []  # (module, name) of every buffer
        self._grad_copies = _Copies()
        self._buffer_copies = _Copies()
        self._flag_tensors: dict = {}  # device -> (found-inf flag, inverse scale): see _flags
        self._warned: set = set()
        self._told_internal_error = False
        self._by_device = False  # the fused check could not take these tensors: one group per device
        self.calls = 0
        self.skipped = 0
        self.failures: deque[Anomaly] = deque(maxlen=_MAX_FAILURES)
        self.last_replay: Watch | None = None
        functools.update_wrapper(self, train_step, updated=())

    # -- a call ----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if not self._enabled:
            return self._step(*args, **kwargs)
        self.calls += 1
        if self._params is None:
            self._collect()
        start = self._start(args, kwargs)
        try:
            result = self._step(*args, **kwargs)
        except _NOT_REPLAYED:
            raise  # out of memory: a replay under a watch would only run out again, slower
        except Exception as error:
            if self._changed_parameters(start):
                self._refuse_changed_parameters(start, error=error)
            return self._failed(start, args, kwargs, f"it raised {type(error).__name__}: {_first_line(error)}", error=error)
        if self._changed_parameters(start):
            self._refuse_changed_parameters(start)
        if self._check_results and not self._checked(result):
            failure = f"the check after it found {self._what_was_not_finite(result)}"
            del result  # not kept alive through the replay
            return self._failed(start, args, kwargs, failure)
        return result

    def _collect(self) -> None:
        """The parameters and where the buffers live (read once: buffers by slot, so that a
        buffer the model replaces is still found)."""
        if self._model is None:
            self._params = self._given_params
            return
        self._params = list(self._model.parameters())
        self._buffer_slots = [
            (module, name) for module in self._model.modules() for name, buffer in module._buffers.items() if buffer is not None
        ]

    def _start(self, args, kwargs) -> _Start:
        start = _Start()
        start.cpu_rng = torch.get_rng_state()
        start.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        params = self._params
        start.versions = [version_counter(param) for param in params]
        start.grads = grads = [param.grad for param in params]
        held = [grad for grad in grads if grad is not None]
        if held:
            self._grad_copies.save(held)
        if self._buffer_slots:
            start.buffers = [(module, name, module._buffers.get(name)) for module, name in self._buffer_slots]
            self._buffer_copies.save([buffer for _, _, buffer in start.buffers if buffer is not None])
        start.arguments = _tensor_arguments(args, kwargs)
        return start

    def _changed_parameters(self, start) -> bool:
        return start.versions != [version_counter(param) for param in self._params]

    # -- the check of a healthy step -----------------------------------------------------------

    def _checked(self, result) -> bool:
        """Whether the step's results are finite; an error of the check itself (a tensor kind
        it does not know) is opwatch's problem: one warning, and the step counts as healthy."""
        try:
            return self._all_finite(result)
        except Exception as error:
            if not self._told_internal_error:
                self._told_internal_error = True
                warnings.warn(
                    OpwatchWarning(f"opwatch.guard could not check a step's results ({type(error).__name__}: {error}); "
                                   "steps that do not raise are not checked. Please report this to the opwatch issue tracker."),
                    stacklevel=3,
                )
            self._check_results = False
            return True

    def _all_finite(self, result) -> bool:
        """One fused check of the returned tensors and floats and of the gradients."""
        returned = []
        for _, value in _leaves(result):
            if isinstance(value, _Tensor):
                if value.dtype in _CHECKED_DTYPES:
                    returned.append(value)
            elif isinstance(value, float) and not math.isfinite(value):
                return False
        grads = []
        # With GradScaler, scaled gradients overflow now and then by design: the scaler finds
        # it, skips the step and lowers its scale. Only what the step returned is checked.
        scaled = self._scaler is not None and self._scaler.is_enabled()
        for param in () if scaled else self._params:
            grad = param.grad
            if grad is not None:
                # GradScaler's kernel writes the values back: not into gradients that are part
                # of a graph (create_graph=True). Sparse and complex ones make it raise: see below.
                (returned if grad.requires_grad else grads).append(grad)
        if not returned and not grads:
            return True
        if self._by_device:
            return self._all_finite_by_device(returned + grads)
        try:
            with torch.no_grad():
                # The returned tensors' largest magnitudes (nan and inf carry through): new
                # tensors, safe for the kernel to write.
                checked = grads + [torch.linalg.vector_norm(tensor, math.inf) for tensor in returned]
                device = checked[0].device
                found, one = self._flags(device)
                _amp_check(checked, found, one)
                if found.item() == 0:
                    return True
                found.zero_()
                return False
        except (RuntimeError, NotImplementedError, TypeError):
            # Several devices; sparse, complex, meta or overlapping gradients; a torch without
            # the CPU kernel (values written before it raised were written back unchanged).
            with torch.no_grad():
                for found, _ in self._flag_tensors.values():
                    found.zero_()  # it may have been set before the kernel gave up
            self._by_device = True  # from now on: the model's tensors will not change kind
            return self._all_finite_by_device(returned + grads)

    def _all_finite_by_device(self, tensors) -> bool:
        """The same check, one group per device: one host read per device."""
        by_device: dict = {}
        for tensor in tensors:
            if type(tensor) not in _PLAIN_TYPES or tensor.device.type == "meta":
                continue
            if tensor.layout != torch.strided:
                tensor = tensor._values() if tensor.is_sparse else tensor.values()  # COO; CSR, CSC, BSR
            if tensor.dtype in _CHECKED_DTYPES:
                by_device.setdefault(tensor.device, []).append(tensor)
        founds = []
        with torch.no_grad():
            for device, group in by_device.items():
                norms = [norm.float().reshape(1) for norm in foreach_norm(group, math.inf)]
                founds.append(torch.cat(norms).amax())  # nan and inf carry through amax
        return all(math.isfinite(found.item()) for found in founds)

    def _flags(self, device) -> tuple:
        """GradScaler's found-inf flag (kept at 0 between failures) and inverse scale (1) on
        ``device``, made on the first call."""
        flags = self._flag_tensors.get(device)
        if flags is None:
            flags = self._flag_tensors[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
        return flags

    # -- a failing step ------------------------------------------------------------------------

    def _failed(self, start, args, kwargs, failure, *, error=None):
        """Replay the step, leave the model as the docs say, raise (or skip). ``failure``: what
        went wrong, for messages; ``error``: the step's exception, if it raised."""
        self._refuse_changed_arguments(start, failure, error)
        after = self._buffers_now()  # the buffers as this run of the step left them
        self._restore(start)
        replay = self._replay(args, kwargs)
        self.last_replay = replay.watch
        anomaly, repro, repro_note = self._judge(replay, error)
        skip = error is None and self._on_failure == "skip"
        # The optimizer never sees this step's gradients; the buffers are as one run left them,
        # or as they were before it when the step is skipped.
        self._put_grads(start)
        if skip:
            self._put_buffers(start.buffers, self._buffer_copies.values)
        elif after is not None:
            self._put_buffers(*after)
        name = getattr(self._step, "__qualname__", None) or repr(self._step)
        restored = "RNG states, " + (f"{len(start.buffers)} buffer(s), " if start.buffers else "") + ".grad"
        if anomaly is None:
            problem = self._not_found(replay, error, name, failure, restored, repro)
            if skip and replay.error is None:
                self.skipped += 1
                warnings.warn(OpwatchWarning(f"{problem}\nThe step was skipped."), stacklevel=3)
                return None
            raise problem
        context = f"call {self.calls} of {name} failed: {failure}; replayed from the same start ({restored} restored) under a full watch"
        replayed = _Replayed(anomaly, step=self.calls, context=context, repro=repro, repro_note=repro_note)
        self.failures.append(replayed)
        if skip:
            self.skipped += 1
            self._warn_skipped(replayed)
            return None
        raised = AnomalyError(replayed)
        note = self._ops_note(replay.watch, anomaly.record)
        if note:
            raised.add_note(note)
        if error is not None:
            raise raised from error
        raise raised

    def _replay(self, args, kwargs) -> _Replay:
        watch = Watch(
            strict=False, max_records=self._max_records, checks=self._checks, dump_on_error=False,
            last=0, file=None, warn=False, check_every=1, **_allow_option(self._allow),
        )
        capture = InputCapture(max_bytes=self._repro_max_bytes, keep_values=self._repro)
        replay = _Replay(watch, capture)
        result = None
        try:
            with watch:
                with capture:
                    result = self._step(*args, **kwargs)
                # ``result`` stays alive until the watch has judged: a nan only in the returned
                # loss is alive at the end of the block, so it matters.
        except Exception as error:
            replay.error = error
        del result
        return replay

    def _judge(self, replay, error):
        """``(anomaly, repro folder, note on the repro)``: the anomaly that explains the
        failure (for nan/inf, the earliest nan/inf origin; for an exception, the anomaly on the
        op that raised, else the first one reported: what a strict watch would have raised),
        and the repro of its op, or of the op that raised."""
        anomalies = replay.watch.anomalies
        raised_at = None
        if replay.capture.raised is not None and replay.error is not None and _in_chain(replay.error, replay.capture.raised[1]):
            raised_at = replay.capture.raised[0]
        if error is None and replay.error is None:
            found = [anomaly for anomaly in anomalies if anomaly.kind in _NONFINITE]
            anomaly = min(found, key=lambda anomaly: anomaly.index) if found else None
        else:
            on_op = [anomaly for anomaly in anomalies if anomaly.index == raised_at]
            anomaly = on_op[0] if on_op else (anomalies[0] if anomalies else None)
        call = None
        if anomaly is not None:
            call = replay.capture.call_for(anomaly.record)
        if call is None and raised_at is not None:
            call = replay.capture.calls.get(raised_at)
        replay.raised_at = raised_at
        if not self._repro:
            return anomaly, None, None
        if call is None:
            broken = replay.capture.broken
            problem = f"none (capturing the replay's inputs failed: {broken})" if broken else "none (the op's inputs were not captured in the replay)"
            return anomaly, None, problem if anomaly is not None else None
        same_op = anomaly is not None and anomaly.index == call.index
        record = anomaly.record if same_op else self._record(replay.watch, call.index)
        note = "this op alone, on its saved inputs"
        if not same_op and record is not None:
            note = f"{record.op} at {location(record)}, the op that raised, alone on its saved inputs"
        about = []
        if anomaly is not None and anomaly.index == call.index:
            about.append("found:    " + anomaly.message.split("\n", 1)[0])
        if call.raised and replay.error is not None:
            about.append(f"raised:   {type(replay.error).__name__}: {_first_line(replay.error)}")
        if record is not None:
            about.append(f"op:       {record.signature()}")
            code = record.position.expression() or record.position.line_text()
            if code:
                about.append(f"code:     {location(record)}: {code.strip()}")
        try:
            return anomaly, write_repro(call, self._repro_dir, about=about, max_bytes=self._repro_max_bytes), note
        except Exception as problem:
            return anomaly, None, f"none (it could not be written: {type(problem).__name__}: {problem})"

    def _not_found(self, replay, error, name, failure, restored, repro) -> BaseException:
        """What to raise when the replay found no anomaly that explains the failure."""
        allowed = len(getattr(replay.watch, "allowed", ()))
        also = f" ({allowed} finding(s) matched an allow entry)" if allowed else ""
        if error is not None:
            if replay.error is None:
                what = "it did not raise again: the failure did not reproduce" + _WHY
            else:
                again = "again" if type(replay.error) is type(error) else f"(not {type(error).__name__})"
                what = f"it raised {type(replay.error).__name__} {again}, with no anomaly before it{also}"
                failed = self._record(replay.watch, replay.raised_at) if replay.raised_at is not None else None
                if failed is not None:
                    what += "\n" + exception_note(failed)
            if repro is not None:
                what += f"\none-op repro of the op that raised: python {display_path(os.path.join(repro, 'repro.py'))}"
            error.add_note(f"opwatch.guard: call {self.calls} of {name} was replayed from the same start ({restored} restored) under a full watch: {what}")
            return error
        if replay.error is not None:
            message = (
                f"opwatch.guard: call {self.calls} of {name} failed ({failure}); its replay under a full watch "
                f"raised {type(replay.error).__name__} instead: the replay did not run as the step did" + _WHY
            )
            mismatch = RuntimeError(message)
            mismatch.__cause__ = replay.error
            return mismatch
        allowed_nonfinite = [anomaly for anomaly in getattr(replay.watch, "allowed", ()) if anomaly.kind in _NONFINITE]
        if allowed_nonfinite:
            first = allowed_nonfinite[0].message.split("\n", 1)[0]
            return RuntimeError(
                f"opwatch.guard: call {self.calls} of {name} failed ({failure}); its replay from the same start "
                f"({restored} restored) under a full watch found only nan/inf origins that match an allow entry "
                f"({len(allowed_nonfinite)}, the first: {first}). Allowed or not, they reached the step's results, "
                "and the optimizer must not see them; Guarded.last_replay.allowed holds them."
            )
        return RuntimeError(
            f"opwatch.guard: call {self.calls} of {name} failed ({failure}), but its replay from the same start "
            f"({restored} restored) under a full watch found no nan/inf origin{also}: the failure did not reproduce" + _WHY
        )

    # -- what the messages say -----------------------------------------------------------------

    def _what_was_not_finite(self, result) -> str:
        """``nan in the returned tensor and inf in the .grad of 2 parameter(s): fc1.weight, fc1.bias``."""
        parts = []
        with torch.no_grad():
            for path, value in _leaves(result):
                kind = _kind_of(value)
                if kind is not None:
                    parts.append(f"{kind} in {path}")
            by_kind: dict = {}
            names = self._parameter_names()
            for position, param in enumerate(self._params):
                kind = _kind_of(param.grad) if param.grad is not None else None
                if kind is not None:
                    by_kind.setdefault(kind, []).append(names.get(id(param)) or f"parameter {position} ({format_meta((tuple(param.shape), param.dtype, param.device, 0))})")
        for kind, found in by_kind.items():
            parts.append(f"{kind} in the .grad of {len(found)} parameter(s): {_names(found)}")
        if not parts:
            return "nan/inf (no longer there when described)"
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]

    def _parameter_names(self) -> dict:
        if self._model is None:
            return {}
        return {id(param): name for name, param in self._model.named_parameters()}

    def _refuse_changed_parameters(self, start, error=None):
        names = self._parameter_names()
        changed = [
            names.get(id(param)) or f"parameter {position}"
            for position, (param, version) in enumerate(zip(self._params, start.versions))
            if version_counter(param) != version
        ]
        refusal = ValueError(
            f"opwatch.guard: {getattr(self._step, '__qualname__', 'train_step')} changed {len(changed)} parameter(s) "
            f"while it ran ({_names(changed)}): an optimizer.step() inside it? A guarded step must leave the "
            "parameters alone, so that a failing step can be replayed from where it started and the optimizer "
            "never sees its gradients. Call optimizer.step() after the guarded call:\n"
            "    step = opwatch.guard(train_step, model)\n"
            "    loss = step(batch)\n"
            "    optimizer.step()\n"
            "If it updates other parameters on purpose (an EMA copy), guard only the trained ones: "
            "opwatch.guard(train_step, model.net.parameters())."
        )
        if error is not None:
            raise refusal from error
        raise refusal

    def _refuse_changed_arguments(self, start, failure, error) -> None:
        changed = [f"{path} ({format_meta((tuple(tensor.shape), tensor.dtype, tensor.device, 0))})" for path, tensor, version in start.arguments if version_counter(tensor) != version]
        if not changed:
            return
        refusal = ValueError(
            f"opwatch.guard cannot replay call {self.calls} of {getattr(self._step, '__qualname__', 'train_step')} "
            f"({failure}): it changed its argument {_names(changed)} in place, so a replay would not start from "
            "the same data. Let the step work on a copy (x = x / 255 rather than x.div_(255)), or run it under "
            "opwatch.strict() to find the failure."
        )
        if error is not None:
            raise refusal from error
        raise refusal

    def _ops_note(self, watch, record) -> str | None:
        if not self._last:
            return None
        records = [older for older in watch.records if older.index <= record.index][-self._last :]
        if not records:
            return None
        return f"opwatch.guard: the replay's last {len(records)} ops up to op #{record.index}:\n" + render_table(records, mark=record.index)

    def _warn_skipped(self, replayed) -> None:
        record = replayed.record
        key = (replayed.kind, record.filename, record.lineno)
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn_explicit(
            OpwatchWarning(f"opwatch.guard skipped a step:\n{replayed.message}"),
            OpwatchWarning,
            filename=record.filename or "<unknown>",
            lineno=record.lineno or 0,
            module="opwatch",
        )

    @staticmethod
    def _record(watch, index):
        if index is None:
            return None
        return next((record for record in reversed(watch.records) if record.index == index), None)

    # -- restoring -------------------------------------------------------------------------------

    def _restore(self, start) -> None:
        torch.set_rng_state(start.cpu_rng)
        if start.cuda_rng is not None:
            torch.cuda.set_rng_state_all(start.cuda_rng)
        self._put_grads(start)
        if start.buffers:
            self._put_buffers(start.buffers, self._buffer_copies.values)

    def _put_grads(self, start) -> None:
        copies = iter(self._grad_copies.values)
        with torch.no_grad():
            for param, grad in zip(self._params, start.grads):
                if grad is None:
                    param.grad = None
                else:
                    grad.copy_(next(copies))
                    param.grad = grad

    def _buffers_now(self):
        if not self._buffer_slots:
            return None
        slots = [(module, name, module._buffers.get(name)) for module, name in self._buffer_slots]
        with torch.no_grad():
            values = [buffer.clone() for _, _, buffer in slots if buffer is not None]
        return slots, values

    @staticmethod
    def _put_buffers(slots, values) -> None:
        if not slots:
            return
        values = iter(values)
        with torch.no_grad():
            for module, name, buffer in slots:
                if buffer is not None:
                    buffer.copy_(next(values))
                module._buffers[name] = buffer

    def __repr__(self) -> str:
        return f"<opwatch.guard of {getattr(self._step, '__qualname__', self._step)!r}: {self.calls} call(s), {len(self.failures)} failure(s)>"


_WHY = (
    ". A replay runs the step again from the same RNG states, buffers and .grad; it can differ when kernels are "
    "nondeterministic (CUDA atomics: index_add, scatter_add, some convolution backward algorithms), when the step "
    "reads data or state that changed since (data loading inside the step, a counter, Python's random), or when "
    "the failure depends on other processes. See help(opwatch.guard)."
)


class _Start:
    """What one call started from."""

    __slots__ = ("cpu_rng", "cuda_rng", "versions", "grads", "buffers", "arguments")

    def __init__(self):
        self.buffers = []  # (module, name, buffer) for every buffer slot


class _Replay:
    __slots__ = ("watch", "capture", "error", "raised_at")

    def __init__(self, watch, capture):
        self.watch = watch
        self.capture = capture
        self.error = None
        self.raised_at = None


class _Copies:
    """The values of a list of tensors, copied into tensors kept from call to call: one
    ``_foreach_copy_`` per call once the shapes settle."""

    def __init__(self):
        self.values: list = []
        self._layout = None

    def save(self, tensors) -> None:
        layout = [(tensor.shape, tensor.dtype, tensor.device) for tensor in tensors]
        with torch.no_grad():
            if layout != self._layout:
                self.values = [tensor.clone() for tensor in tensors]
                self._layout = layout
            else:
                foreach_copy_(self.values, tensors)


class _Replayed(Anomaly):
    """An :class:`~opwatch.Anomaly` found by replaying a guarded step: its message adds the
    step and the repro. ``repro``: the repro folder, or ``None``."""

    __slots__ = ("repro", "step", "_context", "_repro_note")

    def __init__(self, anomaly, *, step, context, repro, repro_note):
        super().__init__(anomaly.finding, anomaly.record)
        self.step = step
        self.repro = repro
        self._context = context
        self._repro_note = repro_note  # what the repro runs, or why there is none

    @property
    def message(self) -> str:
        text = Anomaly.message.fget(self)
        text += f"\n  step:     {self._context}"
        if self.repro is not None:
            text += f"\n  repro:    python {display_path(os.path.join(self.repro, 'repro.py'))} ({self._repro_note})"
        elif self._repro_note:
            text += f"\n  repro:    {self._repro_note}"
        return text


# -- helpers -------------------------------------------------------------------------------------


def _allow_option(allow) -> dict:
    """``allow`` as a keyword for :class:`Watch`, given only when set (older watches lack it)."""
    return {"allow": allow} if allow else {}


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
    return list(unique.values())


def _tensor_arguments(args, kwargs) -> list:
    """``(path, tensor, version)`` of the tensors among the arguments, one level into lists,
    tuples and dicts (a batch)."""
    found = []
    for path, value in _leaves((args, kwargs), depth=3, paths=("args", "kwargs")):
        if isinstance(value, _Tensor):
            found.append((path, value, version_counter(value)))
    return found


def _leaves(value, depth: int = 2, paths=None):
    """``(path, leaf)`` of a returned value: itself, or the items of a tuple, list or dict, a
    few levels deep (``returned['loss']``)."""
    if paths is not None:  # the (args, kwargs) pair
        for name, part in zip(paths, value):
            yield from _leaves_at(part, name, depth - 1)
        return
    if isinstance(value, (_Tensor, float)):
        yield ("the returned tensor" if isinstance(value, _Tensor) else "the returned float"), value
        return
    yield from _leaves_at(value, "returned", depth)


def _leaves_at(value, path, depth):
    if isinstance(value, (_Tensor, float)):
        yield path, value
    elif depth > 0 and isinstance(value, (tuple, list)):
        for position, item in enumerate(value):
            yield from _leaves_at(item, f"{path}[{position}]", depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves_at(item, f"{path}[{key!r}]", depth - 1)


def _kind_of(value) -> str | None:
    if isinstance(value, float):
        return None if math.isfinite(value) else ("nan" if math.isnan(value) else "inf")
    if not isinstance(value, _Tensor) or value.dtype not in _CHECKED_DTYPES or value.device.type == "meta":
        return None
    if value.is_sparse:
        value = value._values()
    if bool(torch.isnan(value).any()):
        return "nan"
    if bool(torch.isinf(value).any()):
        return "inf"
    return None


def _names(names) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    return shown + (f", +{len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")


def _first_line(error) -> str:
    text = str(error).strip()
    return text.split("\n", 1)[0] if text else ""


def _in_chain(error, error_id) -> bool:
    """Whether the exception ``error_id`` is ``error`` or one it was raised from."""
    for _ in range(16):
        if error is None:
            return False
        if id(error) == error_id:
            return True
        error = error.__cause__ or error.__context__
    return False


def _check_int(name, value, least) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")

