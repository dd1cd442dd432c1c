""":func:`opwatch.diff` of a sharded run (the ranks of a ``torch.distributed`` job, each
recorded with ``watch(fingerprints=True)``) against a single-process run of the same model and
data: the ranks' logs are combined into one run, whose outputs are the global tensors'.

No gather during the run: a ``DTensor`` output's fingerprint is its local shard's, with its
placement, global shape and mesh size (:class:`~opwatch.checks.fingerprints.ShardPrint`). Here
the ranks' op streams are aligned with rank 0's (the same program on every rank: the same ops),
and each output's shards combined by its placement on the 1-D mesh:

- ``Shard(d)``: the sums add, the squares of the L2 norms add, min and max are the ranks'
  least and greatest;
- ``Replicate``: rank 0's;
- ``Partial``: the sums add; its norm, min and max are not known, so it is not compared;
- a plain tensor (the same on every rank, as the loss after an all-reduce, or FSDP2's
  all-gathered parameters and the compute on them): rank 0's.

Exact hashes cannot be combined from shards, so the runs are compared within a tolerance (the
dtype's default when none is given). Ops that exist in the sharded run only (collectives,
redistributions, FSDP2's all-gathers and copies) are aligned away as ops in one run only and do
not make the runs disagree; an op only the single-process run has does.
"""

from __future__ import annotations

import math
import os

from ..checks.fingerprints import Fingerprint, ShardPrint

__all__ = ["is_ranks", "rank_sources", "open_ranks", "combine", "combine_ranks"]


def is_ranks(source) -> bool:
    """Whether ``source`` is several ranks' logs: a list or tuple, or a directory of ``.jsonl``."""
    if isinstance(source, (list, tuple)):
        return True
    return isinstance(source, (str, os.PathLike)) and os.path.isdir(source)


def rank_sources(source, name: str) -> list:
    """The ranks' sources: the list given, or the directory's ``.jsonl`` files (by name)."""
    if isinstance(source, (list, tuple)):
        sources = list(source)
    else:
        sources = sorted(os.path.join(source, entry) for entry in os.listdir(source) if entry.endswith(".jsonl"))
    if len(sources) < 1:
        raise ValueError(f"opwatch.diff: {name} is a directory with no .jsonl log in it: {os.fspath(source)}")
    return sources


def combine(prints: list):
    """The global fingerprint of one output from each rank's (``None`` where it cannot be
    known: a rank without it, placements that differ, partial sums)."""
    if any(found is None for found in prints):
        return None
    first, *_ = prints
    if not isinstance(first, ShardPrint):
        return first if not any(isinstance(found, ShardPrint) for found in prints) else None
    if any(not isinstance(found, ShardPrint) or found.placement != first.placement for found in prints):
        return None
    if first.placement == "R":
        return Fingerprint(first.hash, first.sum, first.norm, first.min, first.max)
    if first.placement.startswith("S") and len(prints) == first.ranks:
        return Fingerprint(
            -1,  # no hash of the whole: compared within a tolerance
            math.fsum(found.sum for found in prints),
            math.sqrt(math.fsum(found.norm * found.norm for found in prints)),
            min(found.min for found in prints),
            max(found.max for found in prints),
        )
    return None  # partial sums (norm, min and max unknown), or ranks missing


def combine_ranks(runs: list, keys: list, matches) -> dict:
    """Rank 0's op index -> its outputs' global fingerprints. ``runs``: per rank ``(records,
    prints)``, rank 0 first; ``keys``: per rank the alignment keys of its records;
    ``matches(keys_a, keys_b)``: the aligned ``(i, j)`` of two key lists."""
    (records, prints), *_ = runs
    own_keys, *other_keys = keys
    step_of = [dict(matches(own_keys, theirs)) for theirs in other_keys]
    combined: dict = {}
    for step, record in enumerate(records):
        own = prints.get(record.index)
        if own is None:
            continue
        per_rank = [own]
        for rank, steps in enumerate(step_of, 1):
            other_records, other_prints = runs[rank]
            other = steps.get(step)
            per_rank.append(None if other is None else other_prints.get(other_records[other].index))
        outputs = []
        for position in range(len(own)):
            outputs.append(combine([None if found is None or position >= len(found) else found[position] for found in per_rank]))
        combined[record.index] = tuple(outputs)
    return combined


def open_ranks(source, name: str, open_one, keys_of, matches):
    """``(label, torch version, records, fingerprints, whole script, ranks)`` of a sharded
    run's ranks' logs: rank 0's records, each output's fingerprint combined from the ranks'.
    ``open_one(source, name)`` opens one log as ``(label, torch, records, prints, whole
    script)``; ``keys_of(records)`` gives ``(keys,)``; ``matches`` aligns two key lists."""
    opened = [open_one(one, f"{name} (log {number})") for number, one in enumerate(rank_sources(source, name))]
    opened.sort(key=_rank_of)
    keys = [found_keys for found_keys, in (keys_of(records) for _, _, records, _, _ in opened)]
    prints = combine_ranks([(records, found) for _, _, records, found, _ in opened], keys, matches)
    labels = [label for label, *_ in opened]
    shown = os.fspath(source) if isinstance(source, (str, os.PathLike)) else ", ".join(labels)
    (_, version, records, _, whole), *_ = opened
    return f"{len(opened)} ranks ({shown})", version, records, prints, whole, len(opened)


def _rank_of(opened) -> int:
    """A log's rank, from its records (``None`` outside a job: 0)."""
    _, _, records, _, _ = opened
    for record in records:
        rank = record.rank
        return rank if isinstance(rank, int) else 0
    return 0
