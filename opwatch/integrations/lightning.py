"""opwatch for Lightning: ``OpwatchCallback`` watches each training batch of ``Trainer.fit``.

    from opwatch.integrations.lightning import OpwatchCallback

    callback = OpwatchCallback()                # strict=True: stop at the first anomaly
    trainer = lightning.Trainer(callbacks=[callback], ...)
    trainer.fit(model, data)
    callback.anomalies                          # what was found, as opwatch.Anomaly objects

Lightning (``lightning`` or the older ``pytorch_lightning``) is imported when
``OpwatchCallback`` is first used, not when this module is imported.
"""

from __future__ import annotations

from . import StepWatch, WatchedSteps, lazy_callback

__all__ = ["OpwatchCallback"]


class _Hooks(WatchedSteps):
    """Watch each training batch of ``lightning.Trainer.fit``: its forward, backward and
    optimizer step (from ``on_train_batch_start`` to ``on_train_batch_end``). Validation and
    prediction batches are not watched.

    - ``callback.anomalies`` / ``callback.contained`` / ``callback.watch``: what the watch
      found, and the :class:`opwatch.Watch` itself (its ``records`` are the last
      ``max_records`` ops of the latest batches; ``watch.table()``, ``watch.export_jsonl()``).
    - At the end of fit the summary is printed (to ``file``, stderr by default).
    - The running counts ``opwatch/anomalies`` and ``opwatch/contained`` are logged each batch
      with ``LightningModule.log``, so they reach the trainer's loggers (every
      ``log_every_n_steps``, like any metric logged on step).
    - ``strict=True``: fit stops at the first anomaly with :class:`opwatch.AnomalyError`
      (device, dtype and broadcast anomalies before the op runs; nan/inf at the next check
      point: the batch's end, or a value read on the host such as ``loss.item()``).
    - When a batch raises, the watch prints the last ``last`` ops with the failing one marked
      and adds a note to the exception, as a ``with opwatch.watch():`` block does.

    Options (keyword-only) are those of :func:`opwatch.watch` (``checks``, ``allow``,
    ``last``, ``max_records``, ``warn``, ``file``); ``log=False`` logs no counts.
    """

    def __init__(self, *, strict: bool = False, file=None, log: bool = True, **watch_options):
        if not isinstance(log, bool):
            raise TypeError(f"log must be True or False, got {log!r}")
        self._steps = StepWatch(strict=strict, file=file, **watch_options)
        self._log = log

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._steps.enter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._steps.exit()
        if self._log:
            counts = {"opwatch/anomalies": float(self._steps.anomaly_count), "opwatch/contained": float(self._steps.contained_count)}
            pl_module.log_dict(counts, on_step=True, on_epoch=False, batch_size=1)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._steps.exit(exception)

    def on_train_end(self, trainer, pl_module) -> None:
        self._steps.exit()  # a batch that ended without on_train_batch_end (should not happen)
        prefix = f"[rank {trainer.global_rank}] " if trainer.world_size > 1 else ""
        self._steps.print_summary(prefix)


def _load_base():
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError:
            raise ImportError("opwatch.integrations.lightning needs Lightning: pip install lightning") from None
    return Callback


__getattr__ = lazy_callback(__name__, _load_base, _Hooks)
