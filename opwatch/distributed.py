"""``torch.distributed`` for opwatch: the rank, collectives, the DDP reducer's ops, and the
exchange of anomalies between ranks when a watch ends.

**Ranks.** A watch entered while a process group exists (or under a launcher that sets ``RANK``
and ``WORLD_SIZE``, as ``torchrun`` does before the script creates its group) knows its rank;
its records and anomalies carry it and every message says ``rank N``. Without
``torch.distributed`` nothing changes: the rank is ``None`` and the output is what it was.

**Collectives.** ``c10d`` ops (``allreduce_``, ``broadcast_``, ``allgather_``,
``_allgather_base_``, ``reduce_scatter_``, ...) write their first argument and return it with a
``Work`` (``([tensors], Work)``, nested lists for ``allgather_``), or return the ``Work`` alone;
:func:`collective_outputs` gives the interceptor the tensors written, which are the op's
outputs. Functional collectives (``_c10d_functional.*``) return a tensor the collective has not
filled yet; ``_wrap_tensor_autograd`` wraps it in an ``AsyncCollectiveTensor`` whose first
non-view use waits for it (``wait_tensor``, which opwatch sees only when the program calls it).
None of their values exist when the op returns: the nan/inf check reads them once the collective
has completed (``opwatch.checks.nonfinite``).

**The DDP reducer.** Its ops run in autograd hooks and in the engine's final callback, with no
user frame and no forward op behind them. In a distributed watch they get a *labelled site*
instead of a source line (:class:`ReducerSites`): ``DDP gradient of fc1.weight`` where a
parameter's gradient is copied into its bucket, ``DDP bucket [fc2.bias, fc2.weight, ...]`` for
the bucket's all-reduce, ``DDP end of backward`` where the reduced buckets are copied into
``.grad``. Their phase is ``backward``.

**The exchange.** When a distributed watch ends, the rank publishes its anomalies (each distinct
one once, with its count and message) under ``opwatch/<block>/<rank>`` in the process group's
store (its innermost ``TCPStore``, or the ``torchrun`` agent's store when the script has already
destroyed its group), or as files under ``$OPWATCH_EXCHANGE_DIR`` when that is set: one
``set`` per rank. :meth:`Exchange.collect` waits for the other ranks' entries with a timeout and
names those that did not report. No collective ever runs on the program's process groups: a
rank that crashed or hangs cannot make another one hang here. ``<block>`` counts the distributed
watches this process has ended, so every rank must run the same watched blocks.

Private torch APIs, through :mod:`opwatch.compat` (torch 2.13 has them all; each use is guarded
and degrades): ``Work.unbox`` / ``ProcessGroup.unbox`` (a ``ScriptObject`` argument or result to its Python
object; without: the Work is not followed, outputs are read at a check point once used; the
group is stored by class name), ``_resolve_process_group`` (a group name to its group; without:
no mismatch comparison), ``distributed_c10d._get_default_store`` (without: the ``torchrun``
agent's store or ``$OPWATCH_EXCHANGE_DIR``), ``ScriptObject._type()`` and ``AccumulateGrad.variable``
(names only, read where used).
"""

from __future__ import annotations

import itertools
import json
import os
import time
import weakref
from datetime import timedelta

import torch

from .compat import default_store, resolve_process_group, unbox_process_group, unbox_work
from .ops import C10D, FUNCTIONAL, WAIT, WRAP, Collective, collective_of, is_collective_op

__all__ = [
    "current_rank",
    "current_world_size",
    "Collective",
    "collective_of",
    "is_collective_op",
    "CollectiveOutputs",
    "collective_outputs",
    "describe_script_object",
    "C10D",
    "FUNCTIONAL",
    "WAIT",
    "WRAP",
    "on_completion",
    "group_of",
    "ReducerSites",
    "DistributedWatch",
    "Exchange",
    "RankAnomaly",
    "AllAnomalies",
    "encode",
    "decode",
    "EXCHANGE_DIR_VARIABLE",
    "DEFAULT_TIMEOUT",
]

EXCHANGE_DIR_VARIABLE = "OPWATCH_EXCHANGE_DIR"
DEFAULT_TIMEOUT = 30.0  # seconds to wait for the other ranks' anomalies
_MAX_PUBLISHED = 32  # distinct anomalies a rank publishes (the rest are counted in "total")

# -- ranks ------------------------------------------------------------------------------------


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() else None


