"""What a guarded step fed its model, read only when the step fails: a batch that held nan/inf
before any op of the model ran is the step's cause (``input``), named with the line that fed it.
What the model returned, kept by weak reference, says where a finite batch's failure began
(:meth:`FedBatches.output_kind`): in the model's forward, after it, or in the backward.

The leave-on runner (``python -m opwatch --guard``, the trainers' guard mode) watches the model
this way after its first audit; nothing here reads a value on a healthy step."""

from __future__ import annotations

import sys
import weakref
from typing import NamedTuple

import torch

from ..core.compat import compiled_module_inner, module_class_name, no_python_dispatch, run_uncompiled, version_counter
from ..core.finite import extremes_kind, extremes_on_device, nonfinite_kind, tensors_in
from ..core.sites import file_line, user_frame
from ..session.optimizer_steps import optimizer_parameters

__all__ = ["FedBatches", "FedInput", "floating_arguments", "hooked_module", "model_name", "named_argument"]

# The model's earlier calls kept between two optimizer steps (accumulated micro-batches); the
# calls past it are not read (as the losses kept then, ``leave_on._MAX_LOSSES``).
_MAX_EARLIER_CALLS = 64
# The model's floating outputs followed (weak references) for a failed step: its logits, its loss.
_MAX_OUTPUTS = 8


class FedInput(NamedTuple):
    """A call of the model whose arguments held nan/inf when they entered it."""

    model: str  # the model's class name
    argument: tuple  # (name, dtype, shape, device)
    kind: str  # "nan" or "inf"
    where: str | None  # file:line of the call
    call: tuple | None  # (its number, the calls since the last optimizer step), or None for one call

    def facts(self) -> dict:
        """Plain JSON facts, for another rank (:meth:`from_facts`)."""
        name, dtype, shape, device = self.argument
        return {"model": self.model, "argument": [name, str(dtype).removeprefix("torch."), list(shape), device],
                "kind": self.kind, "where": self.where, "call": list(self.call) if self.call else None}

    @classmethod
    def from_facts(cls, facts: dict) -> FedInput:
        name, dtype, shape, device = facts["argument"]
        call = facts.get("call")
        return cls(facts["model"], (name, getattr(torch, dtype, dtype), tuple(shape), device), facts["kind"], facts.get("where"),
                   tuple(call) if call else None)


