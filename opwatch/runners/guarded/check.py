"""The fused finiteness check of a healthy step: the tensors (and floats) it returned and the
parameters' gradients, one host read.

The check is :class:`opwatch.core.finite.FusedFiniteCheck` (GradScaler's kernel over the
gradients, given the largest magnitude of each returned tensor). A returned CPU scalar (the
usual loss) is read on the host instead: there a read waits for nothing and costs a few
microseconds, where a norm kernel right after a backward costs tens.
"""

from __future__ import annotations

import cmath
import math
import torch

from ...core.finite import CHECKED_DTYPES, FusedFiniteCheck, nonfinite_kind
from ...render.guard_facts import BadGrads, FailedElsewhere, NotFinite, Raised, Returned, Unnamed
from .ranks import local
from .snapshot import leaves
from ..step_verdict import CLIP, FUSED_PASS, scalars_finite

_Tensor = torch.Tensor
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

# What a runner does with a step whose gradients hold nan/inf: one option, the same words in
# guard(), python -m opwatch --guard and the trainers' guard modes.
ON_FAILURE = ("skip", "raise", "apply")


def on_failure_option(value, default: str) -> str:
    """``value`` checked (``None``: ``default``): one of :data:`ON_FAILURE`."""
    if value is None:
        return default
    if not isinstance(value, str) or value not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(map(repr, ON_FAILURE))}, got {value!r}")
    return value


class FiniteCheck:
    """Checks steps' results and gradients (:class:`opwatch.core.finite.FusedFiniteCheck`, its
    flags kept from call to call). ``scaler``: a GradScaler whose overflow steps are its
    business (gradients left unchecked). ``reductions``: a
    :class:`~opwatch.runners.step_verdict.StepReductions` whose clip norm, when it covers every
    gradient, stands for them (no pass over the gradients)."""

    def __init__(self, scaler=None, reductions=None):
        self._scaler = scaler
        self.reductions = reductions
        self.source = None  # what the last check read: "clip" or "fused pass" (step_verdict's names)
        self.tensors = FusedFiniteCheck()
        self.sharded = False  # the parameters are DTensors (FSDP2, tensor parallel): their local shards are read

    def all_finite(self, result, params) -> bool:
        """One fused check of the returned tensors and floats and of the gradients."""
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
            return self.tensors([], returned)
        # The gradients may be written back (unchanged) by the kernel; what the step returned
        # is the user's, never written.
        grads = [grad for param in params if (grad := param.grad) is not None]
        norm = self.reductions.norm_covering(grads) if self.reductions is not None and grads else None
        if norm is not None:  # the step's clip reduced every gradient to one norm: it stands for them
            self.source = CLIP
            return scalars_finite([*returned, norm.total], self.tensors)
        self.source = FUSED_PASS
        if self.sharded:  # each rank reads its own shard, no collective (the ranks agree after)
            return self.tensors([local(grad) for grad in grads], returned)
        return self.tensors(grads, returned)


__all__ = ["ON_FAILURE", "on_failure_option", "FiniteCheck", "not_finite", "kind_of", "Raised", "FailedElsewhere", "NotFinite"]


def not_finite(result, params, names) -> NotFinite:
    """The failure's facts (:mod:`opwatch.render.guard_facts`): a :class:`Returned` for each
    returned value that is not finite, a :class:`BadGrads` for each kind found in the
    gradients; ``names``: ``{id(param): name}`` (an unnamed parameter is an :class:`Unnamed`)."""
    returned = []
    by_kind: dict = {}
    with torch.no_grad():
        for path, value in leaves(result):
            kind = kind_of(value)
            if kind is not None:
                returned.append(Returned(kind, path, "float" if isinstance(value, float) else "tensor"))
        for position, param in enumerate(params):
            kind = kind_of(local(param.grad)) if param.grad is not None else None
            if kind is not None:
                meta = (tuple(param.shape), param.dtype, param.device, 0)
                by_kind.setdefault(kind, []).append(names.get(id(param)) or Unnamed(position, meta))
    return NotFinite("not_finite", tuple(returned), tuple(BadGrads(kind, tuple(found)) for kind, found in by_kind.items()))


def kind_of(value) -> str | None:
    """``"nan"``, ``"inf"`` or ``None`` for a returned float or tensor (anything else: ``None``)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else ("nan" if math.isnan(value) else "inf")
    return nonfinite_kind(value) if isinstance(value, _Tensor) else None