def current_rank() -> int | None:
    """This process's rank: the default process group's, else ``RANK`` where the launcher set
    both ``RANK`` and ``WORLD_SIZE`` (``torchrun``, before the script creates its group); else
    ``None`` (not distributed)."""
    dist = _dist()
    if dist is not None and dist.is_initialized():
        return dist.get_rank()
    return _from_environment("RANK")


def current_world_size() -> int | None:
    """The default process group's size, else ``WORLD_SIZE`` as for :func:`current_rank`."""
    dist = _dist()
    if dist is not None and dist.is_initialized():
        return dist.get_world_size()
    return _from_environment("WORLD_SIZE")


def _from_environment(name: str) -> int | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return int(os.environ[name])
    except ValueError:
        return None


# -- collectives --------------------------------------------------------------------------

class CollectiveOutputs(tuple):
    """The tensors a collective writes, and the ``Work`` (a ``ScriptObject``) that completes
    it when the op returned one (``work``; ``None`` for functional collectives)."""

    def __new__(cls, tensors, work=None):
        outputs = super().__new__(cls, tensors)
        outputs.work = work
        return outputs


def collective_outputs(collective: Collective, args, kwargs, out) -> CollectiveOutputs:
    """The tensors ``collective`` wrote (nested lists flattened) and its ``Work``."""
    work = None
    written = ()
    if type(out) is tuple and len(out) == 2 and isinstance(out[1], torch.ScriptObject):
        written, work = out  # ([tensors], Work), ([[tensors]], Work), (tensor, Work)
    elif isinstance(out, torch.ScriptObject):
        work = out
        if collective.writes_first and args:
            written = args[0]
    elif collective.kind != C10D:
        written = out  # a functional collective's list of tensors
    tensors: list = []
    _flatten(written, tensors)
    return CollectiveOutputs(tensors, work)


def _flatten(value, into: list) -> None:
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif type(value) is list or type(value) is tuple:
        for item in value:
            _flatten(item, into)


def describe_script_object(value) -> str:
    """How a ``ScriptObject`` argument is stored in the op log: ``ProcessGroup(0)`` (its group
    name), ``ReduceOp``, ``Work``; the class name of others."""
    try:
        name = value._type().name()
    except Exception:
        return "ScriptObject"
    if name == "ProcessGroup":
        try:
            return f"ProcessGroup({unbox_process_group(value).group_name})"
        except Exception:
            return name
    return name


def group_of(collective: Collective, flat_args) -> tuple[str, object] | None:
    """``(group name, ProcessGroup)`` of a collective call, read from its logged arguments
    (``ProcessGroup(0)`` for c10d ops, the group name for functional ones); ``None`` when unknown."""
    if collective.group_arg is None:
        return None
    name = None
    for key, value in zip(flat_args[::2], flat_args[1::2]):
        if key == collective.group_arg or key in ("process_group", "group_name"):
            name = value
            break
    if not isinstance(name, str):
        return None
    if name.startswith("ProcessGroup(") and name.endswith(")"):
        name = name[len("ProcessGroup(") : -1]
    try:
        return name, resolve_process_group(name)
    except Exception:
        return None


def on_completion(work, callback) -> bool:
    """Call ``callback()`` once the collective behind ``work`` (a ``Work`` ``ScriptObject``)
    has completed: from the ``Work``'s future, on the thread that completes it (gloo's worker),
    or with the collective's streams current (NCCL), so that device work it enqueues follows
    the collective without a host sync. Returns ``False`` when the ``Work`` has no future."""
    try:
        unboxed = unbox_work(work)
        future = unboxed.get_future()
    except Exception:
        return False

    def run(_future):
        try:
            callback()
        except Exception:
            pass  # opwatch's own reading failed: the collective's result is untouched
        return None

    try:
        future.then(run)
    except Exception:
        return False
    return True


# -- labelled sites for the DDP reducer's ops ----------------------------------------------


