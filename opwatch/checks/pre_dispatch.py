"""Torch functions that reject a device or a dtype before any ATen op reaches a dispatch mode.

Some torch functions compare their tensor arguments in C++ (a composite kernel) or in Python
before the first op is dispatched, or inside a kernel whose rule the per-op checks cannot know
(the ``lengths`` of a packed sequence must be on the CPU although the data is on the GPU). The
user gets torch's own error, and the per-op checks see nothing or nothing odd. This module
judges those calls from their Python arguments, as metadata, for the private
``TorchFunctionMode`` of :mod:`opwatch.modes.functions`.

The table (:func:`table`) was found by ``tools/find_pre_dispatch_checks.py`` (torch's OpInfo
samples with one tensor moved to ``meta`` or cast, under a dispatch mode that records whether
the error came from inside a dispatched op), on torch 2.13:

==================================================  ==================================================
function                                            what torch requires before dispatching
==================================================  ==================================================
``torch.stft``, ``torch.istft`` (and the methods)   ``window`` on the input's device
``F.conv1d`` / ``conv2d`` / ``conv3d`` with a bias  the input in the bias's dtype (an integer image!)
``nn.utils.rnn.pack_padded_sequence``               ``lengths`` on the CPU (any integer dtype)
``F.one_hot``                                       an int64 tensor
``torch.isclose`` (and the method)                  both tensors in one dtype
``torch.quantile`` / ``nanquantile``                a tensor ``q`` in the input's dtype and device
``torch.meshgrid`` / ``torch.cartesian_prod``       every tensor in one dtype and on one device
==================================================  ==================================================

Each judge returns a :class:`~opwatch.checks.finding.Finding` of rule ``"pre_dispatch.device"``
or ``"pre_dispatch.dtype"`` whose facts are: ``function`` (its public name), ``argument`` and
``other`` (the names of the odd tensor argument and of the one it is judged against, ``other``
``None`` for a rule on one tensor), ``requires`` (``"same_device"``, ``"same_dtype"``,
``"cpu"``, ``"int64"``) and ``metas`` (the two tensors' metadata, the odd one first). Inside
``torch.autocast``, the dtype mixes autocast makes legal are left alone, as in the per-op checks.

A call through torch's own ``nn.Conv*d`` module with a floating input is judged by
:mod:`~opwatch.checks.module_calls` at the module call already: :func:`judge` is told whether
the caller is such a forward and leaves it alone (an integer input is judged here: the
module-call check looks at floating mixes only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.compat import pack_padded_sequence_function
from ..core.records import M_DTYPE
from . import device as device_check
from . import dtype as dtype_check
from ..core.fact_tuples import RuleFacts, rule_facts
from ..core.notation import as_meta
from .finding import Finding

# The check's name in ``watch(checks=...)``. On by default (checks.DEFAULT_CHECK_NAMES): it
# enters a TorchFunctionMode, and torch then sends every torch function call and tensor
# attribute read of the program through Python, 4-6% of a watched step (bench.pre_dispatch),
# about what any function mode costs there.
NAME = "pre_dispatch"

__all__ = ["table", "judge", "DEVICE_RULE", "DTYPE_RULE", "PreDispatch"]

DEVICE_RULE = "pre_dispatch.device"
DTYPE_RULE = "pre_dispatch.dtype"


@rule_facts(DEVICE_RULE, DTYPE_RULE)
class PreDispatch(RuleFacts):
    function: str  # the public function's name
    argument: str  # the odd argument's name
    other: str | None  # the argument it disagrees with
    requires: object  # what the odd argument must be (a device or dtype)
    metas: tuple  # the odd argument's metadata, then the other's

# Names of torch's own module methods that call a function of the table and whose module call
# module_calls judges already (floating input against a conv's bias).
_JUDGED_AT_MODULE_CALL = frozenset({"_conv_forward"})

_TABLE: dict | None = None


def table() -> dict:
    """function object -> ``(public name, judge(args, kwargs) -> Finding | None)``, built once."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _build()
    return _TABLE


def judge(entry, args: tuple, kwargs: dict, caller_name: str = "") -> Finding | None:
    """The finding of one call of a table function (``entry`` its value in :func:`table`), or
    ``None``; ``caller_name``: the name of the calling function's code (see the module doc)."""
    name, rule = entry
    finding = rule(name, args, kwargs)
    if finding is not None and caller_name in _JUDGED_AT_MODULE_CALL:
        (odd,) = finding.odd
        if odd[M_DTYPE].is_floating_point:
            return None
    return finding


