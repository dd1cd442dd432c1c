"""opwatch for Hugging Face: ``OpwatchCallback`` watches each training step of
``transformers.Trainer.train``.

    from opwatch.runners.transformers import OpwatchCallback

    callback = OpwatchCallback()                # strict=True: stop at the first anomaly
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    with callback:                              # optional: see "when training raises" below
        trainer.train()
    callback.anomalies

To leave it on for a long run, ``OpwatchCallback(mode="guard")`` audits the first step under
the full watch and checks the gradients before each optimizer step; transformers shows
callbacks no batch, so to audit new batch signatures and to replay a failing batch under the
full watch, guard the trainer's own training step with :func:`guard_trainer`.

transformers is imported when ``OpwatchCallback`` is first used, not when this module is
imported.
"""

from __future__ import annotations

import math
import sys

from .trainers import StepWatch, WatchedSteps, lazy_callback, leave_on_runner, metrics

__all__ = ["OpwatchCallback", "guard_trainer"]


class _Hooks(WatchedSteps):
    """Watch each training step of ``transformers.Trainer.train``: the forward and backward
    of each of its micro-batches, gradient clipping, the optimizer and scheduler steps (from
    ``on_step_begin`` to ``on_step_end``). Evaluation is not watched.

    - ``callback.anomalies`` / ``callback.contained`` / ``callback.watch``: what the watch
      found, and the :class:`opwatch.Watch` itself (its ``records`` are the last
      ``max_records`` ops of the latest steps; ``watch.table()``, ``watch.export_jsonl()``).
    - At the end of training the summary is printed (to ``file``, stderr by default).
    - The running counts (:func:`opwatch.runners.trainers.metrics`: ``opwatch/anomalies``, one
      ``opwatch/anomalies/<kind>`` per kind found, ``opwatch/contained``) are added to each log
      (``logging_steps``), so they reach every ``report_to`` integration (TensorBoard, W&B,
      ...), ``trainer.state.log_history`` and the progress printer. The Trainer registers
      the integrations before the user's callbacks and calls them in that order: when
      training begins, this callback moves itself to the front of the trainer's callback
      list (``trainer.callback_handler.callbacks``), so that its ``on_log`` runs first.
    - ``strict=True``: training stops at the first anomaly with :class:`opwatch.AnomalyError`
      (device, dtype and broadcast anomalies before the op runs; nan/inf at the next check
      point: the Trainer's own ``isnan(loss)`` test after each micro-batch, or the step's end).

    When training raises: transformers tells callbacks nothing of exceptions, so the step's
    watch is still open when the exception leaves ``trainer.train()``. Train inside
    ``with callback:`` to close it right there (the watch then prints its dump of the last
    ops and adds its note to the exception); otherwise it is closed by the next
    ``trainer.train()`` or by ``callback.close()``.

    ``mode="guard"`` leaves it on at eager speed (:mod:`opwatch.runners.leave_on`): the first training
    step runs under the full watch until its optimizer step has run; the others run with no
    dispatch mode and one fused check that the gradients are finite before each optimizer step
    (GradScaler's skipped steps never reach it). A failing check names the step and the
    parameters holding nan/inf, then ``on_failure``: ``"skip"`` (default; ``"raise"`` with
    ``strict=True``) skips that optimizer step (the weights stay as they were) and watches the
    next step fully to name the op that makes them; ``"raise"`` skips it too and raises at the
    next step: :class:`opwatch.AnomalyError` with the origin when the failure recurs,
    ``opwatch.runners.leave_on.GradientsNotFinite`` when it does not; ``"apply"`` lets the
    optimizer apply them. The callback sees no batch: to audit each new batch signature and
    replay a failing batch from its start (its origin named at once), use
    :func:`guard_trainer` as well, which takes the callback's ``on_failure``.
    ``callback.runner`` counts steps, audits, failures and skips (logged as ``opwatch/steps``,
    ``opwatch/audited``, ``opwatch/failed`` and ``opwatch/skipped``).

    Options (keyword-only) are those of :func:`opwatch.watch` (``checks``, ``allow``,
    ``last``, ``max_records``, ``warn``, ``file``), ``mode`` (``"watch"``, default, or
    ``"guard"``) and ``on_failure`` (guard mode).
    """

    def __init__(self, *, strict: bool = False, file=None, mode: str = "watch", on_failure=None, **watch_options):
        self.runner = leave_on_runner(mode, strict=strict, file=file, on_failure=on_failure, **watch_options)
        self._steps = self.runner if self.runner is not None else StepWatch(strict=strict, file=file, **watch_options)

    def close(self, error: BaseException | None = None) -> None:
        """Stop watching now (a step left open when training raised)."""
        if self.runner is not None:
            self.runner.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)
        else:
            self._steps.exit(error)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self.close(exc)
        return False

    def on_train_begin(self, args, state, control, **kwargs):
        self.close()  # a step of an earlier train() that raised
        _move_to_front(self)
        if self.runner is not None:
            if kwargs.get("model") is not None:
                self.runner.know(kwargs["model"])
            # The callback alone runs no failing batch again; guard_trainer(trainer) does.
            self.runner.unreplayed = "transformers" if self.runner.replay is None else None
            self.runner.__enter__()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.runner is not None:
            self.runner.audit_batch(None)  # the first step: the callback sees no batch
        else:
            self._steps.enter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.runner is not None:
            self.runner.end_batch()
            if state.max_steps and state.global_step >= state.max_steps:
                # The last step: an audit armed after it (a failure's re-check) has no step left
                # to watch, and would watch the Trainer's wrap-up, naming the mean of the failed
                # step's nan loss as an origin; the run's end tells the failure as one the loop ended on.
                self.runner.end_audit()
        else:
            self._steps.exit()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.runner is not None:
            self.runner.ledger.settle()  # a log holds every step that ran: one wait for the device, at a log
        counts = metrics(self)
        if logs is not None:
            logs.update(counts)
        # Trainer.log appended this log's copy to the history just before calling on_log.
        if state.log_history:
            state.log_history[-1].update(counts)

    def on_train_end(self, args, state, control, **kwargs):
        prefix = f"[rank {args.process_index}] " if args.world_size > 1 else ""
        if self.runner is not None:
            self.runner.__exit__(None, None, None)
            self.runner.print_summary(prefix, watch_summary=True)
            return
        self._steps.exit()
        self._steps.print_summary(prefix)