class ReducerSites:
    """Site labels for ops the autograd engine runs without a forward line in a distributed
    watch: a parameter's gradient hook (``DDP gradient of fc1.weight``), a collective launched
    from one (``DDP bucket [fc2.bias, fc2.weight, +2]``: the parameters whose hooks ran since
    the previous collective), and the engine's final callback (``DDP end of backward``).
    "DDP" only when the outermost module called is a ``DistributedDataParallel``."""

    _MAX_NAMES = 3

    def __init__(self, log, modules):
        self._log = log
        self._modules = modules  # ModuleStack: its last root names the parameters
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> {id(param): name}
        self._ready: list[str] = []  # parameters whose gradient hooks ran since the last collective

    def site(self, node, is_collective: bool) -> int:
        """The labelled site id of an engine-run op without a forward line; 0 when unknown."""
        root = self._root()
        prefix = "DDP " if type(root).__name__ == "DistributedDataParallel" else ""
        if node is None:
            return self._log.label_site(f"{prefix}end of backward")
        if type(node).__name__ != "AccumulateGrad":
            return 0
        if is_collective:
            names, self._ready = self._ready, []
            shown = ", ".join(names[: self._MAX_NAMES])
            if len(names) > self._MAX_NAMES:
                shown += f", +{len(names) - self._MAX_NAMES}"
            return self._log.label_site(f"{prefix}bucket [{shown}]")
        name = self._name(root, node)
        if not self._ready or self._ready[-1] != name:
            self._ready.append(name)
            if len(self._ready) > 4096:
                del self._ready[:2048]
        return self._log.label_site(f"{prefix}gradient of {name}")

    def _root(self):
        ref = getattr(self._modules, "_root", None)
        return ref() if ref is not None else None

    def _name(self, root, node) -> str:
        try:
            param = node.variable
        except Exception:
            return "a parameter"
        if root is not None:
            names = self._names.get(root)
            if names is None:
                names = self._names[root] = _parameter_names(root)
            name = names.get(id(param))
            if name is not None:
                return name
        from .notation import format_meta

        return f"a {format_meta((tuple(param.shape), param.dtype, param.device))} parameter"


def _parameter_names(root) -> dict:
    strip = "module." if type(root).__name__ == "DistributedDataParallel" else ""
    names = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name.removeprefix(strip))
    return names


# -- one watch's view of the job -----------------------------------------------------------

_blocks = itertools.count()  # distributed watches this process has ended: the exchange's key


class DistributedWatch:
    """A watch in a distributed job: its rank and world size, the store it exchanges through
    (kept from when the process group existed: scripts often destroy it before the watch
    ends), the DDP reducer's site labels and, once it ended, its :class:`Exchange`."""

    def __init__(self, log, modules):
        self.log = log
        self.sites = ReducerSites(log, modules)
        self.rank: int | None = None
        self.world: int | None = None
        self._store = None
        self.exchange: Exchange | None = None
        self.refresh()

    @classmethod
    def start(cls, log, modules) -> DistributedWatch | None:
        """The state of a watch entered now; ``None`` where ``torch.distributed`` is not
        available. Its ``rank`` stays ``None`` until there is a job (a process group, or a
        launcher's ``RANK``)."""
        return cls(log, modules) if _dist() is not None else None

    def refresh(self) -> None:
        """Read the rank again and keep the process group's store (called when the watch starts,
        at its first collective and when it ends)."""
        rank = current_rank()
        if rank is None:
            return
        self.rank, self.world = rank, current_world_size()
        self.log.rank = rank
        if self._store is None:
            self._store = _group_store()

    def publish(self, anomalies, contained: int) -> None:
        """Publish this rank's anomalies for the other ranks (one ``set``)."""
        self.refresh()
        if self.rank is None or not self.world or self.world < 2:
            return
        self.exchange = Exchange.open(self._store or _agent_store(), self.rank, self.world, next(_blocks))
        self.exchange.publish(encode(anomalies, self.rank, self.world, contained))


def _group_store():
    """The innermost store of the default process group (its ``TCPStore``: held, it stays
    reachable after the group is destroyed); ``None`` without a group."""
    dist = _dist()
    if dist is None or not dist.is_initialized():
        return None
    try:
        store = default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        return store
    except Exception:
        return None


def _agent_store():
    """A client of the ``torchrun`` agent's store (``MASTER_ADDR:MASTER_PORT`` when
    ``TORCHELASTIC_USE_AGENT_STORE`` is set): it outlives the script's process group."""
    dist = _dist()
    if dist is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
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


def _prefix() -> str:
    # A torchelastic restart reuses the agent's store: keys of an earlier attempt must not count.
    return f"opwatch/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class _StoreExchange(Exchange):
    def __init__(self, store, rank, world, block):
        super().__init__(rank, world, block)
        self._store = store
        self.round_trips = 0

    def _key(self, rank: int) -> str:
        return f"{_prefix()}/{self.block}/{rank}"

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
        self._folder = os.path.join(folder, _prefix().replace("/", "-"), str(block))

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


