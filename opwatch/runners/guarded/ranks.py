"""One decision for every rank of a distributed job, and no wait without an end.

In a job of several ranks (``torch.distributed`` initialized, world size > 1) each rank's fused
finite check decides only for itself: a rank that replays a step under a full watch runs the
step's collectives again, and a rank that goes on runs the next step's, so both would wait for
ever. :meth:`Agreement.failed` reduces the failure flag across the ranks once per guarded step
(or, for leave-on, per optimizer step), on a gloo process group of opwatch's own (made once by
every rank at its first guard; the default group, on the current CUDA device under NCCL, where
gloo is missing): the flag never meets the program's collectives, so a rank whose step raised
before a collective the others run waits at the flag instead of being matched with it. So every
rank replays the same steps, with matching collectives, and applies the same ``on_failure``. :meth:`Agreement.decide` is the same
all-reduce with one slot per rank (``MAX`` of a vector where each rank writes only its own slot):
every rank learns what each rank's step did (made nan/inf, raised, ran under a full watch), so a
step that raised on one rank is known to all (:class:`RaisedElsewhere` names the rank, the
exception and its line, read from the store key the raising rank wrote before the flag). After a replay, :meth:`Agreement.origins`
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
from ...findings.exchange import agent_store
from ...findings.ranks import DEFAULT_TIMEOUT, Exchange, RankAnomaly, decode, encode
from ...render import guard as words

__all__ = ["Agreement", "Decision", "Made", "NoAnswer", "RaisedElsewhere", "RankOrigin", "local", "ROLL_CALL_WAIT",
           "NONFINITE", "RAISED", "WATCHED", "BAD_INPUT", "raised_where"]

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


# What a rank's slot of the decision says (bits): its step made nan/inf, raised, ran under a
# full watch (an audit: its origin, if any, is known without a replay), was fed a batch that
# held nan/inf (leave-on: what it held is in a store key, :meth:`Agreement.publish_input`).
NONFINITE, RAISED, WATCHED, BAD_INPUT = 1, 2, 4, 8


class Decision(NamedTuple):
    """Every rank's slot of one decision, as each rank reads it (the same on every rank)."""

    codes: tuple  # per rank: NONFINITE | RAISED | WATCHED bits

    def ranks(self, bit: int) -> tuple:
        return tuple(rank for rank, code in enumerate(self.codes) if code & bit)

    @property
    def failed(self) -> bool:
        """Some rank's step made nan/inf or raised."""
        return any(code & (NONFINITE | RAISED) for code in self.codes)

    @property
    def raised(self) -> tuple:
        return self.ranks(RAISED)

    @property
    def nonfinite(self) -> tuple:
        return self.ranks(NONFINITE)

    @property
    def all_watched(self) -> bool:
        return all(code & WATCHED for code in self.codes)


class RaisedElsewhere(RuntimeError):
    """Another rank's step raised: every rank stops at that step (no rank replays it, since a
    replay would run collectives the raising rank does not reach). ``rank``, ``error_type``,
    ``where`` (``file:line`` of the user's frame that raised, or ``""``), ``line`` (the
    exception's first line) are that rank's facts, as it wrote them before the flag."""

    def __init__(self, message: str, *, rank: int, error_type: str = "", where: str = "", line: str = ""):
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.where = where
        self.line = line


def raised_where(error: BaseException) -> str:
    """``file:line`` of the innermost user frame of ``error``'s traceback (not torch, opwatch
    or an installed package), or ``""``."""
    from ...core.sites import USER, classify_code, display_path

    found = ""
    walk = error.__traceback__
    while walk is not None:
        code = walk.tb_frame.f_code
        if classify_code(code) == USER:
            found = f"{display_path(code.co_filename)}:{walk.tb_lineno}"
        walk = walk.tb_next
    return found


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


# The flag's own gloo process group, one per default group (made by every rank at its first
# guard, in the same order): the flag never meets the program's collectives, so a rank whose
# step raised before a collective the others run waits at the flag instead of being matched
# with that collective; and the flag stays a CPU tensor under NCCL (the check read it already).
_flag_groups: list = []  # [(the default group, its flag group)]


def _flag_group(dist):
    world = dist.group.WORLD
    for default, group in _flag_groups:
        if default is world:
            return group
    group = None
    if dist.is_gloo_available():
        try:
            group = dist.new_group(backend="gloo")
        except Exception:
            group = None  # the default group then carries the flag
    _flag_groups[:] = [(world, group)]  # an older default group is gone
    return group


