"""One entry of the op log.

An ``OpRecord`` is built on the hot path from small tuples only: tensor metadata, the code
object and instruction offset of the user's frame, the module path. It never holds a tensor,
and it formats nothing until somebody reads it.
"""

from __future__ import annotations

from typing import Any

from .notation import TensorMeta, format_meta
from .sites import Position, position_of

__all__ = ["OpRecord", "FORWARD", "BACKWARD"]

FORWARD = "forward"
BACKWARD = "backward"


class OpRecord:
    """What opwatch saw of one ATen op.

    Attributes:
        index: position of the op in the watch's log, counted from 0 since the watch began; it
            keeps counting when old records leave the bounded log.
        op: the op's name, e.g. ``"aten.addmm.default"``.
        inputs / outputs: one :class:`TensorMeta` (shape, dtype, device) per tensor argument or
            result, in argument order; ``outputs`` is ``None`` when the kernel raised.
        args: non-tensor arguments as ``(name, value)`` pairs (values that are not plain
            numbers, strings, dtypes or devices are summarised by their type name).
        filename / lineno: the user's source line (the innermost frame outside torch and
            opwatch). Backward ops carry the line of the forward op that created them.
        module: dotted path of the ``nn.Module`` running the op, relative to the outermost
            module called (that one is named by its class); ``None`` outside modules.
        phase: ``"forward"`` or ``"backward"``.
        forward_func: for a backward op run by autograd, the forward ``OpOverload`` whose
            gradient it computes (``None`` otherwise).
        flags: anomaly kinds found on this op (``()`` when none).
    """

    __slots__ = ("index", "_func", "_inputs", "_outputs", "_args", "_code", "_lasti", "module", "phase", "_flags", "forward_func")

    def __init__(self, index, func, inputs, args, code, lasti, module, phase):
        self.index = index
        self._func = func
        self._inputs = inputs
        self._outputs = None
        self._args = args
        self._code = code
        self._lasti = lasti
        self.module = module
        self.phase = phase
        self._flags = None
        self.forward_func = None  # for backward ops run by autograd: the forward op they differentiate

    @property
    def op(self) -> str:
        return str(self._func)

    @property
    def func(self):
        """The ``torch._ops.OpOverload`` itself."""
        return self._func

    @property
    def inputs(self) -> tuple[TensorMeta, ...]:
        return tuple(TensorMeta(*meta) for meta in self._inputs)

    @property
    def outputs(self) -> tuple[TensorMeta, ...] | None:
        if self._outputs is None:
            return None
        return tuple(TensorMeta(*meta) for meta in self._outputs)

    @property
    def args(self) -> tuple[tuple[str, Any], ...]:
        schema_args = getattr(getattr(self._func, "_schema", None), "arguments", ())
        named = []
        for key, value in self._args:
            if isinstance(key, int):
                key = schema_args[key].name if key < len(schema_args) else f"arg{key}"
            named.append((key, value))
        return tuple(named)

    @property
    def position(self) -> Position:
        """Line and column range of the user's expression that issued the op."""
        return position_of(self._code, self._lasti)

    @property
    def filename(self) -> str | None:
        return self._code.co_filename if self._code is not None else None

    @property
    def lineno(self) -> int | None:
        return self.position.lineno

    @property
    def where(self) -> str:
        """``file.py:23`` (base name only), or ``?`` when no user frame was found."""
        position = self.position
        if position.filename is None:
            return "autograd" if self.phase == BACKWARD else "?"
        return f"{_basename(position.filename)}:{position.lineno}"

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(self._flags) if self._flags else ()

    def add_flag(self, kind: str) -> None:
        if self._flags is None:
            self._flags = [kind]
        elif kind not in self._flags:
            self._flags.append(kind)

    def signature(self) -> str:
        """``aten.mm(f64[5, 3] cpu, f32[3, 2] cpu) -> f64[5, 2] cpu``."""
        inputs = ", ".join(format_meta(meta) for meta in self._inputs)
        text = f"{short_op_name(self._func)}({inputs})"
        if self._outputs:
            text += " -> " + ", ".join(format_meta(meta) for meta in self._outputs)
        return text

    def __repr__(self) -> str:
        return f"<OpRecord #{self.index} {self.signature()} at {self.where} {self.phase}>"


def short_op_name(func) -> str:
    """``aten.mm.default`` -> ``aten.mm``; other overload names are kept (``aten.add.Tensor``)."""
    name = str(func)
    return name.removesuffix(".default")


def _basename(filename: str) -> str:
    return filename.replace("\\", "/").rsplit("/", 1)[-1]
