"""Where a silent promotion's result is used: a promotion cast straight back is deliberate.

Mixture-of-experts code keeps its routing weights in float32 on purpose and writes
``(expert(x) * weights).to(x.dtype)``: the product is float32 for one op, and the rest of the
program stays in ``x``'s dtype. So a ``dtype.silent_upcast`` finding (a pointwise op, ``cat``,
``stack``: :mod:`opwatch.checks.dtype`) is not reported when its op runs: it waits for the
first op that consumes the op's output (the tensor itself, or a view of it: matched by identity,
then by storage):

- a cast back to one of the narrower dtypes the op mixed (``.to(x.dtype)``, ``.half()``, a
  ``copy_`` into a narrower tensor, an in-place op or ``out=`` writing into a narrower tensor:
  ``out += p``, ``out.index_add_(0, i, p)``): deliberate, dropped;
- a view (``.view``, ``[..., :k]``, ``.detach()``): no computation, it waits on;
- any other op: the promoted value flows on, and the finding is reported there, before that
  op's kernel runs (``strict()`` raises there, naming the promoting op's line).

A result dropped without a cast back is reported at the next op, and one not consumed by the
next final check point (the end of the block, ``w.check()``, an optimizer step) is reported
there: only a cast back makes a promotion deliberate. At most :data:`LIMIT` findings wait at once; a
promotion found while that many wait is reported at once, as before.

This is the *defer* stage of the one exit of findings (:mod:`opwatch.findings.pipeline`), which
asks :meth:`PendingPromotions.consumed_by` about an op only while a finding waits (a switch the
interceptor already tests on every op): a healthy program pays nothing.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ..core.ops import facts_of

__all__ = ["PendingPromotions", "LIMIT", "RULE"]

RULE = "dtype.silent_upcast"  # the rule whose findings wait for their use
LIMIT = 64  # findings waiting at once
_CASTS = {"aten::_to_copy", "aten::to"}
_Tensor = torch.Tensor


class _Waiting(NamedTuple):
    ref: weakref.ref  # the promoted output (weakly: waiting never keeps it alive)
    storage: tuple | None  # (device, storage address) of the output, to match views of it
    narrower: frozenset  # the dtypes a cast back may go to: those the op mixed, but the result
    finding: object
    record: object


class PendingPromotions:
    """The promotion findings of one watch waiting for their result's first use."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: list[_Waiting] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def takes(self, finding) -> bool:
        """Whether ``finding`` waits for its result's use (room left, the right rule)."""
        return finding.rule == RULE and len(self._waiting) < LIMIT

    def wait(self, finding, record, outputs) -> bool:
        """Let ``finding`` (logged as ``record``) wait on the op's first output; ``False`` when
        the op gave no tensor to wait on (then report it now)."""
        out = next((tensor for tensor in outputs if isinstance(tensor, _Tensor)), None)
        if out is None:
            return False
        try:
            ref = weakref.ref(out)
        except TypeError:
            return False  # a tensor kind that refuses weak references: not kept, not waited on
        result = finding.facts.result
        narrower = frozenset(dtype for dtype in finding.facts.dtypes if dtype != result)
        self._waiting.append(_Waiting(ref, _storage(out), narrower, finding, record))
        return True

    def consumed_by(self, func, args, kwargs) -> list[tuple]:
        """The ``(finding, record)`` pairs to report before ``func`` runs on ``args``/``kwargs``:
        the waiting promotions whose result it consumes without casting it back, or that died
        without one. Results cast back are let go; views and other ops leave the rest waiting."""
        tensors = _tensors(args, kwargs)
        facts = facts_of(func)
        due, kept = [], []
        for waiting in self._waiting:
            target = waiting.ref()
            if target is None:
                due.append((waiting.finding, waiting.record))  # dropped without a cast back
            elif not _consumes(tensors, target, waiting.storage) or facts.is_view:
                kept.append(waiting)
            elif not _casts_back(func, facts, args, kwargs, target, waiting.narrower):
                due.append((waiting.finding, waiting.record))
        self._waiting = kept
        return due

    def unused(self) -> list[tuple]:
        """At a final check point: the ``(finding, record)`` pairs of every waiting finding (its
        result was never cast back); none waits any more."""
        unused = [(waiting.finding, waiting.record) for waiting in self._waiting]
        self._waiting = []
        return unused


def _storage(tensor) -> tuple | None:
    """``(device, address of the storage)``, shared by the tensor's views; ``None`` for tensors
    without real memory (meta, fake, sparse, subclasses that refuse)."""
    try:
        address = tensor.untyped_storage().data_ptr()
    except Exception:
        return None
    return (tensor.device, address) if address else None


def _tensors(args, kwargs) -> list:
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor):
            found.append(value)
        elif type(value) is list or type(value) is tuple:
            found.extend(item for item in value if isinstance(item, _Tensor))
    return found


def _consumes(tensors, target, storage) -> bool:
    for tensor in tensors:
        if tensor is target or (storage is not None and _storage(tensor) == storage):
            return True
    return False


def _casts_back(func, facts, args, kwargs, target, narrower) -> bool:
    """Whether the op takes the promoted ``target`` back to a narrower dtype: a cast to one, or a
    write (in place, ``copy_``, ``out=``) into tensors of narrower dtypes only."""
    if facts.schema_name in _CASTS:
        return kwargs.get("dtype") in narrower
    written = []
    for position, name in facts.mutated_args:
        value = args[position] if position < len(args) else kwargs.get(name)
        if isinstance(value, _Tensor):
            written.append(value)
    return bool(written) and all(tensor is not target and tensor.dtype in narrower for tensor in written)
