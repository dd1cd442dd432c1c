"""Collective mismatch: the ranks of a process group call a collective with different shapes or
dtypes, or call different collectives, or one of them never calls it. NCCL and gloo then hang
until their timeout or, with matching byte counts, corrupt memory. Off by default: it costs a
store round trip per collective; turn it on with
``watch(checks=[..., "collective_mismatch"])`` on every rank.

Before each collective (c10d ops and functional collectives; not point to point), every rank
of the group writes what it passes (the op, the shapes and dtypes its rule compares, its line)
under ``opwatch/<run>/<restart>/collective/<watch>/<group>/<n>/<rank>`` in the process group's
store, ``<n>`` counting the collectives this watch has called on that group and ``<watch>`` the
watches of this rank that reached a collective with this check (a counter the rank keeps in the
store), then waits for the other ranks' entries, at most ``OPWATCH_COLLECTIVE_TIMEOUT`` seconds
(default 60). This wait blocks before the kernel, on purpose: a mismatch must be found before
the collective hangs. A difference, or a rank that has not written by then, is a finding with
every rank's line; in ``strict()`` it raises before the collective runs, so before the hang.
No collective runs on the program's groups: only the store.

The counters live in a :class:`Handshakes` object per watch (``CheckContext.handshakes``, made
by :class:`~opwatch.checks.ActiveChecks` when the check is on), not in the process.

What is compared (``opwatch.core.ops.Collective.compare``): every tensor's shape and dtype;
only the output for ``scatter_`` and only the input for ``gather_`` (the root alone passes the
others); dtypes only for all-to-all (split sizes differ by rank); the op alone for barriers.
Limit: it compares per call, so every rank must run the same watched collectives; the keys it
writes stay in the store (about 150 bytes per rank and collective).

Findings (rendered by :mod:`opwatch.render.ranks`): ``collective.mismatch`` (one collective,
different tensors), ``collective.different_ops`` (different collectives at the same place in
the order), ``collective.late`` (a rank did not call it within the timeout).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

from ..core.collective_ops import group_of, group_store, store_prefix
from ..core.notation import format_meta
from ..core.ops import collective_of
from ..core.records import M_DEVICE, M_DTYPE, M_SHAPE
from ..core.sites import position_of
from typing import NamedTuple

from ..core.fact_tuples import RuleFacts, fact_tuple, rule_facts
from .finding import Finding

__all__ = ["KIND", "for_op", "TIMEOUT_VARIABLE", "Handshakes", "compared", "compare", "counter_key", "CollectiveCall", "CollectiveCalls"]


@fact_tuple("collective_call")
class CollectiveCall(NamedTuple):
    """One distinct call of a collective among the ranks' calls."""

    ranks: list  # the ranks that made it
    op: str
    tensors: list  # its tensors, as text (``f32[4] cuda:0``, or dtypes only)
    where: list  # its ranks' places, each ``[filename, lineno, label]``


@rule_facts("collective.mismatch", "collective.different_ops", "collective.late")
class CollectiveCalls(RuleFacts):
    op: str  # the collective's name
    number: int  # its number on its group, from 1
    group: str
    timeout: float  # how long the ranks were waited for, in seconds
    missing: list  # the ranks that wrote nothing in time, sorted
    calls: list  # one CollectiveCall per distinct call

KIND = "collective_mismatch"
TIMEOUT_VARIABLE = "OPWATCH_COLLECTIVE_TIMEOUT"
_DEFAULT_TIMEOUT = 60.0


def for_op(func):
    """The bound check for a collective the ranks must call alike; ``None`` for other ops."""
    collective = collective_of(func)
    if collective is None or collective.compare is None:
        return None
    op = str(func).removesuffix(".default")

    def check(tensors, context) -> Finding | None:
        return _check(op, collective, tensors, context)

    return check


def counter_key(rank: int) -> str:
    """The store key where ``rank`` counts its watches that reached a checked collective."""
    return f"{store_prefix()}/collective/watches/{rank}"


