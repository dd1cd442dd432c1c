"""What a guarded float16 loop's GradScaler did with each call's gradients.

``scaler.step(optimizer)`` runs after the guarded call: it unscales the optimizer's gradients
(its kernel checks every one) and calls ``optimizer.step()`` only when they are finite. An
optimizer the scaler unscaled that did not step since was skipped; the guard learns it at its
next call (:meth:`ScalerSteps.since_last_call`), from two things the program does anyway: the
scaler's ``unscale_`` (its class's method wrapped once, for the process) and the optimizer
step post-hook (:data:`~opwatch.session.optimizer_steps.steps_followed`). No kernel, no host read.
A fused optimizer (``fused=True``) is never unscaled: GradScaler calls its step with a
``found_inf``, and its kernel skips the update when that flag is set; the post-hook keeps the
flag, read at the next call (:class:`~opwatch.runners.step_verdict.ScalerSkips`, which also
keeps leave-on's count).

A call the guard skipped itself leaves its gradients to the scaler the same way: filled with nan
(:meth:`ScalerSteps.leave_to_scaler`), so that ``scaler.step()`` skips the update as it skips an
overflow and ``scaler.update()`` lowers its scale, as the step's own nan would have made it do.
(``.grad`` dropped to ``None`` everywhere would make ``scaler.step()`` fail: "No inf checks were
recorded for this optimizer".)
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from ...session.optimizer_steps import steps_followed
from ..step_verdict import ScalerSkips

__all__ = ["ScalerSteps"]


class _Unscales:
    """Followers told of every ``unscale_`` of the scaler they follow: the ``unscale_`` of each
    GradScaler class met (the class in its MRO that defines it: ``GradScaler``, FSDP's
    ``ShardedGradScaler``) wrapped once and never put back, as the optimizer step post-hook is
    (:class:`~opwatch.session.optimizer_steps.StepFollowers`)."""

    def __init__(self):
        self._followers = weakref.WeakSet()
        self._wrapped: set = set()
        self._lock = threading.Lock()

    def follow(self, follower) -> None:
        self._followers.add(follower)
        owner = next(cls for cls in type(follower.scaler).__mro__ if "unscale_" in vars(cls))
        with self._lock:
            if owner not in self._wrapped:
                self._wrapped.add(owner)
                owner.unscale_ = self._told(vars(owner)["unscale_"])

    def _told(self, original):
        followers = self._followers

        @functools.wraps(original)
        def unscale_(scaler, optimizer):
            result = original(scaler, optimizer)
            if followers and scaler.is_enabled():  # a disabled scaler checks nothing and calls the step
                for follower in list(followers):
                    if follower.scaler is scaler:
                        follower.unscaled(optimizer)
            return result

        return unscale_


_unscales = _Unscales()


class ScalerSteps:
    """The GradScaler a guard was given (``guard(..., scaler=)``) and what it did with the
    gradients of the latest call: the optimizers it unscaled since, and which of them stepped."""

    def __init__(self, scaler):
        self.scaler = scaler
        self._skips = ScalerSkips()  # the optimizers it unscaled since the last call, and what they did
        self._left = False  # the guard skipped the latest call: its nan gradients were left to the scaler
        _unscales.follow(self)
        steps_followed.follow(self)

    @property
    def enabled(self) -> bool:
        return self.scaler.is_enabled()

    def unscaled(self, optimizer) -> None:
        self._skips.checked(optimizer, self.scaler)

    def stepped(self, optimizer) -> None:
        """Any optimizer's step (the global post-hook): a skipped one never gets here, but for a
        fused one GradScaler handed ``found_inf`` (it never unscales it), which skips inside its
        kernel (decided when its flag is read, at the next call)."""
        self._skips.stepped(optimizer, self.scaler)

    def since_last_call(self) -> tuple:
        """``(skipped, stepped)`` since the latest call: an optimizer the scaler unscaled that
        did not step (it skipped that call's step; with several optimizers, one is enough), or
        ``None``; whether one it unscaled stepped. A call the guard skipped itself counts as
        neither (it is counted as failed). Forgets both."""
        skips, stepped = self._skips.read()
        left, self._left = self._left, False
        if left:
            return None, False
        first = next(iter(skips), None)
        return (None if first is None else first.optimizer), stepped

    def leave_to_scaler(self, params) -> bool:
        """A call the guard skipped: fill the ``.grad`` it left with nan, so that the scaler
        skips the update (its kernel finds them) and lowers its scale, as for an overflow.
        Returns ``False`` (nothing done) when the scaler is off or no parameter holds a ``.grad``:
        then they are dropped as without a scaler (a disabled scaler just calls the step)."""
        grads = [param.grad for param in params if param.grad is not None]
        if not grads or not self.enabled:
            return False
        with torch.no_grad():
            for grad in grads:
                grad.fill_(float("nan"))
        self._left = True
        return True
