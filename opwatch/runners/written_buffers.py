"""The buffers a training step's forward writes (BatchNorm's running statistics and its count of
batches), kept after each optimizer step so that a step that does not run leaves them as it
found them, as it leaves the weights.

A batch that holds nan fails its step, and leave-on skips the update: the weights are as they
were. But the forward that made the gradients also wrote BatchNorm's running mean and variance
from that batch: nan. Training goes on finite (a BatchNorm in training mode normalizes with the
batch's own statistics), and the model put in ``eval()`` returns nan everywhere. ``opwatch.guard``
restores a failing call's buffers from its start; leave-on and the trainers keep a copy instead,
after each optimizer step, of the buffers a step writes: every buffer slot of the models the run
saw at the first step, then only those that moved between the first two (their tensor, version
or values: BatchNorm's kernel writes its statistics without moving their version; one
``_foreach_copy_`` a step, none at all for a model whose forward writes no buffer).
"""

from __future__ import annotations

import torch

from ..core.compat import version_counter
from .guarded.snapshot import Copies, buffer_slots

__all__ = ["WrittenBuffers"]


class WrittenBuffers:
    """The written buffers of the models ``models()`` returns (the modules the run saw), kept by
    :meth:`keep` (when the run first sees its model, then after each optimizer step) and put
    back by :meth:`put_back` when a step does not run."""

    def __init__(self, models):
        self._models = models
        self._kept: list | None = None  # (module, name) of the buffers kept: every one at first, then those a step writes
        self._first: dict | None = None  # at the first keep: each slot's (tensor, version), to find those a step writes
        self._narrowed = False
        self._copies = Copies()

    def start(self) -> None:
        """Keep the buffers as the run starts with them, once: when it first sees its model."""
        if self._kept is None:
            self.keep()

    def keep(self) -> None:
        """Copy the buffers a step writes as they are now: the first time every buffer of the
        models seen, at the second only those that moved since (and those of a model seen since),
        and from then on those alone."""
        if self._kept is None:
            models = self._models()
            if not models:  # no model seen yet (a trainer that audited no batch): looked for at the next step
                return
            self._kept = buffer_slots(models)
            self._first = {slot: _state(slot) for slot in self._kept}
        elif not self._narrowed:
            # BatchNorm's kernel writes its running statistics without moving their version: a
            # slot is written where its tensor, its version or its values moved.
            self._narrowed = True
            values = dict(zip(self._kept, self._copies.values))
            first = self._first
            self._kept = [slot for slot in buffer_slots(self._models()) if slot not in first or _moved(slot, first[slot], values.get(slot))]
            self._first = None
        if self._kept:
            self._copies.save([module._buffers[name] for module, name in self._kept])

    def put_back(self) -> list:
        """The kept buffers put back into their slots (a step that did not run: its forward's
        writes undone); returns ``(module, name)`` of each."""
        slots = self._kept or []
        if not slots or len(self._copies.values) != len(slots):
            return []
        with torch.no_grad():
            for (module, name), value in zip(slots, self._copies.values):
                buffer = module._buffers.get(name)
                if buffer is not None and buffer.shape == value.shape:
                    buffer.copy_(value)
        return slots


def _moved(slot, before: tuple, value) -> bool:
    """Whether the buffer in ``slot`` moved since its state ``before`` and its copy ``value``."""
    if _state(slot) != before or value is None:
        return True
    module, name = slot
    return not torch.equal(module._buffers[name], value)


def _state(slot) -> tuple:
    """The tensor in a buffer slot and its version: either moves when a step writes it."""
    module, name = slot
    buffer = module._buffers.get(name)
    return (None, -1) if buffer is None else (id(buffer), version_counter(buffer))
