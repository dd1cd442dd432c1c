"""The anomaly checks, one module each, and the small interface the interceptor feeds them by.

A pre-kernel check is a module with

- ``KIND``: the anomaly kind it reports;
- ``for_op(func)``: the check bound to one ``OpOverload``, or ``None`` when it cannot fire on
  that op. Asked once per op overload (the interceptor keeps the answer), so that everything
  that depends on the op alone (its name, its schema's rule) is settled before the hot path.
  The bound check is called as ``check(tensors, context) -> Finding | None`` with the op's
  tensor arguments as ``(shape, dtype, device, ident)`` tuples; ``context`` is the
  :class:`CheckContext`, which answers the few questions shapes cannot.

They see metadata only, so each is plain code testable without any mode running.

A check that needs to remember something about earlier ops owns that state in a *tracker* of
its own module: the broadcast check's :class:`~opwatch.checks.broadcast.ShapeProvenance` (how each
tensor got its size-1 dims) and the nan/inf check's
:class:`~opwatch.checks.nonfinite.NonFiniteTracker` (sync-free flags, resolved at check
points). A tracker has ``for_op(func)`` too, returning an *observer* called after the kernel
as ``observe(entry, inputs, outputs, metas)`` (the op's log entry, its inputs' and outputs'
metadata, the output tensors), or ``None`` when the op does not concern it.

:class:`ActiveChecks` is all the interceptor knows of the checks: which ones apply to an op,
the observers to call, the context, and the nan/inf check points.
"""

from __future__ import annotations

from . import broadcast, device, dtype, nonfinite
from .finding import Finding

__all__ = ["Finding", "CheckContext", "ActiveChecks", "PRE_KERNEL_CHECKS", "CHECK_NAMES", "KINDS"]

# Run in this order before each kernel; the first finding wins.
PRE_KERNEL_CHECKS = (device, dtype, broadcast)

# Names accepted by ``watch(checks=...)``.
CHECK_NAMES = tuple(check.KIND for check in PRE_KERNEL_CHECKS) + (nonfinite.NAME,)

# Anomaly kinds, as ``Anomaly.kind`` reports them.
KINDS = tuple(check.KIND for check in PRE_KERNEL_CHECKS) + nonfinite.KINDS


class CheckContext:
    """What a check may ask beyond shapes, about the op being checked.

    ``site`` and ``phase`` are set by the interceptor for each op before its checks run.
    """

    __slots__ = ("site", "phase", "args", "_log", "_shapes")

    def __init__(self, log, shapes: broadcast.ShapeProvenance | None):
        self.site = 0  # source site id of the op (see OpLog.sites); 0 when unknown
        self.phase = "forward"  # "forward" or "backward"
        self.args = ()  # the op's other arguments, flat: position or name, value, ...
        self._log = log
        self._shapes = shapes

    def deliberate_dims(self, tensor: tuple) -> frozenset[int]:
        """Size-1 dims of ``tensor`` (negative, counted from the right) that the program made on
        purpose: by ``unsqueeze``/``None`` indexing, or inside the op's own decomposition."""
        if self._shapes is None:
            return frozenset()
        return self._shapes.deliberate_dims(tensor, self.site)

    def previous_expand(self) -> tuple | None:
        """``(site, operand, result shape)`` of the last ``expand`` op, for the broadcast check
        of ``broadcast_tensors`` pairs."""
        return self._shapes.previous_expand if self._shapes is not None else None

    def producer(self, tensor: tuple) -> str | None:
        """Short description of the op that produced ``tensor`` (``aten.addmm at demo.py:23``)."""
        from ..records import M_IDENT, short_op_name

        record = self._log.producer_of(tensor[M_IDENT])
        if record is None:
            return None
        return f"{short_op_name(record.func)} at {record.where}"


class ActiveChecks:
    """The checks one watch runs: bound per op, with their trackers and their context."""

    def __init__(self, enabled: frozenset[str], log, table_limit: int):
        self._enabled = enabled
        self.shapes = broadcast.ShapeProvenance(table_limit) if broadcast.KIND in enabled else None
        self.values = nonfinite.NonFiniteTracker(log) if nonfinite.NAME in enabled else None
        self.context = CheckContext(log, self.shapes)
        self._trackers = tuple(tracker for tracker in (self.shapes, self.values) if tracker is not None)

    def pre_kernel(self, func) -> tuple:
        """The bound pre-kernel checks that can fire on ``func``, in order."""
        bound = (check.for_op(func) for check in PRE_KERNEL_CHECKS if check.KIND in self._enabled)
        return tuple(check for check in bound if check is not None)

    def observers(self, func) -> tuple:
        """The trackers' observers to call after each kernel of ``func``."""
        bound = (tracker.for_op(func) for tracker in self._trackers)
        return tuple(observe for observe in bound if observe is not None)

    def flags_wait_on(self, device) -> bool:
        """Whether nan/inf flags wait on ``device``: a host read there pays for a sync anyway."""
        return self.values is not None and self.values.pending_on(device)

    def resolve(self, log, since: int, *, reading=(), final: bool = False) -> list:
        """A nan/inf check point: the origins judged now
        (:class:`~opwatch.checks.nonfinite.Origin`, ``matters`` set), oldest first, among the
        ops of ``log`` from index ``since`` on; ``reading``: idents of the tensors the program
        is about to read on the host; ``final``: judge what is still alive (the program chose
        this point: the end of the block, ``Watch.check()``)."""
        if self.values is None or not (self.values.pending or self.values.carrying):
            return []
        return self.values.resolve(log.since(since), reading=reading, final=final)
