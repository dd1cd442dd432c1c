"""The private ``TorchDispatchMode`` that sees every ATen op: the hot path of opwatch.

Per op it stores one small tuple (tensor metadata, the interned source site, the module path;
see :mod:`opwatch.records`), runs the pre-kernel checks, calls the kernel, and queues the
sync-free nan/inf reduction. Everything that does not change between calls of one
``OpOverload`` is worked out once and cached in an :class:`_OpPlan`.

Backward ops are tied to the forward line through autograd sequence numbers: a forward op
that creates an autograd node bumps the thread's sequence counter, so the counter read in the
forward op names its node; in backward, the node being run reports the same number. No
``grad_fn`` or node metadata is touched (both have crashed or raised in probes).
"""

from __future__ import annotations

import sys
import traceback
from itertools import islice

import torch
from torch._C._autograd import _get_sequence_nr
from torch.utils._python_dispatch import TorchDispatchMode

from .. import checks
from ..checks import broadcast as broadcast_check
from ..checks.nonfinite import NonFiniteTracker, checked_outputs, makes_new_data, needs_carrier, preserves_values
from ..records import BACKWARD, E_INDEX, FORWARD, OpLog, short_op_name
from ..sites import user_frame

__all__ = ["OpInterceptor", "keep_dynamo_out"]

