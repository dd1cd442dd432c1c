"""opwatch's counts in TensorBoard, from a plain script or ``python -m opwatch --tensorboard DIR``.

    from torch.utils.tensorboard import SummaryWriter
    from opwatch.runners.tensorboard import log_counts

    writer = SummaryWriter("runs/train")
    with opwatch.watch() as w:
        for step, batch in enumerate(data):
            train_step(model, batch)
            log_counts(writer, w, step)         # opwatch/anomalies, opwatch/anomalies/<kind>, ...

The metrics are those of :func:`opwatch.runners.trainers.metrics`, the same names the Lightning
and Hugging Face callbacks log. torch's ``SummaryWriter`` (which needs the ``tensorboard``
package) is imported only by :class:`OptimizerStepCounts`, never by ``import opwatch``.
"""

from __future__ import annotations


from ..core.compat import run_uncompiled
from ..core.sites import warn_at_user
from ..findings.anomaly import OpwatchWarning
from ..render.notices import counts_not_written
from .trainers import metrics

__all__ = ["log_counts", "OptimizerStepCounts", "summary_writer"]


def log_counts(writer, source, step: int) -> dict[str, int]:
    """Write :func:`opwatch.runners.trainers.metrics` of ``source`` (an :class:`opwatch.Watch`, a
    guard-mode ``LeaveOn``, or a trainer's ``OpwatchCallback``) to ``writer`` at global step
    ``step``, one ``writer.add_scalar(name, value, step)`` each, and return them. ``writer``:
    a ``torch.utils.tensorboard.SummaryWriter`` or anything with its ``add_scalar``
    (tensorboardX's)."""
    if not callable(getattr(writer, "add_scalar", None)):
        raise TypeError(f"writer must be a SummaryWriter (an object with add_scalar), got {type(writer).__name__}")
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {step!r}")
    values = metrics(source)
    for name, value in values.items():
        writer.add_scalar(name, value, step)
    return values


def summary_writer(log_dir):
    """A ``torch.utils.tensorboard.SummaryWriter`` writing into ``log_dir`` (imported here:
    it needs the ``tensorboard`` package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError("opwatch's TensorBoard counts need the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(log_dir=str(log_dir))


class OptimizerStepCounts:
    """The counts of ``source`` written to ``writer`` after every optimizer step (torch's global
    optimizer step post-hook, so any ``torch.optim`` optimizer is seen, however the loop is
    written), at step 1, 2, ... (optimizer steps so far), while the context is entered;
    :meth:`close` writes them once more at the end, if they changed since (or nothing was
    written yet), and closes the writer. The command line's ``--tensorboard DIR``; enter it
    after the watch or guard runner, so that their own step hooks have counted first.

    A failure to write (a full disk) is told once as an :class:`opwatch.OpwatchWarning` and
    writing stops; the program goes on.
    """

    def __init__(self, writer, source):
        metrics(source)  # a TypeError now rather than in the program's optimizer step
        self._writer = writer
        self._source = source
        self.steps = 0  # optimizer steps seen
        self._written = None  # the last counts written
        self._handle = None
        self._failed = False

    def __enter__(self) -> OptimizerStepCounts:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(run_uncompiled(self._after_step))
        return self

    def __exit__(self, exc_type, exc, traceback_) -> bool:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        return False

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        self._write()

    def _write(self) -> None:
        written = self._guarded(lambda: log_counts(self._writer, self._source, self.steps))
        if written is not None:
            self._written = written

    def _guarded(self, write):
        """``write()``'s result, unless an earlier write failed; a failure is warned once."""
        if self._failed:
            return None
        try:
            return write()
        except Exception as error:  # never an exception in the program's optimizer step
            self._failed = True
            warn_at_user(OpwatchWarning(counts_not_written(error)))  # the program's line, not torch's optimizer
            return None

    def close(self) -> None:
        """Write the final counts (when they changed since the last step's) and close the writer."""
        self.__exit__(None, None, None)
        if self._written is None or self._written != metrics(self._source):
            self._write()
        self._guarded(self._writer.close)
