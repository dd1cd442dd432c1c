"""What the model returned with gradients off: an evaluation pass (``torch.no_grad()``,
``torch.inference_mode()``), which no optimizer step's check ever sees.

A validation set with one corrupted record makes ``val loss nan`` at every evaluation while
training goes on healthy: no gradient holds it. The leave-on runner hooks the model's forward
(the same model its batch hook watches, after the first audit) and, for each call with
gradients off outside an audit, keeps the (min, max) of each floating tensor the call returned
and of each floating argument it took, left on their device: one reduction each, no host read,
no reference to the tensors. The next optimizer step's check (or the run's end) reads them all
at once (one host read per device; every 4096 calls in a long pass) and tells each call whose
output held **nan**, with what its
batch held: nan/inf in an argument came in with the batch, finite arguments mean the
model made it. An output holding only inf is not told: a ``-inf`` logit is a mask's, on purpose.
A model that takes nan on purpose and returns finite values is never told.
"""

from __future__ import annotations

import sys
import warnings
from typing import NamedTuple

import torch

from ..core.compat import no_python_dispatch, run_uncompiled
from ..core.finite import extremes_kind, extremes_on_device, tensors_in
from ..core.sites import file_line, position_of, user_frame
from ..findings.anomaly import OpwatchWarning
from ..render import leave_on as words
from .batches import floating_arguments, hooked_module, model_name, named_argument

__all__ = ["EvaluationCalls", "EvaluationNan"]

_MAX_KEPT = 4096  # calls kept between two reads; then they are read at once (a long pass, generation's many calls)


class EvaluationNan(NamedTuple):
    """A call with gradients off whose output held nan."""

    model: str  # the model's class name
    where: str | None  # file:line of the call
    filename: str | None  # the call's file and line, where its warning points
    lineno: int | None
    argument: tuple | None  # (name, dtype, shape, device) of the first argument that held nan/inf, or None
    kind: str | None  # what that argument held: "nan" or "inf", or None (finite arguments)
    after_step: int  # the optimizer steps run before it


class EvaluationCalls:
    """A forward hook on the model alone and the extremes it keeps of each call with gradients
    off (outside an audit: ``auditing``, a callable, says when the watch judges every op;
    ``steps``, a callable, how many optimizer steps ran before the call; ``full``, a callable
    that reads the kept calls, called when they reach the most kept between two reads)."""

    def __init__(self, auditing, steps, full) -> None:
        self._auditing = auditing
        self._steps = steps  # a callable: the optimizer steps run so far
        self._full = full  # a callable: read the kept calls now (the runner's read, which tells them)
        self._hook = None
        self._kept: list = []  # (model's class name, (code, offset), [output extremes], [(argument, extremes)], step)

    def watch(self, model) -> None:
        """Hook ``model`` (the one the batch hook watches: its :func:`~.batches.hooked_module`); once."""
        if self._hook is None:
            self._hook = hooked_module(model).register_forward_hook(run_uncompiled(self._returned), with_kwargs=True)

    def unwatch(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook = None

    @property
    def pending(self) -> bool:
        """Calls kept and not read yet."""
        return bool(self._kept)

    def _returned(self, module, args, kwargs, output) -> None:
        if torch.is_grad_enabled() or self._auditing():
            return
        try:
            self._keep(module, args, kwargs, output)
        except Exception as error:  # opwatch's problem, not the program's: told once, the check stops
            self.unwatch()
            warnings.warn(OpwatchWarning(words.evaluation_check_failed(type(error).__name__, str(error))), stacklevel=2)

    def _keep(self, module, args, kwargs, output) -> None:
        if len(self._kept) >= _MAX_KEPT:
            self._full()  # one host read per this many calls, memory bounded
        with no_python_dispatch():  # (gradients are off already)
            returned = [found for tensor in tensors_in(output) if (found := extremes_on_device(tensor)) is not None]
            if not returned:
                return  # nothing floating came back (token ids): nothing to tell
            taken = [(named_argument(name, tensor), found) for name, tensor in floating_arguments(args, kwargs)
                     if (found := extremes_on_device(tensor)) is not None]
        code, lasti, _ = user_frame(sys._getframe(2))
        self._kept.append((model_name(module), (code, lasti), returned, taken, self._steps()))

    def read(self) -> list[EvaluationNan]:
        """The kept calls whose output held nan, in order (one host read per device), and
        forget them all."""
        kept, self._kept = self._kept, []
        if not kept:
            return []
        values = _read_all([found for _, _, returned, taken, _ in kept for found in (*returned, *(found for _, found in taken))])
        told = []
        for model, site, returned, taken, step in kept:
            outputs = [extremes_kind(next(values)) for _ in returned]
            arguments = [(name, extremes_kind(next(values))) for name, _ in taken]
            if "nan" in outputs:
                argument, kind = next(((name, held) for name, held in arguments if held is not None), (None, None))
                code, offset = site
                position = None if code is None else position_of(code, offset)
                told.append(EvaluationNan(model, file_line(*site), position and position.filename, position and position.lineno,
                                          argument, kind, step))
        return told


def _read_all(extremes: list):
    """Each ``(min, max)`` pair of ``extremes`` read to the host, in order: one read per device
    and dtype (stacked as they are: no conversion kernel per pair)."""
    groups: dict = {}
    for position, pair in enumerate(extremes):
        groups.setdefault((pair.device, pair.dtype), []).append(position)
    read = [None] * len(extremes)
    with torch.no_grad(), no_python_dispatch():
        for positions in groups.values():
            pairs = torch.stack([extremes[position] for position in positions]).tolist()
            for position, pair in zip(positions, pairs):
                read[position] = pair
    return iter(read)
