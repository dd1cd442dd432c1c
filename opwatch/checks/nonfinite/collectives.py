"""Collectives (``torch.distributed``) for the nan/inf check: their outputs are read once the
collective has completed, not when their op returns, and what they deliver was *received*.

A c10d op's or functional collective's outputs hold nothing yet when its op returns (gloo
fills them on a thread, NCCL on a stream). A c10d op's outputs are read when its ``Work``
completes (a callback on its future: enqueued after the collective on NCCL, no host sync); a
functional collective's when it is waited for (``wait_tensor``) or, wrapped in an
``AsyncCollectiveTensor`` that waits inside the subclass, at the next check point if alive,
else when the wrapper dies. Either is read at the next check point instead when an op used it
before the read came (a future's waiters wake before its callbacks run).
"""

from __future__ import annotations

import weakref

import torch

from ...core.compat import no_python_dispatch, python_made_collective_wrapper, unbox_work
from ...core.collective_ops import on_completion
from ...core.ops import WRAP, collective_of, facts_of
from ...core.records import E_FUNC, E_INDEX, M_DTYPE, M_IDENT, entry_inputs, entry_outputs
from .rules import COMPLEX, checkable

__all__ = ["CollectiveReads", "delivered"]

ST_ORIGIN = 1  # in a replay status (kind, origin)


class _Pending:
    """A collective's output, read once the collective has filled it: by the ``Work``'s
    completion callback (c10d ops), at ``wait_tensor``, or, for an ``AsyncCollectiveTensor``
    waited inside the subclass, at the next check point (alive) or when it dies, valid when an
    op used it before (``used_at``) the read (``read_at``)."""

    __slots__ = ("index", "position", "ref", "stats", "done", "used", "used_at", "read_at", "work", "aliases", "held")

    def __init__(self, index, position, tensor):
        self.index = index
        self.position = position
        self.ref = weakref.ref(tensor)
        self.stats = None  # (min, max), 0-dim tensors on the tensor's device
        self.done = False  # the stats hold the collective's result
        self.used = False  # an op other than a view used the output (functional: it was waited for)
        self.used_at = -1  # that op's index
        self.read_at = None  # the last op index logged when it was read at its wrapper's death
        self.work = None  # the Work, where it has no future to call back
        self.aliases: list[int] = []  # ops that gave its values another name (its wrapper, views)
        self.held = None  # the tensor itself, until the next check point, where no wrapper dies for it

    def read(self, tensor) -> None:
        with no_python_dispatch():
            self.stats = min_max(tensor)
        self.done = True


def min_max(tensor) -> tuple:
    checked = torch.view_as_real(tensor.resolve_conj()) if tensor.dtype in COMPLEX else tensor
    return tuple(torch.aminmax(checked.detach()))


def _read_completed(ready) -> None:
    """The ``Work``'s callback: its collective has completed; read its outputs (on gloo's thread,
    or with the collective's stream current on NCCL), then let go of them."""
    for pending, tensor in ready:
        pending.read(tensor)
    ready.clear()


def _read_at_death(pending, tensor, log_ref) -> None:
    """An ``AsyncCollectiveTensor`` dies: read its collective's output while it still exists."""
    log = log_ref()
    if log is None:
        return  # the watch is gone
    try:
        with no_python_dispatch():
            pending.stats = min_max(tensor)
        pending.read_at = log.entries[-1][E_INDEX] if log.entries else -1
    except Exception:
        pass


def _completed(work) -> bool:
    try:
        return unbox_work(work).is_completed()
    except Exception:
        return False


