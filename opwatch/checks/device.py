"""device_mismatch: tensor arguments of one op on different devices, caught before the kernel.

0-dim CPU tensors mix legally with any device as *inputs* (they are scalars) and are not flagged,
except where torch does not take them as scalars: ``torch.cat``/``stack`` need every tensor on
one device (rule ``device.joined``), and a 0-dim CPU tensor written in place (``total += x.sum()``
with ``total`` on the CPU, or an ``out=`` on the CPU) cannot take a result computed on another
device (rule ``device.scalar_written``; CUDA raises, ``meta`` lets it pass silently). CPU mixed
with ``meta`` is flagged even where torch lets it pass: it means a model was only half
materialised from meta init. Ops whose job is to move data between devices (copies) are exempt.

Advanced indexing (``x[idx]``, ``x[idx] = v``) takes index tensors on the CPU whatever the
device of ``x``; an index tensor on another *non-CPU* device than ``x`` is flagged (on CUDA
torch raises; with a ``meta`` index into a CPU tensor it silently returns garbage: a buffer
left on meta by ``load_state_dict(..., assign=True)``, which skips non-persistent buffers).

Composite modules that check their arguments in Python before any op runs (``nn.LSTM`` with its
initial state on another device) are judged by :mod:`opwatch.checks.module_calls`.

Findings hold facts only (a rule name per sentence family); their sentences are made in
:mod:`opwatch.render.device`, where each rule's facts are listed.
"""

from __future__ import annotations

from functools import partial

from ..core.records import M_DEVICE, M_SHAPE
from ..core.notation import as_meta
from ..core.ops import facts_of
from ..core.fact_tuples import RuleFacts, rule_facts
from .finding import Finding, tensor_names

__all__ = ["KIND", "DeviceIndex", "DeviceMix", "ScalarWritten", "for_op"]


@rule_facts("device.mix", "device.joined")
class DeviceMix(RuleFacts):
    devices: list  # the devices met, in order (``"cuda:0"``, ``"cpu"``)
    names: list  # the op's tensor arguments' names
    target: str  # the device the odd one out should move to


@rule_facts("device.index")
class DeviceIndex(RuleFacts):
    op: str  # the op's short name
    position: int  # which index (from 1)
    indexed: tuple  # the indexed tensor's metadata
    index: tuple  # the index tensor's


@rule_facts("device.scalar_written")
class ScalarWritten(RuleFacts):
    written: str  # the written 0-dim CPU tensor's argument name
    device: str  # the other operand's device
    names: list

KIND = "device_mismatch"

_CROSS_DEVICE_OPS = {
    "aten::copy_",
    "aten::copy",
    "aten::_copy_from",
    "aten::_copy_from_and_resize",
    "aten::_to_copy",
    "aten::to",
    "aten::set_",
    "aten::_has_same_storage_numel",
    "aten::_local_scalar_dense",
}
# Ops of packed sequences whose second tensor argument (``lengths``, ``batch_sizes``) lives on the
# CPU whatever the device of the data: a CPU one there is legal. (A ``lengths`` on the GPU is
# judged at the call of ``pack_padded_sequence`` by opwatch.checks.pre_dispatch.)
_PACKED_SEQUENCE_OPS = {
    "aten::_pack_padded_sequence", "aten::_pack_padded_sequence_backward", "aten::_pad_packed_sequence",
    "aten::lstm", "aten::gru", "aten::rnn_tanh", "aten::rnn_relu",
}
# Ops that join their tensors into one: every tensor on one device, 0-dim CPU ones included.
_JOINING_OPS = {"aten::cat", "aten::stack", "aten::_stack", "aten::concat", "aten::concatenate", "aten::hstack", "aten::vstack", "aten::dstack", "aten::column_stack"}
# In-place ops that read a 0-dim written tensor's new value from a host number (``Tensor.item()``):
# a device operand is legal there.
_SCALAR_VALUE_WRITES = {"aten::fill_"}
# Advanced indexing accepts CPU index tensors whatever the device of ``self``.
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::_unsafe_index", "aten::_unsafe_index_put"}


def for_op(func):
    """The check bound to ``func``, as ``check(tensors, context) -> Finding | None``; ``None``
    when it cannot fire on this op."""
    name = func._schema.name
    if name in _CROSS_DEVICE_OPS or not facts_of(func).takes_several_tensors:
        return None
    # foreach/fused optimizer kernels group their tensor lists by device themselves; nested
    # tensors carry metadata tensors (on meta or CPU) by design.
    op = name.split("::", 1)[-1]
    if op.startswith(("_foreach_", "_fused_", "_nested_")):
        return None
    if name in _PACKED_SEQUENCE_OPS and _sizes_second(func):
        return partial(_check_packed, func)
    if name in _INDEX_OPS:
        # Only the indexed tensor and the values written must agree; indices may live on CPU.
        return partial(_check_indexing, func, "put" in name)
    if name in _JOINING_OPS:
        return partial(_check_joined, func)
    written = facts_of(func).written
    if written is not None and name not in _SCALAR_VALUE_WRITES:
        return partial(_check_written, func, written)
    return partial(_check, func)


