"""Facts about ops, worked out once per ``OpOverload`` and asked by every room: the
interceptor's plan, the checks, the nan/inf tracker and its replay.

:func:`facts_of` answers what an op *is* (a view, a copy, a host read, a factory, a lift of
Python data, a collective, ...); nothing else in opwatch derives these from schema names. Sets
of names below are the only lists of ops by kind; add an op here, never in a second place.
The cache holds one small :class:`OpFacts` per distinct op a program runs (a few hundred).
"""

from __future__ import annotations

__all__ = [
    "OpFacts",
    "facts_of",
    "Collective",
    "collective_of",
    "is_collective_op",
    "C10D",
    "FUNCTIONAL",
    "WAIT",
    "WRAP",
    "op_name",
]

# -- ops by kind ------------------------------------------------------------------------------

# Ops that read device values on the host (``.item()``, ``bool(t)``, ``torch.equal``).
HOST_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item", "aten::equal"}
# Copies that may bring a device's values to the host (printing a CUDA tensor, ``.cpu()``).
COPIES = {"aten::_to_copy", "aten::copy_"}
# Ops whose outputs are uninitialised memory (garbage may look like nan/inf); and ``set_``, which
# points a tensor at a storage whose bytes may be filled after it with no op (``torch.load`` of
# the legacy format reads the file into the storage after ``set_``).
NEW_DATA = {
    "aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided",
    "aten::new_empty_strided", "aten::empty_permuted", "aten::resize_", "aten::resize_as_",
    "aten::set_",
}
# Of those, the ones whose output's values may be filled after them with no op at all.
STORAGE_ALIASES = {"aten::set_"}
# Python data entering torch (``torch.tensor([...])``, ``m[mask] = float("-inf")``).
LIFTS = {"aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift"}
# Ops that make tensors from nothing: a stray one usually lacks its device= or dtype=.
FACTORIES = {
    "aten::zeros", "aten::ones", "aten::full", "aten::empty", "aten::rand", "aten::randn",
    "aten::randint", "aten::arange", "aten::linspace", "aten::logspace", "aten::eye",
    "aten::scalar_tensor", "aten::randperm", "aten::empty_strided",
}
# Views and copies that hold exactly their input's values: they keep its range.
SAME_VALUES = {
    "aten::expand", "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::t", "aten::transpose",
    "aten::permute", "aten::detach", "aten::alias", "aten::clone", "aten::contiguous", "aten::unsqueeze", "aten::squeeze",
}
# Views, and ops that only move values around: a non-finite output can only have come in
# through an input. Ops that can drop non-finite values (relu, clamp, max, where, ...) and
# casts (``_to_copy``: f32 -> f16 can overflow) are not among them.
VALUE_PRESERVING = {
    "aten::clone", "aten::contiguous", "aten::neg", "aten::abs", "aten::cat", "aten::stack",
    "aten::index_select", "aten::gather", "aten::index", "aten::masked_select", "aten::flip",
    "aten::roll", "aten::repeat", "aten::select_backward", "aten::slice_backward", "aten::embedding",
    "aten::_unsafe_view",
    # A functional collective's output, waited for or wrapped as an AsyncCollectiveTensor.
    "_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd",
}
# How a value-moving op maps its input's range (other value-preserving ops keep a part of their
# inputs' values: the output's range lies within theirs): neg flips it, abs folds it, a gradient
# scattered into zeros (select_backward, slice_backward) spans 0 too.
RANGE_MAPS = {"aten::neg": "neg", "aten::abs": "abs", "aten::select_backward": "with_zero", "aten::slice_backward": "with_zero"}
# Views whose output has no ``_base`` link, so it does not keep its input alive (found by
# probing the common view ops).
UNLINKED_VIEWS = {("aten::detach", "default"), ("aten::view", "dtype")}
# Ops whose later outputs are statistics derived from the first (mean, rstd, logsumexp).
PRIMARY_OUTPUT_ONLY = {
    "aten::native_layer_norm", "aten::native_batch_norm", "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training", "aten::native_group_norm",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::max_pool2d_with_indices", "aten::max_pool3d_with_indices",
    # FSDP2's all-gather copy-in: its second output is filled by the all-gather later.
    "fsdp::all_gather_copy_in",
}
# Ops that drop the values they do not select (the torch.where gradient trap).
MASKING = {"aten::where", "aten::masked_fill", "aten::masked_fill_", "aten::nan_to_num", "aten::nan_to_num_"}
# Ops that pick the indices of the largest or smallest values (argmax, top-k): a nan among them
# is what gets picked (torch ranks nan above every number, and below for min/argmin), and the
# indices hold no nan to see. ARG_PICKS return the indices alone; the overloads of VALUE_PICKS
# that return two tensors return (values, indices) (``max.dim``; ``max.default`` and
# ``max.other`` return values). Not sort: putting nan last on purpose is documented use.
ARG_PICKS = {"aten::argmax", "aten::argmin"}
VALUE_PICKS = {"aten::max", "aten::min", "aten::topk"}
# GradScaler's overflow check of the scaled gradients (torch.amp.grad_scaler).
GRAD_SCALER_CHECK = "aten::_amp_foreach_non_finite_check_and_unscale_"
# The fused optimizers' steps, which take GradScaler's ``grad_scale`` and ``found_inf`` (the two
# last tensor arguments when given) and skip their update inside the kernel when it is set.
FUSED_STEPS = {"aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_", "aten::_fused_adagrad_"}
# Ops that write a source tensor's values into ``self`` (in place, or into a copy in ``self``'s
# dtype) at indices or under a mask, whose kernels raise unless the source has ``self``'s dtype
# (torch 2.13, found by tools/find_accumulation_dtypes.py; ``index_put`` takes a one-element
# value of another dtype under a single bool mask, where it runs as ``masked_fill_``). The
# source is the argument named in SOURCE_NAMES; in-place, functional and out= forms share a name.
SOURCE_WRITES = {
    "aten::index_add", "aten::index_add_", "aten::index_copy", "aten::index_copy_", "aten::index_reduce",
    "aten::index_reduce_", "aten::scatter", "aten::scatter_", "aten::scatter_add", "aten::scatter_add_",
    "aten::scatter_reduce", "aten::scatter_reduce_", "aten::masked_scatter", "aten::masked_scatter_",
    "aten::put", "aten::put_", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
    "aten::_unsafe_index_put", "aten::lerp", "aten::lerp_",
}
SOURCE_NAMES = ("source", "src", "values", "end")
# Pointwise ops that add into the tensor they write (in place or as out=): torch computes in the
# promoted dtype and rounds the result into the written tensor's dtype silently.
ACCUMULATING = {
    "aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::addcmul", "aten::addcmul_",
    "aten::addcdiv", "aten::addcdiv_",
}


