"""Where each rank of a ``torch.distributed`` job writes a file the command line was given one
path for (``--jsonl PATH``, ``--trace PATH``, ``--tensorboard DIR``), so that no rank overwrites
another's: rank 0, and a process outside a job, write the path as given; rank ``r > 0`` writes
beside it, its rank in the name.

    rank_path("run.jsonl", 1)      -> "run.rank1.jsonl"
    rank_path("out/trace.json", 3) -> "out/trace.rank3.json"
    rank_folder("runs/exp", 1)     -> "runs/exp/rank1"    (a run of its own under the log dir)

The name depends on the rank alone, not on the job's size: a single process and rank 0 write the
same file name, the one a later command (``show run.jsonl``) reads.
"""

from __future__ import annotations

import os

__all__ = ["rank_path", "rank_folder"]


def rank_path(path, rank: int | None) -> str:
    """The file rank ``rank`` writes for ``path``: ``path`` itself for rank 0 or ``None``
    (outside a job), else the rank before the extension (``run.jsonl`` -> ``run.rank1.jsonl``)."""
    path = os.fspath(path)
    if not rank:
        return path
    folder, name = os.path.split(path)
    stem, extension = os.path.splitext(name)
    return os.path.join(folder, f"{stem}.rank{rank}{extension}")


def rank_folder(folder, rank: int | None) -> str:
    """The folder rank ``rank`` writes its TensorBoard events into for ``folder``: ``folder``
    itself for rank 0 or ``None``, else its subfolder ``rank<r>`` (TensorBoard shows it as a run
    of its own beside rank 0's)."""
    folder = os.fspath(folder)
    return folder if not rank else os.path.join(folder, f"rank{rank}")
