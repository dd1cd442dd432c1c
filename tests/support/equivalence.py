"""Shared helpers for the opwatch equivalence tests.

opwatch must be *transparent*: running code under ``opwatch.watch()`` has to
produce exactly what the same code produces under a bare, do-nothing
``TorchDispatchMode``.  The reference is that passthrough mode and not plain
eager, because merely having a Python dispatch mode active changes a few
backward formulas (e.g. ``prod``'s goes down its subclass-safe branch); that is
PyTorch's doing, not opwatch's.

Contents

* :class:`PassthroughMode` -- the reference: a dispatch mode that only calls
  ``func(*args, **kwargs)``.
* :func:`watching` -- returns a fresh context manager for the mode under test.
  Defaults to ``opwatch.watch()``.  While the ``opwatch`` package does not
  exist yet (it cannot be found, or is a bare directory without
  ``__init__.py``) it falls back to :class:`StandInWatch`,
  a *second* passthrough mode, so that the harness itself can be proven and
  timed.  Set ``OPWATCH_EQUIV_TARGET=standin`` to force the stand-in.  If
  ``opwatch`` exists but is broken, importing it fails loudly (no fallback).
* :func:`clone_inputs` -- deep copy of (nested) op inputs that preserves
  layout (strides, storage offset, overlapping/expanded memory), aliasing
  between inputs (views of one storage stay views of one new storage),
  conj/neg bits, efficient-zero tensors, ``requires_grad`` and generator state.
* :func:`compare` / :func:`diff` -- bitwise comparison of nested outputs:
  container types, tensor subclass, dtype, shape, strides, storage offset,
  layout, conj/neg/zero-tensor bits, ``requires_grad``, ``grad_fn`` type, and
  the raw bits of the values (so NaN positions/payloads and signed zeros must
  match).  Python floats are compared bitwise as well.
* :func:`same_exception` -- exception-type comparison.
* :func:`capture` runs a thunk under a mode (after reseeding) and records its
  result or its exception (type, stage, traceback) plus the warnings raised;
  :func:`outcome_diff` compares two such outcomes.
* :func:`internal_errors` -- opwatch's contained crashes seen in a run.
* :func:`run_reference` / :func:`run_watched` / :func:`assert_transparent` --
  the "watched == reference, no warning, no anomaly" check of opwatch's own
  tests, with :func:`comparable`, :func:`opwatch_warnings` and :func:`ops`.
  These need the real opwatch (no stand-in).
"""

from __future__ import annotations

import importlib.util
import os
import struct
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "PassthroughMode",
    "StandInWatch",
    "watching",
    "target_name",
    "opwatch_warning_category",
    "clone_inputs",
    "compare",
    "diff",
    "same_exception",
    "internal_errors",
    "Outcome",
    "outcome_diff",
    "capture",
    "seed_everything",
    "comparable",
    "opwatch_warnings",
    "ops",
    "run_reference",
    "run_watched",
    "assert_transparent",
]


# --------------------------------------------------------------------------
# modes
# --------------------------------------------------------------------------


class PassthroughMode(TorchDispatchMode):
    """The reference: a bare dispatch mode that changes nothing.

    It only counts the ops it sees (``ops_seen``), so that tests can tell
    whether the watcher had anything to watch."""

    def __init__(self):
        super().__init__()
        self.ops_seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops_seen += 1
        return func(*args, **(kwargs or {}))


class StandInWatch(TorchDispatchMode):
    """Stand-in for ``opwatch.watch()`` while opwatch does not exist.

    A second passthrough mode with the small part of the ``watch`` API the
    tests read (``records``, ``anomalies``, ``contained``)."""

    def __init__(self):
        super().__init__()
        self.records: list = []
        self.anomalies: list = []
        self.contained: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _StandInWarning(UserWarning):
    """Placeholder for opwatch.OpwatchWarning when opwatch is absent."""


def _use_standin() -> bool:
    """True while there is no opwatch package to test (or when forced).

    "No package" means: not importable at all, or only a bare directory
    without ``__init__.py`` (a namespace package -- the lead is still
    writing it).  A real but broken opwatch is *not* replaced: importing it
    in :func:`watching` raises."""
    if os.environ.get("OPWATCH_EQUIV_TARGET", "").lower() == "standin":
        return True
    spec = importlib.util.find_spec("opwatch")
    return spec is None or spec.origin in (None, "namespace")


