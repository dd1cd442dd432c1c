"""Collective mismatch: the ranks of a process group call a collective with different shapes or
dtypes, or call different collectives, or one of them never calls it. NCCL and gloo then hang
until their timeout or, with matching byte counts, corrupt memory. Off by default: it costs a
store round trip per collective; turn it on with
``watch(checks=[..., "collective_mismatch"])`` on every rank.

Before each collective (c10d ops and functional collectives; not point to point), every rank
of the group writes what it passes (the op, the shapes and dtypes its rule compares, its line)
under ``opwatch/<run>/<restart>/collective/<group>/<n>/<rank>`` in the process group's store,
``<n>`` counting the collectives this process has called on that group under a watch with
this check, then waits for the other ranks' entries, at most ``OPWATCH_COLLECTIVE_TIMEOUT``
seconds (default 60). A difference, or a rank that has not written by then, is a finding with
every rank's line; in ``strict()`` it raises before the collective runs, so before the hang.
No collective runs on the program's groups: only the store.

What is compared (``opwatch.distributed.Collective.compare``): every tensor's shape and dtype;
only the output for ``scatter_`` and only the input for ``gather_`` (the root alone passes the
others); dtypes only for all-to-all (split sizes differ by rank); the op alone for barriers.
Limit: it compares per call, so every rank must run the same watched collectives; the keys it
writes stay in the store (about 150 bytes per rank and collective).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

from ..distributed import _group_store, _prefix, collective_of, group_of
from ..notation import format_meta
from ..records import M_DTYPE, M_SHAPE
from ..render import display_path, format_ranks
from .finding import Finding, text_finding

__all__ = ["KIND", "for_op", "TIMEOUT_VARIABLE", "compared", "compare"]

KIND = "collective_mismatch"
TIMEOUT_VARIABLE = "OPWATCH_COLLECTIVE_TIMEOUT"
_DEFAULT_TIMEOUT = 60.0
# Collectives this process has called, per group name: the n in each key. Process-wide, not
# per watch: every rank must count the same calls for the keys to meet.
_calls: dict[str, int] = {}


def for_op(func):
    """The bound check for a collective the ranks must call alike; ``None`` for other ops."""
    collective = collective_of(func)
    if collective is None or collective.compare is None:
        return None
    op = str(func).removesuffix(".default")

    def check(tensors, context) -> Finding | None:
        return _check(op, collective, tensors, context)

    return check


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
    return [format_meta((meta[M_SHAPE], meta[M_DTYPE], meta[2])) for meta in tensors]


def compare(op: str, number: int, group: str, calls: dict, missing, timeout: float) -> Finding | None:
    """The finding for the ranks' calls (``rank -> {"op", "tensors", "where"}``) of the
    ``number``-th collective (from 1) on ``group``; ``missing``: ranks that wrote nothing within
    ``timeout`` seconds."""
    kinds: dict = {}
    for rank in sorted(calls):
        call = calls[rank]
        kinds.setdefault((call["op"], tuple(call["tensors"])), []).append(rank)
    if len(kinds) <= 1 and not missing:
        return None
    parts = []
    for (called, tensors), ranks in kinds.items():
        lines = sorted({calls[rank]["where"] for rank in ranks})
        parts.append(f"{format_ranks(ranks)}: {called}({', '.join(tensors)}) at {', '.join(lines)}")
    if missing:
        parts.append(f"{format_ranks(sorted(missing))}: no call within {timeout:g} s")
    ops = {called for called, _ in kinds}
    if missing and len(kinds) <= 1:
        problem = f"{format_ranks(sorted(missing))} of process group {group} did not reach its collective #{number} ({op}) within {timeout:g} s; the others wait there: " + "; ".join(parts)
        expected = "every rank of the group calls the same collectives in the same order"
        fix = "look for a collective that only some ranks call (inside an if on the rank or on data, an early return, an uneven last batch); or raise OPWATCH_COLLECTIVE_TIMEOUT if a rank is only slow"
    elif len(ops) > 1:
        problem = f"the ranks of process group {group} call different collectives as collective #{number}: " + "; ".join(parts)
        expected = "every rank of the group calls the same collectives in the same order (this call hangs or mixes up data)"
        fix = "make every rank run the same collectives in the same order: a collective inside an if on the rank or on data runs on some ranks only"
    else:
        problem = f"{op} gets different tensors on the ranks of process group {group}: " + "; ".join(parts)
        expected = "the same shapes and dtypes on every rank of the group (with these, the collective hangs or corrupts memory)"
        fix = "make every rank pass tensors of one shape and dtype: pad an uneven last batch, or all_gather the sizes first and pad to the largest"
    return text_finding(kind=KIND, problem=problem, expected=expected, fix=fix)


def _check(op, collective, tensors, context) -> Finding | None:
    resolved = group_of(collective, context.args)
    store = _group_store()
    if resolved is None or store is None:
        return None  # no group to tell the ranks by: nothing to compare
    import torch.distributed as dist

    name, group = resolved
    ranks = dist.get_process_group_ranks(group)
    rank = dist.get_rank()
    if len(ranks) < 2:
        return None
    number = _calls.get(name, 0)
    _calls[name] = number + 1
    timeout = _timeout()
    prefix = f"{_prefix()}/collective/{name}/{number}"
    mine = {"op": op, "tensors": compared(collective.compare, tensors), "where": _where(context)}
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
    return compare(op, number + 1, name, calls, missing, timeout)


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


def _where(context) -> str:
    """``train.py:23`` for the op being checked (or the name of its place), in the one location
    format; ``?`` when unknown."""
    log = getattr(context, "_log", None)
    if log is None:
        return "?"
    from ..sites import position_of

    code, lasti = log.sites[context.site]
    if code is None:
        return lasti if isinstance(lasti, str) else "?"
    position = position_of(code, lasti)
    return f"{display_path(position.filename)}:{position.lineno}"
