"""What a decided step tells: the errors a failed step raises (:class:`GradientsNotFinite`,
:class:`RunStuck`), where its warnings point (the user's line, an anomaly's line), and an
origin's facts as the messages name them (:func:`origin_facts`, :func:`elsewhere_anomaly`)."""

from __future__ import annotations

import warnings

from ...core.sites import UserLine, warn_at_user
from ...findings.anomaly import OpwatchWarning
from ...findings.ranks import RankAnomaly
from ...render import leave_on as words
from ..ledger import came_with

__all__ = ["GradientsNotFinite", "RunStuck", "max_failed_option", "warn", "warn_at", "origin_facts", "elsewhere_anomaly"]


class GradientsNotFinite(RuntimeError):
    """Raised with ``on_failure="raise"`` (the default in strict mode) when no op can be named
    as the origin of gradients that hold nan/inf: the failure did not recur in the fully
    watched next step, the script ended first, or the weights already held nan/inf. The
    optimizer step that had them did not run.

    Attributes: ``step`` (the 1-based count of the optimizer step whose gradients held
    nan/inf), ``parameters`` (``(name, kind)`` pairs, kind ``"nan"`` or ``"inf"``)."""

    def __init__(self, message: str, *, step: int, parameters: list):
        super().__init__(message)
        self.step = step
        self.parameters = parameters


class RunStuck(GradientsNotFinite):
    """Raised when ``max_failed_in_a_row`` steps in a row failed (the run would go on
    skipping every step): ``step`` and ``parameters`` are the first failure's, ``failed_in_a_row``
    how many steps failed since (it included)."""

    def __init__(self, message: str, *, step: int, parameters: list, failed_in_a_row: int):
        super().__init__(message, step=step, parameters=parameters)
        self.failed_in_a_row = failed_in_a_row


def max_failed_option(value) -> int | None:
    """``max_failed_in_a_row`` checked: an int of at least 1, or ``None`` (never stop)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_failed_in_a_row must be an int of at least 1 or None, got {value!r}")
    return value


def warn(text: str, line: UserLine | None = None) -> None:
    """Warn, attributed to the user's line that called the optimizer step, or to ``line``."""
    warn_at_user(OpwatchWarning(text), line=line)


def warn_at(warning, anomaly) -> None:
    """Warn, attributed to the anomaly's line (the way Python shows its own warnings)."""
    warnings.warn_explicit(warning, OpwatchWarning, filename=anomaly.filename or "<unknown>", lineno=anomaly.lineno or 0, module="opwatch")


def origin_facts(origin) -> words.NamedOrigin | None:
    """The :class:`~opwatch.render.leave_on.NamedOrigin` of an origin anomaly (its rank when
    another rank made it), or ``None``: where its cause says no op made the values (the op's
    input or a parameter already held them), what they came in with."""
    if origin is None:
        return None
    rank = origin.rank if isinstance(origin, RankAnomaly) else None
    return words.NamedOrigin(origin.kind, origin.op, origin.where, origin.phase, rank, came_with(origin))


def elsewhere_anomaly(first, ranks, step: int, bad) -> RankAnomaly:
    """The origin another rank made, as this rank raises and tells it: that rank's facts
    (``.rank``, ``.op``, ``.lineno``) with a message saying where this rank stood."""
    text = words.made_elsewhere(ranks.rank, step, ranks.origin, bool(bad), ranks.missing, ranks.timeout, first.message)
    return RankAnomaly(**{**first.fields(), "message": text}, rank=first.rank)
