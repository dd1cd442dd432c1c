"""The op log: compact entries on the hot path, ``OpRecord`` views when somebody reads.

The hot path appends one plain tuple per op (see the ``E_*`` positions) holding only ints,
strings, dtypes, devices and tuples of those: never a tensor, never a formatted string. Ops and
source sites are interned into per-log tables and referred to by number, so an entry holds
nothing the garbage collector has to track: a full log of 10,000 entries does not slow down
Python's collections, which would otherwise cost more than the recording itself.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Any

import torch

from .bounded import BoundedCache
from .compat import collective_wrapper_inner, dtensor_class, python_made_collective_wrapper
from .notation import Sharding, TensorMeta, format_meta, sharding_of
from .sites import Position, location, position_of

__all__ = [
    "BaseRecord",
    "OpRecord",
    "OpLog",
    "MODULE_PATH",
    "MODULE_CLASS",
    "SharedShapes",
    "FORWARD",
    "BACKWARD",
    "op_entry",
    "tensor_metas",
    "entry_inputs",
    "entry_outputs",
    "short_op_name",
]

FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"  # the ops of an optimizer step
CLIPPING = "clipping"  # the ops of torch.nn.utils.clip_grad_norm_ / clip_grad_value_
_PHASE_SPANS = 64  # optimizer steps and clippings whose ops' phase is kept

# A log entry is one tuple: nine plain values, two counts, then one tensor metadata tuple per
# tensor, inputs first. Shapes are interned. Everything in it is untracked by the garbage
# collector once it has looked at it (within two young collections), so a full log of 10,000
# entries never reaches the old generation and never slows collections down.
E_INDEX = 0  # op index since the watch began
E_FUNC = 1  # op id in OpLog.funcs
E_SITE = 2  # source site id in OpLog.sites
E_MODULE = 3  # (path, class name) of the module running the op (MODULE_PATH, MODULE_CLASS), or None
E_PHASE = 4  # FORWARD or BACKWARD
E_FORWARD_FUNC = 5  # backward ops run by autograd: op id of the forward op they differentiate; else -1
E_ARGS = 6  # (position or name, value, position or name, value, ...) of the other arguments
E_START_NS = 7  # time.perf_counter_ns() right before the kernel ran (or was stopped)
E_END_NS = 8  # the same right after it returned; -1 when it raised or did not run
E_NINPUTS = 9  # number of tensor arguments
E_NOUTPUTS = 10  # number of tensor results; -1 when the kernel raised or did not run
E_TENSORS = 11  # from here: the tensors' metadata, inputs then outputs

# Tensor metadata, one tuple per tensor: (shape, dtype, device, ident), never the tensor.
M_SHAPE = 0  # a plain tuple of ints (interned); None for tensors without one (nested)
M_DTYPE = 1
M_DEVICE = 2
M_IDENT = 3  # id() of the tensor object when the op saw it: follows data from op to op
# Only a DTensor's tuple has a fifth item: (local shape, placements' facts, mesh shape, id() of
# the local shard), see opwatch.core.notation.sharding_of; M_SHAPE is then its global shape, as
# the op sees it.
M_SHARDING = 4
SH_LOCAL_IDENT = 3  # in the fifth item: the local shard's id()


# An entry's module (at E_MODULE): None outside modules, else a plain tuple of two facts, its
# dotted path (relative to the outermost module called, which is named by its class: "Net",
# "enc.0", "enc.0.attn") and its class's name ("Linear"), None where no module class stands
# behind the name (a compiled graph's records: "torch.compile graph 3 (forward)"). A plain
# tuple of strings, so that the collector untracks it (a NamedTuple it would track, and every
# entry holding it); one per module, shared by the entries of its ops
# (opwatch.modes.modules.ModuleStack makes them).
MODULE_PATH = 0
MODULE_CLASS = 1


def op_entry(head: tuple, start_ns: int, end_ns: int, inputs, outputs=None) -> tuple:
    """The one constructor of a log entry. ``head``: the values at ``E_INDEX`` .. ``E_ARGS``
    (index, op id, site id, module path, phase, forward op id or -1, other arguments);
    ``start_ns``/``end_ns``: the kernel's times (``end_ns`` -1 when it did not return);
    ``inputs``/``outputs``: the tensors' metadata, ``outputs`` ``None`` while the kernel has not
    returned (it raised, or it has not run yet)."""
    if outputs is None:
        return (*head, start_ns, end_ns, len(inputs), -1, *inputs)
    return (*head, start_ns, end_ns, len(inputs), len(outputs), *inputs, *outputs)


def entry_inputs(entry: tuple) -> tuple:
    """The ``(shape, dtype, device, ident)`` of each tensor argument."""
    return entry[E_TENSORS : E_TENSORS + entry[E_NINPUTS]]


def entry_outputs(entry: tuple) -> tuple | None:
    """The same for the results; ``None`` when the kernel raised or did not run."""
    count = entry[E_NOUTPUTS]
    if count < 0:
        return None
    start = E_TENSORS + entry[E_NINPUTS]
    return entry[start : start + count]


class ModuleCall:
    """Stands for an op in the log where a check judged a module call before its forward ran
    (``LSTM.forward``): composite modules check their arguments before any op is dispatched."""

    __slots__ = ("name",)
    _known = BoundedCache(1024)  # module class -> its ModuleCall (a few per program)

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def of(cls, module_class) -> ModuleCall:
        known = cls._known.get(module_class)
        if known is None:
            known = cls._known.put(module_class, cls(f"{module_class.__name__}.forward"))
        return known

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


class SharedShapes(BoundedCache):
    """``torch.Size`` -> the one plain tuple that entries store for that shape.

    Looked up as ``shapes[tensor.shape]``: a miss interns the shape. Distinct shapes beyond a
    few thousand (sequence lengths that vary every step) start a fresh table rather than pile up.
    """

    __slots__ = ()

    def __init__(self, limit: int = 4096):
        super().__init__(limit)

    def __missing__(self, size) -> tuple:
        return self.put(size, tuple(size))


class PhaseSpan:
    """Ops ``first`` to ``end`` (excluded; ``None`` while open) ran in ``phase``."""

    __slots__ = ("first", "end", "phase")

    def __init__(self, first: int, phase: str):
        self.first, self.end, self.phase = first, None, phase


class OpLog:
    """The bounded log of one watch, and the tables its entries refer to."""

    def __init__(self, max_records: int):
        self.entries: deque[tuple] = deque(maxlen=max_records)
        self.funcs: list = []  # op id -> OpOverload
        self.func_ids: dict = {}
        self.sites: list[tuple] = [(None, 0)]  # site id -> (code object, instruction offset); 0: unknown
        # (id of the code object, instruction offset) -> site id. Keyed by id: hashing a code
        # object hashes its bytecode and constants on every call. ``sites`` keeps each code
        # object alive, so its id is not reused.
        self.site_ids: dict = {(id(None), 0): 0}
        self.flags: dict[int, list[str]] = {}  # op index -> anomaly kinds found on it, pruned with the ring
        # List-valued arguments (sizes, dims): most calls repeat earlier ones. Unique scalars (a
        # decaying learning rate) must not pile up.
        self._interned = BoundedCache(4096)
        self.shapes = SharedShapes()
        # This process's rank in a torch.distributed job (see opwatch.core.collective_ops); None outside one.
        self.rank: int | None = None
        # Whether an op on DTensors was logged (entries with a fifth metadata item): the nan/inf
        # replay then follows values between DTensors and their local shards.
        self.sharded = False
        # The next op's index. The log numbers every op it holds, whichever mode logs it (the
        # interceptor, the function mode, module calls, compiled graphs), and keeps counting
        # across the blocks of one Watch. The interceptor takes its number inline (a method
        # call on every op costs); the others log through log_call.
        self.next_index = 0
        # The ops of an optimizer step or of gradient clipping (PhaseSpan), set by hooks around
        # those calls (opwatch.session) and read when a record's phase is asked for, never on
        # the per-op path. The newest few are kept.
        self.phase_spans: deque[PhaseSpan] = deque(maxlen=_PHASE_SPANS)
        self._open_span: PhaseSpan | None = None

    def open_span(self, phase: str) -> None:
        """The ops logged from now on, until :meth:`close_span`, ran in ``phase``."""
        self._open_span = PhaseSpan(self.next_index, phase)
        self.phase_spans.append(self._open_span)

    def close_span(self) -> None:
        if self._open_span is not None:
            self._open_span.end = self.next_index
            self._open_span = None

    def phase_at(self, index: int, logged: str) -> str:
        """The phase of op ``index`` logged as ``logged`` (forward): an optimizer step's or
        gradient clipping's when a span holds it."""
        for span in reversed(self.phase_spans):
            if span.first <= index and (span.end is None or index < span.end):
                return span.phase
        return logged

    def log_call(self, func, site: int, module, phase: str, inputs, *, start_ns: int, end_ns: int = -1, outputs=None) -> tuple:
        """Number one op, or a call that stands for one (a :class:`ModuleCall`), and log its
        entry (made by :func:`op_entry`; no forward op, no other arguments). ``site``: a site id
        of this log; ``inputs``/``outputs``: tensor metadata (:func:`tensor_metas`), ``outputs``
        ``None`` where nothing ran. Returns the entry (:meth:`view` makes its record)."""
        index = self.next_index
        self.next_index = index + 1
        entry = op_entry((index, self.func_id(func), site, module, phase, -1, ()), start_ns, end_ns, inputs, outputs)
        self.entries.append(entry)
        return entry

    def func_id(self, func) -> int:
        known = self.func_ids.get(func)
        if known is None:
            known = self.func_ids[func] = len(self.funcs)
            self.funcs.append(func)
        return known

    def site_id(self, code, lasti: int) -> int:
        key = (id(code), lasti)
        known = self.site_ids.get(key)
        if known is None:
            known = self.site_ids[key] = len(self.sites)
            self.sites.append((code, lasti))
        return known

    def label_site(self, label: str) -> int:
        """The site id of a place that has a name but no source line (``DDP bucket [fc.weight]``,
        see :class:`opwatch.modes.reducer.ReducerSites`); stored as ``(None, label)``."""
        return self.site_id(None, label)

    def line_site(self, filename: str, lineno: int) -> int:
        """The site id of a source line known by file and number only (a node of a compiled
        graph, by its ``stack_trace``: :mod:`opwatch.modes.compiled_graphs`); stored as
        ``(None, (filename, lineno))``."""
        return self.site_id(None, (filename, lineno))

    def intern(self, values: tuple) -> tuple:
        """One shared copy of an argument tuple. Held by this table, it is scanned (and
        untracked) by the garbage collector before the entries that refer to it."""
        # Keyed by types too: (1, -1) == (1, -1.0) and 1 == True, but they are different arguments.
        key = (values, tuple(map(type, values)))
        try:
            known = self._interned.get(key)  # a plain dict read on the hot path; put() on a miss
        except TypeError:  # an unhashable value
            return values
        return self._interned.put(key, values) if known is None else known

    def add_flag(self, index: int, kind: str) -> None:
        """Mark op ``index`` with an anomaly kind. Flags of ops that left the ring go with them
        (checked only when flags outnumber the ring's size: anomalies are rare)."""
        kinds = self.flags.setdefault(index, [])
        if kind not in kinds:
            kinds.append(kind)
        if len(self.flags) > self.entries.maxlen and self.entries:
            oldest = self.entries[0][E_INDEX]
            self.flags = {known: kinds for known, kinds in self.flags.items() if known >= oldest}

    @property
    def lost_ops(self) -> bool:
        """Whether the ring has dropped ops: the log no longer starts at the watch's first op."""
        for entry in self.entries:
            return entry[E_INDEX] > 0
        return False

    def view(self, entry: tuple) -> OpRecord:
        return OpRecord(entry, self)

    def add(self, entry: tuple) -> OpRecord:
        """Log ``entry`` (made by :func:`op_entry`) and return its record: for an op with a
        finding, logged before its kernel runs (a strict raise dumps it as the failing op)."""
        self.entries.append(entry)
        return OpRecord(entry, self)

    def complete(self, record: OpRecord, entry: tuple) -> None:
        """Replace the entry of ``record`` (added before its kernel ran) by the complete
        ``entry``, in the log (when still the last entry) and in the record."""
        entries = self.entries
        if entries and entries[-1] is record._entry:
            entries[-1] = entry
        record._entry = entry

    def records(self) -> list[OpRecord]:
        return [OpRecord(entry, self) for entry in self.entries]

    def find(self, index: int) -> OpRecord | None:
        for entry in reversed(self.entries):
            if entry[E_INDEX] == index:
                return OpRecord(entry, self)
            if entry[E_INDEX] < index:
                break
        return None

    def producer_of(self, ident: int, *, before: int | None = None, like: tuple | None = None) -> OpRecord | None:
        """The latest logged op (before op ``before``, when given) that output the tensor
        ``ident`` (slow: for messages only). ``like``: the tensor's metadata tuple; then ``None``
        where that op's output under the id had another shape, dtype or device: an older tensor,
        whose address this one took once it was freed (the tensor itself was made by no op)."""
        for entry in reversed(self.entries):
            if before is not None and entry[E_INDEX] >= before:
                continue
            outputs = entry_outputs(entry)
            if not outputs:
                continue
            for meta in outputs:
                if meta[M_IDENT] == ident:
                    if like is not None and (meta[M_SHAPE] != like[M_SHAPE] or meta[M_DTYPE] != like[M_DTYPE] or meta[M_DEVICE] != like[M_DEVICE]):
                        return None
                    return OpRecord(entry, self)
        return None

    def since(self, index: int) -> list[tuple]:
        """Entries with an op index of at least ``index``, oldest first."""
        newer = []
        for entry in reversed(self.entries):
            if entry[E_INDEX] < index:
                break
            newer.append(entry)
        newer.reverse()
        return newer


