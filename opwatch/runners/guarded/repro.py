"""One-op repros: the inputs of the op where a replayed step went wrong, saved to a folder with
a ``repro.py`` that runs that op alone and prints how many nan/inf its output holds.

A watch records no tensors, so :func:`opwatch.guard` enters :class:`InputCapture` on top of
the replay's watch: it numbers each op with the index the watch gives it and keeps
CPU copies of the arguments of the few ops that can become the subject of a repro:

- an op whose floating output holds nan while no input did, or inf while every input was
  finite (a superset of the watch's nan/inf origins: the watch also judges which mattered);
- the op that raised.

It costs a check of every output (a host read per op) and a copy of what in-place ops
overwrite: fine in a replay, never on a healthy step. What it keeps is bounded by
``max_bytes``; tensors beyond it are kept as shapes only, and the repro says so.
"""

from __future__ import annotations

import keyword
import math
import os
import platform
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...core.compat import SKIPS_DYNAMO_PER_CODE, no_python_dispatch, skip_dynamo_for_code
from ...core.finite import nonfinite_kind, tensors_in
from ...core.notation import format_meta

__all__ = ["InputCapture", "SavedCall", "write_repro"]

_Tensor = torch.Tensor
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
# The script's own names: an argument of the op that is called the same gets a trailing "_".
_RESERVED = frozenset({"torch", "os", "result", "outputs", "error", "number", "value"})


class _Slot:
    """One tensor argument as the op saw it: a CPU copy of its values (``value``), or ``None``
    when they were left out (``left_out`` says why)."""

    __slots__ = ("name", "value", "shape", "dtype", "device", "left_out")

    def __init__(self, name, tensor, budget):
        self.name = name
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.device = str(tensor.device)
        self.value = None
        self.left_out = None
        if tensor.device.type == "meta":
            return  # no values to keep: the repro makes it on meta again
        if type(tensor) not in _PLAIN_TYPES or tensor.layout != torch.strided:
            self.left_out = f"a {type(tensor).__name__} with layout {tensor.layout}: only dense tensors are saved"
            return
        # A broadcast view (stride 0, common in backward) is saved collapsed and expanded again.
        compact = tensor.detach()
        collapse = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None) for size, stride in zip(compact.shape, compact.stride()))
        if collapse:
            compact = compact[collapse]
        size = compact.numel() * compact.element_size()
        if size > budget[0]:
            self.left_out = f"{_size(size)} over what was left of the limit ({_size(budget[0])})"
            return
        budget[0] -= size
        # A copy: exactly the view's values (saving a view would save its whole storage).
        self.value = compact.to("cpu", copy=True)

    @property
    def meta(self) -> tuple:
        return (self.shape, self.dtype, torch.device(self.device), 0)


class SavedCall:
    """One op call kept for a repro: the op, its index in the replay (the watch's numbering),
    and its arguments with every tensor replaced by a :class:`_Slot`."""

    __slots__ = ("func", "index", "args", "kwargs", "slots", "dropped", "raised")

    def __init__(self, func, index, args, kwargs, budget, *, raised=False):
        self.func = func
        self.index = index
        self.raised = raised
        self.slots: list[_Slot] = []
        self.dropped: list[str] = []  # non-tensor arguments the script cannot write (None there)
        names = [argument.name for argument in func._schema.arguments]
        taken = set(_RESERVED)
        self.args = tuple(self._replace(names[i] if i < len(names) else f"arg{i}", value, budget, taken) for i, value in enumerate(args))
        self.kwargs = {name: self._replace(name, value, budget, taken) for name, value in kwargs.items()}

    def _replace(self, name, value, budget, taken):
        if isinstance(value, _Tensor):
            slot = _Slot(_identifier(name, taken), value, budget)
            self.slots.append(slot)
            return slot
        if isinstance(value, (list, tuple)) and any(isinstance(item, _Tensor) for item in value):
            return [self._replace(f"{name}_{i}", item, budget, taken) if isinstance(item, _Tensor) else item for i, item in enumerate(value)]
        if not _writable(value):
            self.dropped.append(f"{name}: a {type(value).__name__} (None here)")
            return None
        return value

    @property
    def left_out(self) -> list[str]:
        """What the repro does not have, one line each."""
        tensors = [f"{slot.name} ({format_meta(slot.meta)}): {slot.left_out} (zeros here)" for slot in self.slots if slot.left_out]
        return tensors + self.dropped

    @property
    def nbytes(self) -> int:
        return sum(slot.value.numel() * slot.value.element_size() for slot in self.slots if slot.value is not None)


