"""One watch's place in a distributed job, as the interceptor reads it while the watch runs.

:class:`DistributedWatch` is the watch's :class:`~opwatch.core.collective_ops.RankState` (rank,
world size, the process group's store) with the DDP reducer's site labels (``sites``, read by
the interceptor once the rank is known). When the watch ends, the exchange of anomalies
between the ranks (:mod:`opwatch.findings.ranks`) publishes through it and keeps its
``exchange`` and, once every rank reported, the ``collected`` anomalies on it.
"""

from __future__ import annotations

from ..core.collective_ops import RankState
from .reducer import ReducerSites

__all__ = ["DistributedWatch"]


class DistributedWatch(RankState):
    """A watch in a distributed job: its :class:`~opwatch.core.collective_ops.RankState`, the DDP
    reducer's site labels (``sites``, read by the interceptor once the rank is known), once it
    ended its :class:`~opwatch.findings.ranks.Exchange` (``exchange``), and the every-rank
    anomalies once all ranks reported (``collected``)."""

    def __init__(self, log, modules):
        self.sites = ReducerSites(log, modules)
        self.exchange = None  # set by opwatch.findings.ranks.publish
        self.collected = None  # kept once every rank reported (opwatch.findings.ranks.all_anomalies)
        super().__init__(log)

    @classmethod
    def start(cls, log, modules) -> DistributedWatch | None:
        """The state of a watch entered now; ``None`` where ``torch.distributed`` is not
        available. Its ``rank`` stays ``None`` until there is a job (a process group, or a
        launcher's ``RANK``)."""
        return cls(log, modules) if RankState.available() else None