# -- what is exchanged ------------------------------------------------------------------------


def encode(anomalies, rank: int, world: int, contained: int = 0) -> bytes:
    """This rank's anomalies as the exchange carries them: each distinct one (kind, line, op,
    phase) once, with its count, its message and the wall-clock time of its op."""
    offset = time.time_ns() - time.perf_counter_ns()  # perf_counter -> wall clock
    groups: dict = {}
    for anomaly in anomalies:
        key = (anomaly.kind, anomaly.filename, anomaly.lineno, anomaly.op, anomaly.phase)
        if key in groups:
            groups[key]["count"] += 1
            continue
        if len(groups) >= _MAX_PUBLISHED:
            continue
        record = anomaly.record
        groups[key] = {
            "kind": anomaly.kind,
            "op": anomaly.op,
            "filename": anomaly.filename,
            "lineno": anomaly.lineno,
            "where": record.where,
            "module": anomaly.module,
            "phase": anomaly.phase,
            "index": anomaly.index,
            "received": anomaly.received,
            "count": 1,
            "time_ns": record.start_ns + offset,
            "message": anomaly.message,
        }
    payload = {"rank": rank, "world": world, "total": len(anomalies), "contained": contained, "anomalies": list(groups.values())}
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def decode(data: bytes) -> list[RankAnomaly]:
    payload = json.loads(data.decode("utf-8"))
    rank = payload["rank"]
    return [RankAnomaly(rank=rank, **fields) for fields in payload["anomalies"]]


class RankAnomaly:
    """An anomaly another rank reported, as the exchange carried it: the attributes of
    :class:`~opwatch.Anomaly` (``kind``, ``op``, ``filename``, ``lineno``, ``where``, ``module``,
    ``phase``, ``index``, ``message``, ``received``) plus ``rank``, ``count`` (how often it fired
    there) and ``time_ns`` (wall clock of its op). ``record`` is ``None``: records stay on
    their rank."""

    __slots__ = ("rank", "kind", "op", "filename", "lineno", "where", "module", "phase", "index", "received", "count", "time_ns", "message")
    record = None

    def __init__(self, *, rank, kind, op, filename, lineno, where, module, phase, index, received, count, time_ns, message):
        self.rank = rank
        self.kind = kind
        self.op = op
        self.filename = filename
        self.lineno = lineno
        self.where = where
        self.module = module
        self.phase = phase
        self.index = index
        self.received = received
        self.count = count
        self.time_ns = time_ns
        self.message = message

    @classmethod
    def of(cls, anomaly, rank: int, offset: int) -> RankAnomaly:
        """This rank's own ``anomaly`` in the same form (``offset``: wall clock - perf counter)."""
        return cls(
            rank=rank, kind=anomaly.kind, op=anomaly.op, filename=anomaly.filename, lineno=anomaly.lineno,
            where=anomaly.record.where, module=anomaly.module, phase=anomaly.phase, index=anomaly.index,
            received=anomaly.received, count=1, time_ns=anomaly.record.start_ns + offset, message=anomaly.message,
        )

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"<RankAnomaly rank {self.rank} {self.kind} {self.op} at {self.where} #{self.index}>"


class AllAnomalies(list):
    """Every rank's anomalies (:meth:`opwatch.Watch.all_anomalies`): this rank's
    :class:`~opwatch.Anomaly` objects and the other ranks' :class:`RankAnomaly` objects, in
    rank order, each with ``.rank``.

    Attributes:
        world: the number of ranks (``None`` outside a distributed job).
        missing: ranks that had not reported when the timeout ran out.
        timeout: the seconds waited for them.
    """

    def __init__(self, anomalies, *, world, missing=(), timeout=DEFAULT_TIMEOUT):
        super().__init__(anomalies)
        self.world = world
        self.missing = tuple(missing)
        self.timeout = timeout

    def summary(self) -> str:
        """The combined summary: which rank made the first nan/inf, at which op and line, where
        it was received, each rank's distinct anomalies, and the ranks that did not report."""
        from .render import render_combined_summary

        offset = time.time_ns() - time.perf_counter_ns()
        rows = [anomaly if isinstance(anomaly, RankAnomaly) else RankAnomaly.of(anomaly, anomaly.rank, offset) for anomaly in self]
        return render_combined_summary(rows, world=self.world, missing=self.missing, timeout=self.timeout)
