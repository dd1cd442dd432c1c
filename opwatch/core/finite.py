"""Whether tensors hold only finite values, in one fused kernel and one host read.

The one check that ``opwatch.guard`` runs after each healthy step and the leave-on runner
(``opwatch.runners.leave_on``) before each optimizer step: GradScaler's own kernel
(``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1, which writes every value
back unchanged) over the tensors of one device, its found-inf flag kept from call to call.
Tensors the kernel must not write (a returned loss, gradients that are part of a graph) join
it through their largest magnitude (``linalg_vector_norm(t, inf)``: nan and inf carry through).
Where the kernel cannot take the tensors (several devices; sparse, complex, meta, float8 or
overlapping ones; a torch without it) the check runs one group per device, one host read per
device, from then on.

A DTensor (FSDP2's parameters and gradients, tensor parallel ones) is read through its local
shard: each rank checks its own values, no collective (reducing the DTensor itself would
all-reduce, on the ranks that happen to check only).

float8 tensors hold nan (``float8_e4m3fn``: no inf; ``float8_e5m2``: nan and inf), but no
reduction, GradScaler's kernel included, takes them: they are read through a wider copy
(:func:`readable`: float16 holds every float8 value exactly; float32 for ``float8_e8m0fnu``).
"""

from __future__ import annotations

import math

import torch

from .compat import amp_non_finite_check, dtensor_class, dtensor_parts, foreach_norm

__all__ = ["FusedFiniteCheck", "finite_by_device", "local_shards", "nonfinite_kind", "extremes_kind", "extremes_on_device", "value_extremes", "readable", "tensors_in", "CHECKED_DTYPES", "FLOAT8_DTYPES"]

# float8 dtype -> the dtype it is read through (reductions do not take float8): one that holds
# each of its values exactly, its nan and inf included. The names torch has (e8m0fnu: 2.7+).
_FLOAT8_READ = {
    getattr(torch, name): wider
    for name, wider in (
        ("float8_e4m3fn", torch.float16), ("float8_e5m2", torch.float16), ("float8_e4m3fnuz", torch.float16),
        ("float8_e5m2fnuz", torch.float16), ("float8_e8m0fnu", torch.float32),  # 2 ** 127: beyond float16
    )
    if hasattr(torch, name)
}
FLOAT8_DTYPES = frozenset(_FLOAT8_READ)

# The dtypes whose values can be nan or inf, for every reader (the nan/inf check's tracker and
# replay, guard, leave-on): the floating ones, float8 included, and the complex ones.
CHECKED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128}) | FLOAT8_DTYPES


def tensors_in(value) -> list:
    """The tensors of a nested argument (lists, tuples and dicts' values), in order: what a
    step fed a model, or what an op wrote, for the finite readers."""
    found: list = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found


def readable(tensor):
    """``tensor``, or for a float8 one a copy in a dtype the reductions take (``aminmax``,
    norms), with the same values: nan and inf kept."""
    wider = _FLOAT8_READ.get(tensor.dtype)
    return tensor if wider is None else tensor.to(wider)


