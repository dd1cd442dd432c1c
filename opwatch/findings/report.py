"""The one place where findings become anomalies, warnings and raises.

Every finding, from a pre-kernel check or from a nan/inf check point, goes through
:meth:`Reporter.report`. It never raises by itself: in strict mode it *returns* the
:class:`AnomalyError` for the caller to raise outside opwatch's internal-error guard, so that
only that error ever leaves opwatch, and a failure while building a message is opwatch's own
bug (one warning, the watch switches off) rather than an exception on the user's line.
"""

from __future__ import annotations

import warnings
from collections import Counter, deque

from .anomaly import Anomaly, AnomalyError, OpwatchWarning
from ..checks.finding import Finding
from ..core.records import OpRecord

__all__ = ["Reporter"]


class Reporter:
    """Keeps one watch's anomalies and contained origins, warns once per place, and says when
    strict mode must raise."""

    def __init__(self, *, log, strict: bool, warn: bool, limit: int, allow: tuple = ()):
        self._log = log
        self.strict = strict
        self._warn = warn
        self._allow = allow  # Allow entries: what matches one is allowed, not an anomaly
        self.anomalies: deque[Anomaly] = deque(maxlen=limit)
        self.contained: deque[Anomaly] = deque(maxlen=limit)
        self.allowed: deque[Anomaly] = deque(maxlen=limit)
        self.count = 0  # anomalies ever reported (the deque drops old ones)
        self.kinds: Counter = Counter()  # anomalies ever reported, by kind
        self.contained_count = 0  # contained origins ever reported
        self._warned: set = set()  # (kind, file, line) already warned

    def report(self, finding: Finding, record: OpRecord, *, contained: bool = False, may_raise: bool = True) -> AnomalyError | None:
        """Keep ``finding`` on ``record``; warn once per (kind, file, line). Returns the error to
        raise in strict mode (``None`` otherwise, for contained origins, or with
        ``may_raise=False``, used while another exception is already on its way)."""
        anomaly = Anomaly(finding, record)
        if contained:
            self.contained.append(anomaly)
            self.contained_count += 1
            return None
        if self._allow and any(entry.matches(anomaly) for entry in self._allow):
            self.allowed.append(anomaly)
            return None
        self._log.add_flag(record.index, finding.kind)
        self.anomalies.append(anomaly)
        self.count += 1
        self.kinds[finding.kind] += 1
        if self.strict and may_raise:
            return AnomalyError(anomaly)
        if self._warn:
            key = (finding.kind, record.filename, record.lineno)
            if key not in self._warned:
                self._warned.add(key)
                # Attributed to the user's line, the way Python shows its own warnings.
                warnings.warn_explicit(
                    OpwatchWarning(anomaly.message),
                    OpwatchWarning,
                    filename=record.filename or "<unknown>",
                    lineno=record.lineno or 0,
                    module="opwatch",
                )
        return None

    def newest(self, count: int) -> list[Anomaly]:
        """The last ``count`` anomalies reported (fewer if the deque dropped some)."""
        return list(self.anomalies)[-count:] if count else []
