"""The flag tracker, on the hot path: one sync-free reduction per checked output, read back in
one batch at a check point, then handed to the replay (:mod:`.replay`).

Each floating output gets one reduction, ``torch.aminmax``, whose two results stay on the
tensor's device: nan shows as a nan min/max, inf as an infinite max or min. The kernel writes
them (``out=``) into two slots of a small buffer of its device and dtype (:class:`_Buffer`),
so that an output allocates no tensor and nothing is stacked on the hot path; the buffers are
read back with one transfer per device at a check point, and used again after it. Observers are bound per op (:meth:`NonFiniteTracker.for_op`), so
the interceptor calls the one that fits without asking what the op is.

A tensor made before the watch (a batch from a DataLoader worker, a parameter, a buffer) has no
op in the log that made it: each one is checked when an op first reads it
(:meth:`NonFiniteTracker.for_inputs`), with the same reduction, queued under the reading op's
index at a position from :data:`FIRST_SEEN` on. So the replay knows whether it already held
nan/inf, and its range, instead of taking it for finite.
"""

from __future__ import annotations

import math
import weakref

import torch

from ...core.finite import readable
from ...core.compat import dispatch_modes_outside, dtensor_class, dtensor_parts, inference_mode_enabled, is_zerotensor, no_python_dispatch, tensor_base
from ...core.ops import C10D, FUNCTIONAL, WAIT, WRAP, facts_of
from ...core.records import E_INDEX, M_DEVICE, M_DTYPE, M_SHARDING
from .collectives import CollectiveReads
from .cause import decide_causes, fold_same_source
from .origin import Origin, headroom_risks
from .replay import Flags, Origins
from .rules import CHECKED_DTYPES, COMPLEX, FLOAT8_DTYPES, FLOAT16, HEADROOM_LIMIT, PLAIN_TYPES, SENTINEL, SENTINELS, STRIDED

__all__ = ["NonFiniteTracker", "FIRST_SEEN", "EarlierBlocks"]

# Queued positions from here on are inputs checked when first seen, not outputs.
FIRST_SEEN = 1 << 16
_KNOWN_START = 256  # tensors remembered as accounted for before the dead ones are dropped

_aminmax = torch.aminmax  # the one reduction per output (bench.ablate times these three here)
# On a CPU, torch's aminmax of float32 and float64 is one pass but not vectorized like amin and
# amax: measured at one thread (torch 2.13), two passes cost less from about 24k elements
# (64k: 7.5 us against 9.8), and from 2k where the tensor is not contiguous (4k: 2.4 against
# 4.4). Same two values, nan and inf included. Float16 and bfloat16 keep aminmax (amin and
# amax are slower there), as does every other device (one kernel launch, not two).
_amin = torch.amin
_amax = torch.amax
_SPLIT_DTYPES = frozenset((torch.float32, torch.float64))
_SPLIT_FROM = 24576
_SPLIT_STRIDED_FROM = 2048
# Checked dtypes that no reduction takes as they are: read through a real view or a copy.
_CONVERTED = COMPLEX | FLOAT8_DTYPES
# An id no table holds: (a reference that is always dead, no index).
_UNKNOWN = (lambda: None, -1)


class _Buffer:
    """Slots for (min, max) pairs of one device and dtype: a 1-D tensor and its 0-dim views,
    made once (the views are what ``aminmax(out=...)`` writes into). ``base``: where its slots
    start in the check point's numbering (:meth:`NonFiniteTracker._read_flags`)."""

    __slots__ = ("values", "views", "used", "base", "splits")

    def __init__(self, values):
        self.values = values
        self.views = values.unbind()
        self.used = 0
        self.base = 0
        # Whether a large tensor's pair is read by amin and amax (see _SPLIT_FROM).
        self.splits = values.device.type == "cpu" and values.dtype in _SPLIT_DTYPES

    def write(self, tensor, count: int) -> None:
        """The (min, max) of ``tensor`` (``count`` elements) into the next two slots."""
        slot = self.used
        views = self.views
        if self.splits and (count >= _SPLIT_FROM or (count >= _SPLIT_STRIDED_FROM and not tensor.is_contiguous())):
            _amin(tensor, out=views[slot])
            _amax(tensor, out=views[slot + 1])
        else:
            _aminmax(tensor, out=(views[slot], views[slot + 1]))
        self.used = slot + 2