class Agreement:
    """A guard's place in a distributed job: its rank, the world, its flag tensor."""

    def __init__(self, dist, rank: int, world: int):
        self._dist = dist
        self.rank = rank
        self.world = world
        self.number = next(_guards)
        self._group = _flag_group(dist)
        backend = str(dist.get_backend())
        on_cpu = self._group is not None or "gloo" in backend or "nccl" not in backend
        device = torch.device("cpu") if on_cpu or not torch.cuda.is_available() else torch.device("cuda", torch.cuda.current_device())
        self._flag = torch.zeros(world, device=device)
        self._max = dist.ReduceOp.MAX
        self.timeout = _timeout()
        self._store = group_store()  # held: it stays reachable after the program destroys its group
        self._end: Exchange | None = None  # the run's end counts (publish_evaluations)

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
        """Whether any rank's step ``call`` failed, waiting at most the timeout; a rank that
        does not answer raises :class:`NoAnswer` on the others. ``waited``: what the flag asks
        (``"flag"``: the step failed; ``"poisoned"``: the parameters hold nan/inf)."""
        return self.decide(NONFINITE if failed else 0, call, name, waited).failed

    def decide(self, code: int, call: int, name: str, waited: str = "flag") -> Decision:
        """Every rank's ``code`` (:data:`NONFINITE`, :data:`RAISED`, :data:`WATCHED` bits) for
        step ``call``: one all-reduce (``MAX``) of one slot per rank, bounded like
        :meth:`failed`."""
        flag = self._flag
        flag.zero_()
        flag[self.rank] = float(code)
        try:
            work = self._dist.all_reduce(flag, op=self._max, group=self._group, async_op=True)
            if self.timeout is None:
                work.wait()  # bounded by the process group's timeout
            else:
                work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as error:
            raise self.no_answer(call, name, waited, error) from error
        return Decision(tuple(int(value) for value in flag.tolist()))

    def raised_elsewhere(self, decision: Decision, call: int, name: str) -> RaisedElsewhere:
        """The error of a rank whose step ``call`` did not raise while another rank's did: that
        rank's facts read from the key it wrote before the flag (:meth:`mark`)."""
        rank = min(decision.raised)
        facts: dict = {}
        try:
            store = group_store()
            if store.check([self._where_key(rank)]):
                facts = json.loads(store.get(self._where_key(rank)).decode("utf-8"))
        except Exception:
            pass  # the store is gone: the rank is named, its exception is not
        text = words.raised_elsewhere(self.rank, call, name, rank, facts.get("error_type", ""), facts.get("where", ""),
                                      facts.get("line", ""), [other for other in decision.raised if other != rank])
        return RaisedElsewhere(text, rank=rank, error_type=facts.get("error_type", ""), where=facts.get("where", ""), line=facts.get("line", ""))

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

    # -- a batch that held nan/inf ------------------------------------------------------------------

    def _input_key(self, call, rank: int) -> str:
        return f"{store_prefix()}/guard/{self.number}/input/{call}/{rank}"

    def publish_input(self, call, facts: dict) -> None:
        """Write what this rank's batch of step ``call`` held (one store key) before it joins
        the flag with :data:`BAD_INPUT`: once the decision is read, the key is there for every
        rank, with no wait."""
        try:
            group_store().set(self._input_key(call, self.rank), json.dumps(facts))
        except Exception:
            pass  # no store: the others name the rank without what its batch held

    def input_of(self, rank: int, call) -> dict | None:
        """What ``rank``'s batch of step ``call`` held (:meth:`publish_input`), or ``None``."""
        try:
            store = group_store()
            key = self._input_key(call, rank)
            if store.check([key]):
                return json.loads(store.get(key).decode("utf-8"))
        except Exception:
            pass
        return None

    # -- the run's end ---------------------------------------------------------------------------

    def publish_evaluations(self, count: int) -> None:
        """This rank's calls with gradients off that returned nan, at the run's end (one store
        key): each rank checks its own evaluations, and rank 0's combined summary speaks for all."""
        try:
            self._end = Exchange.open(self._store or agent_store(), self.rank, self.world, f"guard/{self.number}/end")
            self._end.publish(json.dumps({"evaluations_nan": count}).encode("utf-8"))
        except Exception:
            self._end = None  # no store: the combined summary counts this rank's alone

    def evaluations_elsewhere(self) -> int:
        """The other ranks' counts (:meth:`publish_evaluations`), waiting at most
        :attr:`wait_s` seconds for them; a rank that did not publish counts none."""
        if self._end is None:
            return 0
        try:
            found, _ = self._end.collect(self.wait_s)
            return sum(int(json.loads(data.decode("utf-8")).get("evaluations_nan", 0)) for data in found.values())
        except Exception:
            return 0

    # -- a rank that does not answer --------------------------------------------------------------

    def _where_key(self, rank) -> str:
        return f"{store_prefix()}/guard/{self.number}/where/{rank}"

    def mark(self, call: int, name: str, waited: str, detail: str = "", **facts) -> None:
        """Say where this rank is (one store key), written before it joins the flag: for the
        others' :class:`RaisedElsewhere` (``facts``: ``error_type``, ``where``, ``line``) and
        for ranks that time out waiting for it."""
        try:
            group_store().set(self._where_key(self.rank), json.dumps({"call": call, "name": name, "waited": waited, "detail": detail, **facts}))
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
