"""opwatch for Lightning: ``OpwatchCallback`` watches each training batch of ``Trainer.fit``,
and each validation, test and prediction batch, counted apart.

    from opwatch.runners.lightning import OpwatchCallback

    callback = OpwatchCallback()                # strict=True: stop at the first anomaly
                                                # mode="guard": leave it on at eager speed
    trainer = lightning.Trainer(callbacks=[callback], ...)
    trainer.fit(model, data)
    callback.anomalies                          # what was found, as opwatch.Anomaly objects

Lightning (``lightning`` or the older ``pytorch_lightning``) is imported when
``OpwatchCallback`` is first used, not when this module is imported.
"""

from __future__ import annotations

from ..session.optimizer_steps import optimizer_parameters
from .trainers import StepWatch, WatchedSteps, lazy_callback, leave_on_runner, metrics, phase_metrics

__all__ = ["OpwatchCallback"]

# trainer.state.fn of a run of one evaluation phase alone (trainer.validate, test, predict)
_ALONE = {"validation": "validate", "test": "test", "predict": "predict"}


class _Hooks(WatchedSteps):
    """Watch each training batch of ``lightning.Trainer.fit``: its forward, backward and
    optimizer step (from ``on_train_batch_start`` to ``on_train_batch_end``); and each
    validation, test and prediction batch (``validation_step``, ``test_step``,
    ``predict_step``, from ``on_validation_batch_start`` to ``on_validation_batch_end`` and
    the like), in fit's validation, the sanity check, ``trainer.validate``, ``trainer.test``
    and ``trainer.predict``. Each evaluation phase has a watch of its own, so its anomalies
    are counted apart from training's.

    - ``callback.anomalies`` / ``callback.contained`` / ``callback.watch``: what the training
      watch found, and the :class:`opwatch.Watch` itself (its ``records`` are the last
      ``max_records`` ops of the latest batches; ``watch.table()``, ``watch.export_jsonl()``).
      ``callback.watches``: every phase's watch that ran, by phase (``"train"``,
      ``"validation"``, ``"test"``, ``"predict"``); ``callback.watches["validation"].anomalies``.
    - At the end of fit the summary is printed (to ``file``, stderr by default), then, when
      validation ran, validation's (``opwatch (validation): ...``); ``trainer.validate``,
      ``test`` and ``predict`` print their phase's summary at their end.
    - The running counts (:func:`opwatch.runners.trainers.metrics`: ``opwatch/anomalies``, one
      ``opwatch/anomalies/<kind>`` per kind found, ``opwatch/contained``) are logged each batch with
      ``LightningModule.log``, so they reach every logger of the trainer (TensorBoard, CSV,
      W&B; every ``log_every_n_steps``, like any metric logged on step), and once more at the
      end of fit, at the trainer's ``global_step`` (the final counts, whatever the interval).
      Validation's and test's counts are logged once per epoch, under their phase's name
      (``opwatch/validation/anomalies``, ``opwatch/test/anomalies/<kind>``, ...: running totals,
      as training's); Lightning takes no log from prediction (``callback.watches["predict"]``).
    - ``strict=True``: fit stops at the first anomaly with :class:`opwatch.AnomalyError`
      (device, dtype and broadcast anomalies before the op runs; nan/inf at the next check
      point: the batch's end, or a value read on the host such as ``loss.item()``).
    - When a batch raises, the watch prints the last ``last`` ops with the failing one marked
      and adds a note to the exception, as a ``with opwatch.watch():`` block does.

    ``mode="guard"`` leaves it on at eager speed (:mod:`opwatch.runners.leave_on`): the first batch and
    each batch of a new signature (nesting, shapes, dtypes, devices; at most ``max_audits``,
    default 8) run under the full watch until their optimizer step has run; the other batches
    run with no dispatch mode, and after each backward (``on_before_optimizer_step``) one fused
    check that the gradients are finite. A failing check names the step and the parameters
    holding nan/inf, and the failing batch runs again from its start (the RNG states and the
    buffers as the batch found them, no ``.grad``) under the full watch: the module's
    ``training_step`` and the backward of its loss, which name the op and line that made the
    first nan/inf. Then ``on_failure``: ``"skip"`` (default; ``"raise"`` with ``strict=True``)
    skips the optimizer step: Lightning checks inside ``optimizer.step(closure)``, after the
    closure, so every parameter's ``.grad`` is set to ``None`` there and the optimizer's update
    reads none (torch's optimizers then move no weight, momentum, weight decay or step count,
    as for a step GradScaler skips); ``"raise"`` raises :class:`opwatch.AnomalyError` with the
    origin (``opwatch.runners.leave_on.GradientsNotFinite`` when no op of the batch made them);
    ``"apply"`` lets the optimizer apply them. With manual optimization or gradient
    accumulation the batch is not run again: the next batch is watched fully instead. ``callback.runner`` counts steps, audits,
    failures and skips (logged as ``opwatch/steps``, ``opwatch/audited``, ``opwatch/failed``);
    the summary at the end of fit says them.
    Guard mode watches no validation, test or prediction batch (they have no gradients to
    check, and a full watch of each would cost what guard mode saves). ``mode="watch"``
    (default) watches every batch.

    Options (keyword-only) are those of :func:`opwatch.watch` (``checks``, ``allow``,
    ``last``, ``max_records``, ``warn``, ``file``); ``log=False`` logs no counts; ``mode``
    (``"watch"`` or ``"guard"``); ``max_audits`` and ``on_failure`` (guard mode).
    """

    def __init__(self, *, strict: bool = False, file=None, log: bool = True, mode: str = "watch", on_failure=None, **watch_options):
        if not isinstance(log, bool):
            raise TypeError(f"log must be True or False, got {log!r}")
        self.runner = leave_on_runner(mode, strict=strict, file=file, pre_hook=False, on_failure=on_failure, **watch_options)
        self._steps = self.runner if self.runner is not None else StepWatch(strict=strict, file=file, **watch_options)
        self._log = log
        self._replay_options = {name: watch_options[name] for name in ("checks", "allow", "max_records") if name in watch_options}
        self._batch = None  # (batch, batch_idx, what it started from) in guard mode
        self._snapshots = None
        self._eval_options = dict(strict=strict, file=file, **watch_options)
        self._phases: dict[str, StepWatch] = {}  # evaluation phase -> its StepWatch, once it ran

    @property
    def watches(self) -> dict:
        """Each phase's :class:`opwatch.Watch` that ran so far, by phase: ``"train"`` (in
        guard mode, the runner's), ``"validation"``, ``"test"``, ``"predict"``."""
        watches = {"train": self._steps.watch}
        watches.update((phase, steps.watch) for phase, steps in self._phases.items())
        return watches

    # -- validation, test and prediction batches --------------------------------------------

    def _eval_enter(self, phase: str) -> None:
        if self.runner is not None:
            return  # guard mode: see the class docstring
        steps = self._phases.get(phase)
        if steps is None:
            steps = self._phases[phase] = StepWatch(**self._eval_options)
        steps.enter()

    def _eval_exit(self, phase: str, pl_module) -> None:
        steps = self._phases.get(phase)
        if steps is None:
            return
        steps.exit()
        if self._log and phase != "predict":  # Lightning takes no log in prediction
            # Running totals: the epoch's value is the largest, the last batch's.
            pl_module.log_dict(phase_metrics(phase, steps.watch), on_step=False, on_epoch=True, reduce_fx="max", batch_size=1)

    def _eval_end(self, phase: str, trainer) -> None:
        """The end of a validation, test or prediction run: alone (``trainer.validate``...),
        its summary now; inside fit, at the end of fit."""
        steps = self._phases.get(phase)
        if steps is None:
            return
        steps.exit()
        if trainer.state.fn == _ALONE[phase]:
            steps.print_summary(_prefix(trainer), phase=phase)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_enter("validation")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_exit("validation", pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._eval_end("validation", trainer)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_enter("test")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_exit("test", pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._eval_end("test", trainer)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_enter("predict")

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_exit("predict", pl_module)

    def on_predict_end(self, trainer, pl_module) -> None:
        self._eval_end("predict", trainer)

    # -- training batches -------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        if self.runner is not None:
            # With a GradScaler, Lightning runs the backward first and scaler.step() calls
            # optimizer.step() only for finite gradients: torch's pre-hook is the check point.
            self.runner.pre_hook = getattr(trainer.precision_plugin, "scaler", None) is not None
            self.runner.know(pl_module)
            if pl_module.automatic_optimization and getattr(trainer, "accumulate_grad_batches", 1) == 1:
                self.runner.replay = lambda: self._replay(pl_module)
            else:  # no failing batch runs again: the summary says what names a one-off's op
                self.runner.unreplayed = "lightning"
            self.runner.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.runner is not None:
            audited = self.runner.audit_batch(batch)
            # An audited batch keeps its start too: in a job, a rank that audited it replays it
            # with the others that did not (their collectives, if any, match).
            if self.runner.replay is not None and (not audited or _in_job()):
                if self._snapshots is None:  # the buffers and the RNG states: a batch's start
                    from .guarded.snapshot import Snapshots

                    self._snapshots = Snapshots([], pl_module)
                self._batch = (batch, batch_idx, self._snapshots.take((), {}))
        else:
            self._steps.enter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.runner is None or self.runner.pre_hook:
            return
        if pl_module.automatic_optimization and trainer.gradient_clip_val and _by_norm(trainer.gradient_clip_algorithm):
            # Lightning clips by norm right after this hook: the step is decided on that norm
            # (no pass of opwatch's over the gradients), before the update.
            self.runner.policy.decide_at_clip(optimizer, self.runner, lambda: _drop_gradients(optimizer))
        elif self.runner.before_step(optimizer):
            _drop_gradients(optimizer)

    def _replay(self, pl_module):
        """The failing batch again from its start under a full watch: ``(ran, origin)``."""
        if self._batch is None:
            return False, None
        from .guarded import replay as replays

        batch, batch_idx, start = self._batch
        self._snapshots.restore(start)
        for parameter in pl_module.parameters():
            parameter.grad = None

        def training_step():
            output = pl_module.training_step(batch, batch_idx)
            loss = output["loss"] if isinstance(output, dict) else output
            loss.backward()
            return loss

        replay = replays.run(training_step, (), {}, keep_values=False, repro_max_bytes=0, **{
            "checks": self._replay_options.get("checks"), "allow": self._replay_options.get("allow", ()),
            "max_records": self._replay_options.get("max_records", 10_000)})
        if replay.error is not None:
            return False, None
        origin = replays.explaining(replay.watch.anomalies, None, None, None)
        self.runner.compiled_verdict = self._compiled_verdict(replay, origin, training_step, start, pl_module)
        return True, origin

    def _compiled_verdict(self, replay, origin, training_step, start, pl_module):
        """For a replayed batch that runs compiled code: eager fails too, or only the compiled
        step (then the compiler's stages, the first wrong graph node, inductor's settings and a
        graph repro, each run from the batch's start: ``guarded.compiled.explain``). The module
        is left as the replay left it (buffers, ``.grad``, the CPU RNG state)."""
        import torch

        from .guarded import compiled as compiled_steps
        from .guarded.snapshot import put_buffers

        verdict = compiled_steps.verdict(replay.watch, origin)
        if verdict is None or verdict.eager_fails:
            return verdict
        parameters = list(pl_module.parameters())
        grads, buffers, rng = [parameter.grad for parameter in parameters], self._snapshots.buffers_now(), torch.get_rng_state()

        def restore():
            self._snapshots.restore(start)
            for parameter in parameters:
                parameter.grad = None

        def finite(loss):
            tensors = [loss.detach(), *(parameter.grad for parameter in parameters if parameter.grad is not None)]
            return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)

        try:
            return compiled_steps.explain(verdict, training_step, (), {}, restore=restore, finite=finite, max_bytes=128 * 2**20, repro_dir=None)
        finally:
            for parameter, grad in zip(parameters, grads):
                parameter.grad = grad
            if buffers is not None:
                put_buffers(*buffers)
            torch.set_rng_state(rng)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.runner is not None:
            self._batch = None
            # An audit goes on through the batches Lightning accumulates, to the optimizer step
            # that applies them (at an epoch's end Lightning steps on fewer); a batch of manual
            # optimization that stepped no optimizer ends it.
            accumulate = getattr(trainer, "accumulate_grad_batches", 1)
            if not (pl_module.automatic_optimization and accumulate > 1 and (batch_idx + 1) % accumulate):
                self.runner.end_batch()
        else:
            self._steps.exit()
        if self._log:
            pl_module.log_dict(metrics(self), on_step=True, on_epoch=False, batch_size=1)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        for steps in self._phases.values():
            steps.exit(exception)  # the batch open when it raised, if an evaluation one
        if self.runner is not None:
            self.runner.__exit__(type(exception), exception, exception.__traceback__)
        else:
            self._steps.exit(exception)

    def on_train_end(self, trainer, pl_module) -> None:
        prefix = _prefix(trainer)
        if self.runner is not None:
            self.runner.replay, self._snapshots, self._batch = None, None, None  # the module is not kept alive by the callback
            self.runner.__exit__(None, None, None)
        else:
            self._steps.exit()  # a batch that ended without on_train_batch_end (should not happen)
        validation = self._phases.get("validation")
        if self._log:
            counts = metrics(self)
            if validation is not None:
                counts.update(phase_metrics("validation", validation.watch))
            _log_final_counts(trainer, counts)
        if self.runner is not None:
            self.runner.print_summary(prefix, watch_summary=True)
        else:
            self._steps.print_summary(prefix)
        if validation is not None:
            validation.print_summary(prefix, phase="validation")


def _in_job() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _prefix(trainer) -> str:
    return f"[rank {trainer.global_rank}] " if trainer.world_size > 1 else ""


def _log_final_counts(trainer, counts: dict) -> None:
    """The counts at the end of fit, to every logger, at the trainer's global step: the batches
    after the last ``log_every_n_steps`` reach no logger otherwise (and Lightning does not say
    which batch it sent last)."""
    counts = {name: float(value) for name, value in counts.items()}  # as LightningModule.log sends them
    for logger in trainer.loggers:
        logger.log_metrics(counts, step=trainer.global_step)


def _load_base():
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError:
            raise ImportError("opwatch.runners.lightning needs Lightning: pip install lightning") from None
    return Callback


__getattr__ = lazy_callback(__name__, _load_base, _Hooks)


def _drop_gradients(optimizer) -> None:
    """A skipped step: the update after the closure reads no gradient."""
    for parameter in optimizer_parameters(optimizer):
        parameter.grad = None


def _by_norm(algorithm) -> bool:
    """Whether Lightning's ``gradient_clip_algorithm`` (an enum, a string or ``None``: norm) clips by norm."""
    return algorithm is None or getattr(algorithm, "value", algorithm) == "norm"