def target_name() -> str:
    """Human-readable name of the mode under test (for reports)."""
    if not _use_standin():
        return "opwatch.watch()"
    forced = os.environ.get("OPWATCH_EQUIV_TARGET", "").lower() == "standin"
    return "StandInWatch (forced by OPWATCH_EQUIV_TARGET)" if forced else "StandInWatch (opwatch not found)"


def watching():
    """A fresh context manager for the mode under test (default ``opwatch.watch()``)."""
    if _use_standin():
        return StandInWatch()
    import opwatch  # noqa: PLC0415 -- must fail loudly if opwatch is broken

    return opwatch.watch()


def opwatch_warning_category() -> type[Warning]:
    if _use_standin():
        return _StandInWarning
    import opwatch  # noqa: PLC0415

    return opwatch.OpwatchWarning


def seed_everything(seed: int = 0) -> None:
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


# --------------------------------------------------------------------------
# cloning inputs
# --------------------------------------------------------------------------


def clone_inputs(tree: Any) -> Any:
    """Deep-copy a nested structure of op inputs, preserving exact layout.

    Every strided tensor is rebuilt as ``set_(copied_storage, offset, size,
    stride)``; tensors that share a storage in ``tree`` share one copied
    storage in the result, and the same tensor object maps to the same clone.
    The result tensors are leaves with the original ``requires_grad``."""
    storages: dict[int, Any] = {}
    # id(original) -> (original, clone).  The original is kept alive so that
    # its id cannot be reused by a temporary (t.conj() below) during the copy.
    memo: dict[int, tuple] = {}

    def clone_tensor(t: torch.Tensor) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)][1]
        with torch.no_grad():
            if t._is_zerotensor():
                c = torch._efficientzerotensor(t.shape, dtype=t.dtype, device=t.device)
            elif t.is_conj():
                c = clone_tensor(t.conj()).detach().conj()
            elif t.is_neg():
                c = torch._neg_view(clone_tensor(torch._neg_view(t)).detach())
            elif t.layout != torch.strided or t.is_quantized or t.is_nested:
                c = t.detach().clone()
            else:
                st = t.untyped_storage()
                key = st.data_ptr() if st.nbytes() else id(t)
                if key not in storages:
                    storages[key] = st.clone()
                c = torch.empty(0, dtype=t.dtype, device=t.device)
                c.set_(storages[key], t.storage_offset(), t.size(), t.stride())
        c = c.detach()
        if t.requires_grad:
            c.requires_grad_(True)
        if type(t) is torch.nn.Parameter:
            c = torch.nn.Parameter(c, requires_grad=t.requires_grad)
        memo[id(t)] = (t, c)
        return c

    def go(x):
        if isinstance(x, torch.Tensor):
            return clone_tensor(x)
        if isinstance(x, torch.Generator):
            g = torch.Generator(device=x.device)
            g.set_state(x.get_state())
            return g
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
            return type(x)(*(go(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(go(v) for v in x)
        if isinstance(x, dict):
            return {k: go(v) for k, v in x.items()}
        return x

    return go(tree)


# --------------------------------------------------------------------------
# bitwise comparison
# --------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer tensor holding exactly the bits of ``t``'s values."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()])


def _grad_fn_name(t: torch.Tensor) -> str:
    # Reading .grad_fn can itself raise (e.g. a no_grad view whose base was
    # modified in place); that is part of the observable behaviour.
    try:
        g = t.grad_fn
    except Exception as e:  # noqa: BLE001
        return f"<raises {type(e).__name__}>"
    return type(g).__name__ if g is not None else "None"


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _tensor_diff(a: torch.Tensor, b: torch.Tensor, path: str, values: bool) -> str | None:
    if type(a) is not type(b):
        return f"{path}: tensor type {type(a).__name__} != {type(b).__name__}"
    meta = [
        ("dtype", lambda t: t.dtype),
        ("shape", lambda t: tuple(t.shape)),
        ("device", lambda t: t.device),
        ("layout", lambda t: t.layout),
        ("requires_grad", lambda t: t.requires_grad),
        ("is_conj", lambda t: t.is_conj()),
        ("is_neg", lambda t: t.is_neg()),
        ("is_zerotensor", lambda t: t._is_zerotensor()),
        ("grad_fn", _grad_fn_name),
    ]
    for name, get in meta:
        va, vb = get(a), get(b)
        if va != vb:
            return f"{path}: {name} {va} != {vb}"
    if a.layout == torch.strided and not a.is_nested:
        if a.stride() != b.stride():
            return f"{path}: stride {a.stride()} != {b.stride()}"
        if a.storage_offset() != b.storage_offset():
            return f"{path}: storage_offset {a.storage_offset()} != {b.storage_offset()}"
    if not values or a._is_zerotensor() or a.numel() == 0:
        return None
    if a.is_nested:
        return diff(a.unbind(), b.unbind(), path + ".unbind()", values=values)
    ba, bb = _bits(a), _bits(b)
    if torch.equal(ba, bb):
        return None
    ne = (ba != bb).nonzero().reshape(-1)
    first = int(ne[0])
    fa = a.detach().resolve_conj().resolve_neg()
    fb = b.detach().resolve_conj().resolve_neg()
    if fa.layout != torch.strided:
        fa, fb = fa.to_dense(), fb.to_dense()
    if fa.is_complex():
        fa, fb = torch.view_as_real(fa), torch.view_as_real(fb)
    fa, fb = fa.reshape(-1), fb.reshape(-1)
    return (
        f"{path}: {ne.numel()} of {ba.numel()} elements differ bitwise "
        f"(dtype {a.dtype}); first at flat index {first}: "
        f"{fa[first].item()!r} != {fb[first].item()!r}"
    )


def diff(a: Any, b: Any, path: str = "out", *, values: bool = True) -> str | None:
    """First difference between two nested results, or None if identical.

    ``values=False`` compares tensor metadata only (for ops whose outputs are
    uninitialized memory, e.g. ``torch.empty``)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} != {type(b).__name__}"
        return _tensor_diff(a, b, path, values)
    if type(a) is not type(b):
        return f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = diff(x, y, f"{path}[{i}]", values=values)
            if d:
                return d
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            d = diff(a[k], b[k], f"{path}[{k!r}]", values=values)
            if d:
                return d
        return None
    if isinstance(a, float):
        if _float_bits(a) != _float_bits(b):
            return f"{path}: {a!r} != {b!r}"
        return None
    if isinstance(a, complex):
        if _float_bits(a.real) != _float_bits(b.real) or _float_bits(a.imag) != _float_bits(b.imag):
            return f"{path}: {a!r} != {b!r}"
        return None
    try:
        eq = a == b
        if isinstance(eq, bool) and eq:
            return None
        if not isinstance(eq, bool) and a is b:
            return None
    except Exception:  # noqa: BLE001
        pass
    if a is b or repr(a) == repr(b):
        return None
    return f"{path}: {a!r} != {b!r}"


def compare(a: Any, b: Any, *, values: bool = True) -> bool:
    return diff(a, b, values=values) is None


def same_exception(a: BaseException | None, b: BaseException | None) -> bool:
    """Both None, or both exceptions of exactly the same type."""
    if a is None or b is None:
        return a is None and b is None
    return type(a) is type(b)


# --------------------------------------------------------------------------
# running a thunk under a mode
# --------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one run produced: a result (nested) or an exception at a stage."""

    result: Any = None
    exc: BaseException | None = None
    stage: str | None = None  # where the exception happened
    tb: str = ""
    extra: dict = field(default_factory=dict)

    def describe_exc(self) -> str:
        if self.exc is None:
            return "no exception"
        msg = str(self.exc).strip().splitlines()
        first = msg[0][:300] if msg else ""
        return f"{type(self.exc).__name__} in {self.stage}: {first}"


def outcome_diff(ref: Outcome, got: Outcome, *, values: bool = True) -> str | None:
    """Difference between two outcomes (exception types, then results)."""
    if not same_exception(ref.exc, got.exc) or (ref.exc is not None and ref.stage != got.stage):
        text = f"exception mismatch: reference: {ref.describe_exc()} | watched: {got.describe_exc()}"
        if got.exc is not None and got.tb:
            text += "\nwatched traceback (tail):\n" + got.tb
        return text
    return diff(ref.result, got.result, "result", values=values)


def capture(
    mode_factory: Callable[[], Any],
    body: Callable[[dict], Any],
    *,
    seed: int = 0,
) -> Outcome:
    """Run ``body(state)`` inside ``with mode_factory():`` after seeding.

    ``body`` stores partial results in ``state`` (a dict) and sets
    ``state['stage']``; whatever it returns is the result.  Exceptions are
    allowed to propagate through the mode's ``__exit__`` (so that a watcher
    which swallows or rewraps them is caught) and recorded with the stage.
    Warnings are recorded and dropped so that they cannot turn into errors.
    """
    state: dict = {"stage": "setup"}
    out = Outcome()
    seed_everything(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with mode_factory() as mode:
                state["mode"] = mode
                out.result = body(state)
        except Exception as e:  # noqa: BLE001
            out.exc = e
            out.stage = state.get("stage")
            out.tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
            out.result = state.get("partial")
            # Do not keep frames (and the tensors they reference) alive.
            e.__traceback__ = None
    out.extra["warnings"] = caught
    out.extra["mode"] = state.get("mode")
    return out


def internal_errors(outcome: Outcome) -> list[str]:
    """OpwatchWarnings recorded during a run that report an opwatch internal error.

    opwatch contains its own crashes (it warns "opwatch hit an internal error
    and stopped watching this block") instead of breaking the program; for the
    tests that is still a crash of opwatch."""
    cat = opwatch_warning_category()
    return [
        str(w.message)
        for w in outcome.extra.get("warnings", ())
        if issubclass(w.category, cat) and "internal error" in str(w.message).lower()
    ]


# --------------------------------------------------------------------------
# opwatch's own transparency checks
# --------------------------------------------------------------------------
# opwatch is imported inside each helper: this module must stay importable
# while opwatch does not exist (see watching).


def comparable(value: Any) -> Any:
    """Nested tensors refuse ``.shape``: compare them as (layout, components)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return ("nested", str(value.layout), value.dtype, [comparable(part) for part in value.unbind()])
    if isinstance(value, (list, tuple)):
        return type(value)(comparable(item) for item in value)
    return value


def opwatch_warnings(caught) -> list[str]:
    """The messages of the OpwatchWarnings in ``caught`` (a ``catch_warnings(record=True)`` list)."""
    import opwatch  # noqa: PLC0415

    return [str(c.message) for c in caught if issubclass(c.category, opwatch.OpwatchWarning)]


def ops(records) -> list[str]:
    """The op names of ``records``, in order."""
    return [r.op for r in records]


def run_reference(fn: Callable[[], Any], seed: int = 0, *, plain: bool = False) -> Any:
    """``fn()`` after reseeding, under :class:`PassthroughMode` (plain eager with ``plain=True``), warnings silenced."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if plain:
            return fn()
        with PassthroughMode():
            return fn()


def run_watched(fn: Callable[[], Any], seed: int = 0, **options) -> tuple[Any, Any, list[str]]:
    """``fn()`` after reseeding, under ``opwatch.watch(**options)``: (result, watch, OpwatchWarning messages)."""
    import opwatch  # noqa: PLC0415

    torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch(**options) as w:
            out = fn()
    return out, w, opwatch_warnings(caught)


def assert_transparent(fn: Callable[[], Any], *, values: bool = True, plain: bool = False) -> tuple[Any, Any]:
    """Run ``fn`` under the reference and under a watch; check the common promises.

    The watched result equals the reference bitwise, no OpwatchWarning, no
    anomaly, and something was recorded.  Returns (watched result, watch)."""
    ref = run_reference(fn, plain=plain)
    got, w, warned = run_watched(fn)
    difference = diff(comparable(ref), comparable(got), "result", values=values)
    assert difference is None, difference
    assert warned == [], "OpwatchWarning(s):\n" + "\n---\n".join(warned)
    assert w.anomalies == [], [a.message for a in w.anomalies]
    assert w.records, "nothing recorded"
    return got, w
