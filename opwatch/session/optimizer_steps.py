"""The optimizer steps as check points: one global step pre-hook while any watch is active."""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (see opwatch.session).
__tracebackhide__ = True

import functools
import threading
import traceback
import weakref

import torch

from ..core.compat import optimizer_step_runs_only, run_uncompiled
from ..core.records import CLIPPING, OPTIMIZER

__all__ = ["OptimizerCheckPoints", "StepFollowers", "optimizer_parameters", "steps_checked", "steps_followed"]


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
        # optimizer -> its step post-hook (the step's ops end their phase span there): one per
        # optimizer that stepped under a watch, removed with the last watch. Not a global hook:
        # a watch entered inside a global post-hook (leave-on's audits) must not add to the
        # hooks torch is running.
        self._after = weakref.WeakKeyDictionary()
        self._clip = None  # torch.nn.utils' clipping functions as they were, while wrapped
        self._lock = threading.Lock()

    # Its hooks run plain, never through compat.run_uncompiled: they act only while a watch is
    # active, and a watch holds Dynamo in its force_eager stance, where no compiled frame traces.
    def hold(self, w) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        with self._lock:
            self._watches.append((w, threading.get_ident()))
            if self._handle is None:
                self._handle = register_optimizer_step_pre_hook(self._before_step)
                self._wrap_clipping()

    def release(self, w) -> None:
        with self._lock:
            self._watches = [(other, thread) for other, thread in self._watches if other is not w]
            if not self._watches and self._handle is not None:
                self._handle.remove()
                self._handle = None
                for after in list(self._after.values()):
                    after.remove()
                self._after.clear()
                self._unwrap_clipping()

    def _wrap_clipping(self) -> None:
        """While a watch is active, ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_``
        mark their ops' phase (``clipping``, not ``forward``): torch has no hook for them, so
        the two module attributes are wrapped, and put back when the last watch ends (a name
        imported from torch before the watch began calls the function unwrapped: its ops read
        ``forward``)."""
        utils = torch.nn.utils
        self._clip = {name: getattr(utils, name) for name in ("clip_grad_norm_", "clip_grad_value_") if hasattr(utils, name)}
        for name, function in self._clip.items():
            setattr(utils, name, self._spanned(function))

    def _unwrap_clipping(self) -> None:
        for name, function in (self._clip or {}).items():
            if getattr(getattr(torch.nn.utils, name), "__wrapped__", None) is function:
                setattr(torch.nn.utils, name, function)
        self._clip = None

    def _spanned(self, function):
        points = self

        @functools.wraps(function)
        def clipping(*args, **kwargs):
            watches = points._here()
            for w in watches:
                w._phase_begins(CLIPPING)
            try:
                return function(*args, **kwargs)
            finally:
                for w in watches:
                    w._phase_ends()

        return clipping

    def _here(self) -> list:
        """The watches active on this thread, outermost first."""
        thread = threading.get_ident()
        return [w for w, active_on in self._watches if active_on == thread]

    def _after_step(self, optimizer, args, kwargs) -> None:
        for w in self._here():
            w._phase_ends()

    @property
    def registered(self) -> bool:
        return self._handle is not None

    def _before_step(self, optimizer, args, kwargs):
        watches = self._here()[::-1]  # innermost first
        for w in watches:
            w._before_optimizer_step()  # strict: may raise, the step then never runs
            w._phase_begins(OPTIMIZER)  # the step's own ops: phase "optimizer"
        if not watches:
            return None
        if optimizer not in self._after:
            self._after[optimizer] = optimizer.register_step_post_hook(self._after_step)
        if len(watches) == 1:
            (only,) = watches
            try:
                if only._functions is not None and self._runs_only_torch_code(optimizer, args, kwargs):
                    only._functions.stand_aside()
            except Exception as error:
                only._internal_error(error, traceback.format_exc())
        return _closure_unspanned(args, kwargs, watches)

    def _runs_only_torch_code(self, optimizer, args, kwargs) -> bool:
        """Whether the step about to run is torch's own optimizer code alone: a ``torch.optim``
        class (not a subclass of the program's), no closure (the program's forward and backward
        would run inside the step), no other step hook."""
        if self._handle is None or not type(optimizer).__module__.startswith("torch.optim."):
            return False
        _, *step_args = args
        if any(value is not None for value in (*step_args, *kwargs.values())):
            return False
        own = {handle.id for handle in (self._after.get(optimizer), steps_followed.handle) if handle is not None}
        return optimizer_step_runs_only(optimizer, self._handle.id, own_post_hook_ids=own)


class StepFollowers:
    """Objects told of every optimizer step (``follower.stepped(optimizer)``) for as long as
    they live: one global optimizer step post-hook for the whole process, added with the first
    follower and never removed. (Not a hook removed when its follower is collected: the
    collector runs at any moment, a compilation included, and TorchDynamo, which guards the
    keys of the hooks dict a compiled step iterates, then failed building that step's guards
    with a KeyError.) The hook runs as Python where a compiled frame calls it."""

    def __init__(self):
        self._followers = weakref.WeakSet()
        self.handle = None
        self._lock = threading.Lock()

    def follow(self, follower) -> None:
        self._followers.add(follower)
        with self._lock:
            if self.handle is None:
                from torch.optim.optimizer import register_optimizer_step_post_hook

                self.handle = register_optimizer_step_post_hook(run_uncompiled(self._stepped))

    def _stepped(self, optimizer, args, kwargs) -> None:
        for follower in list(self._followers):
            follower.stepped(optimizer)


def optimizer_parameters(optimizer) -> list:
    """Every parameter ``optimizer`` trains, in the order of its ``param_groups``."""
    return [parameter for group in optimizer.param_groups for parameter in group["params"]]


def _closure_unspanned(args, kwargs, watches):
    """``optimizer.step(closure)`` (Lightning's, LBFGS'): the closure runs the forward and the
    backward inside the step; its ops keep their own phases, only the update's are the
    optimizer's. Returns the step's arguments with the closure wrapped, or ``None``."""
    _, *rest = args
    closure = kwargs.get("closure", next(iter(rest), None))
    if not callable(closure):
        return None

    def closure_of_the_step(*closure_args, **closure_kwargs):
        for w in watches:
            w._phase_ends()
        try:
            return closure(*closure_args, **closure_kwargs)
        finally:
            for w in watches:
                w._phase_begins(OPTIMIZER)

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_of_the_step}
    first, _, *others = args
    return (first, closure_of_the_step, *others), kwargs


steps_checked = OptimizerCheckPoints()
steps_followed = StepFollowers()