def _build() -> dict:
    entries = {
        torch.stft: ("torch.stft", _window_device),
        torch.Tensor.stft: ("Tensor.stft", _window_device),
        torch.istft: ("torch.istft", _window_device),
        torch.Tensor.istft: ("Tensor.istft", _window_device),
        torch.conv1d: ("F.conv1d", _conv_bias_dtype),
        torch.conv2d: ("F.conv2d", _conv_bias_dtype),
        torch.conv3d: ("F.conv3d", _conv_bias_dtype),
        F.one_hot: ("F.one_hot", _one_hot_dtype),
        torch.isclose: ("torch.isclose", _same_dtype_pair),
        torch.Tensor.isclose: ("Tensor.isclose", _same_dtype_pair),
        torch.quantile: ("torch.quantile", _quantile_q),
        torch.Tensor.quantile: ("Tensor.quantile", _quantile_q),
        torch.nanquantile: ("torch.nanquantile", _quantile_q),
        torch.Tensor.nanquantile: ("Tensor.nanquantile", _quantile_q),
        torch.meshgrid: ("torch.meshgrid", _all_alike),
        torch.cartesian_prod: ("torch.cartesian_prod", _all_alike),
    }
    packing = pack_padded_sequence_function()
    if packing is not None:
        entries[packing] = ("pack_padded_sequence", _lengths_on_cpu)
    return entries


# -- reading the arguments ------------------------------------------------------------------------


def _get(args, kwargs, position: int, name: str):
    if position < len(args):
        return args[position]
    return kwargs.get(name)


def _meta(tensor) -> tuple:
    """The plain metadata tuple a log entry holds (the function mode logs the call with it)."""
    return (tuple(tensor.shape), tensor.dtype, tensor.device, id(tensor))


def _finding(rule, name, argument, odd, other_name, other, requires) -> Finding:
    kind = device_check.KIND if rule == DEVICE_RULE else dtype_check.KIND
    odd_meta = _meta(odd)
    metas = (odd_meta,) if other is None else (odd_meta, _meta(other))
    facts = PreDispatch(function=name, argument=argument, other=other_name, requires=requires, metas=tuple(map(as_meta, metas)))
    return Finding(kind, rule, facts, operands=metas, odd=(odd_meta,))


def _dtype_mix(a, b) -> bool:
    """Whether ``a`` and ``b`` differ in dtype in a way autocast does not make legal."""
    if a.dtype == b.dtype:
        return False
    if a.dtype.is_floating_point and b.dtype.is_floating_point:
        return not dtype_check.autocast_allows((a.dtype, b.dtype), a.device)
    return True


# -- the judges: (name, args, kwargs) -> Finding | None ---------------------------------------------


def _window_device(name, args, kwargs):
    data, window = _get(args, kwargs, 0, "input"), _get(args, kwargs, 4, "window")
    if isinstance(data, torch.Tensor) and isinstance(window, torch.Tensor) and window.device != data.device:
        return _finding(DEVICE_RULE, name, "window", window, "input", data, "same_device")
    return None


def _conv_bias_dtype(name, args, kwargs):
    data, weight, bias = _get(args, kwargs, 0, "input"), _get(args, kwargs, 1, "weight"), _get(args, kwargs, 2, "bias")
    if not (isinstance(data, torch.Tensor) and isinstance(bias, torch.Tensor)) or not _dtype_mix(data, bias):
        return None
    if isinstance(weight, torch.Tensor) and weight.dtype == data.dtype:
        return _finding(DTYPE_RULE, name, "bias", bias, "weight", weight, "same_dtype")  # the bias cast alone
    return _finding(DTYPE_RULE, name, "input", data, "bias", bias, "same_dtype")


def _lengths_on_cpu(name, args, kwargs):
    lengths = _get(args, kwargs, 1, "lengths")
    if isinstance(lengths, torch.Tensor) and lengths.device.type != "cpu":
        data = _get(args, kwargs, 0, "input")
        other = data if isinstance(data, torch.Tensor) else None
        return _finding(DEVICE_RULE, name, "lengths", lengths, "input" if other is not None else None, other, "cpu")
    return None


def _one_hot_dtype(name, args, kwargs):
    data = _get(args, kwargs, 0, "tensor")
    if isinstance(data, torch.Tensor) and data.dtype != torch.int64:
        return _finding(DTYPE_RULE, name, "tensor", data, None, None, "int64")
    return None


def _same_dtype_pair(name, args, kwargs):
    data, other = _get(args, kwargs, 0, "input"), _get(args, kwargs, 1, "other")
    if isinstance(data, torch.Tensor) and isinstance(other, torch.Tensor) and data.dtype != other.dtype:
        return _finding(DTYPE_RULE, name, "other", other, "input", data, "same_dtype")
    return None


def _quantile_q(name, args, kwargs):
    data, q = _get(args, kwargs, 0, "input"), _get(args, kwargs, 1, "q")
    if not (isinstance(data, torch.Tensor) and isinstance(q, torch.Tensor)):
        return None
    if q.device != data.device:
        return _finding(DEVICE_RULE, name, "q", q, "input", data, "same_device")
    if q.dtype != data.dtype:
        return _finding(DTYPE_RULE, name, "q", q, "input", data, "same_dtype")
    return None


def _all_alike(name, args, kwargs):
    tensors = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if len(tensors) < 2:
        return None
    first = tensors[0]
    for position, tensor in enumerate(tensors[1:], start=1):
        if tensor.device != first.device:
            return _finding(DEVICE_RULE, name, f"tensors[{position}]", tensor, "tensors[0]", first, "same_device")
    for position, tensor in enumerate(tensors[1:], start=1):
        if tensor.dtype != first.dtype:
            return _finding(DTYPE_RULE, name, f"tensors[{position}]", tensor, "tensors[0]", first, "same_dtype")
    return None
