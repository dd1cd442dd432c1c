"""Every optimizer's code path audited once, not only the first optimizer's.

Shape, dtype and device bugs belong to the code path, and one fully watched optimizer step (the
audit) sees a loop whose every step runs the same ops. A loop of several optimizers, each
stepped on its own loss (a GAN's discriminator and generator, an actor and a critic), runs a path
per optimizer: the run's first audit ends at the first optimizer's step and never saw the
others' forward, loss or backward. So the first step of an optimizer that no full watch has seen
arms one audit, from right after that step until its next step (at most ``MAX_ARMED_STEPS``
optimizer steps, for an optimizer that steps once; at most ``MAX_ARMED`` such audits a run, for a
loop that makes a new optimizer each step), which watches its path whole. An optimizer
that steps on a backward a watch saw (``opt_a.step(); opt_b.step()`` after one ``backward()``)
was seen by that watch: it arms none; nor does any optimizer of a run that audits no step.
"""

from __future__ import annotations

import weakref

__all__ = ["OptimizerAudits", "MAX_ARMED_STEPS", "MAX_ARMED"]

MAX_ARMED_STEPS = 16  # a GAN's critic steps up to 15 times per generator step; a one-step optimizer's audit ends there
MAX_ARMED = 8  # audits armed in a run: a loop that makes an optimizer each step (an inner loop's) must not run watched


class OptimizerAudits:
    """Which optimizers took a step whose backward a full watch saw, and the audit armed for
    one that did not.

    :meth:`stepped` notes each optimizer step; :meth:`goes_on` says whether the running audit,
    armed for another optimizer, watches past this step; :meth:`arm` whether this
    optimizer's unwatched step arms one (once per optimizer)."""

    def __init__(self) -> None:
        self._watched = weakref.WeakSet()  # optimizers with a step whose backward a watch saw
        self._armed_once = weakref.WeakSet()
        self._armed_count = 0
        self._until = None  # a weak reference to the optimizer whose next step ends the armed audit
        self._left = 0  # optimizer steps the armed audit may still watch past
        self._backward_watched = False  # the newest step's backward ran under a watch
        self._audited = False  # the run audited an optimizer step (a trainer may audit none)

    @property
    def armed(self) -> bool:
        """Whether an armed audit waits for its optimizer's step (it outlives a trainer's batch)."""
        return self._until is not None and self._until() is not None

    def stepped(self, optimizer, *, watched: bool, same_backward: bool) -> None:
        """``optimizer`` stepped; ``watched``: under a full watch; ``same_backward``: on the
        gradients of the backward the step before applied (then watched if that one was)."""
        watched = watched or (same_backward and self._backward_watched)
        self._backward_watched = watched
        if watched:
            self._watched.add(optimizer)
            self._audited = True

    def goes_on(self, optimizer, *, may: bool) -> bool:
        """Whether the running audit watches on past ``optimizer``'s step: it ``may`` (no
        failure or re-check ends it here), it was armed for another optimizer, which has not
        stepped since, and it has steps left. Otherwise it ends here, and its arming with it."""
        if may and self.armed and self._until() is not optimizer and self._left > 0:
            self._left -= 1
            return True
        self._until = None
        return False

    def arm(self, optimizer) -> bool:
        """Whether ``optimizer``'s step, which no watch saw, arms an audit until its next step:
        its first such step only, in a run that audited another optimizer's step (a trainer
        that audits no step arms none), ``MAX_ARMED`` times at most."""
        if not self._audited or optimizer in self._watched or optimizer in self._armed_once or self._armed_count >= MAX_ARMED:
            return False
        self._armed_once.add(optimizer)
        self._armed_count += 1
        self._until, self._left = weakref.ref(optimizer), MAX_ARMED_STEPS - 1  # the steps after the first it watches
        return True
