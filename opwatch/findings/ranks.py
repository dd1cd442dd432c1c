"""The exchange of anomalies between the ranks of a distributed job, when a watch ends: above
the core (it reads finished anomalies and renders the combined summary); the session's
``Watch.all_anomalies`` is a thin call into :func:`all_anomalies`. The watch's place in the
job (its rank, world size and store: the state the interceptor reads while the watch runs) is
:class:`opwatch.modes.ranks.DistributedWatch`, which this module reads and fills
(``exchange``, ``collected``) without importing it.

When a distributed watch ends, the rank publishes its anomalies (each distinct one once, with
its count and message) under ``opwatch/<run>/<restart>/<block>/<rank>`` in the process group's
store (its innermost ``TCPStore``, or the ``torchrun`` agent's store when the script has already
destroyed its group), or as files under ``$OPWATCH_EXCHANGE_DIR`` when that is set: one ``set``
per rank. :meth:`Exchange.collect` (:mod:`.exchange`, how the entries travel) waits for the other
ranks' entries with a timeout and names those that did not report. No collective ever runs on the program's process groups: a rank that
crashed or hangs cannot make another one hang here. ``<block>`` counts the distributed watches
this process has ended, so every rank must run the same watched blocks.

The other ranks' anomalies arrive as :class:`RankAnomaly` objects: the attributes of an
:class:`~opwatch.Anomaly`, their message as that rank rendered it, and ``rank``, ``count``,
``time_ns``.
"""

from __future__ import annotations

import itertools
import json
import time

from .anomaly import BaseAnomaly, OpwatchWarning
from .exchange import DEFAULT_TIMEOUT, EXCHANGE_DIR_VARIABLE, Exchange, agent_store
from ..core.sites import warn_at_user
from ..render.ranks import collect_failed, publish_failed, render_combined_summary

__all__ = [
    "all_anomalies",
    "publish",
    "Exchange",
    "RankAnomaly",
    "AllAnomalies",
    "encode",
    "decode",
    "EXCHANGE_DIR_VARIABLE",
    "DEFAULT_TIMEOUT",
]

_MAX_PUBLISHED = 32  # distinct anomalies a rank publishes (the rest are counted in "total")

# Distributed watches this process has ended: the exchange's key. Process-wide on purpose: the
# ranks meet under the same key only if each counts its own watched blocks alike.
_blocks = itertools.count()


def publish(state, anomalies, contained: int) -> None:
    """In a distributed job, publish this rank's anomalies when its watch ends (one store
    ``set``); a failure is one warning, never an exception on the program's line. ``state``:
    the watch's :class:`~opwatch.modes.ranks.DistributedWatch`, or ``None``."""
    if state is None:
        return
    try:
        state.refresh()
        if state.rank is None or not state.world or state.world < 2:
            return
        state.exchange = Exchange.open(state.store or agent_store(), state.rank, state.world, next(_blocks))
        state.exchange.publish(encode(anomalies, state.rank, state.world, contained))
    except Exception as error:
        state.exchange = None
        warn_at_user(OpwatchWarning(publish_failed(error)))  # the user's ``with``


