"""The one exit of findings from the hot path: every finding of a watch (a pre-kernel check's,
a module call's, a pre-dispatch call's, a nan/inf check point's) leaves through a
:class:`FindingPipeline`, in front of the reporter. Its stages, each owned by its check:

1. **defer**: a promotion waits for its result's first use and is dropped when cast straight
   back (:class:`~opwatch.checks.promotions.PendingPromotions`);
2. **provenance**: where each odd operand was made (:meth:`~opwatch.checks.provenance.Provenance.with_provenance`);
3. **containment**: a nan/inf origin whose values reached no sink is contained, not an anomaly
   (:func:`opwatch.checks.nonfinite.verdict`);

then the reporter (``report(finding, record, *, contained, may_raise)``: in strict mode it
returns the error to raise, which the pipeline hands back to its caller to raise outside
opwatch's internal-error guard).

It sits on the findings floor, above the checks whose stages it runs and below the modes that
feed it, so that a finding travels down from the interceptor: modes -> findings (here, then the
reporter) -> checks and render. opwatch's own torch calls at a check point run with its modes
off, the function mode (:mod:`opwatch.modes.functions`) included.

The interceptor calls it at the moments of an op that can carry a finding: before an op while
findings wait (:meth:`before`), when a check found one (:meth:`found`), once the op's kernel
returned or raised (:meth:`ran`), and at a check point (:meth:`check_point`); a call judged
before it runs (a module call, a pre-dispatch function) goes out by :meth:`deliver`. What goes
wrong in here raises to the caller, whose guard turns it into one warning.
"""

from __future__ import annotations

from ..checks.nonfinite import verdict
from ..core.compat import no_python_dispatch, no_torch_function

__all__ = ["FindingPipeline"]


class FindingPipeline:
    """The findings of one watch on their way to ``reporter``; ``checks`` is the watch's
    :class:`~opwatch.checks.ActiveChecks`."""

    __slots__ = ("waiting", "_checks", "_provenance", "_reporter", "_promotions", "_held")

    def __init__(self, checks, reporter):
        self._checks = checks
        self._provenance = checks.provenance
        self._reporter = reporter
        self._promotions = checks.promotions  # None when the dtype check is off
        # True while findings wait for an op that uses their result: then every op is shown
        # to before() first (a healthy program never has one waiting).
        self.waiting = False
        self._held = None  # the finding of the op running now, to wait once its output exists

    def found(self, finding, record):
        """``finding`` of the op (or call) logged as ``record``, before its kernel runs: held
        until :meth:`ran` when it waits for its result's use, else reported. Returns the error
        strict mode raises now, or ``None``."""
        promotions = self._promotions
        if promotions is not None and promotions.takes(finding):
            self._held = finding  # judged where its result is used
            return None
        return self._report(finding, record)

    def deliver(self, finding, record):
        """``finding`` of a call judged before it runs (a module's forward, a torch function),
        logged as ``record``: reported now, nothing to wait for. Returns the error strict mode
        raises, or ``None``."""
        return self._report(finding, record)

    def ran(self, record, outputs) -> None:
        """The op logged as ``record`` has run (its complete entry logged); ``outputs``: its
        tensors, ``None`` when its kernel raised. A finding held for it waits on its first
        output, or, with none to wait on, is reported now without raising."""
        finding, self._held = self._held, None
        if finding is None:
            return
        finding = self._provenance.with_provenance(finding)
        if outputs is not None and self._promotions.wait(finding, record, outputs):
            self.waiting = True
            return
        self._reporter.report(finding, record, may_raise=False)

    def before(self, func, args, kwargs):
        """While findings wait: report those whose result ``func`` consumes on ``args`` and
        ``kwargs`` without casting it back, before its kernel. Returns the error strict mode
        raises, or ``None``."""
        promotions = self._promotions
        due = promotions.consumed_by(func, args, kwargs)
        self.waiting = bool(promotions)
        for finding, record in due:
            error = self._report(finding, record)
            if error is not None:
                return error  # strict: the first one raises
        return None

    def check_point(self, log, since: int, *, reading=(), final: bool = False, may_raise: bool = True):
        """Report what is judged at a check point over the ops of ``log`` from index ``since``
        on (see :meth:`~opwatch.checks.ActiveChecks.resolve`): at a ``final`` one, the
        promotions still waiting (never cast back); the nan/inf origins, contained or not.
        Returns the first error strict mode raises (``None`` with ``may_raise`` false)."""
        report = self._reporter.report
        first_error = None
        promotions = self._promotions
        if final and promotions:
            # Promoted results never consumed and still alive leave the block in the wide dtype.
            for finding, record in promotions.unused():
                first_error = first_error or report(finding, record, may_raise=may_raise)
            self.waiting = False
        with no_python_dispatch(), no_torch_function():  # neither mode sees opwatch's own reads
            origins = self._checks.resolve(log, since, reading=reading, final=final)
        for finding, record, contained in map(verdict, origins):
            error = report(finding, record, contained=contained, may_raise=may_raise)
            first_error = first_error or error  # every origin is reported; the first raises
        return first_error

    def _report(self, finding, record):
        return self._reporter.report(self._provenance.with_provenance(finding), record)
