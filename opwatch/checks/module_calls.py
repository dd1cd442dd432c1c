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
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ..notation import format_dtype as _name
from ..notation import format_meta
from . import device as device_check
from . import dtype as dtype_check
from .finding import Finding, text_finding

__all__ = ["check_call"]

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


def _meta(tensor) -> tuple:
    return (tuple(tensor.shape), tensor.dtype, tensor.device, id(tensor))


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
    name = type(module).__name__
    if weight is not None and data.device != weight.device:
        return _device_finding(name, "input", data, "its parameters'", weight, "Input and parameter tensors are not at the same device")
    for label, state in states:
        if state.device != data.device:
            return _device_finding(name, f"initial state {label}", state, "the input's", data, "Input and hidden tensors are not at the same device")
    if weight is not None and _floating_mix(data, weight):
        return text_finding(
            kind=dtype_check.KIND,
            problem=(
                f"{name} gets an input {format_meta(_meta(data))} for {_name(weight.dtype)} parameters; "
                f"torch raises 'RNN input dtype ({data.dtype}) does not match weight dtype ({weight.dtype})'"
            ),
            expected=f"the input in the parameters' dtype ({_name(weight.dtype)})",
            fix=f"cast the input where it is made (x.to({weight.dtype}), torch.from_numpy(a).float()) or the model (model.to(x.dtype))",
        )
    for label, state in states:
        if _floating_mix(state, data):
            return text_finding(
                kind=dtype_check.KIND,
                problem=(
                    f"{name}'s initial state {label} {format_meta(_meta(state))} has another dtype than its input "
                    f"{format_meta(_meta(data))}; torch fails inside the recurrent kernel ('unsupported data type' "
                    f"in oneDNN's LSTM, a matmul dtype error in GRU/RNN)"
                ),
                expected=f"{label} in the input's dtype ({_name(data.dtype)})",
                fix=f"make the state like the input: torch.zeros(..., dtype=x.dtype, device=x.device) or {label}.to(x.dtype)",
            )
    return None


def _states(hx) -> list:
    if isinstance(hx, torch.Tensor):
        return [("h_0", hx)]
    if isinstance(hx, (tuple, list)):
        return [(label, state) for label, state in zip(("h_0", "c_0"), hx) if isinstance(state, torch.Tensor)]
    return []


def _device_finding(name, what, tensor, whose, other, torch_says) -> Finding:
    devices = [str(other.device), str(tensor.device)]
    return text_finding(
        kind=device_check.KIND,
        problem=(
            f"{name}'s {what} {format_meta(_meta(tensor))} is not on {whose} device ({other.device}); "
            f"torch raises '{torch_says}' from inside nn.{name}.{device_check.meta_note(devices)}"
        ),
        expected=f"the input, the initial state and the parameters on one device ({other.device})",
        fix=f"create the {what} on {str(other.device)!r} (device=x.device where it is made), or move the model with model.to(...)",
    )


# -- convolutions ----------------------------------------------------------------------------------


def _check_conv(module, args) -> Finding | None:
    data = args[0]
    bias = getattr(module, "bias", None)
    if not isinstance(data, torch.Tensor) or not isinstance(bias, torch.Tensor):
        return None
    if not _floating_mix(data, bias):
        return None
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    torch_says = f"'Input type ({_torch_name(data.dtype)}) and bias type ({_torch_name(bias.dtype)}) should be the same' before any op runs"
    if isinstance(weight, torch.Tensor) and weight.dtype == data.dtype:
        # The module's own parameters disagree: its bias was cast on its own.
        return text_finding(
            kind=dtype_check.KIND,
            problem=f"{name}'s bias is {_name(bias.dtype)} but its weight and input are {_name(weight.dtype)}: input {format_meta(_meta(data))}; torch raises {torch_says}",
            expected=f"weight, bias and input in one dtype ({_name(weight.dtype)})",
            fix=f"cast the module as a whole (module.to({weight.dtype})) rather than its bias alone",
        )
    params = _name(bias.dtype) if weight is None or weight.dtype == bias.dtype else f"{_name(weight.dtype)} weight, {_name(bias.dtype)} bias"
    return text_finding(
        kind=dtype_check.KIND,
        problem=f"{name} gets an input {format_meta(_meta(data))} for {params} parameters; torch raises {torch_says}",
        expected=f"the input in the parameters' dtype ({_name(bias.dtype)})",
        fix=f"cast the input where it is made (images.to({bias.dtype}), torch.from_numpy(a).float()) or the model (model.to(images.dtype))",
    )


def _torch_name(dtype) -> str:
    return {torch.float64: "double", torch.float32: "float", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}.get(dtype, str(dtype))
