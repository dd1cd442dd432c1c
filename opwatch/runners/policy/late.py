"""A fused optimizer's verdict (leave-on and the trainers' guard mode, mixed into
:class:`~opwatch.runners.policy.StepPolicy`): handed to the optimizer as ``found_inf`` (it skips
a failing step on the device, no host read), read back a step late, or at the first read of the
run's counts after it (:meth:`LateVerdicts.settle`, the ledger's ``unsettled``), whichever
comes first; a read never raises: what it finds to raise waits for the next check."""

from __future__ import annotations

import torch

from ...render import leave_on as words
from ..step_verdict import DeviceVerdict
from .outcomes import GradientsNotFinite, RunStuck, warn

__all__ = ["LateVerdicts"]


class LateVerdicts:
    """The policy's side of a verdict handed to a fused optimizer (``hand_off``, a
    :class:`~opwatch.runners.step_verdict.FoundInfHandOff`); it reads the policy's ``ledger``,
    ``verdict``, ``on_failure``, ``told()``, ``raised()`` and ``stop_when_stuck()``."""

    def hands_over(self, optimizer, trigger) -> bool:
        """Whether this step's verdict goes to ``optimizer`` as ``found_inf`` (it skips a failing
        step on the device) and is read at its next step: a fused optimizer that GradScaler did
        not hand a flag, outside audits and re-checks, in a process of its own, when failing
        steps are skipped or raised."""
        # The optimizer's own answer first: most optimizers take no flag (the step's hot path).
        return (self.hand_off.takes(optimizer) and self.on_failure != "apply" and not trigger.auditing and self.recheck_of is None
                and self.ledger.poisoned_since is None and self.agreement is None)

    def hand_over(self, optimizer, gradients, losses, step: int) -> None:
        verdict = self.verdict.device_flag(gradients, losses, optimizer)
        if verdict is None:  # no gradient, or on several devices: the host read of the other optimizers
            self.hand_off.forget(optimizer)
            if not gradients or self.verdict.finite(gradients, losses, optimizer):
                self.ledger.passed(step)
                return
            first, *_ = gradients
            verdict = DeviceVerdict(torch.ones((), device=first.device), torch.ones(2, device=first.device))
        self.hand_off.hand(optimizer, verdict, step, losses)

    def told_late(self, optimizer, now, trigger, *, wait: bool = True, read: bool = False) -> None:
        """Read the flag handed to ``optimizer`` at its last step (``None``: every optimizer's,
        at the end of the run, ``now`` ``None``, or at a read of the counts after step ``now``,
        ``read``: only the flags the device finished unless ``wait``); a set flag is a failed
        step the device skipped, counted and told now; the step after this one then runs under
        the full watch. A read never raises: what ``on_failure="raise"`` or a stuck run raises
        is held until the next check (:meth:`raise_held`)."""
        for late in self.hand_off.read(optimizer, wait=wait):
            if not late.failed:
                self.ledger.passed(late.step)  # the streak of failed steps ends (in step order: read before the next)
                continue
            loss = self.verdict.loss_kind(late.losses)
            failure = self.ledger.fail(late.step, [], "loss" if loss is not None and not late.gradients else "gradients", loss=loss)
            text = words.failed_late(late.step, now, self.on_failure, loss=loss, gradients=late.gradients, read=read)
            self.ledger.decide(failure, "skipped")  # on the device, by the fused optimizer
            if self.on_failure == "raise":  # the device skipped it; the run stops here (the first such step)
                error = self.raised(failure, GradientsNotFinite(text, step=late.step, parameters=[]))
                self._held = self._held or error
            else:
                if self.told():
                    warn(text)
                    self.audit_next = now is not None  # a failure that recurs is named
                try:
                    self.stop_when_stuck(failure, trigger)
                except RunStuck as stuck:
                    self._held = self._held or stuck
            if not read:
                self.raise_held(trigger)

    def settle(self, wait: bool = True) -> None:
        """The ledger's :attr:`~opwatch.runners.ledger.RunLedger.unsettled`: before its counts
        are read (a log, a summary, the run's end), the verdicts still on the device are taken in."""
        if self.hand_off.pending():
            self.told_late(None, self.ledger.steps, None, wait=wait, read=True)

    def raise_held(self, trigger=None) -> None:
        """Raise what a read of the counts held (a late failure under ``on_failure="raise"``, a stuck run)."""
        held, self._held = self._held, None
        if held is not None:
            if trigger is not None:
                self.stop_rechecking(trigger)
            raise held
