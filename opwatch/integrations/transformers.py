"""opwatch for Hugging Face: ``OpwatchCallback`` watches each training step of
``transformers.Trainer.train``.

    from opwatch.integrations.transformers import OpwatchCallback

    callback = OpwatchCallback()                # strict=True: stop at the first anomaly
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    with callback:                              # optional: see "when training raises" below
        trainer.train()
    callback.anomalies

transformers is imported when ``OpwatchCallback`` is first used, not when this module is
imported.
"""

from __future__ import annotations

from . import StepWatch, WatchedSteps, lazy_callback

__all__ = ["OpwatchCallback"]


class _Hooks(WatchedSteps):
    """Watch each training step of ``transformers.Trainer.train``: the forward and backward
    of each of its micro-batches, gradient clipping, the optimizer and scheduler steps (from
    ``on_step_begin`` to ``on_step_end``). Evaluation is not watched.

    - ``callback.anomalies`` / ``callback.contained`` / ``callback.watch``: what the watch
      found, and the :class:`opwatch.Watch` itself (its ``records`` are the last
      ``max_records`` ops of the latest steps; ``watch.table()``, ``watch.export_jsonl()``).
    - At the end of training the summary is printed (to ``file``, stderr by default).
    - The running counts ``opwatch/anomalies`` and ``opwatch/contained`` are added to each log
      (``logging_steps``): they reach ``trainer.state.log_history`` and the callbacks after
      this one (the progress printer). Integrations that ``report_to`` registered before it
      have logged by then.
    - ``strict=True``: training stops at the first anomaly with :class:`opwatch.AnomalyError`
      (device, dtype and broadcast anomalies before the op runs; nan/inf at the next check
      point: the Trainer's own ``isnan(loss)`` test after each micro-batch, or the step's end).

    When training raises: transformers tells callbacks nothing of exceptions, so the step's
    watch is still open when the exception leaves ``trainer.train()``. Train inside
    ``with callback:`` to close it right there (the watch then prints its dump of the last
    ops and adds its note to the exception); otherwise it is closed by the next
    ``trainer.train()`` or by ``callback.close()``.

    Options (keyword-only) are those of :func:`opwatch.watch` (``checks``, ``allow``,
    ``last``, ``max_records``, ``warn``, ``file``).
    """

    def __init__(self, *, strict: bool = False, file=None, **watch_options):
        self._steps = StepWatch(strict=strict, file=file, **watch_options)

    def close(self, error: BaseException | None = None) -> None:
        """Stop watching now (a step left open when training raised)."""
        self._steps.exit(error)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self._steps.exit(exc)
        return False

    def on_train_begin(self, args, state, control, **kwargs):
        self._steps.exit()  # a step of an earlier train() that raised

    def on_step_begin(self, args, state, control, **kwargs):
        self._steps.enter()

    def on_step_end(self, args, state, control, **kwargs):
        self._steps.exit()

    def on_log(self, args, state, control, logs=None, **kwargs):
        counts = {"opwatch/anomalies": self._steps.anomaly_count, "opwatch/contained": self._steps.contained_count}
        if logs is not None:
            logs.update(counts)
        # Trainer.log appended this log's copy to the history just before calling on_log.
        if state.log_history:
            state.log_history[-1].update(counts)

    def on_train_end(self, args, state, control, **kwargs):
        self._steps.exit()
        prefix = f"[rank {args.process_index}] " if args.world_size > 1 else ""
        self._steps.print_summary(prefix)


def _load_base():
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise ImportError("opwatch.integrations.transformers needs transformers: pip install transformers") from None
    return TrainerCallback


__getattr__ = lazy_callback(__name__, _load_base, _Hooks)
