"""The verdict seam: whether a step's update is finite and which parameters are bad
(:class:`StepVerdict`, read from what the step computed: :mod:`opwatch.runners.step_verdict`),
and whether weights that hold nan/inf were written by the program (:class:`ProgramWrites`)."""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch

from ...core.compat import no_python_dispatch, unseen_by_dispatch_modes, version_counters
from ...core.finite import nonfinite_kind
from ...session.optimizer_steps import optimizer_parameters, steps_followed
from ..guarded.check import FiniteCheck
from ..guarded.ranks import local
from ..step_verdict import DeviceVerdict, StepReductions, VerdictFromStep

__all__ = ["StepVerdict", "ProgramWrites", "nonfinite_of"]


def nonfinite_of(named, of) -> list:
    """``(name, "nan" | "inf")`` of each ``(name, parameter)`` of ``named`` whose ``of(parameter)``
    (its gradient, or itself) is not finite: read after a failed verdict only, one host read each.
    A DTensor is read on its local shard."""
    bad = []
    with torch.no_grad():
        for name, parameter in named:
            value = of(parameter)
            if value is None:
                continue
            value = local(value)  # a DTensor's shard, taken before its dispatch is off
            with no_python_dispatch():
                kind = nonfinite_kind(value)
            if kind is not None:
                bad.append((name, kind))
    return bad


class StepVerdict:
    """The verdict of one step: whether its update is finite, and which parameters are bad.

    The one seam between a runner and how a step's health is read: :meth:`finite` answers from
    the step's facts (the gradients about to be applied, the losses ``backward()`` ran on) from
    what the step already computed (:class:`~opwatch.runners.step_verdict.VerdictFromStep`:
    GradScaler's unscale, the clip's total norm kept by :attr:`reductions`) or one fused pass,
    at most one host read; :meth:`device_flag` gives it on the device, no host read (a fused
    optimizer's ``found_inf``); :meth:`bad_gradients` and :meth:`loss_kind` say what failed,
    read only after a failed verdict."""

    def __init__(self, scaler=None):
        self.reductions = StepReductions()  # what the step computed; the trigger enters it for its run (or call)
        self.returned = FiniteCheck(scaler, self.reductions)  # a call wrapper's: what the step returned, and the gradients
        self.check = self.returned.tensors  # one FusedFiniteCheck, its flags kept from step to step
        self.from_step = VerdictFromStep(self.reductions, self.check)

    @property
    def source(self) -> str | None:
        """Where the last verdict came from: ``"scaler"``, ``"clip"`` or ``"fused pass"``."""
        return self.returned.source if self.from_step.source is None else self.from_step.source

    def finite(self, gradients, losses=(), optimizer=None) -> bool:
        """An optimizer step's: the gradients about to be applied and the losses."""
        # An audit's watch may be open: the check is not the program's.
        return unseen_by_dispatch_modes(self.from_step.finite, gradients, list(losses), optimizer)

    def gradients_finite(self, gradients, optimizer=None) -> bool:
        """The gradients' part alone, read after a failed :meth:`finite` (DDP: a loss that is
        not finite on this rank only)."""
        return unseen_by_dispatch_modes(self.from_step.gradients_finite, gradients, optimizer)

    def device_flag(self, gradients, losses, optimizer) -> DeviceVerdict | None:
        return unseen_by_dispatch_modes(self.from_step.device_flag, gradients, losses, optimizer)

    def step_finite(self, result, params) -> bool:
        """A guarded call's: what it returned (tensors, floats) and the parameters' gradients
        (the clip norms the call computed, when one covers them, read in their place)."""
        try:
            return self.returned.all_finite(result, params)
        finally:
            self.reductions.forget()  # the norms' ids name this call's gradients only

    @staticmethod
    def bad_gradients(named) -> list:
        """``(name, kind)`` of each ``(name, parameter)`` whose gradient holds nan/inf."""
        return nonfinite_of(named, lambda parameter: parameter.grad)

    @staticmethod
    def loss_kind(losses, *, scaled: bool = False) -> str | None:
        """``"nan"`` or ``"inf"``: the first loss that is not finite. ``scaled``: the losses are
        GradScaler's (``scaler.scale(loss)``, read at a step it skipped, which reads the scale
        anyway), and only what was not finite before the scale counts: a nan at any scale, an
        inf in float32 or bfloat16 (the loss times the scale overflows those beyond 1e31 only),
        not in float16, whose loss times 65536 overflows past 1: GradScaler's to mend."""
        with torch.no_grad(), no_python_dispatch():
            for loss in losses:
                kind = nonfinite_kind(loss)
                if kind == "nan" or (kind == "inf" and not (scaled and loss.dtype == torch.float16)):
                    return kind
        return None


class _StepLeft(NamedTuple):
    """What an optimizer's latest step left: the optimizer (a weak reference), its parameters and
    their version counters then."""

    optimizer: weakref.ref
    parameters: list
    counters: list


class ProgramWrites:
    """Whether weights that hold nan/inf were written by the program rather than by an optimizer
    step: the parameters' version counters as each optimizer step left them (a Python read
    each, no kernel). A counter that moved since, or a parameter no optimizer step touched yet,
    was written by the program (an assignment such as ``w[i] = ...``, a state-dict load, an init)."""

    def __init__(self):
        # id(optimizer) -> (a weak reference to it, its parameters, their counters after its
        # step); the entry goes with the optimizer. A dict, not a WeakKeyDictionary: written at
        # every step, it makes no weak reference and no Python call there.
        self._left: dict = {}

    def follow_steps(self) -> None:
        """Be told of every optimizer step from now on, for as long as this lives (the one
        global post-hook of :data:`~opwatch.session.optimizer_steps.steps_followed`)."""
        steps_followed.follow(self)

    def stepped(self, optimizer) -> None:
        """``optimizer`` finished a step (torch's optimizer step post-hook)."""
        parameters = optimizer_parameters(optimizer)
        key = id(optimizer)
        left = self._left.get(key)
        reference = left.optimizer if left is not None and left.optimizer() is optimizer else None
        if reference is None:
            reference = weakref.ref(optimizer, functools.partial(_forget_optimizer, self._left, key))
        self._left[key] = _StepLeft(reference, parameters, version_counters(parameters))

    def by_program(self, parameters) -> bool:
        """Whether one of ``parameters`` (those that hold nan/inf) was written after the last
        optimizer step that holds it left it, or is held by no optimizer that stepped."""
        wanted = list(parameters)
        now = dict(zip(map(id, wanted), version_counters(wanted)))
        seen = set()
        for left in list(self._left.values()):
            for parameter, then in zip(left.parameters, left.counters):
                if id(parameter) in now:
                    seen.add(id(parameter))
                    if now[id(parameter)] != then:
                        return True
        return len(seen) < len(now)


def _forget_optimizer(left: dict, key: int, reference) -> None:
    """An optimizer ``ProgramWrites`` followed is gone: its entry goes (unless another optimizer
    took its id since)."""
    kept = left.get(key)
    if kept is not None and kept.optimizer is reference:
        del left[key]
