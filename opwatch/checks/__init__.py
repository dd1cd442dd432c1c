"""The anomaly checks, one module each.

A pre-kernel check is a module with

- ``KIND``: the anomaly kind it reports;
- ``for_op(func)``: the check bound to one ``OpOverload``, or ``None`` when it cannot fire on
  that op. Asked once per op overload (the interceptor keeps the answer), so that everything
  that depends on the op alone (its name, its schema's rule) is settled before the hot path.
  The bound check is called as ``check(tensors, context) -> Finding | None`` with the op's
  tensor arguments as ``(shape, dtype, device, ident)`` tuples; ``context`` answers the few
  questions shapes cannot (see :class:`CheckContext`).

They see metadata only, so each is plain code testable without any mode running. The nan/inf
check is different in kind (it looks at values, batched and sync-free) and lives in
:mod:`opwatch.checks.nonfinite`.
"""

from __future__ import annotations

from typing import Protocol

from . import broadcast, device, dtype, nonfinite
from .finding import Finding

__all__ = ["Finding", "CheckContext", "PRE_KERNEL_CHECKS", "CHECK_NAMES", "KINDS"]

# Run in this order before each kernel; the first finding wins.
PRE_KERNEL_CHECKS = (device, dtype, broadcast)

# Names accepted by ``watch(checks=...)``.
CHECK_NAMES = tuple(check.KIND for check in PRE_KERNEL_CHECKS) + (nonfinite.NAME,)

# Anomaly kinds, as ``Anomaly.kind`` reports them.
KINDS = tuple(check.KIND for check in PRE_KERNEL_CHECKS) + nonfinite.KINDS


class CheckContext(Protocol):
    """What a check may ask beyond shapes; the interceptor answers from what it has seen."""

    def deliberate_dims(self, tensor: tuple) -> frozenset[int]:
        """Size-1 dims of ``tensor`` (negative, counted from the right) that the program made on
        purpose: by ``unsqueeze``/``None`` indexing, or inside the op's own decomposition."""
        ...

    def producer(self, tensor: tuple) -> str | None:
        """Short description of the op that produced ``tensor`` (``aten.addmm at demo.py:23``)."""
        ...
