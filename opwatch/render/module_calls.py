"""The sentences of the module-call rules (:mod:`opwatch.checks.module_calls`), with the error
text torch itself raises from inside the module, quoted.

Facts: ``module`` (the module's class name, ``LSTM``), ``input`` (the input's metadata), and

- ``module.rnn_input_device``: ``device`` (the parameters' device, a string);
- ``module.rnn_state_device``, ``module.rnn_state_dtype``: ``label`` (``h_0``, ``c_0``),
  ``state`` (the initial state's metadata);
- ``module.rnn_input_dtype``: ``weight_dtype``;
- ``module.conv_input_dtype``, ``module.conv_bias_dtype``: ``bias_dtype``, ``weight_dtype``
  (``None`` when the module has no weight tensor).
"""

from __future__ import annotations

import torch

from ..core.notation import format_dtype as _name
from ..core.notation import format_meta
from .device import meta_note
from .rules import explains

# How torch's convolution message names dtypes.
_CONV_TORCH_NAMES = {torch.float64: "double", torch.float32: "float", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}


def _device_sentences(name, what, tensor, whose, device, torch_says) -> tuple[str, str, str]:
    devices = [device, str(tensor.device)]
    return (
        f"{name}'s {what} {format_meta(tensor)} is not on {whose} device ({device}); "
        f"torch raises '{torch_says}' from inside nn.{name}.{meta_note(devices)}",
        f"the input, the initial state and the parameters on one device ({device})",
        f"create the {what} on {device!r} (device=x.device where it is made), or move the model with model.to(...)",
    )


@explains("module.rnn_input_device")
def explain_rnn_input_device(finding) -> tuple[str, str, str]:
    facts = finding.facts
    torch_says = "Input and parameter tensors are not at the same device"
    return _device_sentences(facts.module, "input", facts.input, "its parameters'", facts.device, torch_says)


@explains("module.rnn_state_device")
def explain_rnn_state_device(finding) -> tuple[str, str, str]:
    facts = finding.facts
    what = f"initial state {facts.label}"
    device = str(facts.input.device)
    torch_says = "Input and hidden tensors are not at the same device"
    return _device_sentences(facts.module, what, facts.state, "the input's", device, torch_says)


@explains("module.rnn_input_dtype")
def explain_rnn_input_dtype(finding) -> tuple[str, str, str]:
    facts = finding.facts
    data, weight = facts.input, facts.weight_dtype
    problem = (
        f"{facts.module} gets an input {format_meta(data)} for {_name(weight)} parameters; "
        f"torch raises 'RNN input dtype ({data.dtype}) does not match weight dtype ({weight})'"
    )
    return (
        problem,
        f"the input in the parameters' dtype ({_name(weight)})",
        f"cast the input where it is made (x.to({weight}), torch.from_numpy(a).float()) or the model (model.to(x.dtype))",
    )


@explains("module.rnn_state_dtype")
def explain_rnn_state_dtype(finding) -> tuple[str, str, str]:
    facts = finding.facts
    label, data = facts.label, facts.input
    problem = (
        f"{facts.module}'s initial state {label} {format_meta(facts.state)} has another dtype than its input "
        f"{format_meta(data)}; torch fails inside the recurrent kernel ('unsupported data type' "
        f"in oneDNN's LSTM, a matmul dtype error in GRU/RNN)"
    )
    return (
        problem,
        f"{label} in the input's dtype ({_name(data.dtype)})",
        f"make the state like the input: torch.zeros(..., dtype=x.dtype, device=x.device) or {label}.to(x.dtype)",
    )


def _conv_torch_says(facts) -> str:
    data, bias = facts.input.dtype, facts.bias_dtype
    names = _CONV_TORCH_NAMES
    return f"'Input type ({names.get(data, str(data))}) and bias type ({names.get(bias, str(bias))}) should be the same' before any op runs"


@explains("module.conv_bias_dtype")
def explain_conv_bias_dtype(finding) -> tuple[str, str, str]:
    facts = finding.facts
    bias, weight = facts.bias_dtype, facts.weight_dtype
    return (
        f"{facts.module}'s bias is {_name(bias)} but its weight and input are {_name(weight)}: "
        f"input {format_meta(facts.input)}; torch raises {_conv_torch_says(facts)}",
        f"weight, bias and input in one dtype ({_name(weight)})",
        f"cast the module as a whole (module.to({weight})) rather than its bias alone",
    )


@explains("module.conv_input_dtype")
def explain_conv_input_dtype(finding) -> tuple[str, str, str]:
    facts = finding.facts
    bias, weight = facts.bias_dtype, facts.weight_dtype
    params = _name(bias) if weight is None or weight == bias else f"{_name(weight)} weight, {_name(bias)} bias"
    return (
        f"{facts.module} gets an input {format_meta(facts.input)} for {params} parameters; "
        f"torch raises {_conv_torch_says(facts)}",
        f"the input in the parameters' dtype ({_name(bias)})",
        f"cast the input where it is made (images.to({bias}), torch.from_numpy(a).float()) or the model (model.to(images.dtype))",
    )