class InputCapture(TorchDispatchMode):
    """Entered on top of a replay's watch (inside its ``with``): keeps the calls a repro may
    need (see the module's doc). ``calls`` maps the op index to a :class:`SavedCall`;
    ``raised`` is ``(index, id of the exception)`` of the last op that raised."""

    MAX_CALLS = 8  # nan/inf candidates kept; the origin is almost always the first

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not SKIPS_DYNAMO_PER_CODE  # as OpInterceptor: keep Dynamo out without importing it

    def __init__(self, *, max_bytes: int, keep_values: bool = True, numbering=None):
        super().__init__()
        self.calls: dict[int, SavedCall] = {}
        self.raised: tuple[int, int] | None = None
        self.next_index = 0
        # The watch below: the index it gives the op about to run. Counting here alone drifts
        # from it where the watch sees ops this mode does not (on torch 2.6 a mode nested in
        # another makes the outer one see more detaches: autograd storing a first gradient).
        self._numbering = numbering
        self._budget = [max_bytes if keep_values else 0]
        # Without values to keep, only the op that raised is looked for (no check per op).
        self._max_calls = self.MAX_CALLS if keep_values else 0
        self._writes: dict = {}  # OpOverload -> positions and names of the arguments it writes
        self.broken: str | None = None  # set when capturing failed: the replay goes on without it
        skip_dynamo_for_code(InputCapture.__torch_dispatch__.__code__)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func.namespace == "profiler" or self.broken:
            return func(*args, **kwargs)  # the watch does not number record_function markers
        index = self.next_index if self._numbering is None else self._numbering()
        self.next_index = index + 1
        writes = before = None
        try:
            writes = self._writes.get(func)
            if writes is None:
                writes = self._writes[func] = tuple(
                    (position, argument.name)
                    for position, argument in enumerate(func._schema.arguments)
                    if argument.alias_info is not None and argument.alias_info.is_write
                )
            if writes and self._max_calls:
                # The op overwrites these: keep them as they were (on their device, for now).
                with no_python_dispatch():
                    before = _copy_written(writes, args, kwargs)
        except Exception as error:
            self._break(error)
        try:
            out = func(*args, **kwargs)
        except BaseException as error:
            self.raised = (index, id(error))
            self._keep(func, index, args, kwargs, before, raised=True)
            raise
        if len(self.calls) < self._max_calls and not self.broken:
            try:
                with no_python_dispatch():
                    made = _nonfinite_kind(tensors_in(out) if out is not None else [])
                    if made is None and writes:
                        made = _nonfinite_kind(tensors_in([_argument(args, kwargs, position, name) for position, name in writes]))
                    if made is not None:
                        had = _nonfinite_kind(tensors_in(_with_before(args, kwargs, before)))
                        if (made == "nan" and had != "nan") or (made == "inf" and had is None):
                            self._keep(func, index, args, kwargs, before)
            except Exception as error:
                self._break(error)
        return out

    def _keep(self, func, index, args, kwargs, before, *, raised=False) -> None:
        if self.broken:
            return
        try:
            with no_python_dispatch():
                args, kwargs = _with_before(args, kwargs, before)
                self.calls[index] = SavedCall(func, index, args, kwargs, self._budget, raised=raised)
        except Exception as error:
            self._break(error)

    def _break(self, error) -> None:
        self.broken = f"{type(error).__name__}: {error}"
        self.calls.clear()

    def call_for(self, record) -> SavedCall | None:
        """The saved call of the op ``record`` (an :class:`~opwatch.OpRecord` of the replay's
        watch), checked to be the same op; ``None`` when it was not kept."""
        call = self.calls.get(record.index)
        if call is None or call.func is not record.func:
            return None
        return call


