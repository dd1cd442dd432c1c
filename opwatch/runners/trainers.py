"""opwatch inside training frameworks: a callback that watches each training step.

- :mod:`opwatch.runners.lightning`: ``OpwatchCallback`` for ``lightning.Trainer``.
- :mod:`opwatch.runners.transformers`: ``OpwatchCallback`` for ``transformers.Trainer``.
- :mod:`opwatch.runners.tensorboard`: the counts into a ``SummaryWriter`` (a plain
  script, ``python -m opwatch --tensorboard DIR``).

Each module imports its framework only when first used, and this package imports none. Both
callbacks keep one :class:`StepWatch` (``mode="watch"``) or one
:class:`opwatch.runners.leave_on.LeaveOn` (``mode="guard"``), and log :func:`metrics` (the same
names in every runner) to the trainer's loggers.
"""

from __future__ import annotations

import sys

__all__ = ["StepWatch", "WatchedSteps", "lazy_callback", "MODES", "leave_on_runner", "metrics", "phase_metrics"]

MODES = ("watch", "guard")


def leave_on_runner(mode: str, *, strict: bool, file, on_failure=None, **options):
    """``None`` for ``mode="watch"``; for ``mode="guard"`` the leave-on runner the callback
    drives (audits under a full watch, the fused gradient check before each optimizer step)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if mode == "watch":
        if on_failure is not None:
            raise ValueError(f"on_failure is an option of mode='guard' (mode is {mode!r})")
        return None
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    from .leave_on import LeaveOn

    return LeaveOn(strict_mode=strict, on_failure=on_failure, audit="manual", file=file, **options)


def lazy_callback(module_name: str, load_base, hooks):
    """A module ``__getattr__`` that builds ``OpwatchCallback`` (``hooks`` first, then the
    framework's callback class that ``load_base()`` imports) on first use, so that importing
    the integration module does not import its framework."""
    built = []

    def __getattr__(name: str):
        if name != "OpwatchCallback":
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        if not built:
            built.append(type("OpwatchCallback", (hooks, load_base()), {"__doc__": hooks.__doc__, "__module__": module_name}))
        return built[0]

    return __getattr__


class StepWatch:
    """One :class:`opwatch.Watch` entered around each training step and left after it.

    The same watch is re-entered step after step, so its op log stays one ring buffer of
    ``max_records`` ops (the latest steps'), its anomalies accumulate (at most
    ``max_records``), each anomaly is warned once per line for the whole run, and op indices
    keep counting across steps. ``strict`` picks :func:`opwatch.strict`; the other options are
    those of :func:`opwatch.watch` (``file`` also receives the summary).
    """

    def __init__(self, *, strict: bool = False, file=None, **watch_options):
        import opwatch

        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        make = opwatch.strict if strict else opwatch.watch
        self.watch = make(file=file, **watch_options)
        self._file = file
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    @property
    def anomaly_count(self) -> int:
        """Anomalies found so far, over every step (the watch keeps the last ``max_records``)."""
        counts = self.watch.counts
        return sum(counts[kind] for kind in counts if kind != "contained")

    def enter(self) -> None:
        """Start watching a step. A step left open (the framework raised without telling the
        callback) is closed first."""
        if self._active:
            self.exit()
        self.watch.__enter__()
        self._active = True

    def exit(self, error: BaseException | None = None) -> None:
        """Stop watching the current step; ``error`` is the exception that ended it, if any:
        the watch then prints its dump of the last ops and adds its note to ``error``. In
        strict mode, raises :class:`opwatch.AnomalyError` for a nan/inf found at this last
        check point."""
        if not self._active:
            return
        self._active = False
        if error is None:
            self.watch.__exit__(None, None, None)
        else:
            self.watch.__exit__(type(error), error, error.__traceback__)

    def print_summary(self, prefix: str = "", *, phase: str | None = None) -> None:
        """Print the summary; ``phase`` (``"validation"``...): a watch of evaluation batches,
        named in its first line (``opwatch (validation): no anomalies.``)."""
        from ..render.summary import in_phase, shown_of

        stream = self._file if self._file is not None else sys.stderr
        text = self.watch.summary()
        if self.anomaly_count > len(self.watch.anomalies):
            text += shown_of(len(self.watch.anomalies), self.anomaly_count)
        if phase is not None:
            text = in_phase(text, phase)
        print(prefix + text, file=stream)


class WatchedSteps:
    """What both callbacks show of their :class:`StepWatch` or ``LeaveOn`` (``self._steps``)."""

    @property
    def watch(self):
        return self._steps.watch

    @property
    def anomalies(self) -> list:
        """What the watch found; in guard mode also the origins replays named (the run's ledger)."""
        steps = self._steps
        return steps.anomalies if hasattr(steps, "ledger") else steps.watch.anomalies

    @property
    def contained(self) -> list:
        return self._steps.watch.contained


def metrics(source) -> dict[str, int]:
    """opwatch's counts as metrics for TensorBoard and the trainers' loggers: running totals
    since the run began, read from the watch (:attr:`opwatch.Watch.counts`), never from text.

    - ``opwatch/anomalies``: every anomaly reported so far;
    - ``opwatch/anomalies/<kind>``: those of one kind of :data:`opwatch.KINDS`
      (``device_mismatch``, ``dtype_mismatch``, ``broadcast``, ``collective_mismatch``,
      ``nan``, ``inf``, ``overflow_risk``), for each kind found so far (a healthy run's logs
      carry the total alone, 0);
    - ``opwatch/contained``: nan/inf origins absorbed before they mattered (not anomalies);
    - guard mode (the leave-on runner, ``opwatch.runners.leave_on.LeaveOn``): ``opwatch/steps`` (optimizer steps
      seen), ``opwatch/audited`` (of them, run under the full watch), ``opwatch/failed``
      (steps whose gradients held nan/inf), ``opwatch/skipped`` (of those, the steps that
      did not run), ``opwatch/scaler_skipped`` (the steps GradScaler skipped, which never
      call the optimizer: counted apart, at the next ``backward()``), ``opwatch/scaler_skipped_loss``
      (of them, those whose loss was not finite before it was scaled, which no scale mends) and
      ``opwatch/evaluations_nan`` (the model's calls with gradients off that returned nan,
      read at the next step's check).

    ``source``: an :class:`opwatch.Watch`, a ``LeaveOn``, or one of the trainers'
    ``OpwatchCallback`` objects (its watch, or its runner in guard mode).
    """
    from .leave_on import LeaveOn
    from ..session import Watch

    if isinstance(source, WatchedSteps):
        source = source._steps
    if isinstance(source, (StepWatch, LeaveOn)):
        counts = source.watch.counts
    elif isinstance(source, Watch):
        counts = source.counts
    else:
        raise TypeError(f"metrics() takes an opwatch.Watch, a LeaveOn or an OpwatchCallback, got {type(source).__name__}")
    contained = counts.pop("contained")
    if isinstance(source, LeaveOn):  # the origins replays named count as the audits' do (the ledger)
        for origin in source.anomalies[len(source.watch.anomalies):]:
            counts[origin.kind] = counts.get(origin.kind, 0) + 1
    values = {"opwatch/anomalies": sum(counts.values())}
    values.update((f"opwatch/anomalies/{kind}", count) for kind, count in counts.items() if count)
    values["opwatch/contained"] = contained
    if isinstance(source, LeaveOn):
        # the ledger's counts as the device finished them (no wait: a trainer logs every batch)
        values.update((f"opwatch/{name}", count) for name, count in source.ledger.counts(wait=False).items())
        values["opwatch/scaler_skipped"] = source.ledger.scaler_skipped  # GradScaler's, none of the steps above
        values["opwatch/scaler_skipped_loss"] = source.ledger.scaler_skipped_loss  # of them, on a loss not finite unscaled
        values["opwatch/evaluations_nan"] = source.ledger.evaluations_nan  # calls with gradients off: no step's
    return values


def phase_metrics(phase: str, watch) -> dict[str, int]:
    """:func:`metrics` of the watch of one evaluation phase, named under it:
    ``opwatch/validation/anomalies``, ``opwatch/validation/anomalies/<kind>``,
    ``opwatch/validation/contained`` (``phase``: ``"validation"``, ``"test"``...)."""
    return {f"opwatch/{phase}/{name.partition('/')[2]}": value for name, value in metrics(watch).items()}