class Handshakes:
    """One watch's memory of the check: the store the ranks meet in, this watch's number among
    the rank's watches (so that the keys of an earlier watch never answer a later one), and the
    collectives called per group (the ``n`` in each key)."""

    def __init__(self):
        self._store = None
        self._watch: int | None = None
        self._calls: dict[str, int] = {}  # group name -> collectives called on it in this watch

    def meet(self, group: str, rank: int, ranks, mine: dict, timeout: float):
        """Write this rank's call ``mine`` of the next collective on ``group`` and wait at most
        ``timeout`` seconds for the other ``ranks``' calls: ``(number, calls, missing)``
        (``number`` from 1, ``calls``: ``rank -> call``, ``missing``: ranks that wrote nothing);
        ``None`` without a store."""
        store = group_store()
        if store is None:
            return None  # no group to tell the ranks by: nothing to compare
        if store is not self._store:
            self._store, self._calls = store, {}
            self._watch = store.add(counter_key(rank), 1)
        number = self._calls.get(group, 0) + 1
        self._calls[group] = number
        prefix = f"{store_prefix()}/collective/{self._watch}/{group}/{number}"
        store.set(f"{prefix}/{rank}", json.dumps(mine, separators=(",", ":")))
        others = [other for other in ranks if other != rank]
        keys = [f"{prefix}/{other}" for other in others]
        missing = []
        try:
            store.wait(keys, timedelta(seconds=timeout))
            present = others
        except Exception:  # some rank did not write in time (DistStoreError)
            present = [other for other, key in zip(others, keys) if store.check([key])]
            missing = [other for other in others if other not in present]
        calls = {rank: mine}
        if present:
            values = store.multi_get([f"{prefix}/{other}" for other in present])
            calls.update({other: json.loads(value) for other, value in zip(present, values)})
        return number, calls, missing


def compared(rule: str, tensors) -> list[str]:
    """What a rank's call contributes to the comparison, in the one tensor notation."""
    if rule == "nothing" or not tensors:
        return []
    if rule == "first":
        tensors = tensors[:1]
    elif rule == "last":
        tensors = tensors[-1:]
    if rule == "dtypes":
        return [str(meta[M_DTYPE]).removeprefix("torch.") for meta in tensors]
    return [format_meta((meta[M_SHAPE], meta[M_DTYPE], meta[M_DEVICE])) for meta in tensors]


def compare(op: str, number: int, group: str, calls: dict, missing, timeout: float) -> Finding | None:
    """The finding for the ranks' calls (``rank -> {"op", "tensors", "where"}``, ``where`` a
    ``[filename, lineno, label]`` list) of the ``number``-th collective (from 1) on ``group``;
    ``missing``: ranks that wrote nothing within ``timeout`` seconds. Its facts: ``op``,
    ``number``, ``group``, ``timeout``, ``missing`` (sorted ranks) and ``calls``, one
    :class:`CollectiveCall` per distinct call (``where``: its ranks' places)."""
    kinds: dict = {}
    for rank in sorted(calls):
        call = calls[rank]
        kinds.setdefault((call["op"], tuple(call["tensors"])), []).append(rank)
    if len(kinds) <= 1 and not missing:
        return None
    grouped = []
    for (called, tensors), ranks in kinds.items():
        places = []
        for rank in ranks:
            where = list(calls[rank]["where"])
            if where not in places:
                places.append(where)
        grouped.append(CollectiveCall(ranks, called, list(tensors), places))
    if missing and len(kinds) <= 1:
        rule = "collective.late"
    elif len({called for called, _ in kinds}) > 1:
        rule = "collective.different_ops"
    else:
        rule = "collective.mismatch"
    facts = CollectiveCalls(op=op, number=number, group=group, timeout=timeout, missing=sorted(missing), calls=grouped)
    return Finding(KIND, rule, facts)


def _check(op, collective, tensors, context) -> Finding | None:
    handshakes = getattr(context, "handshakes", None)
    resolved = group_of(collective, context.args)
    if handshakes is None or resolved is None:
        return None
    import torch.distributed as dist

    name, group = resolved
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) < 2:
        return None
    timeout = _timeout()
    mine = {"op": op, "tensors": compared(collective.compare, tensors), "where": _where(context)}
    met = handshakes.meet(name, dist.get_rank(), ranks, mine, timeout)
    if met is None:
        return None
    number, calls, missing = met
    return compare(op, number, name, calls, missing, timeout)


def _timeout() -> float:
    value = os.environ.get(TIMEOUT_VARIABLE, "")
    if not value:
        return _DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_VARIABLE}={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_VARIABLE} must be more than 0 seconds, got {value!r}")
    return seconds


def _where(context) -> list:
    """``[filename, lineno, None]`` of the op being checked, ``[None, None, label]`` for a
    labelled place (a DDP bucket), ``[None, None, None]`` when unknown."""
    log = getattr(context, "_log", None)
    if log is None:
        return [None, None, None]
    code, lasti = log.sites[context.site]
    if code is None:
        return [None, None, lasti if isinstance(lasti, str) else None]
    position = position_of(code, lasti)
    return [position.filename, position.lineno, None]