def _copy_written(writes, args, kwargs) -> dict:
    """Copies of the arguments an op writes, keyed by ``(position, name)``. Only plain tensors
    are copied: a subclass (a DTensor: tensor parallel, FSDP2's gradients) has no storage of its
    own to clone with Python dispatch off (cloning it crashes the process), and its values are
    never read here (:func:`_nonfinite_kind`), so no op on it is kept for a repro."""
    copies = {}
    for position, name in writes:
        value = _argument(args, kwargs, position, name)
        if isinstance(value, _Tensor):
            copies[position, name] = _copy(value)
        elif isinstance(value, (list, tuple)):
            copies[position, name] = [_copy(item) if isinstance(item, _Tensor) else item for item in value]
    return copies


def _copy(tensor):
    return tensor.clone() if type(tensor) in _PLAIN_TYPES and tensor.device.type != "meta" else tensor


def _argument(args, kwargs, position, name):
    return args[position] if position < len(args) else kwargs.get(name)


def _with_before(args, kwargs, before) -> tuple:
    """The op's ``(args, kwargs)`` as they were before it ran: written ones replaced by copies."""
    if not before:
        return args, kwargs
    args = list(args)
    kwargs = dict(kwargs)
    for (position, name), value in before.items():
        if position < len(args):
            args[position] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def _nonfinite_kind(tensors) -> str | None:
    """``"nan"`` if any of the checkable ``tensors`` (plain, dense) holds nan, else ``"inf"`` if
    any holds inf, else ``None`` (:func:`opwatch.core.finite.nonfinite_kind` of each). One host
    read per tensor: for replays only."""
    kind = None
    for tensor in tensors:
        if type(tensor) not in _PLAIN_TYPES or tensor.layout != torch.strided:
            continue
        found = nonfinite_kind(tensor)
        if found == "nan":
            return "nan"
        kind = kind or found
    return kind


def _identifier(name, taken) -> str:
    name = "".join(char if char.isalnum() or char == "_" else "_" for char in name) or "arg"
    if name[0].isdigit() or keyword.iskeyword(name) or name.startswith("_"):
        name = "arg_" + name.lstrip("_")
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def _size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


# -- writing -----------------------------------------------------------------------------------


def write_repro(call: SavedCall, folder: str | None, *, about: list[str], max_bytes: int) -> str:
    """Write ``inputs.pt`` and ``repro.py`` for ``call`` into a new folder (in ``folder``, or in
    the system's temporary folder); return the new folder's path. ``about``: lines for the
    script's docstring (what opwatch found, where)."""
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    short = str(call.func).split(".")[1] if "." in str(call.func) else "op"
    target = os.path.abspath(tempfile.mkdtemp(prefix=f"opwatch-repro-{_identifier(short, set())}-", dir=folder))
    values = {slot.name: slot.value for slot in call.slots if slot.value is not None}
    torch.save(values, os.path.join(target, "inputs.pt"))
    with open(os.path.join(target, "repro.py"), "w") as script:
        script.write(_script(call, about, max_bytes))
    return target