def _check_joined(func, tensors, context=None) -> Finding | None:
    """cat/stack: every tensor on one device, 0-dim CPU tensors counted."""
    if not tensors:
        return None
    device = tensors[0][M_DEVICE]
    for meta in tensors:
        if meta[M_DEVICE] != device:
            return _finding(func, tensors, rule="device.joined", scalars_count=True)
    return None


def _check_written(func, written, tensors, context=None) -> Finding | None:
    """An op writing one tensor: the plain check, and a 0-dim CPU tensor written with an
    operand on another device (legal as an input, not as the output)."""
    if len(tensors) < 2:
        return None
    target = tensors[written]
    if not target[M_SHAPE] and target[M_DEVICE].type == "cpu":
        for meta in tensors:
            if meta[M_DEVICE].type != "cpu":
                names = tensor_names(func, len(tensors))
                facts = ScalarWritten(written=names[written], device=str(meta[M_DEVICE]), names=names)
                return Finding(KIND, "device.scalar_written", facts, operands=tuple(tensors), odd=(target,))
    return _check(func, tensors)


def _check_packed(func, tensors, context=None) -> Finding | None:
    """A packed-sequence op: its CPU ``lengths``/``batch_sizes`` (the second tensor) left out."""
    if len(tensors) > 1 and tensors[1][M_DEVICE].type == "cpu":
        tensors = tensors[:1] + tensors[2:]
    return _check(func, tensors)


def _sizes_second(func) -> bool:
    """Whether the second tensor argument of ``func`` is ``lengths``/``batch_sizes`` (the
    ``.data`` overloads of the recurrent ops; not ``lstm.input``, whose second is ``hx``)."""
    names = [arg.name for arg in func._schema.arguments if "Tensor" in str(arg.type)]
    return len(names) > 1 and names[1] in ("lengths", "batch_sizes")


def _check_indexing(func, writes, tensors, context=None) -> Finding | None:
    if not tensors:
        return None
    device = tensors[0][M_DEVICE]
    for meta in tensors:
        if meta[M_DEVICE] != device:
            break
    else:
        return None  # all on one device: the common case
    # Indices may live on the CPU; the indexed tensor and the values written must agree.
    indices = tensors[1:-1] if writes else tensors[1:]
    for position, meta in enumerate(indices, 1):
        if meta[M_DEVICE] != device and meta[M_DEVICE].type != "cpu":
            facts = DeviceIndex(op=func._schema.name.split("::")[-1], position=position, indexed=as_meta(tensors[0]), index=as_meta(meta))
            return Finding(KIND, "device.index", facts, operands=tuple(tensors))
    return _check(func, (tensors[0], tensors[-1]) if writes else tensors[:1])


def _check(func, tensors, context=None) -> Finding | None:
    device = None
    for meta in tensors:
        other = meta[M_DEVICE]
        if other == device:
            continue
        if not meta[M_SHAPE] and other.type == "cpu":
            continue  # a 0-dim CPU tensor is a scalar: legal with any device
        if device is None:
            device = other
            continue
        return _finding(func, tensors)
    return None


def _finding(func, tensors, rule: str = "device.mix", scalars_count: bool = False) -> Finding:
    """The mix of ``tensors``' devices; 0-dim CPU tensors left out unless ``scalars_count``."""
    devices = []
    counts: dict = {}
    for meta in tensors:
        if scalars_count or meta[M_SHAPE] or meta[M_DEVICE].type != "cpu":
            if str(meta[M_DEVICE]) not in devices:
                devices.append(str(meta[M_DEVICE]))
            counts[meta[M_DEVICE]] = counts.get(meta[M_DEVICE], 0) + 1
    # The odd ones out: those off the most common device (every one of them in a tie).
    most = max(counts.values())
    majority = [device for device, count in counts.items() if count == most]
    odd = tuple(
        meta
        for meta in tensors
        if (scalars_count or meta[M_SHAPE] or meta[M_DEVICE].type != "cpu") and (len(majority) > 1 or meta[M_DEVICE] != majority[0])
    )
    facts = DeviceMix(devices=devices, names=tensor_names(func, len(tensors)), target=_target(devices, majority))
    return Finding(KIND, rule, facts, operands=tuple(tensors), odd=odd)


def _target(devices, majority) -> str:
    """The device the odd one out should move to: an accelerator over the CPU (a stray is
    usually a CPU tensor in a GPU model), the most common device otherwise."""
    accelerators = [device for device in devices if device not in ("cpu", "meta")]
    if accelerators:
        return accelerators[0]
    return str(majority[0])
