"""What a guarded step starts from, kept so that a failing step can run again from there.

The RNG states (CPU, and every CUDA device once CUDA is initialized), a copy of the model's
buffers (BatchNorm running statistics), a copy of the parameters' ``.grad`` when they hold
values (gradient accumulation), and the version counters of the parameters and of the tensor
arguments. The copies go into tensors kept from call to call (one ``_foreach_copy_`` once the
shapes settle).
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
        self.buffer_slots = [] if model is None else [
            (module, name) for module in model.modules() for name, buffer in module._buffers.items() if buffer is not None
        ]
        self._grads = Copies()
        self._buffers = Copies()

    def take(self, args, kwargs) -> Start:
        start = Start()
        start.cpu_rng = _CPU_GENERATOR.get_state()
        start.cuda_rng = torch.cuda.get_rng_state_all() if cuda_initialized() else None
        params = self.params
        start.versions = version_counters(params)
        start.grads = grads = [param.grad for param in params]
        if grads.count(None) != len(grads):  # gradients from an earlier backward (accumulation)
            self._grads.save([grad for grad in grads if grad is not None])
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
        self.put_grads(start)
        self.put_start_buffers(start)

    def put_grads(self, start) -> None:
        copies = iter(self._grads.values)
        with torch.no_grad():
            for param, grad in zip(self.params, start.grads):
                if grad is None:
                    param.grad = None
                else:
                    grad.copy_(next(copies))
                    param.grad = grad

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