def _script(call: SavedCall, about: list[str], max_bytes: int) -> str:
    from ..._version import __version__

    op = str(call.func)
    left_out = call.left_out
    lines = ['"""One-op repro made by opwatch.guard: ' + op + " alone, on the inputs it had in the replayed step.", ""]
    lines += ["  " + line for line in about]
    lines.append("")
    saved = sum(1 for slot in call.slots if slot.value is not None or slot.device == "meta")  # meta: no data to save
    lines.append(f"  inputs:   inputs.pt, {saved} of {len(call.slots)} tensor(s), {_size(call.nbytes)} (limit {_size(max_bytes)})")
    for line in left_out:
        lines.append(f"  left out: {line}")
    lines.append(f"  made with opwatch {__version__}, torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} {platform.machine()}")
    lines += ["", "Run it with:  python repro.py", '"""', ""]
    lines += [
        "import os",
        "",
        "import torch",
        "",
        "_HERE = os.path.dirname(os.path.abspath(__file__))",
        '_SAVED = torch.load(os.path.join(_HERE, "inputs.pt"), weights_only=True)',
        '_SHORT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",',
        '          torch.complex64: "c64", torch.complex128: "c128", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}',
        "",
        "",
        "def _load(name, shape, dtype, device):",
        '    """The input ``name`` as the op saw it, on its device: the saved values (expanded again',
        '    where the op saw a broadcast view), zeros where they were left out."""',
        '    if device.startswith("meta"):',
        '        return torch.empty(shape, dtype=dtype, device="meta")',
        "    if name in _SAVED:",
        "        value = _SAVED[name].expand(shape)",
        "    else:",
        '        print(f"note: {name} was left out of this repro (see the top of repro.py): zeros instead")',
        "        value = torch.zeros(shape, dtype=dtype)",
        '    if device != "cpu":',
        "        try:",
        "            value = value.to(device)",
        "        except (RuntimeError, AssertionError) as error:",
        '            print(f"note: {name} stays on the CPU: {device} is not available here ({error})")',
        "    return value",
        "",
        "",
        "def _describe(value):",
        "    if not isinstance(value, torch.Tensor):",
        "        return repr(value)",
        '    text = f"{_SHORT.get(value.dtype, str(value.dtype))}[{\', \'.join(map(str, value.shape))}] {value.device}"',
        '    if value.device.type != "meta" and (value.is_floating_point() or value.is_complex()):',
        '        text += f": {int(torch.isnan(value).sum())} nan, {int(torch.isinf(value).sum())} inf of {value.numel()} values"',
        "    return text",
        "",
        "",
    ]
    for slot in call.slots:
        lines.append(f"{slot.name} = _load({slot.name!r}, {slot.shape!r}, {_literal(slot.dtype)}, {slot.device!r})")
    lines.append("")
    lines.append(f'print("{op}, inputs:")')
    for slot in call.slots:
        lines.append(f'print("  {slot.name}:", _describe({slot.name}))')
    call_args = [_literal(value) for value in call.args] + [f"{name}={_literal(value)}" for name, value in call.kwargs.items()]
    lines += [
        "try:",
        f"    result = torch.ops.{op}({', '.join(call_args)})",
        "except Exception as error:",
        '    print(f"the op raised {type(error).__name__}: {error}")',
        "    raise",
    ]
    written = [slot.name for slot in call.slots if _is_written(call, slot)]
    lines.append("outputs = list(result) if isinstance(result, (tuple, list)) else [result]")
    if written:
        lines += ["if result is None:", f"    outputs = [{', '.join(written)}]  # written in place"]
    lines += [
        'print("outputs:")',
        "for number, value in enumerate(outputs):",
        '    print(f"  {number}:", _describe(value))',
        "",
    ]
    return "\n".join(lines)


def _is_written(call: SavedCall, slot: _Slot) -> bool:
    for position, argument in enumerate(call.func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = call.args[position] if position < len(call.args) else call.kwargs.get(argument.name)
            if value is slot or (isinstance(value, list) and any(item is slot for item in value)):
                return True
    return False


def _literal(value) -> str:
    """Python source for one non-tensor argument (a :class:`_Slot` is its variable's name)."""
    if isinstance(value, _Slot):
        return value.name
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f'float("{value}")'
    if isinstance(value, complex):
        return f"complex({_literal(value.real)}, {_literal(value.imag)})"
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, (list, tuple, torch.Size)):
        return "[" + ", ".join(_literal(item) for item in value) + "]"
    return "None"


def _writable(value) -> bool:
    """Whether :func:`_literal` can write ``value`` as Python source."""
    if value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.layout, torch.memory_format, torch.device)):
        return True
    if isinstance(value, (list, tuple, torch.Size)):
        return all(isinstance(item, _Slot) or _writable(item) for item in value)
    return False


