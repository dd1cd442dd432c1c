"""``torch.distributed`` below the core: this process's rank, what a collective op wrote, its
process group, when it completes, and the store the ranks can meet in. The interceptor, the
checks and the nan/inf tracker ask these per op; which ops are collectives is
:func:`opwatch.core.ops.collective_of`. The exchange of anomalies between ranks when a watch ends
sits above the core, in :mod:`opwatch.findings.ranks`; the watch's place in the job, which the
interceptor reads, in :mod:`opwatch.modes.ranks`; the DDP reducer's site labels in
:mod:`opwatch.modes.reducer`.

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
has completed (:func:`on_completion`).

Private torch APIs, through :mod:`opwatch.core.compat` (torch 2.13 has them all; each use is guarded
and degrades): ``Work.unbox`` / ``ProcessGroup.unbox`` (a ``ScriptObject`` argument or result to
its Python object; without: the Work is not followed, outputs are read at a check point once
used; the group is stored by class name), ``_resolve_process_group`` (a group name to its group;
without: no mismatch comparison), ``distributed_c10d._get_default_store`` (without: the
``torchrun`` agent's store or ``$OPWATCH_EXCHANGE_DIR``), ``ScriptObject._type()`` (names only).
"""

from __future__ import annotations

import os

import torch

from .compat import default_store, resolve_process_group, script_object_type, unbox_process_group, unbox_work
from .ops import C10D, Collective

__all__ = [
    "current_rank",
    "current_world_size",
    "RankState",
    "CollectiveOutputs",
    "collective_outputs",
    "describe_script_object",
    "group_of",
    "on_completion",
    "group_store",
    "store_prefix",
]

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


class RankState:
    """One watch's place in a distributed job: its rank and world size (``None`` until there is
    a job) and the store of its process group, kept from when the group existed (scripts often
    destroy it before the watch ends). The interceptor refreshes it at the first collective."""

    def __init__(self, log):
        self.log = log
        self.rank: int | None = None
        self.world: int | None = None
        self.store = None
        self.refresh()

    def refresh(self) -> None:
        """Read the rank again and keep the process group's store (called when the watch starts,
        at its first collective and when it ends)."""
        rank = current_rank()
        if rank is None:
            return
        self.rank, self.world = rank, current_world_size()
        self.log.rank = rank
        if self.store is None:
            self.store = group_store()

    @staticmethod
    def available() -> bool:
        """Whether ``torch.distributed`` exists in this torch build."""
        return _dist() is not None


def group_store():
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


def store_prefix() -> str:
    """The start of every key opwatch writes in a store: ``opwatch/<run id>/<restart>``. A
    torchelastic restart reuses the agent's store: keys of an earlier attempt must not count."""
    return f"opwatch/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


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
    name = script_object_type(value)
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
