"""The one codec of facts: a finding's facts, tensor metadata and ops to JSON values and back.

Values go through :func:`encode` / :func:`decode`, for any rule's facts: numbers, strings,
booleans and None as they are; tuples as JSON arrays; non-finite floats as
``"nan"``/``"inf"``/``"-inf"`` (and a string that reads like one as ``{"str": ...}``);
everything else as a one-key object naming its kind: ``{"list": [...]}``, ``{"dict": {...}}``
(string keys) or ``{"pairs": [[k, v], ...]}``, ``{"dtype": "float32"}``, ``{"device":
"cuda:0"}``, ``{"layout": ...}``, ``{"memory_format": ...}``, ``{"complex": [re, im]}``,
``{"size": [...]}`` (``torch.Size``), a named tuple of facts as ``{tag: [items]}`` (its tag
registered by :func:`~opwatch.core.fact_tuples.fact_tuple`: ``{"meta": [shape, dtype, device,
ident]}`` for a :class:`~opwatch.core.notation.TensorMeta` (a DTensor's with a fifth item, its
``{"sharding": [local shape, placements, mesh shape]}``), ``{"place": [op, filename, lineno,
phase, label]}`` for a :class:`~opwatch.checks.finding.Place`, ``{"made_by": [...]}`` for where
an operand was made), ``{"op": "aten.add.Tensor"}`` (an ``OpOverload``), ``{"repr": ...}`` for
anything else (read back as that text). Tensor metadata tuples ``(shape, dtype, device,
ident)`` are tuples of these; other tuple and list types (a named tuple not registered) are
written as their items and read back as plain tuples: register a new kind of fact tuple that
must keep its type.
"""

from __future__ import annotations

import math

import torch

from .. import checks  # noqa: F401  (every check module: each rule's facts class registered)
from ..checks.collectives import CollectiveCall
from ..checks.finding import Finding
from ..checks.nonfinite.cause import MATH, Cause, range_cause
from ..checks.nonfinite.origin import read_facts
from ..checks.nonfinite.rules import ValueRange
from ..core.bounded import BoundedCache
from ..core.fact_tuples import CLASSES, TAGS, RuleFacts, facts_of_rule
from ..core.notation import Sharding, TensorMeta
from ..core.records import M_SHARDING as _SHARDING

__all__ = ["encode", "decode", "meta_fields", "meta_from_fields", "finding_fields", "finding_from_fields", "op_named", "rule_facts_from_saved"]

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def meta_fields(meta) -> dict:
    """A :class:`TensorMeta` as the record fields of a saved log; a DTensor's adds
    ``"sharding": [local shape, placements' facts, mesh shape]`` (a plain tensor's fields are
    those of format 3 before DTensors were recorded)."""
    shape = None if meta.shape is None else [_size(size) for size in meta.shape]
    fields = {"shape": shape, "dtype": _name(meta.dtype), "device": str(meta.device), "ident": meta.ident}
    if meta.sharding is not None:
        fields["sharding"] = encode(tuple(meta.sharding))
    return fields


def _size(size):
    try:
        return int(size)
    except (TypeError, ValueError):  # a symbolic size
        return str(size)


def _name(value) -> str:
    """``torch.float32`` -> ``"float32"``; also layouts and memory formats."""
    return str(value).removeprefix("torch.")


def finding_fields(finding) -> dict:
    return {
        "kind": finding.kind,
        "rule": finding.rule,
        "facts": encode(finding.facts.fields() if isinstance(finding.facts, RuleFacts) else finding.facts),
        "operands": encode(finding.operands),
        "odd": encode(finding.odd),
        "made": encode(finding.made),
    }


def finding_from_fields(fields: dict):
    return Finding(
        fields["kind"],
        fields["rule"],
        rule_facts_from_saved(fields["rule"], fields["kind"], decode(fields["facts"])),
        decode(fields["operands"]),
        decode(fields["odd"]),
        decode(fields["made"]),
    )