def tensor_metas(tensors, log: OpLog, types=()) -> list:
    """``[(shape, dtype, device, ident), ...]``, the shapes interned in ``log.shapes``
    (:class:`SharedShapes`). ``types``: the op's tensor subclasses (``__torch_dispatch__``'s);
    where one is a DTensor, its tensors' tuples get their sharding."""
    shapes = log.shapes
    if types and _sharded(types):
        log.sharded = True
        return _sharded_metas(tensors, shapes)
    if types and _python_wrapped(types):
        return _unwrapped_metas(tensors, shapes)
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


# The op's subclass types -> whether one is a DTensor (a few distinct tuples per program).
_SHARDED_TYPES = BoundedCache(256)


def _sharded(types) -> bool:
    known = _SHARDED_TYPES.get(types)
    if known is None:
        dtensor = dtensor_class()
        known = _SHARDED_TYPES.put(types, dtensor is not None and any(issubclass(kind, dtensor) for kind in types))
    return known


def _sharded_metas(tensors, shapes) -> list:
    """``tensor_metas`` of an op on DTensors: a DTensor's tuple gets its sharding facts as a fifth item."""
    dtensor = dtensor_class()
    metas = []
    for tensor in tensors:
        try:
            meta = (shapes[tensor.shape], tensor.dtype, tensor.device, id(tensor))
            if isinstance(tensor, dtensor):
                meta = (*meta, sharding_of(tensor, shapes))
        except Exception:
            meta = _safe_meta(tensor)
        metas.append(meta)
    return metas


