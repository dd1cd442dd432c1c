"""What a check returns: the facts of one anomaly, before it is tied to a record.

A finding holds plain data only: which rule fired, the operands' metadata, the odd one,
where it was made, numbers. Every sentence a user reads is made from these facts in
:mod:`opwatch.render` (one ``explain`` function per rule), so that a saved log stores facts
and re-renders them with the same code, and a test can assert a fact without parsing prose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..core.fact_tuples import fact_tuple

__all__ = [
    "Attribute", "BeforeWatch", "DefaultDevice", "DefaultDtype", "Finding", "MadeBy", "Owned", "Place",
    "tensor_names",
]


@fact_tuple("place")
class Place(NamedTuple):
    """Another op a finding speaks of (where an odd tensor was made, how far a nan spread), as
    facts: its name and where it ran. Rendered ``aten.addmm at train.py:23`` by the render
    package, with the one location format (so a saved log shows it as a live one does)."""

    op: str  # the op's name, ``aten.addmm.default``
    filename: str | None  # the user's source file, ``None`` when no user frame was found
    lineno: int | None
    phase: str  # "forward" or "backward"
    label: str | None = None  # a named place without a source line (``DDP bucket [fc.weight]``)

    @classmethod
    def of(cls, record) -> Place:
        position = record.position
        return cls(record.op, position.filename, position.lineno, record.phase, getattr(record, "label", None))


# Where an odd operand was made (``Finding.made``, see ``Provenance.where_made``, opwatch.checks.provenance): one of
# these provenance facts, each led by ``how``; rendered by ``opwatch.render.phrases.where_made``.


@fact_tuple("attribute")
class Attribute(NamedTuple):
    """A plain tensor attribute of a running module (not a buffer: ``.to()`` does not move it)."""

    how: str  # "attribute"
    cls: str  # the module's class name
    name: str  # the attribute's name
    path: str  # the module's path


@fact_tuple("owned")
class Owned(NamedTuple):
    """A parameter or buffer of a running module."""

    how: str  # "parameter" or "buffer"
    path: str  # the module's path
    name: str
    cls: str | None = None  # the module's class name


@fact_tuple("default_device")
class DefaultDevice(NamedTuple):
    """A factory op called without ``device=``: torch filled in the default device."""

    how: str  # "default_device"
    device: Any


@fact_tuple("default_dtype")
class DefaultDtype(NamedTuple):
    """A factory op called without (or with) ``dtype=``: what it was given, and the default."""

    how: str  # "default_dtype", as its tag (a log of format 4 or older says "dtype": upgraded when read)
    given: Any  # the dtype given, or None
    default: Any  # torch's default dtype then


@fact_tuple("python_data")
class PythonData(NamedTuple):
    """Python or NumPy data entering torch (``torch.from_numpy(a)``, ``torch.tensor(a)``)."""

    how: str  # "python_data"
    expression: str | None  # the call's source text, when known
    lifted: Place | None  # where the data entered, when the odd tensor was then only moved


@fact_tuple("computed_from")
class ComputedFrom(NamedTuple):
    """The op that made it (or the one whose output it only viewed or moved) computed it from a
    module's parameter or buffer of its dtype: a module kept in another dtype than the rest of
    the model (transformers' ``_keep_in_fp32_modules``), or a tensor made so."""

    how: str  # "computed_from"
    kind: str  # "parameter" or "buffer"
    cls: str  # the module's class name
    name: str
    path: str  # the module's path


@fact_tuple("from_module")
class FromModule(NamedTuple):
    """An op only indexed, viewed or copied a module's parameter or buffer
    (``self.class_w[target]``)."""

    how: str  # "from_module"
    kind: str  # "parameter" or "buffer"
    cls: str  # the module's class name
    name: str
    path: str  # the module's path


@fact_tuple("made_by")
class MadeBy(NamedTuple):
    """Made by an op of the watch; ``factory`` says what torch filled in for a factory op."""

    how: str  # "made_by"
    place: Place
    # what more is known: the default torch filled in for a factory op, the Python data the
    # values came from, or the module's tensor they were taken from
    detail: DefaultDevice | DefaultDtype | PythonData | FromModule | None = None


@fact_tuple("before_watch")
class BeforeWatch(NamedTuple):
    """Made before the watch, or outside torch ops (``torch.from_numpy``)."""

    how: str = "before_watch"


@dataclass(frozen=True)
class Finding:
    """One anomaly as a check sees it: facts, no prose.

    Attributes:
        kind: the anomaly kind, one of ``opwatch.KINDS``.
        rule: which rule fired (``"device.mix"``, ``"dtype.silent_upcast"``, ...): the render
            package's ``explain`` function for it turns the facts into sentences.
        facts: the rule's plain data (numbers, names, dtypes, devices, tensor metadata tuples,
            :class:`Place`), one ``RuleFacts`` class per rule (``opwatch.core.fact_tuples``),
            defined beside the check that makes it (``opwatch.checks.device.DeviceMix``) and
            read by field (``facts.devices``; ``facts["devices"]`` reads the same).
        operands: the metadata ``(shape, dtype, device, ident)`` of the tensors involved.
        odd: the operands that stand out (the one on another device, the float64 one).
        made: where each odd operand was made, one provenance fact tuple each, added when the
            finding is reported (see ``Provenance.where_made``, opwatch.checks.provenance).
    """

    kind: str
    rule: str
    facts: Any = field(default=None, compare=False)
    operands: tuple = ()
    odd: tuple = ()
    made: tuple = ()


def tensor_names(func, count: int) -> list[str]:
    """Names for an op's ``count`` tensor arguments, in order, taken from its schema when each
    tensor argument is a single tensor (``self``, ``mask``, ``source``), and optional ones come
    after them and are either all given or one alone (``per_sample_weights`` of
    ``_embedding_bag``); ``#1``, ``#2``, ... otherwise (tensor lists, optional tensors that
    leave the positions unknown)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        names, optional, others = [], [], False
        for arg in schema.arguments:
            type_name = str(arg.type)
            if type_name == "Tensor":
                others = others or bool(optional)  # a required tensor after an optional one
                names.append(arg.name)
            elif type_name in ("Tensor?", "Optional[Tensor]"):
                optional.append(arg.name)
            elif "Tensor" in type_name:
                others = True
        if not others:
            if len(names) == count:
                return names
            if len(names) + len(optional) == count or (len(optional) == 1 and len(names) + 1 == count):
                return names + optional[: count - len(names)]
    return [f"#{i + 1}" for i in range(count)]
