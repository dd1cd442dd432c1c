"""Module calls whose forward checks its arguments in Python before any op reaches a dispatch
mode, judged when the module is called.

Some of torch's own modules raise from Python (or from a composite op) before the first ATen op
runs, so no per-op check ever sees the tensors, and torch's message points inside torch:

- ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: the input on another device than the parameters, or the
  initial state (``h_0``, ``c_0``) on another device or of another floating dtype than the
  input (torch says "Input and hidden tensors are not at the same device", or fails inside
  oneDNN with "unsupported data type"), or the input of another floating dtype than the
  parameters;
- ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` with a bias: the input of another floating dtype
  than the bias, typically a float64 image from numpy (torch says "Input type (double) and bias
  type (float) should be the same" before any op runs). Without a bias the mismatch reaches
  ``aten.convolution``, where the per-op dtype check sees it.

Only modules whose ``forward`` is torch's own are judged: a subclass with a forward of its own
may cast its input first. Inside ``torch.autocast``, float32 with the autocast dtype is legal,
as in the per-op checks. :func:`check_call` is a pure function of the module and its positional
arguments (keyword arguments do not reach a forward pre-hook), cheap for every other module: one
dict lookup by type.

Findings hold facts only (a rule name per sentence family); their sentences are made in
:mod:`opwatch.render.module_calls`, where each rule's facts are listed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from . import device as device_check
from . import dtype as dtype_check
from ..core.compat import module_class_name
from ..core.fact_tuples import RuleFacts, rule_facts
from ..core.notation import TensorMeta
from .finding import Finding

__all__ = ["check_call", "ConvCall", "RnnCall"]


@rule_facts("module.rnn_input_device", "module.rnn_state_device", "module.rnn_input_dtype", "module.rnn_state_dtype")
class RnnCall(RuleFacts):
    module: str  # the module's class name
    input: tuple  # the input's metadata
    device: str | None = None  # the weights' device, when the input is elsewhere
    label: str | None = None  # the odd state (``h_0``, ``c_0``)
    state: tuple | None = None  # its metadata
    weight_dtype: object = None  # the weights' dtype, when the input has another


@rule_facts("module.conv_input_dtype", "module.conv_bias_dtype")
class ConvCall(RuleFacts):
    module: str
    input: tuple
    bias_dtype: object
    weight_dtype: object  # None when the module has no weight tensor

_RNN_FORWARDS = {nn.LSTM.forward, nn.GRU.forward, nn.RNN.forward}
_CONV_FORWARDS = {nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward}
# type(module) -> its rule, or None; bounded (a program makes few module classes).
_RULES: dict = {}
_RULES_LIMIT = 1024


def check_call(module: nn.Module, args: tuple) -> Finding | None:
    """The anomaly of calling ``module`` with the positional ``args``, or ``None``."""
    cls = type(module)
    rule = _RULES.get(cls, _RULES)
    if rule is _RULES:
        if len(_RULES) >= _RULES_LIMIT:
            _RULES.clear()
        rule = _RULES[cls] = _rule_for(cls)
    if rule is None or not args:
        return None
    return rule(module, args)


def _rule_for(cls):
    forward = getattr(cls, "forward", None)
    if forward in _RNN_FORWARDS:
        return _check_rnn
    if forward in _CONV_FORWARDS:
        return _check_conv
    return None


def _meta(tensor) -> TensorMeta:
    return TensorMeta(tuple(tensor.shape), tensor.dtype, tensor.device, id(tensor))


def _floating_mix(a, b) -> bool:
    """Whether floating tensors ``a`` and ``b`` have different dtypes that autocast does not make."""
    if a.dtype == b.dtype or not (a.dtype.is_floating_point and b.dtype.is_floating_point):
        return False
    return not dtype_check.autocast_allows((a.dtype, b.dtype), a.device)


# -- recurrent layers ----------------------------------------------------------------------------


def _check_rnn(module, args) -> Finding | None:
    data = args[0]
    if isinstance(data, PackedSequence):
        data = data.data
    if not isinstance(data, torch.Tensor):
        return None
    weights = getattr(module, "_flat_weights", None) or list(module.parameters())
    weight = next((w for w in weights if isinstance(w, torch.Tensor)), None)
    states = _states(args[1] if len(args) > 1 else None)
    facts = RnnCall(module=module_class_name(module), input=_meta(data))
    if weight is not None and data.device != weight.device:
        return Finding(device_check.KIND, "module.rnn_input_device", facts.replace(device=str(weight.device)))
    for label, state in states:
        if state.device != data.device:
            return Finding(device_check.KIND, "module.rnn_state_device", facts.replace(label=label, state=_meta(state)))
    if weight is not None and _floating_mix(data, weight):
        return Finding(dtype_check.KIND, "module.rnn_input_dtype", facts.replace(weight_dtype=weight.dtype))
    for label, state in states:
        if _floating_mix(state, data):
            return Finding(dtype_check.KIND, "module.rnn_state_dtype", facts.replace(label=label, state=_meta(state)))
    return None


def _states(hx) -> list:
    if isinstance(hx, torch.Tensor):
        return [("h_0", hx)]
    if isinstance(hx, (tuple, list)):
        return [(label, state) for label, state in zip(("h_0", "c_0"), hx) if isinstance(state, torch.Tensor)]
    return []


# -- convolutions ----------------------------------------------------------------------------------


def _check_conv(module, args) -> Finding | None:
    data = args[0]
    bias = getattr(module, "bias", None)
    if not isinstance(data, torch.Tensor) or not isinstance(bias, torch.Tensor):
        return None
    if not _floating_mix(data, bias):
        return None
    weight = getattr(module, "weight", None)
    weight_dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
    facts = ConvCall(module=module_class_name(module), input=_meta(data), bias_dtype=bias.dtype, weight_dtype=weight_dtype)
    if weight_dtype == data.dtype:
        # The module's own parameters disagree: its bias was cast on its own.
        return Finding(dtype_check.KIND, "module.conv_bias_dtype", facts)
    return Finding(dtype_check.KIND, "module.conv_input_dtype", facts)
