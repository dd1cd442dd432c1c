"""The summary of a watch, the dump after a failing block, the note added to its exception, and
every rank's anomalies in one summary."""

from __future__ import annotations

from ..records import BaseRecord
from ..sites import location
from .table import render_table

__all__ = ["render_summary", "render_failure", "exception_note", "render_combined_summary", "format_ranks", "tagged"]


def tagged(rank) -> str:
    """``opwatch`` outside a distributed job, ``opwatch (rank 1)`` in one."""
    return "opwatch" if rank is None else f"opwatch (rank {rank})"


# -- the summary ----------------------------------------------------------------------------


def render_summary(anomalies, contained, allowed=(), *, rank: int | None = None) -> str:
    """Distinct anomalies (one per kind, line, op and phase, with how often each fired), then a
    count of contained nan/inf origins and of allowed findings. ``rank``: the process's rank in
    a distributed job (``opwatch (rank 1): ...``)."""
    groups: dict = {}
    for anomaly in anomalies:
        key = (anomaly.kind, anomaly.filename, anomaly.lineno, anomaly.op, anomaly.phase)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [anomaly, 1]
    if not groups:
        lines = [f"{tagged(rank)}: no anomalies."]
    else:
        lines = [f"{tagged(rank)}: {_places(groups)}:"]
        lines += _messages(groups)
    if contained:
        lines.append("")
        lines.append(f"({len(contained)} nan/inf origin(s) were absorbed before they mattered; see Watch.contained)")
    if allowed:
        lines.append("")
        lines.append(f"({len(allowed)} finding(s) matched an allow entry; see Watch.allowed)")
    return "\n".join(lines)


# -- a failing block ------------------------------------------------------------------------


def render_failure(records: list[BaseRecord], failed: BaseRecord | None, error: BaseException, *, rank: int | None = None) -> str:
    """The dump printed when a watched block raises: the last ops, the failing one marked."""
    lines = [f"{tagged(rank)}: the watched block raised {type(error).__name__}; the last {len(records)} ops:"]
    lines.append(render_table(records, mark=failed.index if failed else None))
    if failed is not None:
        position = failed.position
        lines.append("")
        lines.append(f"failing op #{failed.index}: {failed.signature()}")
        if position.filename:
            lines.append(f"  at {location(failed)}" + (f", module {failed.module}" if failed.module else ""))
            lines += ["    " + line for line in position.caret_lines()]
    return "\n".join(lines)


def exception_note(failed: BaseRecord) -> str:
    """The note added to the exception of a failing block: the op, its line and its tensors."""
    position = failed.position
    note = f"{tagged(failed.rank)}: raised in {failed.op} (op #{failed.index}) at {location(failed)}"
    code = position.expression() or position.line_text()
    if code:
        note += f": {code}"
    note += "\n  inputs: " + ", ".join(str(meta) for meta in failed.inputs)
    if failed.module:
        note += f"\n  module: {failed.module}"
    return note


# -- every rank of a distributed job ------------------------------------------------------


def render_combined_summary(anomalies, *, world: int | None, missing=(), timeout: float | None = None) -> str:
    """Every rank's anomalies in one summary: a headline naming the rank, op and line that made
    the first nan/inf (by the wall clock of the ops) and the ranks that received it through a
    collective; the ranks that did not report; then each rank's distinct anomalies.
    ``anomalies``: :class:`~opwatch.distributed.RankAnomaly` rows (``rank``, ``kind``, ``op``,
    ``where``, ``phase``, ``received``, ``count``, ``time_ns``, ``message``)."""
    everyone = f"all {world} ranks" if world else "every rank"
    if world and missing:
        everyone = f"the {world - len(missing)} of {world} ranks that reported"
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
    elif received:
        taken = received[0]
        head = f"{taken.kind} received on {format_ranks(sorted({row.rank for row in received}))} through {taken.op} at {taken.where}, and no rank made it from finite inputs of its own: "
        if missing:
            head += "the rank that made it may be one that did not report"
        else:
            head += "the collective made it (a reduction that overflowed its dtype?)"
    elif anomalies:
        total = sum(row.count for row in anomalies)
        head = f"{total} anomal{'y' if total == 1 else 'ies'} on {format_ranks(sorted({row.rank for row in anomalies}))}"
    else:
        head = "no anomalies"
    lines = [f"opwatch, {everyone}: {head}."]
    for rank in missing:
        wait = f" within {timeout:g} s" if timeout is not None else ""
        lines.append(f"  rank {rank} did not report{wait}: it crashed, hangs, is still running, or ran a different number of watched blocks")
    by_rank: dict = {}
    for row in anomalies:
        groups = by_rank.setdefault(row.rank, {})
        key = (row.kind, row.filename, row.lineno, row.op, row.phase)
        if key in groups:
            groups[key][1] += row.count
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
        lines.append(f"{format_ranks(ranks)}: {_places(groups)}{' each' if len(ranks) > 1 else ''}:")
        lines += _messages(groups)
    return "\n".join(lines)


def _places(groups) -> str:
    """``3 anomalies at 2 places`` for ``{key: [anomaly, count]}``."""
    total = sum(count for _, count in groups.values())
    return f"{total} anomal{'y' if total == 1 else 'ies'} at {len(groups)} place{'' if len(groups) == 1 else 's'}"


def _messages(groups) -> list[str]:
    """Each group's message, after a blank line, its first line marked ``[xN]`` when it fired
    N > 1 times."""
    lines = []
    for anomaly, count in groups.values():
        lines.append("")
        text = anomaly.message
        if count > 1:
            first, _, rest = text.partition("\n")
            text = f"{first} [x{count}]\n{rest}" if rest else f"{first} [x{count}]"
        lines.append(text)
    return lines


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