# The op's subclass types -> whether one is an AsyncCollectiveTensor torch made in Python.
_WRAPPED_TYPES = BoundedCache(256)


def _python_wrapped(types) -> bool:
    known = _WRAPPED_TYPES.get(types)
    if known is None:
        wrapper = python_made_collective_wrapper()
        known = wrapper is not None and any(issubclass(kind, wrapper) for kind in types)
        if wrapper is not None:  # before the module loads, ask again later
            _WRAPPED_TYPES.put(types, known)
    return known


def _unwrapped_metas(tensors, shapes) -> list:
    """``tensor_metas`` of an op on an ``AsyncCollectiveTensor`` that torch made in Python (torch
    2.6, no wrap op): the wrapper gets the ident of the collective's output it wraps, as the
    wrap op links the two on newer torch, so the collective's output is followed to its use."""
    wrapper = python_made_collective_wrapper()
    metas = []
    for tensor in tensors:
        try:
            inner = collective_wrapper_inner(tensor) if isinstance(tensor, wrapper) else None
            metas.append((shapes[tensor.shape], tensor.dtype, tensor.device, id(tensor if inner is None else inner)))
        except Exception:
            metas.append(_safe_meta(tensor))
    return metas


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


class BaseRecord:
    """The one record interface, shared by live records (:class:`OpRecord`), saved ones
    (:class:`opwatch.storage.jsonl.SavedRecord`) and any other view of one op.

    A subclass provides these primitive attributes (plain attributes or properties):

    - ``index`` (int), ``func`` (the ``OpOverload``, or the op's name where none is known),
      ``module`` (the module's dotted path, or ``None``), ``module_class`` (its class's name, or
      ``None``), ``phase`` (``FORWARD`` / ``BACKWARD``), ``forward_func``;
    - ``inputs`` / ``outputs``: metadata tuples ``(shape, dtype, device, ident)``, one a tensor
      (``outputs`` is ``None`` when the kernel raised or did not run);
    - ``args``: ``(name, value)`` pairs; ``flags``: anomaly kinds; ``rank``; ``label``;
      ``start_ns`` / ``end_ns``;
    - ``position``: an object with ``filename``, ``lineno``, ``end_lineno``, ``col``,
      ``end_col`` and the methods ``line_text()``, ``expression()``, ``caret_lines()``
      (:class:`opwatch.core.sites.Position`).

    Derived here, the same for every record: ``op``, ``filename``, ``lineno``, ``where``,
    :meth:`signature` and the ``repr``. Renderers read records only through this interface.
    """

    __slots__ = ()

    @property
    def op(self) -> str:
        """The op's name, ``aten.addmm.default``."""
        return str(self.func)

    @property
    def filename(self) -> str | None:
        return self.position.filename

    @property
    def lineno(self) -> int | None:
        return self.position.lineno

    @property
    def where(self) -> str:
        """``train.py:23``, in the one location format of every message (made by
        ``opwatch.core.sites.location``): ``autograd`` for backward ops autograd ran without a
        forward line (gradient accumulation), ``?`` when no user frame was found."""
        return location(self)

    def signature(self) -> str:
        """``aten.mm(f64[5, 3] cpu, f32[3, 2] cpu) -> f64[5, 2] cpu``."""
        text = f"{short_op_name(self.func)}({', '.join(map(format_meta, self.inputs))})"
        outputs = self.outputs
        if outputs:
            text += " -> " + ", ".join(map(format_meta, outputs))
        return text

    def __repr__(self) -> str:
        return f"<{type(self).__name__} #{self.index} {self.signature()} at {self.where} {self.phase}>"


