"""The private ``TorchDispatchMode`` that sees every ATen op: the hot path of opwatch.

Per op it stores small tuples only (tensor metadata, the user's code object and instruction
offset, the module path), runs the pre-kernel checks, calls the kernel, and queues the
sync-free nan/inf reduction. Everything that does not change between calls of one
``OpOverload`` is worked out once and cached in an :class:`_OpPlan`.

Backward ops are tied to the forward line through autograd sequence numbers: a forward op
that creates an autograd node bumps the thread's sequence counter, so the counter read in the
forward op names its node; in backward, the node being run reports the same number. No
``grad_fn`` or node metadata is touched (both have crashed or raised in probes).
"""

from __future__ import annotations

import sys
import threading
import traceback
import weakref
from collections import deque
from itertools import islice

import torch
from torch._C._autograd import _get_sequence_nr
from torch.utils._python_dispatch import TorchDispatchMode

from .. import checks
from ..checks import broadcast as broadcast_check
from ..checks.nonfinite import NonFiniteTracker, writes_uninitialized
from ..records import BACKWARD, FORWARD, OpRecord, short_op_name
from ..sites import ENGINE, USER, classify_code

__all__ = ["OpInterceptor", "internal_work"]

_current_autograd_node = torch._C._current_autograd_node
_Tensor = torch.Tensor
# Non-tensor argument values stored as they are; others are summarised by their type.
_PLAIN_VALUES = {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
_HOST_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item", "aten::equal"}
_UNSQUEEZE = "aten::unsqueeze"
# Ops whose output keeps its input's shape and meaning: size-1 dims made on purpose stay so.
_SHAPE_PRESERVING = {"aten::_to_copy", "aten::clone", "aten::contiguous", "aten::detach", "aten::alias", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::to"}

# The "is this frame user code?" answer, per code object (a pure function of the code object).
_code_kinds: dict = {}
# Set while opwatch does its own tensor work, so that other watches do not record it.
internal_work = threading.local()
internal_work.active = False

_FORWARD_SITES_LIMIT = 1 << 16
_NO_SITE = (None, 0, None, None)


class _OpPlan:
    """What one ``OpOverload`` needs on the hot path, worked out on its first call."""

    __slots__ = ("ignored", "mutated_args", "pre_checks", "host_read", "check_values", "unsqueeze", "preserves_shape", "pointwise")

    def __init__(self, func, enabled: frozenset[str]):
        schema_name = func._schema.name
        # record_function markers (optimizers emit them) are not computations.
        self.ignored = func.namespace == "profiler"
        # Arguments written in place: the op's real outputs when it returns nothing
        # (``_foreach_add_`` updating parameters returns None).
        self.mutated_args = tuple(
            (position, arg.name)
            for position, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        self.pre_checks = tuple(check for check in checks.PRE_KERNEL_CHECKS if check.KIND in enabled and check.applies(func))
        self.host_read = schema_name in _HOST_READS
        self.check_values = checks.nonfinite.NAME in enabled and not writes_uninitialized(func)
        self.unsqueeze = schema_name == _UNSQUEEZE
        self.pointwise = torch.Tag.pointwise in func.tags
        self.preserves_shape = schema_name in _SHAPE_PRESERVING or self.pointwise


class OpInterceptor(TorchDispatchMode):
    """Records every op into ``log`` and hands findings to ``report``.

    ``report(finding, record)`` may raise (strict mode): that exception reaches the program
    before the kernel runs, exactly like an error from the op itself.
    """

    def __init__(self, *, log: deque, report, enabled: frozenset[str], modules, max_records: int, on_internal_error):
        super().__init__()
        self._log = log
        self._report = report
        self._enabled = enabled
        self._modules = modules
        self._max_records = max_records
        self._on_internal_error = on_internal_error
        self._plans: dict = {}
        self._next_index = 0
        self._broken = False
        self._track_provenance = broadcast_check.KIND in enabled
        self.values = NonFiniteTracker()
        self._window_start = 0  # first op index not yet covered by a check point
        # autograd sequence number of a forward node -> (code, lasti, module) of its forward op
        self._forward_sites: dict = {}
        self._last_seq = _get_sequence_nr()
        # ident of a tensor with size-1 dims -> (weakref, deliberate dims, code, lasti, record)
        self._size1: dict = {}
        self._site = (None, 0)
        # (op index, id of the exception) when a kernel raised
        self.failure: tuple[int, int] | None = None

    # -- the hot path -------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._broken or internal_work.active:
            return func(*args, **kwargs)
        plan = self._plans.get(func)
        if plan is None:
            try:
                plan = self._plans[func] = _OpPlan(func, self._enabled)
            except Exception as error:
                self._internal_error(error)
                return func(*args, **kwargs)
        if plan.ignored:
            return func(*args, **kwargs)
        try:
            record = self._record_call(func, args, kwargs)
            finding = None
            for check in plan.pre_checks:
                finding = check.check(func, record._inputs, self)
                if finding is not None:
                    break
            origins = self.check_point() if plan.host_read else ()
        except Exception as error:
            self._internal_error(error)
            return func(*args, **kwargs)
        # Outside the guard: in strict mode these raise, before the kernel runs.
        if origins:
            self._report_origins(origins)
        if finding is not None:
            self._report(finding, record)
        try:
            out = func(*args, **kwargs)
        except BaseException as error:
            self.failure = (record.index, id(error))
            raise
        try:
            self._record_result(plan, record, out, args, kwargs)
        except Exception as error:
            self._internal_error(error)
            return out
        if record.index - self._window_start >= self._max_records:
            self._report_origins(self.check_point())
        return out

    def _record_call(self, func, args, kwargs) -> OpRecord:
        tensors = []
        others = []
        for position, value in enumerate(args):
            if isinstance(value, _Tensor):
                tensors.append(value)
            else:
                self._split(position, value, tensors, others)
        for name, value in kwargs.items():
            if isinstance(value, _Tensor):
                tensors.append(value)
            else:
                self._split(name, value, tensors, others)
        try:
            metas = tuple([(t.shape, t.dtype, t.device, id(t)) for t in tensors])
        except Exception:
            metas = tuple([_safe_meta(t) for t in tensors])

        node = _current_autograd_node()
        code, lasti, reached_engine = _user_frame(sys._getframe(2))
        forward_func = None
        if node is None:
            phase = FORWARD
            module = self._modules.current
            seq = _get_sequence_nr()
            if seq != self._last_seq:
                # This op created an autograd node: remember where, for its backward ops.
                self._last_seq = seq
                sites = self._forward_sites
                sites[seq - 1] = (code, lasti, module, func)
                if len(sites) > _FORWARD_SITES_LIMIT:
                    for key in list(islice(sites, _FORWARD_SITES_LIMIT // 2)):
                        del sites[key]
        else:
            phase = BACKWARD
            module = self._modules.current
            if code is None or reached_engine:
                # Run by the autograd engine: point at the forward op that made this node.
                code, lasti, module, forward_func = self._forward_sites.get(node._sequence_nr(), _NO_SITE)
        self._site = (code, lasti)
        record = OpRecord(self._next_index, func, metas, tuple(others), code, lasti, module, phase)
        if phase is BACKWARD:
            record.forward_func = forward_func
        self._next_index += 1
        self._log.append(record)
        return record

    @staticmethod
    def _split(key, value, tensors, others) -> None:
        kind = type(value)
        if kind is list or kind is tuple:
            if any(isinstance(item, _Tensor) for item in value):
                tensors.extend(item for item in value if isinstance(item, _Tensor))
            else:
                others.append((key, tuple(value)))
        elif kind in _PLAIN_VALUES:
            others.append((key, value))
        else:
            others.append((key, kind))

    def _record_result(self, plan, record, out, args, kwargs) -> None:
        if isinstance(out, _Tensor):
            outputs = (out,)
        elif type(out) is tuple or type(out) is list:
            outputs = tuple(item for item in out if isinstance(item, _Tensor))
        elif plan.mutated_args:
            outputs = _mutated_tensors(plan.mutated_args, args, kwargs)
        else:
            outputs = ()
        try:
            metas = tuple([(t.shape, t.dtype, t.device, id(t)) for t in outputs])
        except Exception:
            metas = tuple([_safe_meta(t) for t in outputs])
        record._outputs = metas
        if not outputs:
            return
        if self._track_provenance:
            self._note_size1_dims(plan, record, outputs, metas)
        if plan.check_values:
            internal_work.active = True
            grad_was_enabled = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                self.values.observe(record, outputs, metas)
            finally:
                torch._C._set_grad_enabled(grad_was_enabled)
                internal_work.active = False

    # -- what the checks may ask (CheckContext) ------------------------------------------

    def deliberate_dims(self, meta) -> frozenset[int]:
        entry = self._size1_entry(meta)
        if entry is None:
            return frozenset()
        if (entry[2], entry[3]) == self._site and entry[2] is not None:
            # Made inside the same call as this op (torch.outer reshapes internally).
            return frozenset(range(-len(meta[0]), 0))
        return entry[1]

    def producer(self, meta) -> str | None:
        entry = self._size1_entry(meta)
        if entry is None:
            return None
        record = entry[4]
        return f"{short_op_name(record.func)} at {record.where}"

    def _size1_entry(self, meta):
        entry = self._size1.get(meta[3])
        if entry is None or entry[0]() is None:
            return None
        return entry

    def _note_size1_dims(self, plan, record, outputs, metas) -> None:
        for tensor, meta in zip(outputs, metas):
            shape = meta[0]
            if 1 not in shape:
                continue
            deliberate = frozenset()
            if plan.unsqueeze:
                dim = record._args[0][1] if record._args else 0
                ndim = len(shape)
                new_dim = (dim if dim >= 0 else dim + ndim) - ndim
                inherited = self._inherited(record, shape)
                deliberate = frozenset(d if d > new_dim else d - 1 for d in inherited) | {new_dim}
            elif plan.preserves_shape:
                deliberate = self._inherited(record, shape)
            self._size1[meta[3]] = (weakref.ref(tensor), deliberate, record._code, record._lasti, record)
        if len(self._size1) > 4 * self._max_records + 1024:
            self._size1 = {key: entry for key, entry in self._size1.items() if entry[0]() is not None}

    def _inherited(self, record, shape) -> frozenset[int]:
        dims = set()
        for meta in record._inputs:
            entry = self._size1_entry(meta)
            if entry is not None:
                dims.update(d for d in entry[1] if -len(shape) <= d and shape[d] == 1)
        return frozenset(dims)

    # -- check points ----------------------------------------------------------------------

    def check_point(self) -> list:
        """Resolve queued nan/inf flags (one host read); returns the new origins."""
        if self._broken:
            return []
        window_start = self._window_start
        self._window_start = self._next_index
        if not self.values.pending and not self.values._carry:
            return []
        internal_work.active = True
        try:
            window = [record for record in self._log if record.index >= window_start]
            return self.values.resolve(window)
        except Exception as error:
            self._internal_error(error)
            return []
        finally:
            internal_work.active = False

    def _report_origins(self, origins) -> None:
        for origin in origins:
            contained = not origin.matters
            self._report(origin.finding(contained=contained), origin.record, contained=contained)

    def _internal_error(self, error: Exception) -> None:
        self._broken = True
        self._on_internal_error(error, traceback.format_exc())


def _user_frame(frame):
    """The innermost user frame: ``(code, lasti, reached_engine)``.

    ``reached_engine`` is true when the walk met autograd's engine entry before any user
    frame: the op is run by the engine, not by user code such as a backward hook.
    """
    kinds = _code_kinds
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(code)
        if kind is None:
            kind = kinds[code] = classify_code(code)
        if kind == USER:
            return code, frame.f_lasti, False
        if kind == ENGINE:
            return None, 0, True
        frame = frame.f_back
    return None, 0, False


def _mutated_tensors(mutated_args, args, kwargs) -> tuple:
    tensors = []
    for position, name in mutated_args:
        value = args[position] if position < len(args) else kwargs.get(name)
        if isinstance(value, _Tensor):
            tensors.append(value)
        elif type(value) is list or type(value) is tuple:
            tensors.extend(item for item in value if isinstance(item, _Tensor))
    return tuple(tensors)


def _safe_meta(tensor) -> tuple:
    """Metadata of tensors that refuse ``.shape`` (nested tensors) or ``.device``."""
    try:
        shape = tuple(tensor.shape)
    except Exception:
        shape = None
    try:
        device = tensor.device
    except Exception:
        device = torch.device("meta")
    return (shape, tensor.dtype, device, id(tensor))
