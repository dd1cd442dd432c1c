"""What a guarded step starts from, kept so that a failing step can run again from there.

The RNG states (CPU, and every CUDA device once CUDA is initialized), a copy of the model's
buffers (BatchNorm running statistics), the version counters of the parameters and of the
tensor arguments, and which parameters held a ``.grad`` (references, no copy). The buffers'
copies go into tensors kept from call to call (one ``_foreach_copy_`` once the shapes settle).

The gradients are never copied: a healthy step would pay a copy of every gradient for the rare
failing one. A failing step's gradients, those it accumulated onto included, are dropped
(``.grad`` set to ``None``, as a step GradScaler skips leaves the optimizer nothing to apply),
and its replay starts from zeroed gradients (the ``.grad`` tensors the step found, zeroed in
place, so that a view DDP keeps of them stays valid).
"""

from __future__ import annotations

import torch

from ...core.compat import cuda_initialized, foreach_copy_, version_counter, version_counters

_Tensor = torch.Tensor
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_CPU_GENERATOR = torch.default_generator  # what torch.get_rng_state() reads, without its Python frame


class Start:
    """What one call started from."""

    __slots__ = ("cpu_rng", "cuda_rng", "versions", "grads", "buffers", "flat_arguments", "arguments")
    # buffers: (module, name, buffer) for every buffer slot


class Copies:
    """The values of a list of tensors, copied into tensors kept from call to call: one
    ``_foreach_copy_`` per call once the shapes settle."""

    def __init__(self):
        self.values: list = []
        self._layout = None

    def save(self, tensors) -> None:
        layout = [(tensor.shape, tensor.dtype, tensor.device) for tensor in tensors]
        with torch.no_grad():
            if layout != self._layout:
                self.values = [tensor.clone() for tensor in tensors]
                self._layout = layout
            else:
                foreach_copy_(self.values, tensors)


class Snapshots:
    """Takes and restores the start of a step for one model (its parameters and buffer slots,
    read once: buffers by slot, so that a buffer the model replaces is still found)."""

    def __init__(self, params, model=None):
        self.params = params
        self.buffer_slots = [] if model is None else buffer_slots([model])
        self._buffers = Copies()

    def take(self, args, kwargs) -> Start:
        start = Start()
        start.cpu_rng = _CPU_GENERATOR.get_state()
        start.cuda_rng = torch.cuda.get_rng_state_all() if cuda_initialized() else None
        params = self.params
        start.versions = version_counters(params)
        start.grads = [param.grad for param in params]  # references: which ones held a .grad
        if self.buffer_slots:
            start.buffers = [(module, name, module._buffers.get(name)) for module, name in self.buffer_slots]
            self._buffers.save([buffer for _, _, buffer in start.buffers if buffer is not None])
        else:
            start.buffers = ()
        if not kwargs and all([type(value) in _PLAIN_TYPES for value in args]):
            # The common call, positional tensors: their paths are named only if a step fails.
            start.flat_arguments = args
            start.arguments = version_counters(args)
        else:  # containers the step may change: keep each tensor (and its path) now
            start.flat_arguments = None
            start.arguments = tensor_arguments(args, kwargs)
        return start

    def changed_parameters(self, start) -> list:
        """Positions of the parameters whose version moved since ``start``."""
        now = version_counters(self.params)
        if now == start.versions:
            return []
        return [position for position, (version, before) in enumerate(zip(now, start.versions)) if version != before]

    def restore(self, start) -> None:
        _CPU_GENERATOR.set_state(start.cpu_rng)
        if start.cuda_rng is not None:
            torch.cuda.set_rng_state_all(start.cuda_rng)
        self.zero_grads(start)
        self.put_start_buffers(start)

    def zero_grads(self, start) -> None:
        """The ``.grad`` the step found, zeroed in place (``None`` where there was none): what a
        replay starts from."""
        with torch.no_grad():
            for param, grad in zip(self.params, start.grads):
                if grad is not None:
                    grad.zero_()
                param.grad = grad

    def drop_grads(self) -> None:
        """A failing step's gradients, accumulated ones included, dropped: the optimizer finds
        no ``.grad`` and leaves the parameters alone."""
        for param in self.params:
            param.grad = None

    def put_start_buffers(self, start) -> None:
        put_buffers(start.buffers, self._buffers.values)

    def buffers_now(self):
        """``(slots, values)``: the buffers as they are now, copied; ``None`` without buffers."""
        if not self.buffer_slots:
            return None
        slots = [(module, name, module._buffers.get(name)) for module, name in self.buffer_slots]
        with torch.no_grad():
            values = [buffer.clone() for _, _, buffer in slots if buffer is not None]
        return slots, values


def buffer_slots(models) -> list:
    """``(module, name)`` of each buffer of ``models`` (and their submodules), each once: slots,
    so that a buffer the model replaces is still found."""
    seen, slots = set(), []
    for model in models:
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and (id(module), name) not in seen:
                    seen.add((id(module), name))
                    slots.append((module, name))
    return slots


def put_buffers(slots, values) -> None:
    if not slots:
        return
    values = iter(values)
    with torch.no_grad():
        for module, name, buffer in slots:
            if buffer is not None:
                buffer.copy_(next(values))
            module._buffers[name] = buffer


def changed_arguments(start) -> list:
    """``(path, meta)`` of the tensor arguments the step wrote in place."""
    if start.flat_arguments is not None:
        kept = [(f"args[{position}]", tensor, version) for position, (tensor, version) in enumerate(zip(start.flat_arguments, start.arguments))]
    else:
        kept = start.arguments
    return [
        (path, (tuple(tensor.shape), tensor.dtype, tensor.device, 0))
        for path, tensor, version in kept
        if version_counter(tensor) != version
    ]


def tensor_arguments(args, kwargs) -> list:
    """``(path, tensor, version)`` of the tensors among the arguments, one level into lists,
    tuples and dicts (a batch)."""
    found = []
    for path, value in leaves((args, kwargs), depth=3, paths=("args", "kwargs")):
        if isinstance(value, _Tensor):
            found.append((path, value, version_counter(value)))
    return found


def leaves(value, depth: int = 2, paths=None):
    """``(path, leaf)`` of a returned value: itself, or the items of a tuple, list or dict, a
    few levels deep (``returned['loss']``)."""
    if paths is not None:  # the (args, kwargs) pair
        for name, part in zip(paths, value):
            yield from _leaves_at(part, name, depth - 1)
        return
    if isinstance(value, (_Tensor, float)):
        yield "returned", value
        return
    yield from _leaves_at(value, "returned", depth)


def _leaves_at(value, path, depth):
    if isinstance(value, (_Tensor, float)):
        yield path, value
    elif depth > 0 and isinstance(value, (tuple, list)):
        for position, item in enumerate(value):
            yield from _leaves_at(item, f"{path}[{position}]", depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves_at(item, f"{path}[{key!r}]", depth - 1)