class FusedFiniteCheck:
    """The fused check, keeping GradScaler's flag tensors (one pair per device) from call to
    call: call it with the tensors to check."""

    def __init__(self):
        self._flag_tensors: dict = {}  # device -> (found-inf flag, inverse scale)
        self._cpu_flags = self._flags(torch.device("cpu"))  # without a device object per call
        self.by_device = False  # the kernel could not take these tensors once: one group per device

    def __call__(self, writable, read_only=()) -> bool:
        """Whether every value of ``writable`` (a list the kernel may write back unchanged:
        gradients) and of ``read_only`` is finite."""
        # Right after a backward every line runs with cold caches (a torch call costs tens of
        # us): the common call is one kernel and one host read, with no grad-mode context.
        dtensor = dtensor_class()
        if dtensor is not None:  # torch.distributed.tensor is loaded: DTensors read locally
            writable = local_shards(writable, dtensor)
            read_only = local_shards(read_only, dtensor)
        if any([tensor.requires_grad for tensor in writable]):
            # Part of a graph (create_graph=True): never written, even with its own values.
            read_only = [*read_only, *[tensor for tensor in writable if tensor.requires_grad]]
            writable = [tensor for tensor in writable if not tensor.requires_grad]
        if not writable and not read_only:
            return True
        if self.by_device:
            return finite_by_device([*writable, *read_only])
        try:
            # The largest magnitudes of detached views: new tensors, safe for the kernel to write.
            checked = writable + [torch.linalg.vector_norm(readable(tensor.detach()), math.inf) for tensor in read_only] if read_only else writable
            first = checked[0]
            found, one = self._cpu_flags if first.is_cpu else self._flags(first.device)
            amp_non_finite_check(checked, found, one)
            if found.item() == 0:
                return True
            found.zero_()
            return False
        except (RuntimeError, NotImplementedError, TypeError):
            # Several devices; sparse, complex, meta or overlapping tensors; a torch without
            # the kernel (values written before it raised were written back unchanged).
            with torch.no_grad():
                for found, _ in self._flag_tensors.values():
                    found.zero_()  # it may have been set before the kernel gave up
            self.by_device = True  # from now on: a model's tensors do not change kind
            return finite_by_device([*writable, *read_only])

    def _flags(self, device) -> tuple:
        """GradScaler's found-inf flag (kept at 0 between failures) and inverse scale (1) on
        ``device``, made on the first call."""
        flags = self._flag_tensors.get(device)
        if flags is None:
            flags = self._flag_tensors[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
        return flags


def local_shards(tensors, dtensor) -> list:
    """``tensors`` with each DTensor (``dtensor``: its class) replaced by its local shard."""
    shards = []
    for tensor in tensors:
        if isinstance(tensor, dtensor):
            tensor, _, _ = dtensor_parts(tensor)
        shards.append(tensor)
    return shards


def finite_by_device(tensors) -> bool:
    """The same check without the kernel, one group per device: each tensor's largest
    magnitude, one host read per device. Tensors of other dtypes and meta tensors are left
    out; sparse ones are read through their values; a DTensor through its local shard, another
    subclass through its own dispatch."""
    by_device: dict = {}
    for tensor in tensors:
        if tensor.device.type == "meta":
            continue
        tensor = _values(tensor)
        if tensor.dtype in CHECKED_DTYPES:
            by_device.setdefault(tensor.device, []).append(readable(tensor))
    founds = []
    with torch.no_grad():
        for group in by_device.values():
            norms = [norm.float().reshape(1) for norm in foreach_norm(group, math.inf)]
            founds.append(torch.cat(norms).amax())  # nan and inf carry through amax
    return all(math.isfinite(found.item()) for found in founds)


def value_extremes(tensor) -> tuple[float, float] | None:
    """The one reading of a tensor's values: ``(smallest, largest)`` as floats (real and
    imaginary parts of complex values; the stored values of sparse ones), nan where any value is
    nan (it carries through), in one host read. ``None`` for tensors that hold no checked value:
    other dtypes, meta, empty."""
    extremes = extremes_on_device(tensor)
    return None if extremes is None else tuple(extremes.tolist())


def extremes_on_device(tensor):
    """:func:`value_extremes` left on the tensor's device: a tensor of two values, (smallest,
    largest), with no host read, to be read later (or ``None``, as there)."""
    if tensor.dtype not in CHECKED_DTYPES or tensor.device.type == "meta":
        return None
    values = _values(tensor).detach()
    if values.numel() == 0:
        return None
    values = readable(values)
    if values.is_complex():
        values = torch.view_as_real(values.resolve_conj())
    low, high = torch.aminmax(values)
    return torch.stack((low, high))


def nonfinite_kind(tensor) -> str | None:
    """``"nan"`` or ``"inf"`` when ``tensor`` holds one (nan first), else ``None``: read after
    a failed check to say what it found (one host read, :func:`value_extremes`). Tensors of
    other dtypes and meta tensors hold neither; sparse ones are read through their values."""
    return extremes_kind(value_extremes(tensor))


def extremes_kind(extremes) -> str | None:
    """``"nan"`` or ``"inf"`` for ``(smallest, largest)`` read from :func:`value_extremes` or
    :func:`extremes_on_device` (nan first), ``None`` when both are finite or there are none."""
    if extremes is None:
        return None
    low, high = extremes
    if math.isnan(low) or math.isnan(high):
        return "nan"
    if math.isinf(low) or math.isinf(high):
        return "inf"
    return None


def _values(tensor):
    """The stored values of a sparse tensor (COO; CSR, CSC, BSR), a DTensor's local shard, or
    the tensor itself."""
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(tensor, dtensor):
        tensor, _, _ = dtensor_parts(tensor)  # this rank's values: no collective
    if tensor.layout == torch.strided:
        return tensor
    return tensor._values() if tensor.is_sparse else tensor.values()