class OpRecord(BaseRecord):
    """What opwatch saw of one ATen op: a view of one entry of the watch's log.

    Attributes:
        index: position of the op in the watch's log, counted from 0 since the watch began; it
            keeps counting when old records leave the bounded log.
        op: the op's name, e.g. ``"aten.addmm.default"``; ``func`` is the ``OpOverload``.
        inputs / outputs: one :class:`TensorMeta` (shape, dtype, device) per tensor argument or
            result, in argument order; ``outputs`` is ``None`` when the kernel raised or, in
            ``strict()``, was stopped before it ran.
        args: non-tensor arguments as ``(name, value)`` pairs (values that are not plain
            numbers, strings, dtypes or devices are summarised by their type's name).
        filename / lineno: the user's source line (the innermost frame outside torch and
            opwatch). Backward ops carry the line of the forward op that created them.
        position: line and columns of the sub-expression that issued the op.
        module: dotted path of the ``nn.Module`` running the op (``"enc.0"``), relative to the
            outermost module called (that one is named by its class); ``None`` outside modules.
        module_class: the class name of that module (``"Linear"``); ``None`` outside modules.
            Messages and tables show the two as one label, ``enc.0 (Linear)``, where the path
            ends in an index.
        phase: ``"forward"``, ``"backward"``, ``"clipping"`` (``torch.nn.utils.clip_grad_norm_``,
            ``clip_grad_value_``) or ``"optimizer"`` (an optimizer step).
        forward_func: for a backward op run by autograd, the forward ``OpOverload`` whose
            gradient it computes (``None`` otherwise).
        flags: anomaly kinds found on this op (``()`` when none).
        rank: the process's rank in a ``torch.distributed`` job, ``None`` outside one.
        label: for ops with a named place but no source line (the DDP reducer's), its name.
        where, signature(): see :class:`BaseRecord`.
    """

    __slots__ = ("_entry", "_log")

    def __init__(self, entry: tuple, log: OpLog):
        self._entry = entry
        self._log = log

    @property
    def index(self) -> int:
        return self._entry[E_INDEX]

    @property
    def func(self):
        return self._log.funcs[self._entry[E_FUNC]]

    @property
    def inputs(self) -> tuple[TensorMeta, ...]:
        return tuple(map(_as_meta, entry_inputs(self._entry)))

    @property
    def outputs(self) -> tuple[TensorMeta, ...] | None:
        outputs = entry_outputs(self._entry)
        if outputs is None:
            return None
        return tuple(map(_as_meta, outputs))

    @property
    def args(self) -> tuple[tuple[str, Any], ...]:
        schema_args = getattr(getattr(self.func, "_schema", None), "arguments", ())
        named = []
        flat = self._entry[E_ARGS]
        for key, value in zip(flat[::2], flat[1::2]):
            if isinstance(key, int):
                key = schema_args[key].name if key < len(schema_args) else f"arg{key}"
            named.append((key, value))
        return tuple(named)

    @property
    def module(self) -> str | None:
        module = self._entry[E_MODULE]
        return None if module is None else module[MODULE_PATH]

    @property
    def module_class(self) -> str | None:
        module = self._entry[E_MODULE]
        return None if module is None else module[MODULE_CLASS]

    @property
    def phase(self) -> str:
        phase = self._entry[E_PHASE]
        if phase == FORWARD and self._log.phase_spans:
            return self._log.phase_at(self._entry[E_INDEX], phase)
        return phase

    @property
    def forward_func(self):
        forward = self._entry[E_FORWARD_FUNC]
        return None if forward < 0 else self._log.funcs[forward]

    @property
    def position(self) -> Position:
        """Line and column range of the user's expression that issued the op."""
        code, lasti = self._log.sites[self._entry[E_SITE]]
        if code is None and type(lasti) is tuple:  # a line site: (filename, lineno)
            return Position(*lasti)
        return position_of(code, lasti)

    @property
    def filename(self) -> str | None:
        # Without building the position: the file is the code object's.
        code, lasti = self._log.sites[self._entry[E_SITE]]
        if code is None:
            if type(lasti) is tuple:  # a line site
                filename, _ = lasti
                return filename
            return None
        return code.co_filename

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(self._log.flags.get(self.index, ()))

    @property
    def rank(self) -> int | None:
        """The rank of the process that ran the op in a ``torch.distributed`` job, else ``None``."""
        return self._log.rank

    @property
    def label(self) -> str | None:
        """The name of the op's place when it has no source line but a name (the DDP reducer's
        ops: ``DDP bucket [fc2.bias, fc2.weight]``), else ``None``."""
        code, lasti = self._log.sites[self._entry[E_SITE]]
        return lasti if code is None and isinstance(lasti, str) else None

    @property
    def start_ns(self) -> int:
        """``time.perf_counter_ns()`` right before the kernel ran (or was stopped)."""
        return self._entry[E_START_NS]

    @property
    def end_ns(self) -> int | None:
        """``time.perf_counter_ns()`` right after the kernel returned; ``None`` when it raised
        or did not run."""
        end = self._entry[E_END_NS]
        return None if end < 0 else end

    def __eq__(self, other) -> bool:
        return isinstance(other, OpRecord) and other._entry is self._entry

    def __hash__(self) -> int:
        return hash(self._entry[E_INDEX])


_as_full_meta = partial(tuple.__new__, TensorMeta)  # TensorMeta(*meta), without the Python-level call


def _as_meta(meta: tuple) -> TensorMeta:
    """An entry's metadata tuple as a :class:`TensorMeta` (``sharding`` ``None`` for a plain
    tensor's four items)."""
    if len(meta) > M_SHARDING:
        return tuple.__new__(TensorMeta, (*meta[:M_SHARDING], Sharding(*meta[M_SHARDING])))
    return _as_full_meta((*meta, None))


def short_op_name(func) -> str:
    """The op's name as tables and messages show it: ``aten.mm.default`` -> ``aten.mm``; other
    overload names are kept (``aten.add.Tensor``). ``func``: an ``OpOverload`` or its name."""
    return str(func).removesuffix(".default")