class EarlierBlocks:
    """What a watch's nan/inf trackers hand on from block to block (a watch re-entered step
    after step, as the trainers' callbacks do): ``outside``, the tensors no op of the watch
    made (id -> (weak reference, the op index from which the watch knew it)), kept for the
    watch's life; ``made``, the tensors an op of an earlier block made that were alive when this block
    began (id -> weak reference); ``known``, the last block's known tensors, folded into ``made`` when the next
    block starts (:meth:`next_block`); ``origins``, the last block's replay state, whose live
    carried tensors and waiting origins the next block takes on (:meth:`next_block`);
    ``failure_told``, set for the watch's life once a guard told a failed optimizer step that
    no block watched (leave-on's audits): each later block's :class:`Origins` takes nan/inf it
    finds in tensors made before it as that failure's leftovers (``Origins.failure_told``).

    A tensor first read in a block was made outside the watch's ops (a batch the DataLoader
    made between two steps, ``torch.from_numpy``), unless an op of an earlier block made it.
    The log may still hold an older, freed tensor's op under the same id (CPython gives a new
    object a freed one's address), and only these tables tell the two apart
    (:meth:`outside_since`). ``unchecked`` does the same for the live objects a check point
    finds under the ids the log names (:meth:`may_be`): id -> (weak reference, op index) of
    the tensors that in-place writes and ``detach`` read, which check no input, when no op of
    the watch made them known. Dead entries are dropped from ``made`` when a block starts, from
    the others whenever a table has doubled, so memory stays flat however many blocks run."""

    __slots__ = ("known", "made", "outside", "unchecked", "origins", "failure_told", "block_start", "_outside_limit", "_unchecked_limit")

    def __init__(self) -> None:
        self.known: dict = {}
        self.made: dict = {}
        self.outside: dict = {}
        self.unchecked: dict = {}
        self.origins: Origins | None = None  # the last block's replay state (_hand_on)
        self.failure_told = False
        self.block_start = 0  # the op index of the block's first op
        self._outside_limit = self._unchecked_limit = _KNOWN_START

    def next_block(self, known: dict, origins: Origins, start: int = 0) -> None:
        """A block starts at op index ``start``, its tracker knowing ``known`` (its table, handed
        on to the next block): ``made`` keeps its live tensors, and the live tensors the last
        block knew that an op of the watch made join them (so that an id missing from ``made``
        was no earlier block's live tensor when this one began: :meth:`read_a_newer_tensor`);
        its replay state ``origins`` takes on the last block's (:meth:`_hand_on`). Once a
        block, off the per-op path: a walk of the tensors earlier blocks made and left alive."""
        self.block_start = start
        self._hand_on(origins)
        last, self.known = self.known, known
        outside = self.outside
        self.made = made = {ident: ref for ident, ref in self.made.items() if ref() is not None}
        for ident, ref in last.items():
            if ident not in outside and ref() is not None:
                made[ident] = ref

    def _hand_on(self, origins: Origins) -> None:
        """A block starts, its replay state ``origins``: what the last block's left alive
        holding an origin's nan/inf (weights the optimizer wrote a bad batch's gradients into,
        its moments) goes on as carried, and the origins that wait (data kept unused) wait on,
        as one watch kept over both blocks would follow them; else each later block would
        find the weights holding nan with no op of its own to blame and name them again."""
        last, self.origins = self.origins, origins
        origins.failure_told = self.failure_told
        if last is None:
            return
        origins.carry = {ident: (kind, origin, ref) for ident, (kind, origin, ref) in last.carry.items() if ref() is not None}
        origins.unjudged = last.unjudged
        origins.entered = {ident for ident in last.entered if ident in origins.carry}
        origins.entered_infs = {ident: meta for ident, meta in last.entered_infs.items() if ident in origins.carry}

    def first_read(self, tensor, index: int) -> None:
        """``tensor``, first read at op ``index`` of a block, was made by no op of the block:
        outside the watch's ops, unless an op of an earlier block made it (then the log's op
        under its id is its own). Off the per-op path: once per tensor made before the block."""
        ident = id(tensor)
        ref, _ = self.outside.get(ident, _UNKNOWN)
        if ref() is tensor:
            return  # known since an earlier block
        ref = self.made.get(ident)
        if ref is not None and ref() is tensor:
            return  # an op of an earlier block made it
        self.outside[ident] = (weakref.ref(tensor), index)
        if len(self.outside) > self._outside_limit:
            self.outside = {key: (ref, since) for key, (ref, since) in self.outside.items() if ref() is not None}
            self._outside_limit = max(_KNOWN_START, 2 * len(self.outside))

    def read_unchecked(self, tensor, index: int) -> None:
        """``tensor``, which no op of the watch made known, was read at op ``index`` by an
        in-place write or ``detach``: kept as the object under its id from then on
        (:meth:`may_be`)."""
        unchecked = self.unchecked
        ident = id(tensor)
        ref, _ = unchecked.get(ident, _UNKNOWN)
        if ref() is tensor:
            return
        unchecked[ident] = (weakref.ref(tensor), index)
        if len(unchecked) > self._unchecked_limit:
            self.unchecked = {key: (ref, at) for key, (ref, at) in unchecked.items() if ref() is not None}
            self._unchecked_limit = max(_KNOWN_START, 2 * len(self.unchecked))

    def may_be(self, ident: int, tensor, index: int) -> bool:
        """Whether ``tensor``, alive now under ``ident``, may be the tensor op ``index`` read
        under it. Not when the watch saw a tensor under the id at or after that op (first read
        outside its ops, or read by an in-place write or ``detach``) that is dead now: the tensor
        read then died, and ``tensor`` took its id later (a tensor made outside the watch's
        ops: a guard's own gradient norm at the check point, a loss of the next step made
        before the watch). Where no table tells, it may be. Slow path: causes only."""
        for table in (self.known, self.made):
            ref = table.get(ident)
            if ref is not None and ref() is tensor:
                return True
        for table in (self.outside, self.unchecked):
            ref, at = table.get(ident, _UNKNOWN)
            seen = ref()
            if seen is tensor:
                return True
            if seen is None and at >= index:
                return False
        return True

    def made_by_an_earlier_block(self, ident: int, index: int) -> bool:
        """Whether the op of index ``index``, logged under the id ``ident`` before this block,
        may have made the tensor this block read under it: it is alive and was when the block
        began (``made``). Else the id is a newer tensor's, made outside the watch's ops."""
        if index >= self.block_start:
            return True
        ref = self.made.get(ident)
        return ref is not None and ref() is not None

    def read_a_newer_tensor(self, ident: int, made_at: int) -> bool:
        """Whether the tensor this block read under ``ident`` is newer than the one op
        ``made_at`` of an earlier block output under it: that one was dead when the block began
        (not in ``made``), and this block knows a tensor under the id (so one the watch
        remembers: of a checked dtype, as the older one was). An in-place write checks no
        input, so such a tensor is not in ``outside``: a ``.grad`` that autograd accumulates
        into, made unwatched between two blocks (a skipped step's backward), under the id of an
        older ``.grad``. Slow path: causes only."""
        return made_at < self.block_start and ident not in self.made and ident in self.known

    def outside_since(self, ident: int, index: int, tensor=None) -> int | None:
        """The op index from which the watch knew the tensor ``ident``, read by op ``index``,
        when no op of the watch made it (then an op logged before that index under the same id
        made an older tensor); ``None`` when an op of the watch made it, or it is not known.
        ``tensor``: the object itself, when it is alive. Slow path: causes only."""
        ref, since = self.outside.get(ident, _UNKNOWN)
        alive = ref()
        if since < 0 or since > index or (alive is not None and tensor is not None and alive is not tensor):
            return None  # not known, or a later tensor's under the same id
        return since