def rule_facts_from_saved(rule: str, kind: str, facts: dict):
    """A saved finding's facts (by name, as every format wrote them) as its rule's class, with
    what a log of an older version lacks worked out from what it holds (never in render):
    tensor metadata saved as plain items (format 4 and older) read as :class:`TensorMeta`."""
    facts = {name: _named_metas(value) for name, value in facts.items()}
    if rule in ("nonfinite.origin", "nonfinite.received"):
        facts = _upgraded_origin(kind, facts)
    elif rule.startswith("collective.") and "calls" in facts:  # format 4 and older: each call a dict
        facts = dict(facts, calls=[call if isinstance(call, CollectiveCall) else CollectiveCall(**call) for call in facts["calls"]])
    elif rule == "dtype.one_dtype" and "common" not in facts:  # a log older than the fact
        first, *_ = facts["dtypes"]
        facts = dict(facts, common=first)
    elif rule == "dtype.silent_upcast" and facts.get("common") is None:  # a log older than the fact
        facts = dict(facts, common=min(facts["dtypes"], key=lambda dtype: dtype.itemsize))
    return facts_of_rule(rule, facts)


def _named_metas(value):
    """``value`` with every tensor's metadata in it (a plain ``(shape, dtype, device, ident)``
    tuple) as a :class:`TensorMeta`, inside tuples, lists and named tuples of facts too."""
    if type(value) is tuple:
        if _is_plain_meta(value):
            return TensorMeta(*value)
        return tuple(_named_metas(item) for item in value)
    if type(value) is list:
        return [_named_metas(item) for item in value]
    if isinstance(value, tuple) and type(value) is not TensorMeta and hasattr(value, "_fields"):
        return type(value)._make(_named_metas(item) for item in value)
    return value


def _is_plain_meta(value: tuple) -> bool:
    if len(value) not in (4, 5):
        return False
    shape, dtype, device, ident, *_ = value
    return (
        (shape is None or type(shape) is tuple) and isinstance(dtype, (torch.dtype, str)) and isinstance(device, (torch.device, str))
        and type(ident) is int
    )


def _upgraded_origin(kind: str, facts: dict) -> dict:
    """An origin's facts as this version makes them: input ranges of a log exported before
    ranges were tagged (plain ``(min, max)`` / ``(min, max, "within")`` tuples) as
    :class:`ValueRange`; a cause saved untagged as a :class:`Cause`; and a log saved before
    causes were facts: the cause the inputs' ranges show (the check's ``range_cause``)."""
    upgraded = dict(facts)
    upgraded["input_ranges"] = tuple(
        (meta, value_range if value_range is None or type(value_range) is ValueRange else ValueRange(*value_range))
        for meta, value_range in facts.get("input_ranges", ())
    )
    if "cause" in facts:
        cause = facts["cause"]
        upgraded["cause"] = cause if cause is None or isinstance(cause, Cause) else Cause(*cause)
    else:
        ranges = [value_range for _, value_range in upgraded["input_ranges"]]
        detail = range_cause(facts.get("op_name"), kind, facts.get("outputs", ()), ranges)
        upgraded["cause"] = None if detail is None else Cause(MATH, detail)
    if "written" not in facts:  # format 4 and older: what the inputs show, worked out now
        upgraded.update(read_facts(facts.get("op_name"), facts.get("inputs", ()), facts.get("outputs", ()), upgraded["input_ranges"]))
    return upgraded


# -- the codec of values --------------------------------------------------------------------