_current_autograd_node = torch._C._current_autograd_node
_inference_mode = torch._C.is_inference_mode_enabled
_Tensor = torch.Tensor
# Non-tensor argument values stored as they are; others are summarised by their type's name.
_PLAIN_VALUES = {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
_HOST_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item", "aten::equal"}
# Copies that may bring a device's values to the host (printing a CUDA tensor, .cpu()): a
# check point when they do, since they wait for the device anyway.
_COPIES = {"aten::_to_copy", "aten::copy_"}
_UNSQUEEZE = "aten::unsqueeze"
# Ops whose output keeps its input's shape and meaning: size-1 dims made on purpose stay so.
_SHAPE_PRESERVING = {"aten::_to_copy", "aten::clone", "aten::contiguous", "aten::detach", "aten::alias", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::to"}

try:  # torch >= 2.6: per-code-object frame strategies for TorchDynamo
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    # Skip this frame and every frame it calls.
    _SKIP_FRAMES = (set_code_exec_strategy, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
except (ImportError, AttributeError):  # older torch: TorchDispatchMode's wrapper does it
    _SKIP_FRAMES = None

# opwatch's own tensor work (the nan/inf reductions, reading them back) runs with Python
# dispatch off: neither this mode nor any other sees it.
_no_python_dispatch = torch._C._DisableTorchDispatch
_NO_SITE = (0, None, -1)


class _OpPlan:
    """What one ``OpOverload`` needs on the hot path, worked out on its first call."""

    __slots__ = ("func", "kernel", "func_id", "ignored", "mutated_args", "pre_checks", "host_read", "copies", "check_values", "checked_outputs", "carries_values", "links_values", "unsqueeze", "preserves_shape", "is_view")

    def __init__(self, func, func_id: int, enabled: frozenset[str]):
        schema_name = func._schema.name
        self.func = func
        # The C++ op itself: OpOverload.__call__ is a Python frame around it.
        self.kernel = getattr(func, "_op", func)
        self.func_id = func_id
        # record_function markers (optimizers emit them) are not computations.
        self.ignored = func.namespace == "profiler"
        # Arguments written in place: the op's real outputs when it returns nothing
        # (``_foreach_add_`` updating parameters returns None).
        self.mutated_args = tuple(
            (position, arg.name)
            for position, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        bound = (check.for_op(func) for check in checks.PRE_KERNEL_CHECKS if check.KIND in enabled)
        self.pre_checks = tuple(check for check in bound if check is not None)
        self.host_read = schema_name in _HOST_READS or schema_name in _COPIES
        self.copies = schema_name in _COPIES
        checks_values = checks.nonfinite.NAME in enabled
        self.check_values = checks_values and not (makes_new_data(func) or preserves_values(func))
        self.checked_outputs = checked_outputs(func)
        # Unchecked outputs remembered weakly, to tell at a check point whether a nan/inf they
        # carry is alive; views are not (their base stands in) unless made in inference mode,
        # where they have no link to their base.
        self.carries_values = checks_values and needs_carrier(func)
        self.links_values = checks_values and preserves_values(func) and not self.carries_values
        self.unsqueeze = schema_name == _UNSQUEEZE
        self.is_view = bool(func.is_view)
        self.preserves_shape = schema_name in _SHAPE_PRESERVING or torch.Tag.pointwise in func.tags


class OpInterceptor(TorchDispatchMode):
    """Records every op into ``log`` and hands findings to ``report``.

    ``report(finding, record)`` may raise (strict mode): that exception reaches the program
    before the kernel runs, exactly like an error from the op itself.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._dynamo.disable, a Python
        # wrapper on every op; marking the code object (below) keeps Dynamo out as well, free.
        return _SKIP_FRAMES is None

    def __init__(self, *, log: OpLog, report, enabled: frozenset[str], modules, max_records: int, on_internal_error, first_index: int = 0):
        super().__init__()
        self._log = log
        self._entries = log.entries
        self._report = report
        self._enabled = enabled
        self._modules = modules
        self._max_records = max_records
        self._on_internal_error = on_internal_error
        self._plans: dict = {}
        # Forward sites and size-1 provenance kept, oldest dropped first: part of the fixed
        # memory cost of max_records, so that a long loop stays flat.
        self._table_limit = 2 * max_records + 4096
        self.next_index = first_index
        self._broken = False
        self._track_provenance = broadcast_check.KIND in enabled
        self.values = NonFiniteTracker(log)
        self._window_start = first_index  # first op index not yet covered by a check point
        # autograd sequence number of a forward node -> (site id, module, op id) of its forward op
        self._forward_sites: dict = {}
        self._site_tuples: dict = {}
        self._last_seq = _get_sequence_nr()
        # ident of a tensor with size-1 dims -> (shape, deliberate dims, site id)
        self._size1: dict = {}
        self._site_id = 0  # site of the op being checked
        # (op index, id of the exception) when a kernel raised
        self.failure: tuple[int, int] | None = None

    # -- the hot path -------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # One function on purpose: this runs for every op, and Python calls cost.
        if kwargs is None:
            kwargs = {}
        if self._broken:
            return func(*args, **kwargs)
        # Keyed by id: OpOverload hashes in Python. The plan holds its op, so the id stays its.
        plan = self._plans.get(id(func))
        if plan is None:
            try:
                plan = self._plans[id(func)] = _OpPlan(func, self._log.func_id(func), self._enabled)
            except Exception as error:
                self._internal_error(error)
                return func(*args, **kwargs)
        if plan.ignored:
            return func(*args, **kwargs)

        # -- before the kernel: the op's arguments, source, module and phase; the checks.
        try:
            log = self._log
            tensors = []
            others = []  # flat: key, value, key, value, ...
            position = 0
            for value in args:
                if isinstance(value, _Tensor):
                    tensors.append(value)
                elif type(value) in _PLAIN_VALUES:
                    others += (position, value)
                else:
                    _split(position, value, tensors, others, log.intern)
                position += 1
            if kwargs:
                for name, value in kwargs.items():
                    if isinstance(value, _Tensor):
                        tensors.append(value)
                    else:
                        _split(name, value, tensors, others, log.intern)
            inputs = _metas(tensors, log.shapes)
            head = self._head(plan, others)
            finding = None
            for check in plan.pre_checks:
                finding = check(inputs, self)
                if finding is not None:
                    break
            origins = ()
            # A host read where flags wait is a free check point: the program syncs anyway.
            if plan.host_read and inputs and _reads_to_host(plan, inputs, kwargs) and self.values.pending_on(inputs[-1][2]):
                origins = self.check_point()
        except Exception as error:
            self._internal_error(error)
            return func(*args, **kwargs)
        # Outside the guard: in strict mode these raise, before the kernel runs.
        if origins:
            self._report_origins(origins)
        record = None
        if finding is not None:
            # In the log before it is reported: a strict raise dumps it as the failing op.
            unfinished = (*head, len(inputs), -1, *inputs)
            self._entries.append(unfinished)
            record = log.view(unfinished)
            self._report(finding, record)

        # -- the kernel: its errors reach the program untouched.
        try:
            out = plan.kernel(*args, **kwargs)
        except BaseException as error:
            if record is None:
                self._entries.append((*head, len(inputs), -1, *inputs))
            self.failure = (head[E_INDEX], id(error))
            raise

        # -- after the kernel: the outputs, the complete entry, the nan/inf reduction.
        try:
            if isinstance(out, _Tensor):
                outputs = (out,)
            elif type(out) is tuple or type(out) is list:
                outputs = tuple([item for item in out if isinstance(item, _Tensor)])
            elif plan.mutated_args:
                outputs = _mutated_tensors(plan.mutated_args, args, kwargs)
            else:
                outputs = ()
            metas = _metas(outputs, log.shapes)
            entry = (*head, len(inputs), len(metas), *inputs, *metas)
            if record is None:
                self._entries.append(entry)
            else:
                if self._entries and self._entries[-1] is record._entry:
                    self._entries[-1] = entry
                record._entry = entry
            if outputs:
                if self._track_provenance:
                    self._note_size1_dims(plan, entry, inputs, metas)
                if plan.check_values:
                    self.values.observe(head[E_INDEX], outputs, metas, plan.checked_outputs)
                elif plan.carries_values or (plan.links_values and _inference_mode()):
                    self.values.observe_carrier(head[E_INDEX], outputs, metas)
        except Exception as error:
            self._internal_error(error)
            return out
        if head[E_INDEX] - self._window_start >= self._max_records:
            self._report_origins(self.check_point())
        return out

    def _head(self, plan, others) -> tuple:
        """The start of the op's log entry: index, op, source site, module, phase."""
        modules = self._modules
        # Frames 0-1: this method, __torch_dispatch__ (then, on older torch, Dynamo's wrappers
        # around it, which the walk passes as torch's own frames).
        code, lasti, reached_engine = user_frame(sys._getframe(2), modules.call_frame, modules.call_answer)
        module = modules.current
        forward_func = -1
        node = _current_autograd_node()
        if node is not None and (reached_engine or code is None):
            # Run by the autograd engine: point at the forward op that made this node. A
            # module running now is a checkpoint recomputing its forward: keep its path.
            phase = BACKWARD
            site, forward_module, forward_func = self._forward_sites.get(node._sequence_nr(), _NO_SITE)
            module = module or forward_module
        else:
            # Forward, or backward code of the user's own (a hook, a custom Function).
            phase = FORWARD if node is None else BACKWARD
            site = self._log.site_ids.get((id(code), lasti))
            if site is None:
                site = self._log.site_id(code, lasti)
        seq = _get_sequence_nr()
        if seq != self._last_seq:
            # This op created an autograd node (in forward, in a checkpoint's recomputation, or
            # in a backward pass with create_graph): remember where, for its backward ops.
            self._last_seq = seq
            sites = self._forward_sites
            known = (site, module, plan.func_id if forward_func < 0 else forward_func)
            # Interned: each step makes the same few, and kept tuples cost garbage collections.
            sites[seq - 1] = self._site_tuples.setdefault(known, known)
            if len(sites) > self._table_limit:
                _drop_oldest_half(sites)
                self._site_tuples.clear()
        self._site_id = site
        index = self.next_index
        self.next_index = index + 1
        return (index, plan.func_id, site, module, phase, forward_func, tuple(others))

    # -- what the checks may ask (CheckContext) ------------------------------------------

    def deliberate_dims(self, meta) -> frozenset[int]:
        known = self._size1_entry(meta)
        if known is None:
            return frozenset()
        if known[2] == self._site_id and known[2] != 0:
            # Made inside the same call as this op (torch.outer reshapes internally).
            return frozenset(range(-len(meta[0]), 0))
        return frozenset(known[1])

    def producer(self, meta) -> str | None:
        record = self._log.producer_of(meta[3])
        if record is None:
            return None
        return f"{short_op_name(record.func)} at {record.where}"

    def _size1_entry(self, meta):
        known = self._size1.get(meta[3])
        # An id is reused once its tensor dies; a different shape means another tensor.
        if known is None or known[0] != meta[0]:
            return None
        return known

    def _note_size1_dims(self, plan, entry, inputs, metas) -> None:
        """Remember how outputs got their size-1 dims: on purpose (unsqueeze, and what keeps
        such dims), or by a view (for the same-call rule); forget what other ops overwrote."""
        size1 = self._size1
        for meta in metas:
            shape = meta[0]
            if shape is None or 1 not in shape:
                continue
            if plan.unsqueeze:
                args = entry[6]
                dim = args[1] if args else 0
                ndim = len(shape)
                new_dim = (dim if dim >= 0 else dim + ndim) - ndim
                # The input's deliberate dims, moved past the new one (negative: from the right).
                known = self._size1_entry(inputs[0]) if inputs else None
                kept = known[1] if known is not None else ()
                deliberate = tuple(sorted({d if d > new_dim else d - 1 for d in kept} | {new_dim}))
            elif plan.preserves_shape:
                deliberate = tuple(self._inherited(inputs, shape))
                if not deliberate and not plan.is_view:
                    size1.pop(meta[3], None)
                    continue
            elif plan.is_view:
                deliberate = ()
            else:
                size1.pop(meta[3], None)  # an older tensor's entry under a reused id
                continue
            size1[meta[3]] = (shape, deliberate, entry[2])
        if len(size1) > self._table_limit:
            _drop_oldest_half(size1)

    def _inherited(self, inputs, shape) -> set[int]:
        dims = set()
        for meta in inputs:
            known = self._size1_entry(meta)
            if known is not None:
                dims.update(d for d in known[1] if -len(shape) <= d and shape[d] == 1)
        return dims

    # -- check points ----------------------------------------------------------------------

    def check_point(self) -> list:
        """Resolve queued nan/inf flags (one host read); returns the new origins."""
        if self._broken:
            return []
        window_start = self._window_start
        self._window_start = self.next_index
        if not self.values.pending and not self.values.carrying:
            return []
        try:
            with _no_python_dispatch():
                return self.values.resolve(self._log.since(window_start))
        except Exception as error:
            self._internal_error(error)
            return []

    def _report_origins(self, origins) -> None:
        for origin in origins:
            contained = not origin.matters
            self._report(origin.finding(contained=contained), origin.record, contained=contained)

    def _internal_error(self, error: Exception) -> None:
        self._broken = True
        self._on_internal_error(error, traceback.format_exc())


def keep_dynamo_out() -> None:
    """Make TorchDynamo run ``__torch_dispatch__`` and everything it calls uncompiled, as
    ``torch._dynamo.disable`` would: a compiled function running under a watch must not try to
    compile opwatch. Called on every watch entry, since ``torch._dynamo.reset()`` may clear it."""
    if _SKIP_FRAMES is not None:
        set_strategy, strategy = _SKIP_FRAMES
        set_strategy(OpInterceptor.__torch_dispatch__.__code__, strategy)


def _reads_to_host(plan, inputs, kwargs) -> bool:
    """Whether a host-read op really moves values from a device to the host. For copies: a
    non-CPU source (the last tensor argument) copied to a CPU destination."""
    if not plan.copies:
        return True
    source = inputs[-1][2]
    if source.type in ("cpu", "meta"):
        return False
    if len(inputs) > 1:  # copy_(destination, source)
        return inputs[0][2].type == "cpu"
    destination = kwargs.get("device")
    return destination is not None and torch.device(destination).type == "cpu"


def _split(key, value, tensors, others, intern) -> None:
    """Sort one non-tensor argument: tensor lists join ``tensors``; the rest goes to the flat
    ``others`` as key and value (lists interned, unknown types summarised by their name)."""
    kind = type(value)
    if kind is list or kind is tuple:
        # Schemas never mix: a list is all tensors (optional ones may be None) or all numbers.
        if value and (isinstance(value[0], _Tensor) or value[0] is None):
            tensors.extend(item for item in value if isinstance(item, _Tensor))
            return
        value = intern(tuple(value))  # sizes and dims: numbers (unhashable ones stay as they are)
    elif kind not in _PLAIN_VALUES:
        value = kind.__name__
    others.append(key)
    others.append(value)


def _metas(tensors, shapes) -> list:
    """``[(shape, dtype, device, ident), ...]``, the shapes interned in ``shapes``
    (a :class:`~opwatch.records.SharedShapes`)."""
    try:
        metas = []  # a loop: a comprehension costs a frame of its own before Python 3.12
        for tensor in tensors:
            size = tensor.shape
            shape = shapes.get(size)
            if shape is None:
                shape = shapes[size]
            metas.append((shape, tensor.dtype, tensor.device, id(tensor)))
        return metas
    except Exception:
        return [_safe_meta(tensor) for tensor in tensors]


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


def _drop_oldest_half(table: dict) -> None:
    for key in list(islice(table, len(table) // 2)):
        del table[key]