def guard_trainer(trainer, *, on_failure=None, **guard_options):
    """Guard ``trainer.training_step`` (the forward and backward of each micro-batch) with
    :func:`opwatch.guard`: healthy batches run at eager speed with one fused finiteness check;
    a failing batch is replayed from its start (the trainer's own training step on the same
    batch; RNG states, buffers and ``.grad`` restored) under the full watch, which names the op
    and line that made the first nan/inf; then ``on_failure``: ``"skip"`` undoes the batch's
    gradients (its loss counts as nan: the Trainer's ``logging_nan_inf_filter`` leaves it out
    of the logged loss) and the optimizer step moves no weight; ``"raise"`` raises
    :class:`opwatch.AnomalyError`; ``"apply"`` leaves its gradients for the optimizer. The
    default is the ``on_failure`` of the trainer's ``OpwatchCallback(mode="guard")`` (whose
    own default is ``"skip"``), else ``"skip"``. Other options are those of
    :func:`opwatch.guard`; pass ``scaler=`` with fp16 training. Returns the guarded step
    (``.failures``, ``.steps``, ``.skipped``); ``trainer.training_step`` is replaced by it. ::

        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       callbacks=[OpwatchCallback(mode="guard")])
        guard_trainer(trainer)
        trainer.train()
    """
    import opwatch

    runner = _guard_runner(trainer)
    if on_failure is None:
        on_failure = runner.on_failure if runner is not None else "skip"
    step = trainer.training_step

    def training_step(model, inputs, *args, **kwargs):
        return step(model, inputs, *args, **kwargs)

    guarded = opwatch.guard(training_step, trainer.model, on_failure=on_failure, **guard_options)
    explained = []  # origins of applied failures, told to the callback's check at the step

    def guarded_training_step(model, inputs, *args, **kwargs):
        failures = len(guarded.failures)
        failed = guarded.ledger.failed
        try:
            loss = guarded(model, inputs, *args, **kwargs)
        finally:
            if runner is not None and guarded.ledger.failed > failed:  # one ledger: the callback's counts it
                runner.failed_in_batch(guarded.ledger.latest)
        if on_failure == "apply" and len(guarded.failures) > failures:
            explained.append(next(reversed(guarded.failures)))  # the newest
        if loss is None:  # skipped: counted as nan, as the Trainer counts a nan loss
            import torch

            return torch.tensor(math.nan, device=trainer.args.device)
        return loss

    if runner is not None:
        # The callback's check at the optimizer step: a failure guard already replayed is
        # told with the origin the replay found, not re-checked at the next step.
        runner.replay = lambda: (True, explained.pop()) if explained else (False, None)
    guarded_training_step.guarded = guarded
    trainer.training_step = guarded_training_step
    return guarded


def _guard_runner(trainer):
    """The leave-on runner of the trainer's ``OpwatchCallback(mode="guard")``, or ``None``."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, _Hooks) and callback.runner is not None:
            return callback.runner
    return None


def _move_to_front(callback) -> None:
    """Put ``callback`` first in the list of the trainer's ``CallbackHandler``, found as the
    ``self`` of the ``call_event`` that calls the hook now running (callbacks get no reference
    to the trainer). Taking it out of its place and putting it first leaves every callback
    after it where it was, so the handler's loop over the list goes on unchanged."""
    from transformers.trainer_callback import CallbackHandler

    frame = sys._getframe(1)
    try:
        for _ in range(4):  # _move_to_front <- on_train_begin <- call_event, and a margin
            frame = frame.f_back
            if frame is None:
                return
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler):
                callbacks = handler.callbacks
                for position, item in enumerate(callbacks):
                    if item is callback:
                        callbacks.insert(0, callbacks.pop(position))
                        return
    finally:
        del frame


def _load_base():
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise ImportError("opwatch.runners.transformers needs transformers: pip install transformers") from None
    return TrainerCallback


__getattr__ = lazy_callback(__name__, _load_base, _Hooks)
