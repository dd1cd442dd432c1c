"""The fused finiteness check of a healthy step: the tensors (and floats) it returned and the
parameters' gradients, one host read.

The check GradScaler runs (``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1,
which writes every gradient back unchanged), given also the largest magnitude of each returned
tensor (``linalg_vector_norm(t, inf)``); a returned CPU scalar (the usual loss) is read on the
host instead, where a read costs no wait and a few microseconds against a kernel's tens. Where that kernel cannot take the tensors (several
devices; sparse, complex or meta gradients; a torch without it) the check runs one group per
device (one host read per device) from then on.
"""

from __future__ import annotations

import cmath
import math
from typing import NamedTuple

import torch

from ..compat import amp_non_finite_check, foreach_norm
from .snapshot import leaves

_Tensor = torch.Tensor
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
CHECKED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128})


class FiniteCheck:
    """Checks steps' results and gradients; keeps GradScaler's flag tensors from call to call.
    ``scaler``: a GradScaler whose overflow steps are its business (gradients left unchecked)."""

    def __init__(self, scaler=None):
        self._scaler = scaler
        self._flag_tensors: dict = {}  # device -> (found-inf flag, inverse scale)
        self._cpu_flags = self._flags(torch.device("cpu"))  # without a device object per call
        self._by_device = False  # the fused check could not take these tensors: one group per device

    def all_finite(self, result, params) -> bool:
        """One fused check of the returned tensors and floats and of the gradients."""
        # Right after a backward every line runs with cold caches (a torch call costs tens of
        # us): this path keeps to one kernel and one host read for a loss and its gradients.
        if type(result) in _PLAIN_TYPES:  # the common case: the loss
            if result.dtype not in CHECKED_DTYPES:
                returned = []
            elif result.is_cpu and result.numel() == 1:
                # A CPU scalar is read where it lies (no device to wait for).
                if not cmath.isfinite(result.item()):
                    return False
                returned = []
            else:
                returned = [result]
        else:
            returned = []
            for _, value in leaves(result):
                if isinstance(value, _Tensor):
                    if value.dtype in CHECKED_DTYPES:
                        returned.append(value)
                elif isinstance(value, float) and not math.isfinite(value):
                    return False
        # With GradScaler, scaled gradients overflow now and then by design: the scaler finds
        # it, skips the step and lowers its scale. Only what the step returned is checked.
        if self._scaler is not None and self._scaler.is_enabled():
            grads = []
        else:
            grads = [grad for param in params if (grad := param.grad) is not None]
            # GradScaler's kernel writes the values back: not into gradients that are part of
            # a graph (create_graph=True). Sparse and complex ones make it raise: see below.
            if any([grad.requires_grad for grad in grads]):
                returned += [grad for grad in grads if grad.requires_grad]
                grads = [grad for grad in grads if not grad.requires_grad]
        if not returned and not grads:
            return True
        if self._by_device:
            return _all_finite_by_device(returned + grads)
        try:
            # No grad mode to leave: the kernel writes only gradients that are not part of a
            # graph, and the returned tensors' largest magnitudes (nan and inf carry through)
            # are taken of detached views: new tensors, safe for the kernel to write.
            checked = grads + [torch.linalg.vector_norm(tensor.detach(), math.inf) for tensor in returned] if returned else grads
            first = checked[0]
            found, one = self._cpu_flags if first.is_cpu else self._flags(first.device)
            amp_non_finite_check(checked, found, one)
            if found.item() == 0:
                return True
            found.zero_()
            return False
        except (RuntimeError, NotImplementedError, TypeError):
            # Several devices; sparse, complex, meta or overlapping gradients; a torch without
            # the CPU kernel (values written before it raised were written back unchanged).
            with torch.no_grad():
                for found, _ in self._flag_tensors.values():
                    found.zero_()  # it may have been set before the kernel gave up
            self._by_device = True  # from now on: the model's tensors will not change kind
            return _all_finite_by_device(returned + grads)

    def _flags(self, device) -> tuple:
        """GradScaler's found-inf flag (kept at 0 between failures) and inverse scale (1) on
        ``device``, made on the first call."""
        flags = self._flag_tensors.get(device)
        if flags is None:
            flags = self._flag_tensors[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
        return flags


def _all_finite_by_device(tensors) -> bool:
    """The same check, one group per device: one host read per device."""
    by_device: dict = {}
    for tensor in tensors:
        if type(tensor) not in _PLAIN_TYPES or tensor.device.type == "meta":
            continue
        if tensor.layout != torch.strided:
            tensor = tensor._values() if tensor.is_sparse else tensor.values()  # COO; CSR, CSC, BSR
        if tensor.dtype in CHECKED_DTYPES:
            by_device.setdefault(tensor.device, []).append(tensor)
    founds = []
    with torch.no_grad():
        for device, group in by_device.items():
            norms = [norm.float().reshape(1) for norm in foreach_norm(group, math.inf)]
            founds.append(torch.cat(norms).amax())  # nan and inf carry through amax
    return all(math.isfinite(found.item()) for found in founds)


class Raised(NamedTuple):
    """A failure's facts when the step (or the op a repro runs) raised."""

    how: str  # "raised"
    error_type: str  # the exception's type name
    line: str  # the first line of its text


class NotFinite(NamedTuple):
    """A failure's facts when the check after the step found nan/inf (see :func:`not_finite`)."""

    how: str  # "not_finite"
    returned: tuple  # ((kind, path, type), ...)
    grads: tuple  # ((kind, (name, ...)), ...)


def not_finite(result, params, names) -> NotFinite:
    """The failure's facts: ``NotFinite("not_finite", ((kind, path, type), ...), ((kind, (name, ...)), ...))``
    (``path`` is ``"returned"`` for the returned value itself, ``type`` ``"tensor"`` or ``"float"``);
    ``names``: ``{id(param): name}`` (an unnamed parameter is ``(position, meta)``)."""
    returned = []
    by_kind: dict = {}
    with torch.no_grad():
        for path, value in leaves(result):
            kind = kind_of(value)
            if kind is not None:
                returned.append((kind, path, "float" if isinstance(value, float) else "tensor"))
        for position, param in enumerate(params):
            kind = kind_of(param.grad) if param.grad is not None else None
            if kind is not None:
                meta = (tuple(param.shape), param.dtype, param.device, 0)
                by_kind.setdefault(kind, []).append(names.get(id(param)) or (position, meta))
    return NotFinite("not_finite", tuple(returned), tuple((kind, tuple(found)) for kind, found in by_kind.items()))


def kind_of(value) -> str | None:
    if isinstance(value, float):
        return None if math.isfinite(value) else ("nan" if math.isnan(value) else "inf")
    if not isinstance(value, _Tensor) or value.dtype not in CHECKED_DTYPES or value.device.type == "meta":
        return None
    if value.is_sparse:
        value = value._values()
    if bool(torch.isnan(value).any()):
        return "nan"
    if bool(torch.isinf(value).any()):
        return "inf"
    return None