class FedBatches:
    """A forward pre-hook on the model alone (never a global one) and what it keeps of each call
    outside an audit since the last optimizer step: a reference (no copy) to the latest call's
    arguments and where it was made, and, for the calls before it (a step that accumulates
    gradients over micro-batches), their floating arguments' (min, max) left on their device,
    taken when the next call comes: one reduction per argument per call but the last, no host
    read, no reference kept. A forward hook keeps weak references to what the latest call
    returned (:meth:`output_kind`), and one trained parameter's ``.grad`` tells whether the
    program dropped a backward's gradients without a step (:meth:`gradients_dropped`). The
    model is the one the optimizer trains (:meth:`trained_model`). ``auditing``: a callable,
    whether an audit's full watch runs (its calls are the watch's to judge)."""

    def __init__(self, auditing) -> None:
        self._auditing = auditing
        self._hook = self._returns = None
        self._latest = None  # (model, args, kwargs, (code, offset)) of the latest call
        self._outputs: tuple = ()  # (weak reference, version counter) of the latest call's floating outputs
        self._earlier: list = []  # (model's class name, [(argument, extremes on its device)], file:line)
        self._calls = 0
        self.after_step = False  # the model ran since the last optimizer step
        self._sentinel = None  # a weak reference to one trained parameter of the model
        self._looked = None  # (the optimizer's id, the modules seen) when no module seen was the one it trains
        self._grad_left = None  # (its .grad, a weak reference, and version counter) as the latest backward left it

    def watch(self, model) -> None:
        """Hook ``model`` (the first module the audit saw called that the optimizer trains; its
        :func:`hooked_module`); once."""
        if self._hook is None:
            # First of the model's pre-hooks: the batch as the program fed it, before a hook of
            # the model's own changes it (FSDP2's mixed precision casts it to bfloat16).
            self._hook = hooked_module(model).register_forward_pre_hook(run_uncompiled(self._fed), with_kwargs=True, prepend=True)
            self._returns = hooked_module(model).register_forward_hook(run_uncompiled(self._returned))
            trained = next((parameter for parameter in hooked_module(model).parameters() if parameter.requires_grad), None)
            self._sentinel = None if trained is None else weakref.ref(trained)

    def trained_model(self, modules: dict, optimizer):
        """The model whose calls stand for the step's (to :meth:`watch`, and for its evaluations):
        the first module the audit saw called (``modules``: module -> where it was first called,
        or ``None`` when not seen; a LightningModule's step may call only ``self.net``) that
        ``optimizer`` trains, so that a frozen teacher a distillation step calls first under
        ``torch.no_grad()`` is not taken for it; ``None`` when none is, looked up again only
        once another module or optimizer comes (an optimizer of tensors no module holds: a
        soft prompt, an image)."""
        seen = [module for module, site in modules.items() if site is not None]
        if self._looked == (id(optimizer), len(seen)):
            return None
        ids = {id(parameter) for parameter in optimizer_parameters(optimizer)}
        model = next((module for module in seen if any(id(parameter) in ids for parameter in module.parameters())), None)
        self._looked = None if model is not None else (id(optimizer), len(seen))
        return model

    @property
    def watching(self) -> bool:
        """Whether a model is hooked."""
        return self._hook is not None

    def unwatch(self) -> None:
        for hook in (self._hook, self._returns):
            if hook is not None:
                hook.remove()
        self._hook = self._returns = self._latest = self._sentinel = self._grad_left = None
        self._outputs = ()
        self.step_judged()

    def judged(self) -> bool:
        """An optimizer step's check begins: whether the model ran since the last one (``True``
        before it is hooked: not known). What runs from now on is the next step's."""
        ran = self.after_step or self._hook is None
        self.after_step = False
        return ran

    def step_judged(self) -> None:
        """The optimizer step's check ran: the next calls are the next step's."""
        self._earlier, self._calls = [], 0

    def _fed(self, module, args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation's call: no step's batch (runners.evaluations checks what it returns)
        if not self._auditing():
            if self.after_step and self._latest is not None:
                self._keep_extremes(*self._latest)  # an earlier micro-batch of this step
            code, lasti, _ = user_frame(sys._getframe(1))
            self._latest = (module, args, kwargs, (code, lasti))
            self._calls += 1
        self.after_step = True

    def gradients_dropped(self) -> bool:
        """At a backward's start: whether the program dropped or zeroed the gradients the latest
        backward left, with no optimizer step since (``zero_grad()`` after a step the program
        skipped itself: ``if not torch.isfinite(grad_norm): continue``), so that the losses of
        the backward runs before made none of the gradients the next step applies. Read from
        one trained parameter of the model: its ``.grad`` gone, another tensor, or written
        since (two attribute reads a backward)."""
        left, self._grad_left = self._grad_left, None
        if left is None:
            return False
        grad, version = left
        now = self._sentinel_grad()
        return now is None or now is not grad() or version_counter(now) != version

    def backward_ended(self) -> None:
        """A backward ended: what it left in the sentinel parameter's ``.grad``."""
        grad = self._sentinel_grad()
        self._grad_left = None if grad is None else (weakref.ref(grad), version_counter(grad))

    def _sentinel_grad(self):
        parameter = None if self._sentinel is None else self._sentinel()
        return None if parameter is None else parameter.grad

    def _returned(self, module, args, output) -> None:
        if torch.is_grad_enabled() and not self._auditing():
            floating = [tensor for tensor in tensors_in(output) if tensor.is_floating_point() or tensor.is_complex()]
            self._outputs = tuple((weakref.ref(tensor), version_counter(tensor)) for tensor in floating[:_MAX_OUTPUTS])

    def called(self) -> str | None:
        """``Sequential at train.py:12``: the model of the step's latest call and where it was
        called, or ``None`` when it was not called since the last step."""
        if self._latest is None or not self._calls:
            return None
        module, _, _, site = self._latest
        return f"{model_name(module)} at {file_line(*site)}"

    def output_kind(self) -> str | None:
        """What the model returned at the step's one call (read after a failed check only):
        ``"nan"`` or ``"inf"`` when an output held one, ``"finite"`` when every one it returned
        is alive, unwritten since and finite; ``None`` when that is not known (an output the
        program did not keep, or wrote since; several calls since the last step, whose earlier
        outputs are gone; none floating)."""
        if self._calls != 1 or not self._outputs:
            return None
        found = "finite"
        with torch.no_grad(), no_python_dispatch():
            for reference, version in self._outputs:
                tensor = reference()
                if tensor is not None and version_counter(tensor) == version:
                    kind = nonfinite_kind(tensor)
                    if kind is not None:
                        return kind
                else:
                    found = None
        return found

    def _keep_extremes(self, module, args, kwargs, site) -> None:
        if len(self._earlier) >= _MAX_EARLIER_CALLS:
            return
        extremes = []
        with torch.no_grad(), no_python_dispatch():
            for name, tensor in floating_arguments(args, kwargs):
                found = extremes_on_device(tensor)
                if found is not None:
                    extremes.append((named_argument(name, tensor), found))
        self._earlier.append((model_name(module), extremes, file_line(*site)))

    def bad_input(self) -> FedInput | None:
        """The first call since the last optimizer step whose arguments held nan/inf (read
        after a failed check only), else ``None``. Its ``call`` is ``(its number, the calls)``
        where the model ran more than once (accumulated micro-batches), else ``None``."""
        calls = self._calls if self._calls > 1 else None
        with torch.no_grad(), no_python_dispatch():
            for number, (model, extremes, where) in enumerate(self._earlier, 1):
                for argument, found in extremes:
                    kind = extremes_kind(found.tolist())
                    if kind is not None:
                        return FedInput(model, argument, kind, where, (number, calls) if calls else None)
            if self._latest is None:
                return None
            module, args, kwargs, site = self._latest
            for name, tensor in floating_arguments(args, kwargs):
                kind = nonfinite_kind(tensor)
                if kind is not None:
                    return FedInput(model_name(module), named_argument(name, tensor), kind, file_line(*site), (calls, calls) if calls else None)
        return None


def hooked_module(model):
    """The module whose calls stand for ``model``'s: the module a ``DistributedDataParallel``
    (or ``DataParallel``) wraps, which the wrapper calls and an evaluation through
    ``model.module`` calls too; else ``model`` itself."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model


def floating_arguments(args, kwargs):
    """``(name, tensor)`` of each floating or complex tensor in a call's arguments
    (``"argument 0"`` for a positional one, its keyword else), nested ones included."""
    named = [(f"argument {position}", value) for position, value in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        for tensor in tensors_in(value):
            if tensor.is_floating_point() or tensor.is_complex():
                yield name, tensor


def model_name(module) -> str:
    """The model's class name: the compiled model's own, not ``OptimizedModule``; the wrapped
    model's, not ``DistributedDataParallel`` (or ``DataParallel``)."""
    while True:
        inner = compiled_module_inner(module)
        if inner is None and isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            inner = module.module
        if inner is None:
            return module_class_name(module)
        module = inner


def named_argument(name, tensor) -> tuple:
    return name, tensor.dtype, tuple(tensor.shape), str(tensor.device)