class CollectiveReads:
    """The outputs of one watch's collectives, until each is read: ``pending`` maps
    (op index << 32 | output position) -> :class:`_Pending`; ``awaiting`` maps the idents of
    functional outputs not waited for yet (their tensor, its wrapper, its views) -> the same."""

    def __init__(self, log, observe_carrier) -> None:
        self._log = log
        self._observe_carrier = observe_carrier  # the tracker's, for wait/wrap outputs
        self.pending: dict = {}
        self.awaiting: dict = {}

    def observe_collective(self, entry, inputs, outputs, metas) -> None:
        """A c10d op or functional collective: remember its outputs until they are filled."""
        index = entry[E_INDEX]
        ready = []
        for position, tensor in enumerate(outputs):
            if not checkable(tensor, metas[position][M_DTYPE]):
                continue
            pending = _Pending(index, position, tensor)
            self.pending[index << 32 | position] = pending
            ready.append((pending, tensor))
        if not ready:
            return
        for pending, tensor in ready:
            # Until read: an op using it (not a view) means the program waited for it.
            self.awaiting[id(tensor)] = pending
        work = getattr(outputs, "work", None)
        if work is not None and not on_completion(work, lambda: _read_completed(ready)):
            for pending, _ in ready:
                pending.work = work  # no future: read at a check point once the Work says it completed
        elif work is None and python_made_collective_wrapper() is not None:
            # torch 2.6 wraps a functional output in Python (no wrap op, no death to read it at):
            # it is kept until the next check point, read there once an op used it.
            for pending, tensor in ready:
                pending.held = tensor

    def observe_wait(self, entry, inputs, outputs, metas) -> None:
        """``wait_tensor``: the collective behind its argument has completed; read it now."""
        self._observe_carrier(entry, inputs, outputs, metas)
        pending = self.awaiting.get(inputs[0][M_IDENT]) if inputs else None
        if pending is not None and outputs:
            pending.read(outputs[0])
            pending.used = True

    def observe_wrap(self, entry, inputs, outputs, metas) -> None:
        """The ``AsyncCollectiveTensor`` around a functional collective's output: its first
        non-view use waits for the collective inside the subclass, where opwatch sees no op. The
        output is read at the next check point if still alive, else when the wrapper dies (its
        last moment), and counts only if an op other than a view used it before."""
        self._observe_carrier(entry, inputs, outputs, metas)
        pending = self.awaiting.get(inputs[0][M_IDENT]) if inputs else None
        if pending is None or not outputs:
            return
        wrapper = outputs[0]
        self.awaiting[id(wrapper)] = pending
        pending.aliases.append(entry[E_INDEX])
        tensor = pending.ref()
        if tensor is not None:
            # Holds the tensor no longer than the wrapper, which holds it anyway.
            finalizer = weakref.finalize(wrapper, _read_at_death, pending, tensor, weakref.ref(self._log))
            finalizer.atexit = False

    def settle(self, window, final, queue) -> list:
        """Queue (``queue(low, high, index, position, ref)``) the flags of the collective
        outputs known complete; return the window with the entries of earlier windows'
        collectives that completed since put first."""
        awaiting = self.awaiting
        if awaiting and any(pending.done for pending in awaiting.values()):
            awaiting = self.awaiting = {ident: pending for ident, pending in awaiting.items() if not pending.done}
        if awaiting:
            self._note_uses(window, awaiting)
        first = window[0][E_INDEX] if window else None
        late = []
        for key, pending in list(self.pending.items()):
            self._read_if_complete(pending)
            pending.held = None
            if pending.done or final or pending.ref() is None:
                del self.pending[key]
            if not pending.done or pending.stats is None:
                continue
            low, high = pending.stats
            queue(low, high, pending.index, pending.position, pending.ref)
            if first is not None and pending.index < first:
                # Completed after the check point that replayed it: replay it (and the ops
                # that gave its values other names) again, first.
                for index in (pending.index, *pending.aliases):
                    entry = self._entry_at(index) if index < first else None
                    if entry is not None and all(known is not entry for known in late):
                        late.append(entry)
        if awaiting:
            self.awaiting = {ident: pending for ident, pending in awaiting.items() if not pending.done and pending.ref() is not None}
        if late:
            late.sort(key=lambda entry: entry[E_INDEX])
            return late + list(window)
        return window

    def _note_uses(self, window, awaiting) -> None:
        """Which waiting tensors an op used (an op other than a view: that waited for it)."""
        for entry in window:
            func = None
            for meta in entry_inputs(entry):
                pending = awaiting.get(meta[M_IDENT])
                if pending is None or pending.used or entry[E_INDEX] <= pending.index:
                    continue
                func = func or self._log.funcs[entry[E_FUNC]]
                collective = collective_of(func)
                is_view = facts_of(func).is_view
                if is_view or (collective is not None and collective.kind == WRAP):
                    # Another name for the same values, not a use.
                    for output in entry_outputs(entry) or ():
                        awaiting[output[M_IDENT]] = pending
                    if is_view:
                        pending.aliases.append(entry[E_INDEX])
                else:
                    pending.used = True
                    pending.used_at = entry[E_INDEX]

    @staticmethod
    def _read_if_complete(pending) -> None:
        if not pending.done and pending.work is not None and _completed(pending.work):
            tensor = pending.ref()
            if tensor is not None:
                pending.read(tensor)
            pending.done = True
        if pending.used and not pending.done:
            tensor = pending.ref()
            if tensor is not None:  # alive, and waited for: read it now
                pending.read(tensor)
            elif pending.read_at is not None and pending.read_at >= pending.used_at:
                pending.done = True  # read as its wrapper died, after its use

    def _entry_at(self, index):
        """The log entry of op ``index``, ``None`` once it left the ring."""
        for entry in reversed(self._log.entries):
            if entry[E_INDEX] == index:
                return entry
            if entry[E_INDEX] < index:
                break
        return None


def delivered(entry, facts, deliveries, status, origins):
    """The collective whose result the op ``entry`` delivers, else ``None``. Some backends
    complete a collective into a buffer of their own and copy it into the output when the
    program waits (gloo's reduce-scatter: ``copy_(output, chunk of its buffer)``), after the
    ``Work``'s completion read the output: a ``copy_`` into a collective's output that nothing
    used yet is the collective's delivery, and what it writes was received through it (the
    earlier read, of a buffer not filled yet, is dropped). Any other use of an output ends its
    delivery."""
    inputs = entry_inputs(entry)
    # ``copy_`` (a copy that writes its first argument in place):
    if facts.is_copy and facts.mutated_args and inputs and inputs[0][M_IDENT] in deliveries:
        ident = inputs[0][M_IDENT]
        record, state = deliveries.pop(ident)
        for meta in inputs[1:]:
            deliveries.pop(meta[M_IDENT], None)
        stale = state[ST_ORIGIN] if state is not None else None
        if stale is not None and stale.record.index == record.index and not stale.spread and stale in origins:
            origins.remove(stale)  # read before the backend filled it
            status.pop(ident, None)
        return record
    for meta in inputs:
        deliveries.pop(meta[M_IDENT], None)
    return None
