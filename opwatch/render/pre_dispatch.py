"""Sentences of the pre-dispatch checks (:mod:`opwatch.checks.pre_dispatch`): rules
``pre_dispatch.device`` and ``pre_dispatch.dtype``.

Facts: ``function`` (``torch.stft``), ``argument`` and ``other`` (argument names; ``other`` is
``None`` for a rule on one tensor), ``requires`` (``same_device``, ``same_dtype``, ``cpu``,
``int64``), ``metas`` (the odd tensor's metadata first, then the other's).
"""

from __future__ import annotations

from ..core.notation import format_dtype, format_meta
from .rules import explains

__all__ = ["explain_pre_dispatch"]

_BEFORE = "torch checks this before any op of the call runs, and raises its own error"
_INSIDE = "torch raises its own error from inside the packing op, which the per-op checks cannot judge"

# function -> the likely fix, by what it requires.
_FIXES = {
    ("torch.stft", "same_device"): "make the window where the signal lives (torch.hann_window(n_fft, device=x.device)), or register it as a buffer of the module (self.register_buffer('window', ...)) so that model.to(...) moves it",
    ("F.conv1d", "same_dtype"): None,  # filled by _conv_fix
    ("pack_padded_sequence", "cpu"): "pass lengths.cpu() (or a list of ints): the lengths stay on the CPU even when the batch is on a GPU",
    ("F.one_hot", "int64"): "labels.long() where the labels are made (numpy int32 arrays and int32 data loaders are the usual source)",
    ("torch.isclose", "same_dtype"): "cast one side before comparing: torch.isclose(a, b.to(a.dtype))",
    ("torch.quantile", "same_device"): "make q like the input: torch.tensor(qs, dtype=x.dtype, device=x.device)",
    ("torch.quantile", "same_dtype"): "make q like the input: torch.tensor(qs, dtype=x.dtype, device=x.device)",
    ("torch.meshgrid", "same_device"): "move every tensor to one device before the call (t.to(first.device))",
    ("torch.meshgrid", "same_dtype"): "cast every tensor to one dtype before the call (t.to(first.dtype))",
}
# Functions that share another's fix.
_SAME_FIX = {
    "Tensor.stft": "torch.stft", "torch.istft": "torch.stft", "Tensor.istft": "torch.stft",
    "F.conv2d": "F.conv1d", "F.conv3d": "F.conv1d", "Tensor.isclose": "torch.isclose",
    "Tensor.quantile": "torch.quantile", "torch.nanquantile": "torch.quantile", "Tensor.nanquantile": "torch.quantile",
    "torch.cartesian_prod": "torch.meshgrid",
}


@explains("pre_dispatch.device", "pre_dispatch.dtype")
def explain_pre_dispatch(finding) -> tuple[str, str, str]:
    facts = finding.facts
    name, argument, other, requires = facts.function, facts.argument, facts.other, facts.requires
    odd, *others = facts.metas  # the odd argument's metadata, then its counterpart's if any
    base = next(iter(others), None)
    if requires == "cpu":
        problem = f"{name} gets {argument} {format_meta(odd)}: the lengths of a packed sequence must be a CPU tensor, whatever the device of the data"
        expected = f"{argument} on the CPU (a CPU tensor or a list of ints)"
    elif requires == "int64":
        problem = f"{name} gets {argument} {format_meta(odd)}: it takes int64 class indices only"
        expected = f"{argument} as int64 (i64)"
    elif requires == "same_device":
        problem = f"{name}'s {argument} {format_meta(odd)} is not on the device of its {other} {format_meta(base)}"
        expected = f"{argument} and {other} on one device ({base.device})"
    else:
        problem = f"{name}'s {argument} {format_meta(odd)} is not in the dtype of its {other} {format_meta(base)}"
        expected = f"{argument} and {other} in one dtype ({format_dtype(base.dtype)})"
    problem = f"{problem}; {_INSIDE if requires == 'cpu' else _BEFORE}."
    return problem, expected, _fix(name, requires, argument, odd, base)


def _fix(name, requires, argument, odd, base) -> str:
    key = (_SAME_FIX.get(name, name), requires)
    if key == ("F.conv1d", "same_dtype"):
        if argument == "bias":
            return f"cast the module or the parameters as a whole (module.to({format_dtype(base.dtype)})) rather than the bias alone"
        if not _is_floating(odd.dtype):
            return f"make the images floating point where they are made (images.to({format_dtype(base.dtype)}) / 255, or torchvision's ToImage + ToDtype(torch.float32, scale=True))"
        return f"cast the input where it is made (x.to({format_dtype(base.dtype)}), torch.from_numpy(a).float()) or the model (model.to(x.dtype))"
    fix = _FIXES.get(key)
    return fix if fix is not None else f"make {argument} as torch requires where it is made"


def _is_floating(dtype) -> bool:
    return format_dtype(dtype).startswith(("f", "bf"))