def named_new_data(op: str) -> bool:
    """Whether the op named ``op`` (``aten.set_.source_Storage_storage_offset``, as records and
    places name it) makes values opwatch does not read (:data:`NEW_DATA`)."""
    namespace, _, rest = op.partition(".")
    return f"{namespace}::{rest.partition('.')[0]}" in NEW_DATA


class OpFacts:
    """What opwatch knows about one ``OpOverload``, worked out on first use.

    Attributes:
        schema_name: ``aten::div_``.
        name: the op's short name with in-place variants folded (``div``): the key of the
            per-op explanations.
        is_view: the op returns a view of an input.
        reads_to_host: the op reads device values on the host (or may: a copy, see ``is_copy``).
        is_copy: a copy, which reads to the host only from a device to the CPU.
        makes_new_data: its outputs are uninitialised memory (``empty*``), or memory whose values
            opwatch cannot know (``set_``).
        aliases_storage: of those, ``set_``: its output's bytes may be filled after it with no
            op (``torch.load`` of the legacy format reads the file into the storage then).
        is_lift: Python data entering torch (``lift_fresh``).
        is_factory: makes a tensor from nothing (``zeros``, ``arange``, ...).
        keeps_values: its output holds exactly its input's values (so it keeps its range).
        preserves_values: a view or an op that only moves or selects values.
        range_map: for those, how the output's range follows from the inputs' ranges:
            ``"same"`` (it holds all of one input's values), ``"neg"``, ``"abs"``,
            ``"with_zero"`` (and zeros), ``"within"`` (some of the inputs' values); else ``None``.
        needs_carrier: its unchecked outputs must be remembered weakly (see the nan/inf check).
        checked_outputs: how many leading outputs need the nan/inf reduction (``None``: all).
        is_masking: drops the values it does not select (``where``, ``masked_fill``).
        picks_indices: picks the indices of the largest or smallest values (``argmax``,
            ``topk``; ``max`` / ``min`` with a ``dim``, which return indices).
        is_grad_scaler_check: GradScaler's overflow check.
        is_fused_step: a fused optimizer's step (``FUSED_STEPS``).
        collective: its :class:`Collective`, or ``None``.
        is_collective: moves data between ranks (a c10d op or a functional collective).
        mutated_args: arguments written in place, as ``(position, name)``.
        written: where the one tensor the op writes sits among its tensor arguments as the
            checks get them (positional ones first, then keyword ones): 0 for an in-place op on
            ``self``, -1 for a single ``out=``; ``None`` for an op that writes none or several.
        source: for the ops of ``SOURCE_WRITES``, where the source whose values are written
            into ``self`` sits among the tensor arguments (counted from the end, negative,
            after a list of indices: ``index_put_``'s ``values`` is -1); ``None`` otherwise.
        accumulates: a pointwise op of ``ACCUMULATING`` writing in place or into ``out=``.
        takes_several_tensors: it can receive two or more tensors (a tensor list, or two
            tensor arguments): the mismatch checks need a pair.
    """

    __slots__ = (
        "schema_name", "name", "is_view", "reads_to_host", "is_copy", "makes_new_data", "is_lift",
        "is_factory", "keeps_values", "preserves_values", "range_map", "needs_carrier", "checked_outputs",
        "is_masking", "picks_indices", "is_grad_scaler_check", "is_fused_step", "collective", "is_collective", "mutated_args",
        "written", "source", "accumulates", "takes_several_tensors", "aliases_storage",
    )

    def __init__(self, func):
        schema = func._schema
        name = schema.name
        self.takes_several_tensors = _takes_several_tensors(schema)
        self.schema_name = name
        self.name = op_name(func)
        self.is_view = bool(getattr(func, "is_view", False))
        self.is_copy = name in COPIES
        self.reads_to_host = name in HOST_READS or self.is_copy
        self.makes_new_data = name in NEW_DATA
        self.aliases_storage = name in STORAGE_ALIASES
        self.is_lift = name in LIFTS
        self.is_factory = name in FACTORIES
        self.keeps_values = name in SAME_VALUES
        self.preserves_values = (self.is_view or name in VALUE_PRESERVING) and not self.makes_new_data
        self.range_map = None
        if self.preserves_values:
            self.range_map = "same" if self.keeps_values else RANGE_MAPS.get(name, "within")
        self.needs_carrier = self.preserves_values and (
            not self.is_view or (name, getattr(func, "_overloadname", "")) in UNLINKED_VIEWS
        )
        self.checked_outputs = 1 if name in PRIMARY_OUTPUT_ONLY else None
        self.is_masking = name in MASKING
        self.picks_indices = name in ARG_PICKS or (name in VALUE_PICKS and len(schema.returns) >= 2)
        self.is_grad_scaler_check = name == GRAD_SCALER_CHECK
        self.is_fused_step = name in FUSED_STEPS
        self.collective = collective_of(func)
        self.is_collective = self.collective is not None and self.collective.kind in (C10D, FUNCTIONAL)
        self.mutated_args = tuple(
            (position, arg.name)
            for position, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        self.written = _written_position(schema, self.mutated_args)
        self.source = _source_position(schema) if name in SOURCE_WRITES else None
        self.accumulates = name in ACCUMULATING and self.written is not None

    def __repr__(self) -> str:
        return f"<OpFacts {self.schema_name}>"


_FACTS: dict = {}  # OpOverload -> OpFacts (bounded: cleared past _LIMIT distinct ops)
_LIMIT = 4096


def facts_of(func) -> OpFacts:
    """The :class:`OpFacts` of an ``OpOverload`` (cached per op)."""
    known = _FACTS.get(func)
    if known is None:
        if len(_FACTS) > _LIMIT:
            _FACTS.clear()
        known = _FACTS[func] = OpFacts(func)
    return known


def _takes_several_tensors(schema) -> bool:
    count = 0
    for arg in schema.arguments:
        type_name = str(arg.type)
        if "Tensor" in type_name:
            if type_name not in ("Tensor", "Tensor?"):
                return True  # a tensor list
            count += 1
    return count >= 2


def _written_position(schema, mutated_args) -> int | None:
    if len(mutated_args) != 1:
        return None
    ((position, _name),) = mutated_args
    if position == 0:
        return 0
    return -1 if schema.arguments[position].kwarg_only else None


def _source_position(schema) -> int | None:
    """Where the argument named in ``SOURCE_NAMES`` sits among the tensor arguments as the
    checks get them (lists flattened, ``None`` optionals left out): from the start when only
    single tensors precede it, from the end when a list does and only single tensors follow."""
    before, after, source, listed = 0, 0, None, False
    for arg in schema.arguments:
        type_name = str(arg.type)
        if "Tensor" not in type_name:
            continue
        if source is None and arg.name in SOURCE_NAMES and type_name == "Tensor":
            source = arg
            continue
        if source is None:
            if type_name != "Tensor":
                listed = True  # a list or an optional: the positions after it move
            before += 1
        elif type_name == "Tensor":
            after += 1
        else:
            return None
    if source is None:
        return None
    return -(after + 1) if listed else before


def op_name(func) -> str:
    """``aten::div_`` -> ``div``: in-place variants share their op's name."""
    name = func._schema.name.split("::")[-1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") and not name.startswith("_") else name


# -- collectives ------------------------------------------------------------------------------

C10D = "c10d"  # returns a Work (with the tensors written, or alone)
FUNCTIONAL = "functional"  # returns tensors that the collective fills later
WAIT = "wait"  # _c10d_functional.wait_tensor: the collective behind its argument has completed
WRAP = "wrap"  # _c10d_functional._wrap_tensor_autograd: makes the AsyncCollectiveTensor

_FUNCTIONAL_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}
_C10D_WITHOUT_OUTPUT = {"send", "barrier", "monitored_barrier_"}
_C10D_NOT_COLLECTIVE = {"check_for_nan"}
_POINT_TO_POINT = {"send", "recv_", "recv_any_source_", "isend", "irecv", "batch_p2p_ops"}
# What the collective-mismatch check compares across ranks, where not every tensor argument:
_COMPARE_FIRST = {"scatter_"}  # the output; only the root passes inputs
_COMPARE_LAST = {"gather_"}  # the input; only the root passes outputs
_COMPARE_DTYPES = {"alltoall_", "alltoall_base_", "all_to_all_single"}  # split sizes may differ
_COMPARE_NOTHING = {"barrier", "monitored_barrier_"}  # the op alone

_collectives: dict = {}  # OpOverload -> Collective or None (a few dozen ops at most)


class Collective:
    """What opwatch needs to know about one collective ``OpOverload``, worked out once.

    Attributes:
        kind: ``C10D``, ``FUNCTIONAL``, ``WAIT`` or ``WRAP``.
        name: the op's name without namespace (``allreduce_``).
        writes_first: whether the tensors of its first argument are its outputs (c10d ops).
        group_arg: position of its ``process_group`` / ``group_name`` argument, or ``None``.
        compare: what the mismatch check compares across ranks: ``"all"``, ``"first"``,
            ``"last"``, ``"dtypes"``, ``"nothing"``; ``None`` for ops it does not compare
            (point to point, waits).
    """

    __slots__ = ("kind", "name", "writes_first", "group_arg", "compare")

    def __init__(self, kind, name, writes_first, group_arg, compare):
        self.kind = kind
        self.name = name
        self.writes_first = writes_first
        self.group_arg = group_arg
        self.compare = compare

    def __repr__(self) -> str:
        return f"<Collective {self.kind} {self.name}>"


def collective_of(func) -> Collective | None:
    """The :class:`Collective` of ``func``, or ``None`` for every other op (cached per op)."""
    try:
        return _collectives[func]
    except KeyError:
        pass
    except TypeError:  # not hashable: not an OpOverload
        return None
    found = _classify(func)
    if len(_collectives) > 4096:
        _collectives.clear()
    _collectives[func] = found
    return found


def _classify(func) -> Collective | None:
    namespace = getattr(func, "namespace", None)
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    name = schema.name.split("::")[-1]
    if namespace == "_dtensor" and name == "shard_dim_alltoall":
        namespace = "_c10d_functional"
    group_arg = next(
        (position for position, arg in enumerate(schema.arguments) if arg.name in ("process_group", "group_name")), None
    )
    if namespace == "c10d":
        if name in _C10D_NOT_COLLECTIVE:
            return None
        compare = None if name in _POINT_TO_POINT else _compare_rule(name)
        return Collective(C10D, name, name not in _C10D_WITHOUT_OUTPUT, group_arg, compare)
    if namespace in _FUNCTIONAL_NAMESPACES:
        if name == "wait_tensor":
            return Collective(WAIT, name, False, None, None)
        if name == "_wrap_tensor_autograd":
            return Collective(WRAP, name, False, None, None)
        compare = None if name in _POINT_TO_POINT else _compare_rule(name)
        return Collective(FUNCTIONAL, name, False, group_arg, compare)
    return None


def _compare_rule(name: str) -> str:
    if name in _COMPARE_FIRST:
        return "first"
    if name in _COMPARE_LAST:
        return "last"
    if name in _COMPARE_DTYPES:
        return "dtypes"
    if name in _COMPARE_NOTHING:
        return "nothing"
    return "all"


def is_collective_op(func) -> bool:
    """Whether ``func`` moves data between ranks (a c10d op or a functional collective; not
    ``wait_tensor`` or the ``AsyncCollectiveTensor`` wrapper)."""
    collective = collective_of(func)
    return collective is not None and collective.kind in (C10D, FUNCTIONAL)


