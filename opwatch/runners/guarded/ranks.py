"""One decision for every rank of a distributed job, and no wait without an end.

In a job of several ranks (``torch.distributed`` initialized, world size > 1) each rank's fused
finite check decides only for itself: a rank that replays a step under a full watch runs the
step's collectives again, and a rank that goes on runs the next step's, so both would wait for
ever. :meth:`Agreement.failed` reduces the failure flag across the default process group
(``MAX`` of one element: on the CPU where the backend takes CPU tensors, gloo; on the current
CUDA device otherwise) once per guarded step, so every rank replays the same steps, with
matching collectives, and applies the same ``on_failure``. After a replay, :meth:`Agreement.origins`
exchanges what each rank's replay found (facts: kind, op, line, phase, received or made; through
the process group's store, or ``$OPWATCH_EXCHANGE_DIR``) so that every rank's error names the rank
that made the nan/inf.

Every wait here is bounded: the flag by ``$OPWATCH_COLLECTIVE_TIMEOUT`` seconds when set, else by
the process group's own timeout; the exchange by the same number of seconds (30 when unset). When
a rank does not answer, each waiting rank writes where it waited (one store key) and reads the
others' for a few seconds: :class:`NoAnswer` names the ranks that did not answer and where the
others were.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from datetime import timedelta
from typing import NamedTuple

import torch

from ...checks.collectives import TIMEOUT_VARIABLE
from ...core.collective_ops import group_store, store_prefix
from ...findings.ranks import DEFAULT_TIMEOUT, Exchange, RankAnomaly, decode, encode
from ...render import guard as words

__all__ = ["Agreement", "Made", "NoAnswer", "RankOrigin", "local", "ROLL_CALL_WAIT"]

ROLL_CALL_WAIT = 5.0  # seconds a rank that timed out waits for the others to say where they are

# Guarded steps this process made in a distributed job: the keys of their exchanges. Every rank
# makes its guards in the same order (they wrap the same training code).
_guards = itertools.count()


class Made(NamedTuple):
    """Where a rank made a nan/inf (from its replay's anomaly)."""

    rank: int
    kind: str  # "nan" or "inf"
    op: str
    where: str  # file:line (or the DDP bucket)
    phase: str


class RankOrigin(NamedTuple):
    """What the ranks' replays of one step found, as every rank's error tells it."""

    rank: int  # this rank
    origin: Made | None  # the first nan/inf made, on any rank
    missing: tuple  # ranks that did not report what their replay found in time
    timeout: float  # the seconds waited for them


class NoAnswer(RuntimeError):
    """A rank did not answer within the timeout: the message names it and where the others were."""


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() else None


def local(tensor):
    """A DTensor's local shard (read without a collective), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and type(tensor).__name__ == "DTensor" else tensor


def _timeout() -> float | None:
    """``$OPWATCH_COLLECTIVE_TIMEOUT`` in seconds, or ``None`` (the process group's own)."""
    text = os.environ.get(TIMEOUT_VARIABLE)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value > 0 else None


class Agreement:
    """A guard's place in a distributed job: its rank, the world, its flag tensor."""

    def __init__(self, dist, rank: int, world: int):
        self._dist = dist
        self.rank = rank
        self.world = world
        self.number = next(_guards)
        backend = str(dist.get_backend())
        on_cpu = "gloo" in backend or "nccl" not in backend
        device = torch.device("cpu") if on_cpu or not torch.cuda.is_available() else torch.device("cuda", torch.cuda.current_device())
        self._flag = torch.zeros(1, device=device)
        self._max = dist.ReduceOp.MAX
        self.timeout = _timeout()

    @classmethod
    def start(cls) -> Agreement | None:
        """The agreement of a guard first called now: ``None`` outside a job of 2 or more ranks."""
        dist = _dist()
        if dist is None or not dist.is_initialized():
            return None
        world = dist.get_world_size()
        return cls(dist, dist.get_rank(), world) if world > 1 else None

    @property
    def wait_s(self) -> float:
        """The seconds the exchange waits (the flag's own timeout, else the exchange's default)."""
        return self.timeout if self.timeout is not None else DEFAULT_TIMEOUT

    # -- the flag ------------------------------------------------------------------------------

    def failed(self, failed: bool, call: int, name: str, waited: str = "flag") -> bool:
        """Whether any rank's step ``call`` failed (``MAX`` of the flags), waiting at most the
        timeout; a rank that does not answer raises :class:`NoAnswer` on the others.
        ``waited``: what the flag asks (``"flag"``: the step failed; ``"poisoned"``: the
        parameters hold nan/inf)."""
        flag = self._flag
        flag.fill_(1.0 if failed else 0.0)
        try:
            work = self._dist.all_reduce(flag, op=self._max, async_op=True)
            if self.timeout is None:
                work.wait()  # bounded by the process group's timeout
            else:
                work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as error:
            raise self.no_answer(call, name, waited, error) from error
        return bool(flag.item())

    # -- after a replay --------------------------------------------------------------------------

    def origins(self, call: int, anomalies) -> tuple[RankOrigin, RankAnomaly | None]:
        """Publish this rank's replay findings for step ``call`` and read the others' (at most
        :attr:`wait_s` seconds): the facts of the first nan/inf made on any rank, and its row."""
        exchange = Exchange.open(group_store(), self.rank, self.world, f"guard/{self.number}/{call}")
        exchange.publish(encode(anomalies, self.rank, self.world))
        found, missing = exchange.collect(self.wait_s)
        offset = time.time_ns() - time.perf_counter_ns()
        rows = [RankAnomaly.of(anomaly, self.rank, offset) for anomaly in anomalies]
        for rank in sorted(found):
            rows += decode(found[rank])
        made = [row for row in rows if row.kind in ("nan", "inf") and not row.received]
        first = min(made, key=lambda row: (row.time_ns, row.rank)) if made else None
        origin = None if first is None else Made(first.rank, first.kind, first.op, first.where, first.phase)
        return RankOrigin(self.rank, origin, tuple(missing), self.wait_s), first

    # -- a rank that does not answer --------------------------------------------------------------

    def _where_key(self, rank) -> str:
        return f"{store_prefix()}/guard/{self.number}/where/{rank}"

    def mark(self, call: int, name: str, waited: str, detail: str = "") -> None:
        """Say where this rank is (one store key) for ranks that time out waiting for it: a
        step that raised on this rank is not at the flag the others wait at."""
        try:
            group_store().set(self._where_key(self.rank), json.dumps({"call": call, "name": name, "waited": waited, "detail": detail}))
        except Exception:
            pass  # no store: the others say they heard nothing

    def no_answer(self, call: int, name: str, waited: str, error: BaseException) -> NoAnswer:
        """Say where this rank waited (one store key), read where the others are for at most
        :data:`ROLL_CALL_WAIT` seconds: the error naming the ranks that did not answer."""
        here = {"call": call, "name": name, "waited": waited, "detail": ""}
        others: dict = {}
        store = group_store()
        try:
            store.set(self._where_key(self.rank), json.dumps(here))
            deadline = time.monotonic() + ROLL_CALL_WAIT
            waiting = [rank for rank in range(self.world) if rank != self.rank]
            while waiting and time.monotonic() < deadline:
                for rank in list(waiting):
                    if store.check([self._where_key(rank)]):
                        others[rank] = json.loads(store.get(self._where_key(rank)).decode("utf-8"))
                        waiting.remove(rank)
                if waiting:
                    time.sleep(0.05)
        except Exception:
            pass  # the store is gone with the rank that held it: the others are unknown
        timeout = self.timeout
        silent = [rank for rank in range(self.world) if rank != self.rank and rank not in others]
        line, _, _ = f"{type(error).__name__}: {error}".partition("\n")
        return NoAnswer(words.no_answer(self.rank, here, others, silent, timeout, line))