def all_anomalies(state, local, *, timeout: float, ended: bool) -> AllAnomalies:
    """Every rank's anomalies (what :meth:`opwatch.Watch.all_anomalies` returns): this rank's
    ``local`` ones and the other ranks' published ones, waiting at most ``timeout`` seconds;
    ``ended``: whether the watched block has ended (every rank publishes then)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not timeout >= 0:
        raise ValueError(f"timeout must be 0 or more seconds, got {timeout}")
    local = list(local)
    if state is None or state.rank is None:
        return AllAnomalies(local, world=None)
    if not ended:
        raise RuntimeError("all_anomalies() is available once the watched block has ended: every rank publishes its anomalies then")
    if state.collected is not None:
        return state.collected
    others = [rank for rank in range(state.world or 0) if rank != state.rank]
    if state.exchange is None:  # a job of one rank, or publishing failed (warned)
        return AllAnomalies(local, world=state.world, missing=others, timeout=timeout)
    try:
        found, missing = state.exchange.collect(timeout)
    except Exception as error:
        warn_at_user(OpwatchWarning(collect_failed(error)))  # the user's call
        found, missing = {}, others
    anomalies = []
    for rank in range(state.world):
        if rank == state.rank:
            anomalies += local
        elif rank in found:
            anomalies += decode(found[rank])
    result = AllAnomalies(anomalies, world=state.world, missing=missing, timeout=timeout)
    if not missing:
        state.collected = result
    return result


# -- what is exchanged ------------------------------------------------------------------------


def encode(anomalies, rank: int, world: int, contained: int = 0) -> bytes:
    """This rank's anomalies as the exchange carries them: each distinct one (kind, line, op,
    phase) once, with its count, its message and the wall-clock time of its op."""
    offset = time.time_ns() - time.perf_counter_ns()  # perf_counter -> wall clock
    groups: dict = {}
    for anomaly in anomalies:
        key = (anomaly.kind, anomaly.filename, anomaly.lineno, anomaly.op, anomaly.phase)
        if key in groups:
            groups[key].count += 1
        elif len(groups) < _MAX_PUBLISHED:
            groups[key] = RankAnomaly.of(anomaly, rank, offset)
    payload = {"rank": rank, "world": world, "total": len(anomalies), "contained": contained, "anomalies": [row.fields() for row in groups.values()]}
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def decode(data: bytes) -> list[RankAnomaly]:
    payload = json.loads(data.decode("utf-8"))
    rank = payload["rank"]
    return [RankAnomaly(rank=rank, **fields) for fields in payload["anomalies"]]


class RankAnomaly(BaseAnomaly):
    """An anomaly another rank reported, as the exchange carried it: the attributes of
    :class:`~opwatch.Anomaly` (``kind``, ``op``, ``filename``, ``lineno``, ``where``, ``module``,
    ``phase``, ``index``, ``message``, ``received``, ``came_with``) plus ``rank``, ``count`` (how
    often it fired there) and ``time_ns`` (wall clock of its op). ``record`` and ``finding`` are ``None``:
    records stay on their rank, which rendered the message (both ranks run one opwatch), so the
    attributes :class:`~opwatch.findings.anomaly.BaseAnomaly` derives from them are given here."""

    __slots__ = ("rank", "kind", "op", "filename", "lineno", "where", "module", "module_class", "phase", "index", "received", "count", "time_ns",
                 "message", "came_with")
    record = None
    finding = None

    def __init__(self, *, rank, kind, op, filename, lineno, where, module, phase, index, received, count, time_ns, message, module_class=None,
                 came_with=None):
        self.rank = rank
        self.kind = kind
        self.op = op
        self.filename = filename
        self.lineno = lineno
        self.where = where
        self.module = module
        self.module_class = module_class
        self.phase = phase
        self.index = index
        self.received = received
        self.count = count
        self.time_ns = time_ns
        self.message = message
        self.came_with = came_with  # absent from an older opwatch's entry

    @classmethod
    def of(cls, anomaly, rank: int, offset: int) -> RankAnomaly:
        """This rank's own ``anomaly`` in the same form (``offset``: wall clock - perf counter)."""
        return cls(
            rank=rank, kind=anomaly.kind, op=anomaly.op, filename=anomaly.filename, lineno=anomaly.lineno,
            where=anomaly.record.where, module=anomaly.module, module_class=anomaly.module_class, phase=anomaly.phase, index=anomaly.index,
            received=anomaly.received, count=1, time_ns=anomaly.record.start_ns + offset, message=anomaly.message, came_with=anomaly.came_with,
        )

    def fields(self) -> dict:
        """The attributes the exchange carries (all but ``rank``, which the payload holds once)."""
        return {name: getattr(self, name) for name in self.__slots__[1:]}

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"<RankAnomaly rank {self.rank} {self.kind} {self.op} at {self.where} #{self.index}>"


class AllAnomalies(list):
    """Every rank's anomalies (:meth:`opwatch.Watch.all_anomalies`): this rank's
    :class:`~opwatch.Anomaly` objects and the other ranks' :class:`RankAnomaly` objects, in
    rank order, each with ``.rank``.

    Attributes:
        world: the number of ranks (``None`` outside a distributed job).
        missing: ranks that had not reported when the timeout ran out.
        timeout: the seconds waited for them.
    """

    def __init__(self, anomalies, *, world, missing=(), timeout=DEFAULT_TIMEOUT):
        super().__init__(anomalies)
        self.world = world
        self.missing = tuple(missing)
        self.timeout = timeout

    def summary(self) -> str:
        """The combined summary: which rank made the first nan/inf, at which op and line, where
        it was received, each rank's distinct anomalies, and the ranks that did not report."""
        offset = time.time_ns() - time.perf_counter_ns()
        rows = [anomaly if isinstance(anomaly, RankAnomaly) else RankAnomaly.of(anomaly, anomaly.rank, offset) for anomaly in self]
        return render_combined_summary(rows, world=self.world, missing=self.missing, timeout=self.timeout)
