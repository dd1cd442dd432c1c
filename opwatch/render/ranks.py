"""What users read about the ranks of a distributed job: the combined summary of every rank's
anomalies (:meth:`opwatch.findings.ranks.AllAnomalies.summary`), the collective-mismatch findings
(:mod:`opwatch.checks.collectives`), the exchange's warnings, and ``ranks 0, 1 and 3``."""

from __future__ import annotations

from ..core.sites import display_path
from .rules import explains
from .summary import count_places, group_messages

__all__ = ["render_combined_summary", "format_ranks", "explain_collective", "publish_failed", "collect_failed"]


# -- every rank of a distributed job ------------------------------------------------------


def render_combined_summary(anomalies, *, world: int | None, missing=(), timeout: float | None = None) -> str:
    """Every rank's anomalies in one summary: a headline naming the rank, op and line that made
    the first nan/inf (by the wall clock of the ops) and the ranks that received it through a
    collective; the ranks that did not report; then each rank's distinct anomalies.
    ``anomalies``: :class:`~opwatch.findings.ranks.RankAnomaly` rows (``rank``, ``kind``, ``op``,
    ``where``, ``phase``, ``received``, ``count``, ``time_ns``, ``message``)."""
    everyone = f"all {world} ranks" if world else "every rank"
    if world and missing:
        everyone = f"the {world - len(missing)} of {world} ranks that reported"
    lines = [f"opwatch, {everyone}: {_headline(anomalies, missing)}."]
    for rank in missing:
        wait = f" within {timeout:g} s" if timeout is not None else ""
        lines.append(f"  rank {rank} did not report{wait}: it crashed, hangs, is still running, or ran a different number of watched blocks")
    by_rank: dict = {}
    for row in anomalies:
        groups = by_rank.setdefault(row.rank, {})
        key = (row.kind, row.filename, row.lineno, row.op, row.phase)
        if key in groups:
            first, count = groups[key]
            groups[key] = [first, count + row.count]
        else:
            groups[key] = [row, row.count]
    # Ranks that found the same anomalies (every rank that received the nan through one
    # all-reduce) are shown once, with the first one's messages.
    alike: dict = {}
    for rank in sorted(by_rank):
        signature = tuple((key, count) for key, (_, count) in by_rank[rank].items())
        alike.setdefault(signature, []).append(rank)
    for ranks in alike.values():
        groups = by_rank[ranks[0]]
        lines.append("")
        lines.append(f"{format_ranks(ranks)}: {count_places(groups)}{' each' if len(ranks) > 1 else ''}:")
        lines += group_messages(groups)
    return "\n".join(lines)


def _headline(anomalies, missing) -> str:
    """Who made the first nan/inf and who received it; else how many anomalies on which ranks."""
    nonfinite = [row for row in anomalies if row.kind in ("nan", "inf")]
    origins = sorted((row for row in nonfinite if not row.received), key=lambda row: (row.time_ns, row.rank))
    received = sorted((row for row in nonfinite if row.received), key=lambda row: (row.time_ns, row.rank))
    if origins:
        first = origins[0]
        head = f"the first {first.kind} was made on rank {first.rank} by {first.op} at {first.where} ({first.phase})"
        also = sorted({row.rank for row in origins} - {first.rank})
        if also:
            head += f"; nan/inf was also made on {format_ranks(also)}"
        if received:
            taken = received[0]
            head += f"; {format_ranks(sorted({row.rank for row in received}))} received it through {taken.op} at {taken.where}"
        return head
    if received:
        taken = received[0]
        head = f"{taken.kind} received on {format_ranks(sorted({row.rank for row in received}))} through {taken.op} at {taken.where}, and no rank made it from finite inputs of its own: "
        if missing:
            return head + "the rank that made it may be one that did not report"
        return head + "the collective made it (a reduction that overflowed its dtype?)"
    if anomalies:
        total = sum(row.count for row in anomalies)
        return f"{total} anomal{'y' if total == 1 else 'ies'} on {format_ranks(sorted({row.rank for row in anomalies}))}"
    return "no anomalies"


def format_ranks(ranks) -> str:
    """``rank 1``, ``ranks 0 and 2``, ``ranks 0, 1 and 3``, ``ranks 0-998`` (runs of four or
    more ranks shortened; ``ranks`` sorted)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    items = []
    for run in runs:
        items += [f"{run[0]}-{run[-1]}"] if len(run) >= 4 else [str(rank) for rank in run]
    if len(items) == 1:
        return f"ranks {items[0]}"
    return "ranks " + ", ".join(items[:-1]) + f" and {items[-1]}"


# -- the collective-mismatch check ---------------------------------------------------------


@explains("collective.mismatch", "collective.different_ops", "collective.late")
def explain_collective(finding) -> tuple[str, str, str]:
    """The ranks' calls of one collective, from the facts of
    :func:`opwatch.checks.collectives.compare`: ``op``, ``number`` (from 1), ``group``,
    ``timeout`` (seconds), ``calls`` (one :class:`~opwatch.checks.collectives.CollectiveCall`
    per distinct call, ``where`` a list of ``[filename, lineno, label]``), ``missing`` (ranks)."""
    facts = finding.facts
    op, group, number, timeout, missing = facts.op, facts.group, facts.number, facts.timeout, facts.missing
    parts = []
    for call in facts.calls:
        lines = sorted({_where(where) for where in call.where})
        parts.append(f"{format_ranks(call.ranks)}: {call.op}({', '.join(call.tensors)}) at {', '.join(lines)}")
    if missing:
        parts.append(f"{format_ranks(missing)}: no call within {timeout:g} s")
    calls = "; ".join(parts)
    if finding.rule == "collective.late":
        return (
            f"{format_ranks(missing)} of process group {group} did not reach its collective #{number} ({op}) within {timeout:g} s; the others wait there: {calls}",
            "every rank of the group calls the same collectives in the same order",
            "look for a collective that only some ranks call (inside an if on the rank or on data, an early return, an uneven last batch); or raise OPWATCH_COLLECTIVE_TIMEOUT if a rank is only slow",
        )
    if finding.rule == "collective.different_ops":
        return (
            f"the ranks of process group {group} call different collectives as collective #{number}: {calls}",
            "every rank of the group calls the same collectives in the same order (this call hangs or mixes up data)",
            "make every rank run the same collectives in the same order: a collective inside an if on the rank or on data runs on some ranks only",
        )
    return (
        f"{op} gets different tensors on the ranks of process group {group}: {calls}",
        "the same shapes and dtypes on every rank of the group (with these, the collective hangs or corrupts memory)",
        "make every rank pass tensors of one shape and dtype: pad an uneven last batch, or all_gather the sizes first and pad to the largest",
    )


def _where(where) -> str:
    """``train.py:23`` for a ``[filename, lineno, label]`` fact; the label where there is no
    line (a DDP bucket); ``?`` when unknown."""
    filename, lineno, label = where
    if filename is None:
        return label or "?"
    return f"{display_path(filename)}:{lineno}"


# -- the exchange's warnings ----------------------------------------------------------------


def publish_failed(error: BaseException) -> str:
    return f"opwatch could not publish this rank's anomalies for the other ranks: {type(error).__name__}: {error}"


def collect_failed(error: BaseException) -> str:
    return f"opwatch could not read the other ranks' anomalies: {type(error).__name__}: {error}"