class NonFiniteTracker:
    """Keeps per-output finiteness flags on device and resolves them at check points."""

    # Slots of one buffer (256 pairs): a small model's step fills one, so its check point reads
    # one buffer and joins none (torch.cat of a Hugging Face step's 7 buffers of 64 slots cost
    # 10 us, its tolist as much again).
    _CHUNK = 512
    _POOL = 8  # buffers kept per device and dtype for the next window (2,048 pairs, as before)

    def __init__(self, log, *, keep_ranges: bool = False, earlier: EarlierBlocks | None = None) -> None:
        self._log = log
        # Every op is a check point (guard's replay: ``check_every=1``), so every output's range
        # is read anyway: keep them all, so that an origin's inputs' ranges are known.
        self.keep_ranges = keep_ranges
        # The window's buffers, in the order they were opened; the one being filled per
        # (device, dtype); the one filled last (its device and dtype) and the slots opened so far.
        self._buffers: list[_Buffer] = []
        self._filling: dict = {}
        self._stats = None
        self._stats_key = None
        self._opened = 0
        self._pool: dict = {}  # (device, dtype) -> buffers read and free again
        self._slots: list[int] = []  # per queued pair: its min's slot (its max's is the next)
        # Per queued pair, in parallel lists (ints and one weakref: few objects for the
        # garbage collector to count): the op index, the output's position, the output.
        self._indices: list[int] = []
        self._positions: list[int] = []
        self._refs: list[weakref.ref] = []
        self._devices: set = set()  # devices that flags wait on
        self._carriers: dict = {}  # (op index << 32 | output position) -> weakref, for unchecked outputs
        # In-place writes into a view: (op index << 32 | output position) -> (id of the base,
        # weakref to the base). The values live in the base's storage.
        self._written_bases: dict = {}
        # Queued float16 outputs ((op index << 32) | position): their headroom is judged.
        self._half: set = set()
        # id -> weakref of the tensors whose values are accounted for: outputs of watched ops,
        # and tensors made before the watch once checked. Dead ones are dropped whenever it
        # has doubled (memory stays flat however long the watch).
        self._known: dict = {}
        self._known_limit = _KNOWN_START
        # What the watch's earlier blocks knew (EarlierBlocks): which tensors an op of the
        # watch made, and which no op of it made, with the op index from which it knew them.
        # The log's op that output the same id before that index made an older tensor.
        self._blocks = EarlierBlocks() if earlier is None else earlier
        # op index -> ((position, ident), ...) of the inputs checked when first seen at that op
        self._first_seen: dict = {}
        self._backward_roots: list = []  # (op index, ident) of each tensor backward() ran on, until the check point
        self._origins = Origins(log)  # the replay and judgement, across check points
        self._blocks.next_block(self._known, self._origins, log.next_index)
        self._reads = CollectiveReads(log, self._observe_carrier)  # collectives' outputs until read

    def for_op(self, func):
        """The observer for ``func``'s outputs, called after each kernel as
        ``observe(entry, inputs, outputs, metas)``; ``None`` for ops whose outputs are new data."""
        facts = facts_of(func)
        collective = facts.collective
        if collective is not None:
            reads = self._reads
            return {C10D: reads.observe_collective, FUNCTIONAL: reads.observe_collective, WAIT: reads.observe_wait, WRAP: reads.observe_wrap}[collective.kind]
        if facts.makes_new_data:
            return self._forget if facts.aliases_storage else self._observe_new
        if facts.is_lift:
            return self._observe_all  # an alias of Python data: its values are new here
        if not facts.preserves_values:
            if facts.mutated_args:
                return self._observe_written
            return self._observe_first if facts.checked_outputs == 1 else self._observe_all
        if facts.needs_carrier:
            return self._observe_carrier
        # A view keeps its base alive, and the base is remembered; not so in inference mode.
        return self._observe_view

    def for_inputs(self, func):
        """The check of ``func``'s inputs made before the watch, called after its kernel as
        ``first_seen(index, tensors)``; ``None`` for ops that make new data or only view (the
        op that reads the view reads its base). Ops that write in place check none (a
        destination's old values may be uninitialised memory it is about to fill: a cache made
        with ``torch.empty``; and ``copy_``'s source may be a buffer a collective filled, which
        the collectives' reads follow), nor do views that keep no link to their base
        (``detach``): they only note the objects they read (:meth:`_note_unchecked_reads`)."""
        facts = facts_of(func)
        if facts.makes_new_data or facts.is_lift or facts.collective is not None:
            return None
        if facts.mutated_args or (facts.is_view and facts.needs_carrier):
            return self._note_unchecked_reads
        if facts.is_view:
            return None  # the reader of the view notes its base
        return self._check_first_seen

    @property
    def pending(self) -> int:
        return len(self._indices) + len(self._reads.pending)

    @property
    def carrying(self) -> bool:
        return bool(self._origins.carry) or bool(self._origins.unjudged)

    def forget_ranges(self) -> None:
        """A check point with nothing to resolve: the ranges known from earlier windows may
        be stale after its ops (see ``Origins.ranges``)."""
        self._origins.forget_ranges()

    def backward_from(self, tensors) -> None:
        """``backward()`` (or ``autograd.grad``) runs on ``tensors`` now: the next check point
        tells the origins whose values they hold that they reached the loss (see
        ``replay._backward_ran_on``); kept as identities with the index of the next op."""
        index = self._log.next_index
        self._backward_roots += [(index, id(tensor)) for tensor in tensors]

    def pending_on(self, device) -> bool:
        """Whether flags wait on ``device`` (a host read there already pays for a sync), or
        origins wait to be judged (a host read may be what makes them matter)."""
        return device in self._devices or bool(self._origins.unjudged)

    # -- observers: the hot path, inside the mode's __torch_dispatch__ ------------------------

    def _observe_all(self, entry, inputs, outputs, metas) -> None:
        """Queue one reduction per checkable floating output. No host sync."""
        if dispatch_modes_outside():
            # Modes entered outside opwatch (another watch, the user's own) would see the
            # reductions, which are not the program's ops. Ours is off while it dispatches.
            with no_python_dispatch():
                self._reduce(entry[E_INDEX], outputs, metas)
        else:
            self._reduce(entry[E_INDEX], outputs, metas)

    def _observe_first(self, entry, inputs, outputs, metas) -> None:
        """Like ``_observe_all`` for ops whose later outputs are statistics of the first. The
        statistics are remembered, not read: a layer norm's mean and rstd, saved for its
        backward, are the watch's own tensors there, not ones made before it."""
        self._observe_all(entry, inputs, outputs[:1], metas)
        for tensor in outputs[1:]:
            if type(tensor) in PLAIN_TYPES:
                self._remember(tensor, weakref.ref(tensor))

    def _observe_written(self, entry, inputs, outputs, metas) -> None:
        """Like ``_observe_all`` for ops that write in place: a write into a view
        (``h[:, 0].div_(d)``) puts its values into the base, which outlives the view."""
        self._observe_all(entry, inputs, outputs, metas)
        index = entry[E_INDEX]
        for position, tensor in enumerate(outputs):
            base = tensor_base(tensor)
            if base is not None:
                self._written_bases[index << 32 | position] = (id(base), weakref.ref(base))

    def _check_first_seen(self, index, tensors) -> None:
        """Queue one reduction for each floating input no watched op made and not yet checked
        (a view of a checked tensor counts as checked). No host sync."""
        known = self._known
        for tensor in tensors:
            ref = known.get(id(tensor))
            if ref is not None and ref() is tensor:
                continue
            if tensor.dtype not in CHECKED_DTYPES:
                continue
            base = tensor_base(tensor)
            if base is not None:
                ref = known.get(id(base))
                if ref is not None and ref() is base:
                    continue  # a view of a tensor accounted for
                self._remember(base, weakref.ref(base))
                self._blocks.first_read(base, index)
            else:
                # A view's own op may be logged (it viewed a tensor made outside): only bases
                # and tensors that are no view are known to be made outside the watch's ops.
                self._blocks.first_read(tensor, index)
            if dispatch_modes_outside():
                with no_python_dispatch():
                    self._first(index, tensor)
            else:
                self._first(index, tensor)

    def _note_unchecked_reads(self, index, tensors) -> None:
        """The inputs of an in-place write or of ``detach`` that no op of the watch made known
        (for a view, its base), noted as the objects read at op ``index``
        (:meth:`EarlierBlocks.read_unchecked`): by the check point one may be dead and its id
        a newer tensor's. No reduction."""
        known = self._known
        for tensor in tensors:
            ref = known.get(id(tensor))
            if ref is not None and ref() is tensor:
                continue
            base = tensor_base(tensor)
            if base is not None:
                ref = known.get(id(base))
                if ref is not None and ref() is base:
                    continue
                tensor = base
            self._blocks.read_unchecked(tensor, index)

    def _first(self, index, tensor) -> None:
        seen = self._first_seen.get(index, ())
        position = FIRST_SEEN + len(seen)
        ref = self._reduce_one(index, position, tensor, tensor.dtype, tensor.device)
        if ref is None and type(tensor) not in PLAIN_TYPES and type(tensor) is dtensor_class():
            # A DTensor made before the watch (a tensor-parallel weight): the replay follows its
            # shard under the DTensor's id.
            local_ref, _ = self._reduce_local(index, position, tensor, tensor.dtype)
            ref = None if local_ref is None else weakref.ref(tensor)
        if ref is not None:
            self._first_seen[index] = (*seen, (position, id(tensor)))
        self._remember(tensor, ref or weakref.ref(tensor))

    def _remember(self, tensor, ref) -> None:
        known = self._known
        known[id(tensor)] = ref
        if len(known) > self._known_limit:
            self._drop_dead_known()

    def _drop_dead_known(self) -> None:
        """The known tensors have doubled: keep the live ones (memory stays flat)."""
        self._known = self._blocks.known = known = {ident: ref for ident, ref in self._known.items() if ref() is not None}
        self._known_limit = max(_KNOWN_START, 2 * len(known))

    def _forget(self, entry, inputs, outputs, metas) -> None:
        """``set_``: the tensor's values are what its storage holds, maybe filled with no op
        after it: read when an op first reads it, as if made before the watch."""
        for tensor in outputs:
            self._known.pop(id(tensor), None)

    def _observe_new(self, entry, inputs, outputs, metas) -> None:
        """Uninitialised memory (``empty_like``): made here, not before the watch."""
        for position, tensor in enumerate(outputs):
            if metas[position][M_DTYPE] in CHECKED_DTYPES:
                self._remember(tensor, weakref.ref(tensor))

    def _observe_view(self, entry, inputs, outputs, metas) -> None:
        if inference_mode_enabled():
            self._observe_carrier(entry, inputs, outputs, metas)

    def _observe_carrier(self, entry, inputs, outputs, metas) -> None:
        """For ops whose outputs are not checked: remember them weakly, so that a non-finite
        value they carry counts as alive at the check point. Not needed for views that keep a
        link to their base (see ``OpFacts.needs_carrier``)."""
        carriers, known = self._carriers, self._known
        shifted = entry[E_INDEX] << 32
        position = -1
        for tensor in outputs:
            position += 1
            if metas[position][M_DTYPE] in CHECKED_DTYPES:
                carriers[shifted | position] = known[id(tensor)] = weakref.ref(tensor)  # remembered
                if len(known) > self._known_limit:
                    self._drop_dead_known()
                    known = self._known

    def _reduce(self, index, outputs, metas) -> None:
        """Queue each checked output's (min, max) and remember it. One function for the usual
        output (a plain dense tensor of a real dtype a reduction takes), on every op: the
        others (subclasses, DTensors, complex, float8) take :meth:`_reduce_other`."""
        known = self._known
        position = -1
        for tensor in outputs:
            position += 1
            meta = metas[position]
            dtype = meta[M_DTYPE]
            if dtype not in CHECKED_DTYPES:
                continue  # integers, booleans: nothing to check, nothing to remember
            if type(tensor) not in PLAIN_TYPES or dtype in _CONVERTED:
                self._reduce_other(index, position, tensor, meta)
                known = self._known
                continue
            if tensor.is_meta or tensor.layout is not STRIDED or tensor.is_nested or is_zerotensor(tensor):
                continue
            count = tensor.numel()
            if not count:
                continue
            device = meta[M_DEVICE]
            buffer = self._stats
            if buffer is None or buffer.used == self._CHUNK or self._stats_key != (device, dtype):
                buffer = self._buffer_for(device, dtype)
            slot = buffer.base + buffer.used
            buffer.write(tensor, count)
            self._slots.append(slot)
            self._indices.append(index)
            self._positions.append(position)
            ref = weakref.ref(tensor)
            self._refs.append(ref)
            if dtype is FLOAT16:
                self._half.add(index << 32 | position)  # judged for headroom
            known[id(tensor)] = ref
            if len(known) > self._known_limit:
                self._drop_dead_known()
                known = self._known

    def _reduce_other(self, index, position, tensor, meta) -> None:
        """:meth:`_reduce` for an output that is no plain tensor, or whose dtype no reduction
        takes as it is (complex, float8)."""
        ref = self._reduce_one(index, position, tensor, meta[M_DTYPE], meta[M_DEVICE])
        if ref is not None:
            self._remember(tensor, ref)
        elif len(meta) > M_SHARDING:
            self._reduce_shard(index, position, tensor, meta)

    def _reduce_shard(self, index, position, dtensor, meta) -> None:
        """A DTensor an op made: its local shard is read (reducing the DTensor itself would be
        a collective, run by this rank alone). Both are made here, not before the watch."""
        ref, local = self._reduce_local(index, position, dtensor, meta[M_DTYPE])
        if ref is None and meta[M_DTYPE] in CHECKED_DTYPES:  # an AsyncCollectiveTensor: it holds what its inputs held
            self._carriers[index << 32 | position] = ref = weakref.ref(local)
            self._remember(local, ref)
            self._remember(dtensor, weakref.ref(dtensor))

    def _reduce_local(self, index, position, dtensor, dtype) -> tuple:
        """Queue a DTensor's local shard under (``index``, ``position``), read with no
        collective, and remember both: ``(the shard's reference or None, the shard)``."""
        local, _, _ = dtensor_parts(dtensor)
        ref = self._reduce_one(index, position, local, dtype, local.device)
        if ref is not None:
            self._remember(local, ref)
            self._remember(dtensor, weakref.ref(dtensor))
        return ref, local

    def _reduce_one(self, index, position, tensor, dtype, device):
        """Queue ``tensor``'s (min, max) under (``index``, ``position``); returns the weak
        reference kept to it, ``None`` when it is not checked (its dtype or kind of tensor)."""
        if dtype not in CHECKED_DTYPES or type(tensor) not in PLAIN_TYPES or tensor.is_meta:
            return None
        if tensor.layout is not STRIDED or tensor.is_nested or not tensor.numel() or is_zerotensor(tensor):
            return None
        checked = tensor
        if dtype in COMPLEX:
            checked = torch.view_as_real(checked.resolve_conj())
        elif dtype in FLOAT8_DTYPES:
            checked = readable(checked)  # no reduction takes float8: a float16 copy, nan and inf kept
        # No autograd graph: below the autograd layer, where __torch_dispatch__ runs, the
        # autograd keys are excluded for everything it calls.
        buffer = self._stats
        if buffer is None or self._stats_key != (device, checked.dtype) or buffer.used == self._CHUNK:
            buffer = self._buffer_for(device, checked.dtype)
        slot = buffer.base + buffer.used
        buffer.write(checked, checked.numel())
        self._slots.append(slot)
        self._indices.append(index)
        self._positions.append(position)
        ref = weakref.ref(tensor)
        self._refs.append(ref)
        if dtype is FLOAT16 and position < FIRST_SEEN:
            self._half.add(index << 32 | position)  # judged for headroom
        return ref

    def _buffer_for(self, device, dtype) -> _Buffer:
        """The buffer of ``device`` and ``dtype`` with a free pair of slots: the one being
        filled, else one from the pool (or a new one), opened now."""
        key = (device, dtype)
        buffer = self._filling.get(key)
        if buffer is None or buffer.used == self._CHUNK:
            free = self._pool.get(key)
            buffer = free.pop() if free else _new_buffer(self._CHUNK, dtype, device)
            buffer.used = 0
            buffer.base = self._opened
            self._opened += self._CHUNK
            self._buffers.append(buffer)
            self._filling[key] = buffer
            self._devices.add(device)
        self._stats, self._stats_key = buffer, key
        return buffer

    def _queue(self, low, high, index, position, ref) -> None:
        """Queue a pair read elsewhere (a collective's output, once it completed)."""
        buffer = self._buffer_for(low.device, low.dtype)
        slot = buffer.used
        buffer.views[slot].copy_(low)
        buffer.views[slot + 1].copy_(high)
        buffer.used = slot + 2
        self._slots.append(buffer.base + slot)
        self._indices.append(index)
        self._positions.append(position)
        self._refs.append(ref)

    # -- the check point ----------------------------------------------------------------------

    def resolve(self, window, *, reading=(), final: bool = False) -> list[Origin]:
        """Check point: read all queued flags at once and return the origins judged now, oldest
        first, each with ``matters`` set.

        ``window`` is every log entry since the previous check point, oldest first, or a
        function that returns them: called only when they are needed (rarely: a flag, a float16
        output, a collective's output), so that a healthy check point builds no list.
        ``reading`` are the idents of tensors the program is about to read on the host.
        ``final``: the program chose this point (the end of the block, ``Watch.check()``), so
        what is still alive is the program's state: judge it now.
        """
        carriers, self._carriers = self._carriers, {}
        written_bases, self._written_bases = self._written_bases, {}
        roots, self._backward_roots = self._backward_roots, []
        if callable(window):
            window = _once(window)
        else:
            window = _once(lambda entries=window: entries)
        if self._reads.pending:
            settled = self._reads.settle(window(), final, self._queue)
            window = _once(lambda: settled)
        half, self._half = self._half, set()
        origins = self._origins
        flags = self._take_flags(half, replaying=bool(origins.carry or origins.unjudged or self.keep_ranges))
        flags.carriers, flags.written_bases = carriers, written_bases
        flags.first_seen, self._first_seen = self._first_seen, {}
        risks = headroom_risks(window(), half, flags.ranges, self._log) if half and flags.ranges else []
        nothing_to_follow = not flags.flagged and not origins.carry and not origins.unjudged
        # Nothing to follow, or only a mask's infs, absorbed (the usual Hugging Face step): no replay.
        if not self.keep_ranges and (nothing_to_follow or origins.only_absorbed_constants(window(), flags)):
            origins.remember_sentinels(flags.sentinels)
            origins.forget_ranges()  # this window's ops were not followed
            return risks
        new = origins.replay(window(), flags, reading, roots)
        if new:
            # Whether an origin reads a told failure's leftovers is asked only after one (a walk of the log per input).
            earlier = self._blocks if self._blocks.failure_told else None
            decide_causes(new, self._log, self._blocks, earlier)
            new, folded = fold_same_source(new)
            if folded:
                origins.fold(folded)
        judged = origins.judge(new, final) + risks
        judged.sort(key=lambda found: found.record.index)
        return judged

    def _take_flags(self, half, *, replaying: bool) -> Flags:
        """Read the queued pairs (one host read per device) into :class:`Flags`, and empty the
        queue. ``replaying``: origins wait, or every range is kept, so the window is replayed
        whatever it holds; else a window all finite (no mask value either) needs no per-pair
        facts: its flags are empty, as the replay would not run."""
        indices, positions, refs = self._indices, self._positions, self._refs
        kinds, values = self._read_flags(check_headroom=bool(half), keep_values=self.keep_ranges) if indices else ([], None)
        self._indices, self._positions, self._refs, self._slots = [], [], [], []
        self._devices = set()
        self._release_buffers()
        flags = Flags({}, {}, set())
        if values is None and not replaying and kinds.count(None) == len(kinds):
            return flags  # the usual healthy check point
        # Per pair, built whole (a Hugging Face step queues hundreds, a few of them a mask's):
        # (op index, output position) -> (min, max), read only when something is not finite,
        # to tell the inputs' health at an origin.
        keys = list(zip(indices, positions))
        flags.checked.update(keys)
        if values is not None:
            flags.ranges = dict(zip(keys, zip(values[::2], values[1::2])))
        for number in [number for number, kind in enumerate(kinds) if kind is not None]:
            kind, key = kinds[number], keys[number]
            if kind == SENTINEL:
                flags.sentinels[key] = refs[number]
                continue
            flags.flagged[key] = kind
            flags.refs[key] = refs[number]
        return flags

    def _read_flags(self, check_headroom: bool = False, keep_values: bool = False) -> tuple[list, list | None]:
        """Per queued pair: None (finite), "nan", "inf", or SENTINEL (finite, but holding
        ``finfo.max`` or ``finfo.min`` of a floating dtype: a deliberate mask value); and the
        values read (min, max, min, max, ...), or ``None`` when all were finite (unless
        ``keep_values``)."""
        values = self._read_slots()
        if not keep_values and math.isfinite(sum(values)) and (not check_headroom or HEADROOM_LIMIT > max(map(abs, values))):
            # The usual case: all finite, no float16 near its limit. Masks holding
            # finfo.min (every Hugging Face model) only mark their outputs.
            kinds = [None] * (len(values) // 2)
            if not SENTINELS.isdisjoint(values):
                _mark_sentinels(values, kinds)
            return kinds, None
        kinds = [None] * (len(values) // 2)
        # The pairs holding a non-finite value, found by list.index (C) rather than a test per
        # value in Python: a few among hundreds on a masked step.
        for at in _indices_of(list(map(math.isfinite, values)), False):
            pair = at >> 1
            kinds[pair] = _kind(values[2 * pair], values[2 * pair + 1])
        if not SENTINELS.isdisjoint(values):
            _mark_sentinels(values, kinds)  # where a pair is finite: nan and inf come first
        return kinds, values

    def _read_slots(self) -> list:
        """The queued pairs' values (min, max, min, max, ...), in their queued order: one host
        read per device (its buffers joined in one tensor, in the widest of their dtypes)."""
        buffers = self._buffers
        if len(buffers) == 1:
            # The usual window (a small model's step): one device and dtype, its pairs queued
            # one after the other from the first slot on.
            (only,) = buffers
            return only.values[: 2 * len(self._slots)].tolist()  # the host read
        by_device: dict = {}
        for buffer in buffers:
            by_device.setdefault(buffer.values.device, []).append(buffer)
        slots_read: list = [0.0] * self._opened
        for buffers in by_device.values():
            joined = torch.cat([buffer.values for buffer in buffers]) if len(buffers) > 1 else buffers[0].values
            read = joined.tolist()  # the host read
            for number, buffer in enumerate(buffers):
                start = number * self._CHUNK
                slots_read[buffer.base : buffer.base + buffer.used] = read[start : start + buffer.used]
        values = []
        for slot in self._slots:
            values += slots_read[slot : slot + 2]
        return values

    def _release_buffers(self) -> None:
        """After a check point: the window's buffers go back to the pool (a few per device and
        dtype), to be filled again."""
        for buffer in self._buffers:
            free = self._pool.setdefault((buffer.values.device, buffer.values.dtype), [])
            if len(free) < self._POOL:
                free.append(buffer)
        self._buffers, self._filling, self._opened = [], {}, 0
        self._stats = self._stats_key = None


def _once(make):
    """``make``, called at most once: its result kept for the calls after."""
    entries = None

    def call():
        nonlocal entries
        if entries is None:
            entries = make()
        return entries

    return call


def _new_buffer(size: int, dtype, device) -> _Buffer:
    # Never an inference tensor, also when first made in inference mode: it is written again
    # outside it (writing an inference tensor there raises).
    with torch.inference_mode(False):
        return _Buffer(torch.empty(size, dtype=dtype, device=device))


def _mark_sentinels(values, kinds) -> None:
    """Mark SENTINEL on each pair of ``values`` holding a mask value whose kind is still None."""
    for sentinel in SENTINELS.intersection(values):
        for at in _indices_of(values, sentinel):
            if kinds[at >> 1] is None:
                kinds[at >> 1] = SENTINEL


def _indices_of(values: list, value):
    """The positions in ``values`` of the items equal to ``value``, each found by ``list.index``
    (a search in C): cheap where they are few among many."""
    at = -1
    while True:
        try:
            at = values.index(value, at + 1)
        except ValueError:
            return
        yield at


def _kind(low, high):
    """What a (min, max) pair says: "nan", "inf", SENTINEL or None (finite)."""
    if math.isnan(low) or math.isnan(high):
        return "nan"
    if math.isinf(low) or math.isinf(high):
        return "inf"
    if low in SENTINELS or high in SENTINELS:
        return SENTINEL
    return None
