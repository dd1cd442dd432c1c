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
exit, :class:`~opwatch.findings.pipeline.FindingPipeline` (on the findings floor, above the
checks), whose stages belong to their checks: a promotion's wait (:mod:`.promotions`), where an
odd operand was made (:mod:`.provenance`, asking :mod:`.owners` who holds a tensor), a nan/inf
origin's containment (:mod:`.nonfinite`).
"""

from __future__ import annotations

from functools import partial

from ..core.records import E_PHASE, E_SITE, M_IDENT, entry_inputs, entry_outputs
from . import accumulation, broadcast, collectives, device, dtype, fingerprints, module_calls, nonfinite, pre_dispatch, promotions
from .finding import Finding, Place
from .provenance import Provenance

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

    __slots__ = ("site", "phase", "args", "shapes", "handshakes", "_log")

    def __init__(self, log, shapes: broadcast.ShapeProvenance | None):
        self.site = 0  # source site id of the op (see OpLog.sites); 0 when unknown
        self.phase = "forward"  # "forward" or "backward"
        self.args = ()  # the op's other arguments, flat: position or name, value, ...
        self.shapes = shapes  # this watch's broadcast.ShapeProvenance when that check is on
        self.handshakes = None  # this watch's collectives.Handshakes when that check is on
        self._log = log

    def producer(self, tensor: tuple) -> Place | None:
        """The op that produced ``tensor``, as a :class:`~opwatch.checks.finding.Place`."""
        record = self._log.producer_of(tensor[M_IDENT], like=tensor)
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

class ActiveChecks:
    """The checks one watch runs: bound per op, with their trackers and their context."""

    def __init__(self, enabled: frozenset[str], log, table_limit: int, owners=None, fingerprints: dict | None = None, every_op_checked: bool = False, earlier=None):
        self._enabled = enabled
        self._checks_module_calls = device.KIND in enabled or dtype.KIND in enabled
        self.shapes = broadcast.ShapeProvenance(table_limit, log) if broadcast.KIND in enabled else None
        # every_op_checked: each op is a check point (check_every=1, guard's replay): the nan/inf
        # tracker keeps every range it reads, for the inputs of an origin. earlier: the watch's
        # nonfinite.EarlierBlocks, what its last block's tracker knew (None: a fresh one).
        self.values = nonfinite.NonFiniteTracker(log, keep_ranges=every_op_checked, earlier=earlier) if nonfinite.NAME in enabled else None
        self.context = CheckContext(log, self.shapes)
        # Where a finding's odd operand was made, asked when it is reported; ``owners``: the
        # watch's checks.owners.ModuleOwners (None: no module is asked).
        self.provenance = Provenance(log, owners)
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

    def backward_from(self, tensors) -> None:
        """``backward()`` runs on ``tensors`` (the loss): told to the nan/inf check, when it is on."""
        if self.values is not None:
            self.values.backward_from(tensors)

    def flags_wait_on(self, device) -> bool:
        """Whether nan/inf flags wait on ``device``: a host read there pays for a sync anyway."""
        return self.values is not None and self.values.pending_on(device)

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
        return self.values.resolve(partial(log.since, since), reading=reading, final=final)


def fingerprints_tracker(log, store: dict | None):
    """The :class:`~opwatch.checks.fingerprints.FingerprintTracker` filling ``store``, or
    ``None`` when fingerprints are off (``store`` is ``None``): then nothing is bound."""
    return None if store is None else fingerprints.FingerprintTracker(log, store)


def _none(func):
    return None
