"""The anomaly checks, one module each, and the small interface the interceptor feeds them by.

A pre-kernel check is a module with

- ``KIND``: the anomaly kind it reports;
- ``for_op(func)``: the check bound to one ``OpOverload``, or ``None`` when it cannot fire on
  that op. Asked once per op overload (the interceptor keeps the answer), so that everything
  that depends on the op alone (its name, its schema's rule) is settled before the hot path.
  The bound check is called as ``check(tensors, context) -> Finding | None`` with the op's
  tensor arguments as ``(shape, dtype, device, ident)`` tuples; ``context`` is the
  :class:`CheckContext`, which answers the few questions shapes cannot.

They see metadata only, so each is plain code testable without any mode running. Composite
modules (``nn.LSTM``, convolutions with a bias) check some arguments before any op is
dispatched: :mod:`~opwatch.checks.module_calls` judges those calls from the module pre-hook.

A check that needs to remember something about earlier ops owns that state in a *tracker* of
its own module: the broadcast check's :class:`~opwatch.checks.broadcast.ShapeProvenance` (how each
tensor got its size-1 dims) and the nan/inf check's
:class:`~opwatch.checks.nonfinite.NonFiniteTracker` (sync-free flags, resolved at check
points). A tracker has ``for_op(func)`` too, returning an *observer* called after the kernel
as ``observe(entry, inputs, outputs, metas)`` (the op's log entry, its inputs' and outputs'
metadata, the output tensors), or ``None`` when the op does not concern it.

:class:`ActiveChecks` is all the interceptor knows of the checks: which ones apply to an op,
the observers to call, the context, and the check points; their findings leave through one
exit, :class:`~opwatch.checks.pipeline.FindingPipeline` (``ActiveChecks.exit_to(reporter)``),
whose stages (a promotion's wait, where an odd operand was made, a nan/inf origin's
containment) belong to their checks.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..core.ops import facts_of
from ..core.records import E_PHASE, E_SITE, M_DTYPE, M_IDENT, M_SHAPE, entry_inputs, entry_outputs
from . import accumulation, broadcast, collectives, device, dtype, fingerprints, module_calls, nonfinite, pre_dispatch, promotions
from .pipeline import FindingPipeline
from .finding import Attribute, BeforeWatch, ComputedFrom, DefaultDevice, DefaultDtype, Finding, FromModule, MadeBy, Owned, Place, PythonData

__all__ = ["Finding", "CheckContext", "ActiveChecks", "PRE_KERNEL_CHECKS", "CHECK_NAMES", "DEFAULT_CHECK_NAMES", "KINDS"]

# Run in this order before each kernel; the first finding wins. ``accumulation`` is part of the
# dtype_mismatch check (its kind), in a module of its own.
PRE_KERNEL_CHECKS = (device, dtype, accumulation, broadcast, collectives)

# Names accepted by ``watch(checks=...)``.
CHECK_NAMES = tuple(dict.fromkeys(check.KIND for check in PRE_KERNEL_CHECKS)) + (nonfinite.NAME, pre_dispatch.NAME)

# The checks ``watch(checks=None)`` runs: all but collective_mismatch (a store round trip per
# collective, and every rank must turn it on). pre_dispatch (a function mode every torch
# function call goes through) is on: the device and dtype bugs it names raise inside torch's
# own Python before any op is dispatched, where no other check can see them.
DEFAULT_CHECK_NAMES = tuple(name for name in CHECK_NAMES if name != collectives.KIND)

# Anomaly kinds, as ``Anomaly.kind`` reports them.
KINDS = tuple(dict.fromkeys(check.KIND for check in PRE_KERNEL_CHECKS)) + nonfinite.KINDS


class CheckContext:
    """What a check may ask beyond shapes, about the op being checked.

    ``site`` and ``phase`` are set by the interceptor for each op before its checks run. The
    checks' trackers a check reads are here by name: ``shapes`` (the broadcast check's
    :class:`~opwatch.checks.broadcast.ShapeProvenance`), ``handshakes`` (the collectives
    check's); ``None`` when their check is off.
    """

    __slots__ = ("site", "phase", "args", "shapes", "handshakes", "_log", "_modules")

    def __init__(self, log, shapes: broadcast.ShapeProvenance | None, modules=None):
        self.site = 0  # source site id of the op (see OpLog.sites); 0 when unknown
        self.phase = "forward"  # "forward" or "backward"
        self.args = ()  # the op's other arguments, flat: position or name, value, ...
        self.shapes = shapes  # this watch's broadcast.ShapeProvenance when that check is on
        self.handshakes = None  # this watch's collectives.Handshakes when that check is on
        self._log = log
        self._modules = modules  # the ModuleStack, for where a stray tensor was made

    def producer(self, tensor: tuple) -> Place | None:
        """The op that produced ``tensor``, as a :class:`~opwatch.checks.finding.Place`."""
        record = self._log.producer_of(tensor[M_IDENT])
        return None if record is None else Place.of(record)

    def call_tensors(self) -> tuple[frozenset, tuple]:
        """The call of the program's that issued the op being checked (a composite function:
        the ops logged just before it at the same source site and phase, which ran inside
        the same call instruction): ``(made, passed)``, the idents of the tensors those ops
        made, and the metadata of the tensors they took that they did not make (what the
        program passed, parameters included). Slow: asked only once a finding is in view."""
        if not self.site:
            return frozenset(), ()
        made: set = set()
        taken: list = []
        for entry in reversed(self._log.entries):
            if entry[E_SITE] != self.site or entry[E_PHASE] != self.phase:
                break
            made.update(meta[M_IDENT] for meta in entry_outputs(entry) or ())
            taken.extend(entry_inputs(entry))
        return frozenset(made), tuple(meta for meta in taken if meta[M_IDENT] not in made)

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
            ``DefaultDtype("dtype", the dtype given or None, the default dtype)``;
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
        record = self._log.producer_of(ident)
        if record is None or not any(meta.shape == tensor[M_SHAPE] for meta in record.outputs or ()):
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
            return made._replace(detail=DefaultDtype("dtype", args.get("dtype"), torch.get_default_dtype()))
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
                return PythonData("python_data", record.position.expression(), Place.of(record) if moved else None)
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
            record = self._log.producer_of(source.ident)
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
                    held = self._held_through_views(meta) if meta.dtype == dtype else None
                    if held is not None:
                        return ComputedFrom("computed_from", held.how, held.cls, held.name, held.path)
                return None
            if not inputs:
                return None
            moved, *_ = inputs
            record = self._log.producer_of(moved.ident)
            if record is None:
                return None
        return None

    _VIEW_DEPTH = 3

    def _held_through_views(self, meta) -> Owned | None:
        """The module's parameter or buffer ``meta`` is, or is a view of (a Linear's weight
        reaches its ``mm`` as ``weight.t()``)."""
        for _ in range(self._VIEW_DEPTH):
            held = self._held_by_module(meta.ident)
            if held is not None:
                return held
            record = self._log.producer_of(meta.ident)
            if record is None or not hasattr(record.func, "_schema") or not facts_of(record.func).is_view or not record.inputs:
                return None
            meta, *_ = record.inputs
        return None

    def _is_lift_copy(self, record, source) -> bool:
        """Whether the copy ``record`` copies a lift's output on the same line
        (``torch.tensor(ndarray)`` lifts the array, then copies it)."""
        producer = self._log.producer_of(source.ident)
        if producer is None or not hasattr(producer.func, "_schema") or not facts_of(producer.func).is_lift:
            return False
        lifted, copied = producer.position, record.position
        return (lifted.filename, lifted.lineno, lifted.col, lifted.end_col) == (copied.filename, copied.lineno, copied.col, copied.end_col)

    def _held_by_module(self, ident: int) -> Owned | None:
        """Whose parameter or buffer the tensor ``ident`` is, when a module the watch saw
        called holds it."""
        if self._modules is None:
            return None
        owner = self._modules.owner_of(ident)
        if owner is None:
            return None
        kind, cls, name, path = owner
        return Owned(kind, path, name, cls)

    def _in_running_modules(self, ident: int) -> tuple | None:
        """The provenance of the tensor ``ident`` when a running module holds it."""
        for path, module in self._modules.running() if self._modules is not None else ():
            for name, value in vars(module).items():
                if id(value) == ident and isinstance(value, torch.Tensor):
                    return Attribute("attribute", type(module).__name__, name, path)
            for kind, named in (("parameter", module.named_parameters(recurse=False)), ("buffer", module.named_buffers(recurse=False))):
                for name, value in named:
                    if id(value) == ident:
                        return Owned(kind, path, name, type(module).__name__)
        return None


class ActiveChecks:
    """The checks one watch runs: bound per op, with their trackers and their context."""

    def __init__(self, enabled: frozenset[str], log, table_limit: int, modules=None, fingerprints: dict | None = None, every_op_checked: bool = False):
        self._enabled = enabled
        self._checks_module_calls = device.KIND in enabled or dtype.KIND in enabled
        self.shapes = broadcast.ShapeProvenance(table_limit, log) if broadcast.KIND in enabled else None
        # every_op_checked: each op is a check point (check_every=1, guard's replay): the nan/inf
        # tracker keeps every range it reads, for the inputs of an origin.
        self.values = nonfinite.NonFiniteTracker(log, keep_ranges=every_op_checked) if nonfinite.NAME in enabled else None
        self.context = CheckContext(log, self.shapes, modules)
        # dtype.silent_upcast findings waiting for their result's first use (checks.promotions).
        self.promotions = promotions.PendingPromotions() if dtype.KIND in enabled else None
        if collectives.KIND in enabled:
            self.context.handshakes = collectives.Handshakes()
        # watch(fingerprints=True): output fingerprints for opwatch.diff, read at check points.
        self.prints = fingerprints_tracker(log, fingerprints)
        self._trackers = tuple(tracker for tracker in (self.shapes, self.values, self.prints) if tracker is not None)

    def pre_kernel(self, func) -> tuple:
        """The bound pre-kernel checks that can fire on ``func``, in order."""
        bound = (check.for_op(func) for check in PRE_KERNEL_CHECKS if check.KIND in self._enabled)
        return tuple(check for check in bound if check is not None)

    def observers(self, func) -> tuple:
        """The trackers' observers to call after each kernel of ``func``."""
        bound = (tracker.for_op(func) for tracker in self._trackers)
        return tuple(observe for observe in bound if observe is not None)

    def input_observers(self, func) -> tuple:
        """The trackers' checks of ``func``'s input tensors, called after each kernel as
        ``observe(index, tensors)`` (tensors made before the watch, checked when first read)."""
        bound = (getattr(tracker, "for_inputs", _none)(func) for tracker in self._trackers)
        return tuple(observe for observe in bound if observe is not None)

    def module_call(self, module, args) -> Finding | None:
        """The finding of calling ``module`` with ``args``, judged before its forward runs
        (:mod:`~opwatch.checks.module_calls`), when its kind is enabled."""
        if not self._checks_module_calls:
            return None
        finding = module_calls.check_call(module, args)
        return finding if finding is not None and finding.kind in self._enabled else None

    def flags_wait_on(self, device) -> bool:
        """Whether nan/inf flags wait on ``device``: a host read there pays for a sync anyway."""
        return self.values is not None and self.values.pending_on(device)

    def exit_to(self, reporter):
        """The one exit of this watch's findings, in front of ``reporter``: a
        :class:`~opwatch.checks.pipeline.FindingPipeline` (defer, provenance, containment)."""
        return FindingPipeline(self, reporter)

    def resolve(self, log, since: int, *, reading=(), final: bool = False) -> list:
        """A nan/inf check point: the origins judged now
        (:class:`~opwatch.checks.nonfinite.Origin`, ``matters`` set), oldest first, among the
        ops of ``log`` from index ``since`` on; ``reading``: idents of the tensors the program
        is about to read on the host; ``final``: judge what is still alive (the program chose
        this point: the end of the block, ``Watch.check()``). Fingerprints are read here too."""
        if self.prints is not None:
            self.prints.resolve()
        if self.values is None:
            return []
        if not (self.values.pending or self.values.carrying or self.values.keep_ranges):
            self.values.forget_ranges()  # its ops were not followed
            return []
        return self.values.resolve(log.since(since), reading=reading, final=final)


def fingerprints_tracker(log, store: dict | None):
    """The :class:`~opwatch.checks.fingerprints.FingerprintTracker` filling ``store``, or
    ``None`` when fingerprints are off (``store`` is ``None``): then nothing is bound."""
    return None if store is None else fingerprints.FingerprintTracker(log, store)


def _none(func):
    return None
