"""The least a watch written in Python can cost: dispatch modes that do only the per-op work no
watch with opwatch's records and nan/inf reads can skip, with none of opwatch's design.

    python -m bench.ablate                 # prints these beside the watch, paired in one process

Each mode runs as one ``__torch_dispatch__`` function with no call of its own per op, and is
a lower bound, not a competitor: it checks nothing, keeps no module path, finds no user line
(the op's caller stands for it), and keeps no tensor made before the watch apart from the rest.

- :class:`RecordsFloor`: per op, the caller's code and instruction offset, the autograd sequence
  number and node (what ties a backward op to its forward line), the shape, dtype, device and
  identity of every tensor argument and result, and one log entry kept in a ring of
  ``max_records`` entries, as a watch's log is.
- :class:`ReadsFloor`: the same, plus, for an op whose results the nan/inf check reads (not a
  view, a move or new memory), one ``aminmax`` of its first floating result into two slots of
  a reusable buffer and a weak reference to it.

Both skip ``OpOverload.__call__`` (they call the C++ op, ``compat.op_kernel``) and keep Dynamo out by code object, not
with torch's per-call wrapper, as opwatch does.
"""

from __future__ import annotations

import sys
import weakref
from collections import deque

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opwatch.core.ops import facts_of
from opwatch.core.compat import SKIPS_DYNAMO_PER_CODE, current_autograd_node, get_sequence_nr, op_kernel, skip_dynamo_for_code

__all__ = ["RecordsFloor", "ReadsFloor"]

_Tensor = torch.Tensor
_READ_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_SLOTS = 4096  # pairs of one buffer; the ring wraps (the values are never read)
_FLOAT32 = torch.float32
_aminmax = torch.aminmax


class RecordsFloor(TorchDispatchMode):
    """The op's caller, its backward tie and its tensors' metadata, one kept entry per op."""

    reads = False  # ReadsFloor: one reduction per floating result

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # no torch._dynamo.disable wrapper per op where the code object can be marked instead
        return not SKIPS_DYNAMO_PER_CODE

    def __init__(self, max_records: int = 10_000):
        super().__init__()
        skip_dynamo_for_code(RecordsFloor.__torch_dispatch__.__code__)
        self.entries: deque = deque(maxlen=max_records)
        self.refs: deque = deque(maxlen=max_records)
        self.shapes: dict = {}
        self.slots = torch.empty(2 * _SLOTS).unbind()
        self.used = 0
        # id(OpOverload) -> (its C++ op, whether the nan/inf check reads its results), as opwatch's plan
        self.plans: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # One function, as opwatch's: a call per op is a cost a floor must not add.
        kwargs = kwargs or {}
        caller = sys._getframe(1)
        node = current_autograd_node()
        shapes = self.shapes
        metas = []
        for value in args:
            if isinstance(value, _Tensor):
                size = value.shape
                shape = shapes.get(size)
                if shape is None:
                    shape = shapes[size] = tuple(size)
                metas.append((shape, value.dtype, value.device, id(value)))
        plan = self.plans.get(id(func))
        if plan is None:
            plan = self.plans[id(func)] = (op_kernel(func), self.reads and _read_by_the_check(func))
        kernel, reads = plan
        out = kernel(*args, **kwargs)
        results = (out,) if isinstance(out, _Tensor) else out if type(out) is tuple or type(out) is list else ()
        first = True
        for value in results:
            if not isinstance(value, _Tensor):
                continue
            size = value.shape
            shape = shapes.get(size)
            if shape is None:
                shape = shapes[size] = tuple(size)
            dtype = value.dtype
            metas.append((shape, dtype, value.device, id(value)))
            # The first tensor result only (a lower bound); float32 slots for every dtype's pair
            # would need a buffer per dtype, as opwatch keeps: other dtypes allocate theirs.
            if reads and first and dtype in _READ_DTYPES and value.numel():
                used = self.used
                if used == 2 * _SLOTS:
                    used = 0
                if dtype is _FLOAT32:
                    slots = self.slots
                    _aminmax(value, out=(slots[used], slots[used + 1]))
                else:
                    _aminmax(value)
                self.used = used + 2
                self.refs.append(weakref.ref(value))
            first = False
        self.entries.append((func, caller.f_code, caller.f_lasti, node is None, get_sequence_nr(), *metas))
        return out


def _read_by_the_check(func) -> bool:
    """Whether opwatch's nan/inf check reduces ``func``'s results: not a view, a move or new
    memory (once per op, as opwatch's plan)."""
    facts = facts_of(func)
    return facts.collective is None and not facts.makes_new_data and (facts.is_lift or not facts.preserves_values)


class ReadsFloor(RecordsFloor):
    """:class:`RecordsFloor` plus one ``aminmax`` per floating result, and a weak reference to it."""

    reads = True
