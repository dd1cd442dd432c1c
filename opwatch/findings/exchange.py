"""How the ranks' entries travel when a distributed watch ends: one entry per rank under
``opwatch/<run>/<restart>/<block>/<rank>`` in the process group's store (or the ``torchrun``
agent's store, :func:`agent_store`), or as files under ``$OPWATCH_EXCHANGE_DIR``; what an entry
holds is :mod:`.ranks`' business. No collective ever runs on the program's process groups."""

from __future__ import annotations

import os
import time
from datetime import timedelta

from ..core.collective_ops import RankState, store_prefix

__all__ = ["Exchange", "agent_store", "EXCHANGE_DIR_VARIABLE", "DEFAULT_TIMEOUT"]

EXCHANGE_DIR_VARIABLE = "OPWATCH_EXCHANGE_DIR"
DEFAULT_TIMEOUT = 30.0  # seconds to wait for the other ranks' anomalies


def agent_store():
    """A client of the ``torchrun`` agent's store (``MASTER_ADDR:MASTER_PORT`` when
    ``TORCHELASTIC_USE_AGENT_STORE`` is set): it outlives the script's process group."""
    if not RankState.available() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=DEFAULT_TIMEOUT)
        )
    except Exception:
        return None


# -- the exchange ---------------------------------------------------------------------------


class Exchange:
    """One watched block's entries, one per rank, in a store or a folder."""

    def __init__(self, rank: int, world: int, block: int):
        self.rank = rank
        self.world = world
        self.block = block
        self.published_bytes = 0

    @staticmethod
    def open(store, rank: int, world: int, block: int) -> Exchange:
        folder = os.environ.get(EXCHANGE_DIR_VARIABLE)
        if folder:
            return _FileExchange(folder, rank, world, block)
        if store is None:
            raise RuntimeError(
                f"no store to exchange anomalies through: the process group was never seen; set {EXCHANGE_DIR_VARIABLE} to a shared folder"
            )
        return _StoreExchange(store, rank, world, block)

    def publish(self, payload: bytes) -> None:
        self.published_bytes = len(payload)
        self._put(payload)

    def collect(self, timeout: float) -> tuple[dict[int, bytes], list[int]]:
        """The other ranks' entries, waiting at most ``timeout`` seconds in all, and the ranks
        that did not report by then."""
        others = [rank for rank in range(self.world) if rank != self.rank]
        return self._get(others, timeout)


class _StoreExchange(Exchange):
    def __init__(self, store, rank, world, block):
        super().__init__(rank, world, block)
        self._store = store
        self.round_trips = 0

    def _key(self, rank: int) -> str:
        return f"{store_prefix()}/{self.block}/{rank}"

    def _put(self, payload: bytes) -> None:
        self._store.set(self._key(self.rank), payload)
        self.round_trips += 1

    def _get(self, ranks, timeout):
        if not ranks:
            return {}, []
        keys = [self._key(rank) for rank in ranks]
        store = self._store
        missing = []
        try:
            self.round_trips += 1
            store.wait(keys, timedelta(seconds=max(timeout, 0.001)))
            present = list(ranks)
        except Exception:  # some rank did not report in time (DistStoreError), or the store failed
            present = []
            for rank, key in zip(ranks, keys):
                self.round_trips += 1
                (present if store.check([key]) else missing).append(rank)
        if not present:
            return {}, missing
        self.round_trips += 1
        values = store.multi_get([self._key(rank) for rank in present]) if hasattr(store, "multi_get") else [store.get(self._key(rank)) for rank in present]
        return dict(zip(present, values)), missing


class _FileExchange(Exchange):
    def __init__(self, folder, rank, world, block):
        super().__init__(rank, world, block)
        self._folder = os.path.join(folder, store_prefix().replace("/", "-"), str(block))

    def _path(self, rank: int) -> str:
        return os.path.join(self._folder, f"rank{rank}.json")

    def _put(self, payload: bytes) -> None:
        os.makedirs(self._folder, exist_ok=True)
        path = self._path(self.rank)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "wb") as stream:
            stream.write(payload)
        os.replace(temporary, path)  # readers never see half a file

    def _get(self, ranks, timeout):
        deadline = time.monotonic() + timeout
        found: dict[int, bytes] = {}
        waiting = list(ranks)
        while True:
            for rank in list(waiting):
                try:
                    with open(self._path(rank), "rb") as stream:
                        found[rank] = stream.read()
                    waiting.remove(rank)
                except FileNotFoundError:
                    pass
            if not waiting or time.monotonic() >= deadline:
                return found, waiting
            time.sleep(0.05)
