"""The optimizer steps as check points: one global step pre-hook while any watch is active."""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (see opwatch.session).
__tracebackhide__ = True

import threading

__all__ = ["OptimizerCheckPoints", "steps_checked"]


class OptimizerCheckPoints:
    """One global optimizer step pre-hook while any watch is active (registered by the first,
    removed by the last, however they nest): each step of any ``torch.optim`` optimizer is a
    check point of the watches active on the thread that runs it, innermost first (each
    watch's ``_before_optimizer_step``).

    GradScaler calls ``optimizer.step()`` only when the unscaled gradients are finite, so the
    steps it skips never reach this hook."""

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
        for w, active_on in reversed(self._watches):
            if active_on == thread:
                w._before_optimizer_step()


steps_checked = OptimizerCheckPoints()