def encode(value):
    """``value`` (a fact, an argument) as JSON data that :func:`decode` turns back into an
    equal value of the same type (see the module's docstring for the forms)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _nonfinite_name(value)
    if isinstance(value, str):
        return {"str": value} if value in _NONFINITE else value
    if type(value) is tuple:
        return [encode(item) for item in value]
    if type(value) is list:
        return {"list": [encode(item) for item in value]}
    if isinstance(value, dict):
        if all(type(key) is str for key in value):
            return {"dict": {key: encode(item) for key, item in value.items()}}
        return {"pairs": [[encode(key), encode(item)] for key, item in value.items()]}
    tagged = _encode_tagged(value)
    if tagged is not None:
        return tagged
    if isinstance(value, (tuple, list)):  # another tuple or list type: its items
        return [encode(item) for item in value]
    return {"repr": repr(value)}


def _encode_tagged(value) -> dict | None:
    tag = TAGS.get(type(value))
    if tag is not None:  # a registered named tuple of facts
        if type(value) is TensorMeta and value.sharding is None:
            value = value[:_SHARDING]  # a plain tensor's: the four items it always had
        return {tag: [encode(item) for item in value]}
    if isinstance(value, torch.Size):
        return {"size": [encode(item) for item in value]}
    if isinstance(value, complex):
        return {"complex": [encode(value.real), encode(value.imag)]}
    for kind, tag in ((torch.dtype, "dtype"), (torch.layout, "layout"), (torch.memory_format, "memory_format")):
        if isinstance(value, kind):
            return {tag: _name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if hasattr(value, "overloadpacket"):  # an OpOverload
        return {"op": str(value)}
    return None


def _nonfinite_name(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def decode(value):
    """The value that :func:`encode` wrote as ``value``."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, list):
        return tuple(decode(item) for item in value)
    if isinstance(value, dict):
        (tag, inner), = value.items()
        decoder = _DECODERS.get(tag)
        if decoder is not None:
            return decoder(inner)
        named = CLASSES.get(tag)
        if named is None:
            raise ValueError(f"unknown value tag {tag!r}; the tags are {', '.join(map(repr, [*_DECODERS, *CLASSES]))}")
        value = named(*_decode_items(inner))
        if tag == "default_dtype" and value.how == "dtype":  # format 4 and older said "dtype"
            value = value._replace(how=tag)
        return value
    return value


def _decode_items(inner) -> list:
    return [decode(item) for item in inner]


def _size_of(inner):
    return torch.Size(_decode_items(inner))


_DECODERS = {
    "str": lambda inner: inner,
    "repr": lambda inner: inner,
    "list": _decode_items,
    "dict": lambda inner: {key: decode(item) for key, item in inner.items()},
    "pairs": lambda inner: {decode(key): decode(item) for key, item in inner},
    "complex": lambda inner: complex(*_decode_items(inner)),  # [real, imag]
    "device": lambda inner: _device(inner),
    "dtype": lambda inner: _torch_attribute(inner),
    "layout": lambda inner: _torch_attribute(inner),
    "memory_format": lambda inner: _torch_attribute(inner),
    "size": _size_of,
    "op": lambda inner: op_named(inner),
}


def meta_from_fields(fields: dict):
    shape = fields["shape"]
    sharding = fields.get("sharding")  # a DTensor's only
    return TensorMeta(
        None if shape is None else tuple(shape),
        _torch_attribute(fields["dtype"]),
        _device(fields["device"]),
        fields["ident"],
        None if sharding is None else Sharding(*decode(sharding)),
    )


# Names read back -> torch's objects: a few dozen dtypes and devices, one op per distinct op.
_NAMED = BoundedCache(4096)


def _torch_attribute(name: str):
    """``"float32"`` -> ``torch.float32`` (dtypes, layouts, memory formats); the name itself
    when this torch has no such attribute."""
    return _NAMED.lookup(("attribute", name), _find_attribute)


def _device(name: str):
    return _NAMED.lookup(("device", name), _find_device)


def op_named(name: str):
    """``"aten.add.Tensor"`` -> ``torch.ops.aten.add.Tensor``; the name when this torch does
    not have that op."""
    return _NAMED.lookup(("op", name), _find_op)


def _find_attribute(key: tuple):
    _, name = key
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else name


def _find_device(key: tuple):
    _, name = key
    try:
        return torch.device(name)
    except (RuntimeError, ValueError):
        return name


def _find_op(key: tuple):
    _, name = key
    namespace, _, rest = name.partition(".")
    packet, _, overload = rest.partition(".")
    try:
        func = getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
    except (AttributeError, RuntimeError):
        return name
    return func if str(func) == name else name
