"""The optimizer steps as check points: one global step pre-hook while any watch is active."""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (see opwatch.session).
__tracebackhide__ = True

import threading
import traceback

from ..core.compat import optimizer_step_runs_only

__all__ = ["OptimizerCheckPoints", "steps_checked"]


class OptimizerCheckPoints:
    """One global optimizer step pre-hook while any watch is active (registered by the first,
    removed by the last, however they nest): each step of any ``torch.optim`` optimizer is a
    check point of the watches active on the thread that runs it, innermost first (each
    watch's ``_before_optimizer_step``).

    GradScaler calls ``optimizer.step()`` only when the unscaled gradients are finite, so the
    steps it skips never reach this hook.

    While the step of one of torch's own optimizers runs (no closure, no other step hook), the
    function mode of the one watch active on the thread stands aside
    (:meth:`~opwatch.modes.functions.FunctionWatch.stand_aside`) until the step's profiler
    region ends. (No post-hook: a watch that ends in another post-hook, a guard's audit, would
    remove it while torch iterates over them.)"""

    def __init__(self):
        self._watches: list = []  # (watch, the thread it is active on), innermost last
        self._handle = None
        self._lock = threading.Lock()

    def hold(self, w) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        with self._lock:
            self._watches.append((w, threading.get_ident()))
            if self._handle is None:
                self._handle = register_optimizer_step_pre_hook(self._before_step)

    def release(self, w) -> None:
        with self._lock:
            self._watches = [(other, thread) for other, thread in self._watches if other is not w]
            if not self._watches and self._handle is not None:
                self._handle.remove()
                self._handle = None

    @property
    def registered(self) -> bool:
        return self._handle is not None

    def _before_step(self, optimizer, args, kwargs) -> None:
        thread = threading.get_ident()
        watches = [w for w, active_on in reversed(self._watches) if active_on == thread]
        for w in watches:
            w._before_optimizer_step()  # strict: may raise, the step then never runs
        if len(watches) != 1:
            return
        (only,) = watches
        try:
            if only._functions is not None and self._runs_only_torch_code(optimizer, args, kwargs):
                only._functions.stand_aside()
        except Exception as error:
            only._internal_error(error, traceback.format_exc())

    def _runs_only_torch_code(self, optimizer, args, kwargs) -> bool:
        """Whether the step about to run is torch's own optimizer code alone: a ``torch.optim``
        class (not a subclass of the program's), no closure (the program's forward and backward
        would run inside the step), no other step hook."""
        if self._handle is None or not type(optimizer).__module__.startswith("torch.optim."):
            return False
        _, *step_args = args
        if any(value is not None for value in (*step_args, *kwargs.values())):
            return False
        return optimizer_step_runs_only(optimizer, self._handle.id)


steps_checked = OptimizerCheckPoints()
