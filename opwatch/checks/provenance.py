"""Where a finding's odd operand was made: the provenance facts of ``Finding.made``.

A check names the operand that does not fit (``Finding.odd``); when the finding is reported,
the exit of findings (:class:`~opwatch.findings.pipeline.FindingPipeline`) asks
:meth:`Provenance.with_provenance` where each one came from: a module's attribute, parameter or
buffer, Python or NumPy data entering torch, a factory op that took torch's default, the op
that computed it. It reads the watch's log (the ops that made a tensor) and the watch's
:class:`~opwatch.checks.owners.ModuleOwners` (who holds a tensor). Slow on purpose: it runs
once a finding is in view, never on a healthy op. The facts are rendered by
:func:`opwatch.render.phrases.where_made`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..core.compat import module_class_name
from ..core.ops import facts_of
from ..core.sites import lone_call
from . import device
from .finding import Attribute, BeforeWatch, ComputedFrom, DefaultDevice, DefaultDtype, Finding, FromModule, MadeBy, Owned, Place, PythonData
from ..core.records import M_DTYPE, M_IDENT, M_SHAPE

__all__ = ["Provenance"]


class Provenance:
    """Where the tensors of one watch were made: ``log`` is its op log; ``owners`` its
    :class:`~opwatch.checks.owners.ModuleOwners` (``None``: no module is asked)."""

    __slots__ = ("_log", "_owners")

    def __init__(self, log, owners=None):
        self._log = log
        self._owners = owners

    def with_provenance(self, finding: Finding) -> Finding:
        """``finding`` with where each odd operand was made (``Finding.made``, one
        :meth:`where_made` fact each, rendered after the problem), worked out once, when it is
        reported (slow: never on a healthy op); unchanged when it has no odd operand or says
        already."""
        if not finding.odd or finding.made:
            return finding
        missing = "device" if finding.kind == device.KIND else "dtype"
        return replace(finding, made=tuple(self.where_made(meta, missing=missing) for meta in finding.odd))

    def where_made(self, tensor: tuple, *, missing: str) -> tuple:
        """Where ``tensor`` came from, as a provenance fact tuple (slow: never on a healthy op;
        rendered by :func:`opwatch.render.phrases.where_made`):

        - ``Attribute("attribute", module class name, attribute name, module path)``: a plain
          tensor attribute of a running module;
        - ``Owned("parameter" | "buffer", module path, name, module class name)``: of a running
          module, or of any model the watch saw called;
        - ``MadeBy("made_by", Place, detail)``: the op that made it; ``detail`` tells more:

          - for a factory op called without the ``missing`` argument (``"device"``,
            ``"dtype"``), what torch filled in: ``DefaultDevice("default_device", device)`` or
            ``DefaultDtype("default_dtype", the dtype given or None, the default dtype)``;
          - ``PythonData("python_data", expression or None, Place or None)``: Python or NumPy
            data entering torch (``torch.from_numpy(a)``, ``torch.tensor(a)``): the call's
            source text when known, and, when the odd tensor was then only indexed, viewed or
            copied (``Place`` is the op that made it), where the data entered;
          - ``FromModule("from_module", "parameter" | "buffer", module class name, name, module
            path)``: the op only indexed, viewed or copied that parameter or buffer
            (``self.class_w[target]``);
          - ``ComputedFrom("computed_from", ...)``, the same fields: the op that made it (or
            the one whose output it only viewed) computed it from that parameter or buffer, of
            the odd tensor's dtype (a Linear kept in float32 in a float16 model);
          - else ``None``;
        - ``BeforeWatch("before_watch")``: made before the watch (or outside torch ops).
        """
        ident = tensor[M_IDENT]
        found = self._in_running_modules(ident) or self._held_by_module(ident)
        if found is not None:
            return found
        # Under its id the log may hold an older tensor's op, of another shape, dtype or device,
        # whose address it took once that one was freed (a batch made between two blocks of a
        # re-entered watch often does): then no op made it.
        record = self._log.producer_of(ident, like=tensor)
        if record is None:
            return BeforeWatch()
        made = MadeBy("made_by", Place.of(record))
        if not hasattr(record.func, "_schema"):
            return made
        facts = facts_of(record.func)
        if facts.is_lift or facts.preserves_values or facts.keeps_values or facts.is_copy:
            source = self._source(record)
            if source is None and missing == "dtype":
                source = self._computed_from(record, tensor[M_DTYPE])
            return made if source is None else made._replace(detail=source)
        if not facts.is_factory:
            computed = self._computed_from(record, tensor[M_DTYPE]) if missing == "dtype" else None
            return made if computed is None else made._replace(detail=computed)
        args = dict(record.args)
        if missing == "device" and args.get("device") == torch.get_default_device():
            # torch fills the default in: whether the program named it cannot be told.
            return made._replace(detail=DefaultDevice("default_device", args["device"]))
        if missing == "dtype":
            return made._replace(detail=DefaultDtype("default_dtype", args.get("dtype"), torch.get_default_dtype()))
        return made

    # A lift, then ops that only move values (or a copy of the lift: torch.tensor(ndarray)):
    # followed back this many ops at most.
    _SOURCE_DEPTH = 8

    def _source(self, record) -> PythonData | FromModule | None:
        """Where the values of ``record``'s output came from when the op (and those before it)
        only moved them: Python data (``PythonData``) or a module's parameter or buffer
        (``FromModule``); ``None`` otherwise."""
        moved = False  # through ops that only moved the values (not the copy of torch.tensor(a))
        for _ in range(self._SOURCE_DEPTH):
            facts = facts_of(record.func)
            if facts.is_lift:
                return PythonData("python_data", _python_data_call(record.position), Place.of(record) if moved else None)
            inputs = record.inputs
            if not inputs or not (facts.preserves_values or facts.keeps_values or facts.is_copy):
                return None
            source = inputs[0]
            if facts.is_copy and not self._is_lift_copy(record, source):
                return None  # a cast or a move made it: that op is where it was made
            moved = moved or not facts.is_copy
            held = self._held_by_module(source.ident)
            if held is not None:
                return FromModule("from_module", held.how, held.cls, held.name, held.path)
            record = self._log.producer_of(source.ident, before=record.index)  # an id is reused once its tensor dies
            if record is None or not hasattr(record.func, "_schema"):
                return None
        return None

    def _computed_from(self, record, dtype) -> ComputedFrom | None:
        """The parameter or buffer of ``dtype`` that the op computing ``record``'s output read
        (through ops that only viewed or moved that output: a Linear's ``_unsafe_view`` after its
        ``mm``); ``None`` when it read none."""
        for _ in range(self._SOURCE_DEPTH):
            if not hasattr(record.func, "_schema"):
                return None
            facts = facts_of(record.func)
            inputs = record.inputs or ()
            if not (facts.preserves_values or facts.keeps_values) or facts.is_copy:
                for meta in inputs:
                    held = self._held_through_views(meta, record.index) if meta.dtype == dtype else None
                    if held is not None:
                        return ComputedFrom("computed_from", held.how, held.cls, held.name, held.path)
                return None
            if not inputs:
                return None
            moved, *_ = inputs
            record = self._log.producer_of(moved.ident, before=record.index)
            if record is None:
                return None
        return None

    _VIEW_DEPTH = 3

    def _held_through_views(self, meta, read_at: int) -> Owned | None:
        """The module's parameter or buffer ``meta`` (an input of op ``read_at``) is, or is a
        view of (a Linear's weight reaches its ``mm`` as ``weight.t()``)."""
        for _ in range(self._VIEW_DEPTH):
            held = self._held_by_module(meta.ident)
            if held is not None:
                return held
            record = self._log.producer_of(meta.ident, before=read_at)
            if record is None or not hasattr(record.func, "_schema") or not facts_of(record.func).is_view or not record.inputs:
                return None
            meta, *_ = record.inputs
            read_at = record.index
        return None

    def _is_lift_copy(self, record, source) -> bool:
        """Whether the copy ``record`` copies a lift's output on the same line
        (``torch.tensor(ndarray)`` lifts the array, then copies it)."""
        producer = self._log.producer_of(source.ident, before=record.index)
        if producer is None or not hasattr(producer.func, "_schema") or not facts_of(producer.func).is_lift:
            return False
        lifted, copied = producer.position, record.position
        if copied.col is None:
            # No columns (Python 3.10): a cast on the lift's line (``from_numpy(a).double()``)
            # is told from torch.tensor's own copy by what it is given: the latter names a device.
            return (lifted.filename, lifted.lineno) == (copied.filename, copied.lineno) and "device" in dict(record.args)
        return (lifted.filename, lifted.lineno, lifted.col, lifted.end_col) == (copied.filename, copied.lineno, copied.col, copied.end_col)

    def _held_by_module(self, ident: int) -> Owned | None:
        """Whose parameter or buffer the tensor ``ident`` is, when a module the watch saw
        called holds it."""
        if self._owners is None:
            return None
        owner = self._owners.owner_of(ident)
        if owner is None:
            return None
        kind, cls, name, path = owner
        return Owned(kind, path, name, cls)

    def _in_running_modules(self, ident: int) -> tuple | None:
        """The provenance of the tensor ``ident`` when a running module holds it."""
        for path, module in self._owners.running() if self._owners is not None else ():
            for name, value in vars(module).items():
                if id(value) == ident and isinstance(value, torch.Tensor):
                    return Attribute("attribute", module_class_name(module), name, path)
            for kind, named in (("parameter", module.named_parameters(recurse=False)), ("buffer", module.named_buffers(recurse=False))):
                for name, value in named:
                    if id(value) == ident:
                        return Owned(kind, path, name, module_class_name(module))
        return None


# The calls that bring Python or NumPy data into torch, by their last name.
_PYTHON_DATA_CALLS = frozenset(("tensor", "as_tensor", "asarray", "from_numpy"))


def _python_data_call(position) -> str | None:
    """The user's call that lifted Python data: its sub-expression, or (Python 3.10: no columns)
    the one such call on its line."""
    return position.expression() or lone_call(position.filename, position.lineno, _PYTHON_DATA_CALLS)
