"""The replay that judges origins: at a check point, the op log is followed over tensor
identities to tell origins from propagation, one small step per kind of entry:

- a **lift** (Python data entering torch) is new data, and a non-finite value in it is a
  constant the program wrote on purpose (``m[mask] = float("-inf")``);
- a **collective**'s output whose inputs on this rank were finite was *received*;
- a **carrier** (a view or an op that only moves values) holds what its input held;
- a **checked op** whose output is non-finite while every input was finite is an *origin*
  (nan wins over inf); fed by non-finite inputs, it is that origin's *spread*;
- **sinks**: a host read, an ``nn.Parameter`` written by an op, a ``.grad`` accumulation, and
  GradScaler's overflow check (which contains what it finds in backward).

:class:`Origins` keeps what outlives one window (non-finite tensors still alive, sentinel
holders, origins waiting to be judged, origins by site for recomputed forward ops);
:class:`_Window` is the state of one replay.
"""

from __future__ import annotations

import math

import torch
from torch.nn import Parameter

from ...core.notation import TensorMeta
from ...core.ops import facts_of
from ...core.records import BACKWARD, E_FORWARD_FUNC, E_FUNC, E_INDEX, E_PHASE, E_SITE, M_DTYPE, M_IDENT, M_SHAPE, M_SHARDING, SH_LOCAL_IDENT, ModuleCall, entry_inputs, entry_outputs
from .aliases import Aliases
from .cause import DATA, DELIBERATE_CAUSE, INPUT, MATH, NAN_CONSTANT_CAUSE, OVERFLOWS, PRECISION, UNKNOWN, WEIGHTS, WRITTEN, Cause, written_inputs
from .collectives import delivered
from .origin import LeafRecipe, MovedRecipe, Origin
from .rules import CHECKED_DTYPES, ValueRange, has_sentinel_constant, moved_range

__all__ = ["Flags", "Origins"]

# A replay status, per tensor ident: (kind, origin or None when it came from a deliberate constant)
ST_KIND = 0
ST_ORIGIN = 1

# What a checked op's non-finite output is (flagged_verdict): the one set of rules that both
# the replay and the check that a window needs none (Origins.only_absorbed_constants) follow.
SPREAD = "spread"  # fed by an origin's values
DELIBERATE = "deliberate"  # a constant the program wrote on purpose, or carried on from one
REDUCES_DELIBERATE = "reduces deliberate"  # a forward reduction that took deliberate infs in
NAN_CONSTANT = "nan constant"  # a nan the program wrote itself, in forward
ORIGIN = "origin"  # non-finite from finite inputs (or nan from deliberate infs)
_HELD_INFS = ("inf",)  # what only_absorbed_constants follows: the infs of deliberate constants


class Flags:
    """What a check point read, by (op index, output position): the non-finite ``flagged``
    outputs and their weak ``refs``, every ``checked`` key, the finite ``sentinels`` holders,
    the ``ranges`` read (only when something was not finite); and, by (op index << 32 |
    position), the weak ``carriers`` of unchecked outputs and the ``written_bases`` (id, ref)
    of in-place writes into views; and, by op index, the ``first_seen`` inputs checked there
    (``((position, ident), ...)``: tensors made before the watch, see ``tracker.FIRST_SEEN``)."""

    __slots__ = ("flagged", "refs", "checked", "sentinels", "ranges", "carriers", "written_bases", "first_seen")

    def __init__(self, flagged, refs, checked, sentinels=None, ranges=None, carriers=None, written_bases=None):
        self.flagged = flagged
        self.refs = refs
        self.checked = checked
        self.sentinels = sentinels or {}
        self.ranges = ranges or {}
        self.carriers = carriers or {}
        self.written_bases = written_bases or {}
        self.first_seen = {}

    def flagged_indices(self) -> set:
        """The op indices with a non-finite output (or input first seen there)."""
        return {index for index, _ in self.flagged}


class _Window:
    """The state of one replay: what each tensor holds, which are alive, and what was found."""

    __slots__ = ("log", "flags", "status", "live", "holds_sentinel", "sentinel_refs", "value_ranges", "known_ranges", "recipes", "origins", "deliveries", "accumulates", "received", "entered", "entered_infs", "aliases", "flagged_at", "facts", "fused_checked", "number")

    def __init__(self, log, flags, carry, sentinels, known_ranges, aliases, facts):
        self.log = log
        self.flags = flags
        # ident -> (kind, origin). Carried tensors count even if they died since: ops in this
        # window may have read them first, and an id reused by a newer tensor is overwritten by
        # the op that made it.
        self.status = {ident: (kind, origin) for ident, (kind, origin, _) in carry.items()}
        self.live = {ident: ref for ident, (_, _, ref) in carry.items()}
        self.holds_sentinel = set(sentinels)
        self.sentinel_refs = dict(sentinels)
        # ident -> (shape, dtype, ValueRange) of tensors made in this window, or None where an
        # op of this window made one whose range is unknown (an older tensor's range no more)
        self.value_ranges: dict = {}
        # The same, of tensors made in earlier windows that were followed (see Origins.ranges)
        self.known_ranges = known_ranges
        # ident -> how to work out its range at report time, for outputs of value-moving ops
        # whose inputs' ranges were unknown (see _carry_range)
        self.recipes: dict = {}
        self.origins: list[Origin] = []
        self.deliveries: dict = {}  # outputs of collectives not used yet (see collectives.delivered)
        # Of the entry being replayed: whether it accumulates into a ``.grad``, and the
        # collective whose result it delivers (``None`` for most).
        self.accumulates = False
        self.received = None
        self.fused_checked: dict = {}  # Origins.fused_checked
        self.number = 0  # of the window, counting those with ops
        # Tensors made before the watch that held nan/inf when first read in this window.
        self.entered: set = set()
        # Of those, the ones that held inf: ident -> meta (with the earlier windows' still carried).
        self.entered_infs: dict = {}
        # Which tensors share storage (views), for the ranges a write in place makes stale.
        self.aliases = aliases
        # Op indices with a non-finite output (or input first seen): the others of an op that
        # no followed tensor feeds take the quiet way (see Origins._step).
        self.flagged_at = flags.flagged_indices()
        self.facts = facts  # op id -> its OpFacts (None for a ModuleCall), see Origins.replay


class Origins:
    """The replay and the judgement, with what they keep from one check point to the next."""

    _MAX_UNJUDGED = 1024  # origins kept alive by the program past this many are judged at once
    _MAX_REMEMBERED_SITES = 4096

    def __init__(self, log) -> None:
        self._log = log
        # Non-finite tensors still alive after the last check point: ident -> (kind, origin, ref)
        self.carry: dict[int, tuple] = {}
        # Finite tensors holding a sentinel (finfo.max/min) alive after the last check point.
        self.sentinels: dict = {}
        # Origins whose values were alive at a check point and reached no sink yet.
        self.unjudged: list[Origin] = []
        # (site, op id) -> Origin, for forward ops recomputed in backward (checkpointing).
        self._by_site: dict = {}
        # ident -> (shape, dtype, ValueRange): ranges read in the windows replayed so far,
        # while every window since was replayed (a window not replayed may have written into
        # these tensors: ``forget_ranges``). Shape and dtype tell a reused id.
        self.ranges: dict = {}
        # Views and their bases seen in those windows: a write into one makes the others' ranges stale.
        self.aliases = Aliases()
        # Gradients a fused optimizer's GradScaler check saw (it does not know the scale), whose
        # origins the fused step after it judges, in this window or a later one (_step_fused_under_scaler).
        self.fused_checked: dict = {}  # ident -> (Origin, the number of the window that checked it)
        self._windows = 0  # windows with ops replayed so far
        # Tensors made before the watch that held nan/inf when first read: carried like any
        # other, but their own life says nothing of harm (the program made them before).
        self.entered: set = set()
        # Of those, the ones that held inf (ident -> meta): a nan made of deliberate infs names
        # one (Origin.entered_inf), since the inf may be data rather than a mask.
        self.entered_infs: dict = {}
        # Op index of a collective -> {ident: status} of its non-finite inputs when it was
        # first replayed: one read once it completed is replayed again in a later window, when
        # an input that died since (a redistribution's temporary shard) is no longer carried.
        self._collective_inputs: dict = {}
        # op id in the log -> its OpFacts (None for a ModuleCall): facts_of hashes an OpOverload
        # in Python, and the replay asks for every entry.
        self._facts: list = []
        # A guard told a failed step no block watched (EarlierBlocks.failure_told): see judge.
        self.failure_told = False

    _MAX_RANGES = 1 << 16
    _MAX_COLLECTIVES = 4096

    def forget_ranges(self) -> None:
        """A window went by without a replay: the ranges known may be stale."""
        if self.ranges:
            self.ranges = {}
        if self.aliases:
            self.aliases.clear()

    def remember_sentinels(self, sentinels) -> None:
        """Keep the finite sentinel-holding tensors that are still alive, for later windows."""
        alive = {ident: ref for ident, ref in self.sentinels.items() if ref() is not None}
        for ref in sentinels.values():
            tensor = ref()
            if tensor is not None:
                alive[id(tensor)] = ref
        self.sentinels = alive

    def fold(self, folded) -> None:
        """Origins folded into others (``id(folded) -> kept``, see ``cause.fold_same_source``):
        the values they left alive, and the sites they were remembered at, are the kept one's."""
        self.carry = {ident: (kind, folded.get(id(origin), origin), ref) for ident, (kind, origin, ref) in self.carry.items()}
        self._by_site = {site: folded.get(id(origin), origin) for site, origin in self._by_site.items()}

    def replay(self, window, flags: Flags, reading=(), roots=()) -> list[Origin]:
        """Follow tensor identities through the window's ops to tell origins from spread.
        ``roots``: ``(op index, ident)`` of each tensor ``backward()`` ran on, in order, the
        index the op logged next when it did (see :func:`_backward_ran_on`)."""
        state = _Window(self._log, flags, self.carry, self.sentinels, self.ranges, self.aliases, self._facts_for_log())
        state.fused_checked = self.fused_checked
        self._windows += bool(window)
        state.number = self._windows
        state.entered_infs.update(self.entered_infs)
        sharded = self._log.sharded  # ops on DTensors were logged
        next_root, _ = next(iter(roots), (None, None))
        for entry in window:
            if next_root is not None and next_root <= entry[E_INDEX]:
                roots, next_root = _backward_ran_on(state, roots, entry[E_INDEX])
            outputs = entry_outputs(entry)
            if sharded:
                _dtensors_hold_their_shards(state, entry_inputs(entry))
            if outputs:
                self._step(state, entry, outputs)
                if sharded:
                    _shards_hold_their_dtensors(state, outputs)
            else:  # no outputs: a kernel that raised, or a module or function call judged before it ran (no op)
                func = state.log.funcs[entry[E_FUNC]]
                if not isinstance(func, ModuleCall) and facts_of(func).mutated_args:
                    _forget_written(state, entry)
        _backward_ran_on(state, roots, None)  # after the window's last op
        for ident in reading:  # a host read
            found = state.status.get(ident)
            if found is not None and found[ST_ORIGIN] is not None:
                found[ST_ORIGIN].read_on_host = True
        live = state.live
        self.carry = {
            ident: (kind, origin, live[ident])
            for ident, (kind, origin) in state.status.items()
            if ident in live and live[ident]() is not None
        }
        self.entered = {ident for ident in self.entered | state.entered if ident in self.carry}
        self.entered_infs = {ident: meta for ident, meta in state.entered_infs.items() if ident in self.carry}
        refs = state.sentinel_refs
        self.sentinels = {ident: refs[ident] for ident in state.holds_sentinel if refs[ident]() is not None}
        self._keep_ranges(state)
        return state.origins

    def only_absorbed_constants(self, window, flags: Flags) -> bool:
        """Whether replaying ``window`` could find nothing: with nothing carried in, its only
        non-finite values were infs the program wrote on purpose (an attention mask's
        ``-inf``: a constant, a ``where``/``masked_fill`` with one, a value over a ``finfo.min``
        mask) and ops that carried them on in forward, none reduced into fewer values, and
        none alive now (a softmax took them in). Followed over tensor identities like
        :meth:`replay`, each non-finite output judged by the replay's own rules
        (:func:`flagged_verdict`), with no ranges, views or records: every Hugging Face model's
        step has a mask, and its check point is then judged as a window with no flag is."""
        if self.carry or self.unjudged or self._log.sharded or _entered_nonfinite(flags):
            return False
        flagged, checked, sentinels, first_seen = flags.flagged, flags.checked, flags.sentinels, flags.first_seen
        flagged_at = flags.flagged_indices()
        # Ops with a flagged output or one holding a mask value: the others, when no input holds
        # a constant's infs, only make their outputs' idents hold nothing (most of a window).
        marked_at = flagged_at.union([index for index, _ in sentinels])
        holding: set = set()  # idents holding a constant's infs now (the replay's status)
        sentinel_holders = set(self.sentinels)
        facts_table = self._facts_for_log()
        for entry in window:
            outputs = entry_outputs(entry)
            if not outputs:
                continue  # a kernel that raised, a judged call, a write returning nothing
            facts = facts_table[entry[E_FUNC]]
            if facts.is_collective:
                return False
            index = entry[E_INDEX]
            for position, ident in first_seen.get(index, ()):  # made before the watch
                if (index, position) in sentinels and ident not in holding:
                    sentinel_holders.add(ident)
            fed = False
            if holding:  # a loop, not any(): a generator per op costs more than the lookups
                for meta in entry_inputs(entry):
                    if meta[M_IDENT] in holding:
                        fed = True
                        break
            if not fed and index not in marked_at:
                # What the branches below do for an op fed nothing and with nothing flagged.
                if facts.is_lift or facts.preserves_values:
                    for meta in outputs:
                        holding.discard(meta[M_IDENT])
                else:
                    for meta in outputs:
                        ident = meta[M_IDENT]
                        sentinel_holders.discard(ident)
                        holding.discard(ident)
                continue
            if fed and facts.is_grad_scaler_check:
                return False
            if facts.is_lift or facts.preserves_values:
                for position, meta in enumerate(outputs):
                    ident = meta[M_IDENT]
                    kind = flagged.get((index, position))
                    if kind == "nan":
                        return False
                    carried = facts.preserves_values and fed and _holds_what_it_moved(facts, meta)
                    if kind is not None or carried:
                        holding.add(ident)
                    else:
                        holding.discard(ident)
                continue
            # as the replay judges it: before this op's outputs are noted (an in-place op's are its input)
            deliberate = index in flagged_at and _writes_sentinel(entry, sentinel_holders)
            for position, meta in enumerate(outputs):
                ident = meta[M_IDENT]
                key = (index, position)
                if key in sentinels:
                    sentinel_holders.add(ident)
                else:
                    sentinel_holders.discard(ident)
                kind = flagged.get(key)
                if kind is None:
                    if fed and _holds_unread(key, meta, checked):
                        holding.add(ident)
                    else:
                        holding.discard(ident)
                    continue
                if kind != "inf" or entry[E_PHASE] == BACKWARD or (index << 32 | position) in flags.written_bases:
                    return False
                verdict = flagged_verdict(
                    kind, entry, meta, spread=False, fed_kinds=_HELD_INFS if fed else (), deliberate=deliberate,
                    fed_holders=holding, sentinel_holders=sentinel_holders,
                )
                if verdict is not DELIBERATE:
                    return False  # an origin, or a reduction of the constants followed to the loss
                holding.add(ident)
        return not any(ref() is not None for ref in flags.refs.values()) and not any(
            id(tensor) in holding for tensor in (ref() for ref in flags.carriers.values()) if tensor is not None
        )

    def _facts_for_log(self) -> list:
        """op id in the log -> its OpFacts (None for a ModuleCall), grown with the log's table."""
        funcs, facts = self._log.funcs, self._facts
        if len(facts) < len(funcs):  # the log's table of ops only grows
            facts += [None if isinstance(func, ModuleCall) else facts_of(func) for func in funcs[len(facts):]]
        return facts

    def _keep_ranges(self, state) -> None:
        ranges = self.ranges
        for ident, known in state.value_ranges.items():
            if known is None:
                ranges.pop(ident, None)
            else:
                ranges[ident] = known
        if len(ranges) > self._MAX_RANGES:
            self.ranges = dict(list(ranges.items())[len(ranges) // 2 :])  # the newer half

    def _step(self, state, entry, outputs) -> None:
        """One entry, by kind."""
        facts = state.facts[entry[E_FUNC]]
        status = state.status
        if facts.is_view:
            viewed = entry_inputs(entry)
            if viewed:
                state.aliases.view(next(iter(viewed))[M_IDENT], [meta[M_IDENT] for meta in outputs])
        elif state.aliases and not facts.mutated_args:
            for meta in outputs:  # a new tensor: its id's old views are not its
                state.aliases.forget(meta[M_IDENT])
        seen = state.flags.first_seen.get(entry[E_INDEX]) if state.flags.first_seen else None
        if seen:
            _note_first_seen(state, entry, seen)
        state.received = delivered(entry, facts, state.deliveries, status, state.origins) if state.deliveries else None
        if facts.is_lift:
            _step_lift(state, entry, outputs, self)
            return
        fed = [meta[M_IDENT] for meta in entry_inputs(entry) if meta[M_IDENT] in status]
        if facts.is_collective:
            fed = self._inputs_when_issued(state, entry, fed)
        if facts.is_grad_scaler_check:
            _step_grad_scaler(state, fed, *_scale_below_one(state, entry))
        elif facts.is_fused_step and state.fused_checked:
            _step_fused_under_scaler(state, entry)
        # Gradient accumulation: a backward op autograd runs with no forward op behind it.
        # (No source line: site 0, or a named place such as the DDP reducer's "DDP gradient of fc.weight".)
        code, _ = state.log.sites[entry[E_SITE]]
        state.accumulates = entry[E_PHASE] == BACKWARD and code is None and entry[E_FORWARD_FUNC] < 0
        if facts.preserves_values:
            _carry_range(state, entry, facts, outputs)
            if not fed:  # nothing followed moves here: its outputs are new tensors, finite
                for meta in outputs:
                    status.pop(meta[M_IDENT], None)
                return
            _step_carrier(state, entry, facts, outputs, fed)
            origin = status[fed[0]][ST_ORIGIN] if state.accumulates else None  # the first input's
            if origin is not None:  # accumulated into a .grad
                origin.reached_gradient = True
            return
        if not fed and state.received is None and not facts.is_collective and entry[E_INDEX] not in state.flagged_at:
            # The usual op of a replayed window (a mask's -inf was flagged in it): no followed
            # tensor feeds it and its outputs are finite. Only its ranges, sentinels and writes.
            _step_quiet(state, entry, facts, outputs)
            return
        self._step_checked(state, entry, facts, outputs, fed)
        if facts.is_collective:
            record = state.log.view(entry)
            for meta in outputs:
                state.deliveries[meta[M_IDENT]] = (record, status.get(meta[M_IDENT]))

    def _inputs_when_issued(self, state, entry, fed) -> list:
        """A collective's fed inputs, as they were when it was first replayed (see
        ``_collective_inputs``)."""
        known = self._collective_inputs
        index = entry[E_INDEX]
        before = known.get(index)
        if before is None:
            if len(known) >= self._MAX_COLLECTIVES:
                self._collective_inputs = known = dict(list(known.items())[len(known) // 2 :])  # the newer half
            known[index] = {ident: state.status[ident] for ident in fed}
            return fed
        status = state.status
        for ident, found in before.items():
            status.setdefault(ident, found)
        return [meta[M_IDENT] for meta in entry_inputs(entry) if meta[M_IDENT] in status]

    def _step_checked(self, state, entry, facts, outputs, fed) -> None:
        """An op whose outputs were checked: origin, spread, or a deliberate constant."""
        index = entry[E_INDEX]
        flags = state.flags
        input_states = [state.status[ident] for ident in fed]
        input_origin = next((found[ST_ORIGIN] for found in input_states if found[ST_ORIGIN] is not None and not found[ST_ORIGIN].reduces_deliberate), None)
        # A reduction of deliberate infs: deliberate still (a nan made of it is an origin), but
        # followed to the loss (see Origins.judge).
        reduced = None if input_origin is not None else next((found[ST_ORIGIN] for found in input_states if found[ST_ORIGIN] is not None), None)
        deliberate = _writes_sentinel(entry, state.holds_sentinel)
        fed_kinds = [found[ST_KIND] for found in input_states]
        record = None
        before = _written_in_place(state, entry, outputs) if facts.mutated_args else None
        if facts.picks_indices and entry[E_PHASE] != BACKWARD:
            record = _note_picked(state, entry, input_states)
        for position, meta in enumerate(outputs):
            ident = meta[M_IDENT]
            key = (index, position)
            _note_sentinel_and_range(state, meta, key)
            kind = flags.flagged.get(key)
            if kind is None:
                record = _step_finite(state, entry, facts, meta, key, input_states, input_origin, record)
                continue
            state.live[ident] = flags.refs[key]
            verdict = flagged_verdict(
                kind, entry, meta, spread=input_origin is not None, fed_kinds=fed_kinds, deliberate=deliberate,
                fed_holders=state.status, sentinel_holders=state.holds_sentinel,
            )
            if verdict is SPREAD or (verdict is not ORIGIN and reduced is not None):
                # The values of an origin, or of a followed reduction of deliberate infs (an
                # input's, or this op's own made by an earlier output), carried on.
                origin = input_origin if input_origin is not None else reduced
                if origin.last.index != index:
                    record = record or state.log.view(entry)
                    origin.carried_by(record, kind)
            elif verdict is DELIBERATE:
                origin = None
            elif verdict is REDUCES_DELIBERATE:
                record = record or state.log.view(entry)
                origin = reduced = self._reduction_of_deliberate(state, entry, record, kind, before)
            elif verdict is NAN_CONSTANT:
                record = record or state.log.view(entry)
                origin = reduced = self._nan_constant(state, entry, record, before)
            elif facts.is_copy and _copied_from_storage(state, entry):
                # Loaded values (torch.load's tensors, filled with no op) copied into place
                # (load_state_dict): no op made them; left unknown, as if made before the watch,
                # so that the first op they feed finds them there (its cause: the weights).
                state.status.pop(ident, None)
                state.value_ranges[ident] = None
                continue
            else:
                record = record or state.log.view(entry)
                origin = self._origin(state, entry, facts, record, kind, bool(input_states), before)
            state.status[ident] = (kind, origin)
            if origin is not None:
                _mark_sinks(origin, flags.refs[key], state.accumulates)
            base = flags.written_bases.get(index << 32 | position)
            if base is not None:
                # Written through a view: the values live in the base.
                base_ident, base_ref = base
                state.status[base_ident] = (kind, origin)
                state.live[base_ident] = base_ref

    def _origin(self, state, entry, facts, record, kind, from_deliberate, before=None) -> Origin:
        """Non-finite from finite inputs, or nan from deliberate infs (a softmax over a fully
        masked row): an origin, unless it is a forward op recomputed during backward (activation
        checkpointing) that was one already. A collective's output was received from other
        ranks, never recomputed. ``before``: the inputs' ranges of an op that writes in place,
        taken before its outputs' were noted (see ``_written_in_place``)."""
        received = state.received
        origin = None if facts.is_collective or received else self._recomputed(record, entry)
        if origin is None:
            origin = Origin(received or record, kind, from_deliberate=from_deliberate)
            if from_deliberate and state.entered_infs:
                origin.entered_inf = next(iter(state.entered_infs.values()))  # the first to come in
            origin.input_ranges = before if before is not None else _input_ranges(state, entry)
            state.origins.append(origin)
            self._remember_site(origin, entry)
        return origin

    def _reduction_of_deliberate(self, state, entry, record, kind, before=None) -> Origin:
        """A forward reduction whose inf comes from deliberate infs in its inputs (the sum of
        masked log-probabilities in cross_entropy with label smoothing): followed, and judged
        as an origin only if its values reach a loss (see :meth:`judge`). Its cause is known."""
        origin = Origin(record, kind, from_deliberate=True, reduces_deliberate=True)
        origin.input_ranges = before if before is not None else _input_ranges(state, entry)
        origin.cause = DELIBERATE_CAUSE
        origin.note_loss(record)
        state.origins.append(origin)
        return origin

    def _nan_constant(self, state, entry, record, before=None) -> Origin:
        """A nan the program wrote itself: judged like a reduction of deliberate infs (an
        origin only once its values are the loss, see :meth:`judge`), its cause known."""
        origin = Origin(record, "nan", from_deliberate=True, reduces_deliberate=True)
        origin.input_ranges = before if before is not None else _input_ranges(state, entry)
        origin.cause = NAN_CONSTANT_CAUSE
        state.origins.append(origin)
        return origin

    def _data(self, state, entry, record, meta) -> Origin:
        """Data that came into torch holding nan (an array: ``torch.from_numpy``,
        ``torch.tensor(array)``): an origin, its cause the input (no op made it)."""
        origin = Origin(record, "nan")
        origin.cause = Cause(INPUT, DATA, tensor=TensorMeta(*meta), held="nan")
        state.origins.append(origin)
        self._remember_site(origin, entry)
        return origin

    def _recomputed(self, record, entry):
        """The earlier origin this op repeats, when it is a forward op run again in backward
        (a checkpoint's recomputation: user code, not an autograd formula); else ``None``."""
        if record.phase != BACKWARD or entry[E_FORWARD_FUNC] >= 0:
            return None
        return self._by_site.get((entry[E_SITE], entry[E_FUNC]))

    def _remember_site(self, origin, entry) -> None:
        if len(self._by_site) >= self._MAX_REMEMBERED_SITES:
            self._by_site.clear()
        self._by_site.setdefault((entry[E_SITE], entry[E_FUNC]), origin)

    def judge(self, new, final) -> list[Origin]:
        """Which origins mattered. An origin matters when its values reached a parameter, a
        host read or the tensor ``backward()`` ran on. One whose values are still alive waits, unless ``final``: the program may yet
        drop them (autograd keeps a softmax output until backward), use them, or hand them to
        GradScaler. Then, or once they died: GradScaler's skipped steps are contained; values
        accumulated into a ``.grad`` or alive at the end matter; nan values an argmax or top-k
        picked indices from matter (greedy decoding over nan logits); a forward overflow of its dtype
        (a ``precision`` cause) matters even when absorbed later (``rsqrt(inf) = 0`` silently
        zeroes what it scaled); others were absorbed.

        After a failed step a guard told and no block watched (:attr:`failure_told`), nan/inf
        found in tensors made before the block are that step's leftovers (its loss summed into
        a running total, a metric of its outputs, a loss all-reduced for the log), already
        told: they matter only once they reach the gradients or a parameter (a bad batch of
        this block does), other than by the op writing into such a tensor (:func:`_wrote_into_before`)."""
        entered = self.entered
        alive = {id(origin) for ident, (_, origin, _) in self.carry.items() if origin is not None and ident not in entered}
        judged = []
        waiting = []
        # A fused optimizer's GradScaler check saw them, and the step that knows the scale runs
        # after this point: they wait for it, over the window that checked them; a step that
        # did not come in the window after it left them to the check.
        fused = {id(origin) for origin, number in self.fused_checked.values() if number == self._windows}
        if len(fused) < len(self.fused_checked):
            _left_to_the_check(self.fused_checked, keep=fused)
        for origin in self.unjudged + new:
            if id(origin) in fused:
                waiting.append(origin)
                continue
            is_alive = id(origin) in alive
            if origin.reduces_deliberate:
                # Deliberate infs a reduction took in: an origin only once they are the loss
                # (a one-value forward tensor) and the program reads it, steps on it or keeps it.
                # A nan the program wrote matters too once it reaches the gradients (nanmean
                # leaves it out of the loss, not out of the backward: 0 * nan = nan).
                loss = origin.loss is not None
                if origin.cause == NAN_CONSTANT_CAUSE and (origin.reached_gradient or origin.reached_parameter):
                    origin.matters = True
                elif loss and (origin.reached_parameter or origin.read_on_host or origin.reached_backward):
                    origin.matters = True
                elif is_alive and (not final or (_the_programs_data(origin) and not loss)) and len(waiting) < self._MAX_UNJUDGED:
                    waiting.append(origin)
                    continue
                elif loss and (origin.reached_gradient or is_alive):
                    origin.matters = True
                else:
                    continue  # a masking constant that stayed one: not reported, not contained
                judged.append(origin)
                continue
            if self.failure_told and _from_before_the_block(origin) and not (origin.reached_parameter or (origin.reached_gradient and not _wrote_into_before(origin))):
                if is_alive and not final and len(waiting) < self._MAX_UNJUDGED:
                    waiting.append(origin)
                continue  # the told failure's leftovers: not reported, not contained
            if origin.reached_parameter or origin.picked_by is not None or (
                    (origin.read_on_host or origin.reached_backward) and not origin.skipped_by_grad_scaler):
                origin.matters = True
            elif _overflowed_in_forward(origin) and not is_alive and origin.absorbed_by is not None:
                # Absorbed later (rsqrt(inf) = 0, 1 / inf = 0): the values that went on are
                # finite and wrong, so it matters all the same.
                origin.matters = origin.absorbed = True
            elif is_alive and (not final or _the_programs_data(origin)) and len(waiting) < self._MAX_UNJUDGED:
                waiting.append(origin)
                continue
            else:
                origin.matters = not origin.skipped_by_grad_scaler and (origin.reached_gradient or (is_alive and not _the_programs_data(origin)))
            judged.append(origin)
        self.unjudged = waiting
        judged.sort(key=lambda origin: origin.record.index)
        return judged


def _backward_ran_on(state, roots, before: int | None) -> list:
    """The origins whose values the tensors ``backward()`` ran on held then (``roots``:
    ``(op index, ident)``, those before op ``before``, every one when ``None``) reached that
    sink: the loss of a batch whose every label was ignored (0 / 0) has finite gradients, yet
    the step trained on a nan loss. Returns the roots after ``before`` and the first one's index
    (``None`` when none is left)."""
    for number, (index, ident) in enumerate(roots):
        if before is not None and index > before:
            return roots[number:], index
        found = state.status.get(ident)
        if found is not None and found[ST_ORIGIN] is not None:
            found[ST_ORIGIN].reached_backward = True
    return [], None


def _from_before_the_block(origin) -> bool:
    """Whether ``origin``'s values may have come from a tensor made before the block that the
    op read through a view or a copy, or wrote in place: an input whose range is unknown (gone,
    or written, by the check point), or known only as nan/inf after a collective wrote into it,
    holds what such a tensor held, so its op would be named as making them from finite inputs.
    Not one whose cause tells that they came in with that input (it held them when first read,
    or still does): told so, its words are true."""
    if not origin.reads_made_before or origin.entered is not None:
        return False
    cause = origin.cause
    return cause is None or cause.kind not in (INPUT, WEIGHTS)


def _wrote_into_before(origin) -> bool:
    """Whether ``origin``'s op wrote its result into a tensor made before the watch whose values
    before the write were never read (cause ``unknown``, ``written``): autograd accumulating
    into a ``.grad`` that a skipped step left holding nan (a GAN's generator backward runs
    through the discriminator, whose ``zero_grad`` comes only at its own next step). The
    gradient it reached is that tensor itself."""
    cause = origin.cause
    return cause is not None and (cause.kind, cause.detail) == (UNKNOWN, WRITTEN)


def _the_programs_data(origin) -> bool:
    """Whether ``origin`` is data the program holds, no op made: a nan it wrote itself (a
    corrupted record, a placeholder), or data that came into torch holding nan (a table with
    missing values, loaded once). Alive, it waits past a final check point too (an optimizer
    step says nothing of the batches still to come) until it reaches the gradients, a
    parameter or a host read, however many steps later."""
    cause = origin.cause
    return cause == NAN_CONSTANT_CAUSE or (cause is not None and cause.kind == INPUT and cause.detail == DATA)


def flagged_verdict(kind, entry, output, *, spread, fed_kinds, deliberate, fed_holders, sentinel_holders) -> str:
    """What the non-finite ``output`` (``kind``: ``"nan"`` or ``"inf"``) of a checked op is:
    one of ``SPREAD``, ``DELIBERATE``, ``REDUCES_DELIBERATE``, ``NAN_CONSTANT``, ``ORIGIN``.
    ``spread``: an input held an origin's values; ``fed_kinds``: the kinds of the followed
    inputs it read (deliberate constants and what carried them on), ``fed_holders`` their idents;
    ``deliberate``: the op wrote a sentinel constant or read a tensor holding one, whose idents
    are ``sentinel_holders``. A forward reduction of deliberate infs is followed: it may make
    the loss inf (see :meth:`Origins.judge`)."""
    if spread:
        return SPREAD  # even where inf turns into nan (inf - inf)
    forward = entry[E_PHASE] != BACKWARD
    if fed_kinds:
        if kind == "nan" and "nan" not in fed_kinds:
            return ORIGIN  # nan made of deliberate infs (a softmax over a fully masked row)
        return REDUCES_DELIBERATE if kind == "inf" and forward and _reduces(entry, output, fed_holders) else DELIBERATE
    if not deliberate:
        return ORIGIN
    # masked_fill(mask, -inf), finfo.min; or a forward reduction that overflowed a finfo.min
    # an input held
    if kind == "inf" and forward and _reduces(entry, output, sentinel_holders):
        return REDUCES_DELIBERATE
    if kind == "nan" and forward:
        # A placeholder, a missing value: no mask needs a nan, so it is followed as an origin
        # to be (a check point between forward and backward must not leave its values to look
        # made by a backward op), and reported once it becomes the loss.
        return NAN_CONSTANT
    return DELIBERATE


def _writes_sentinel(entry, sentinel_holders) -> bool:
    """Whether the op wrote a sentinel constant (``masked_fill(mask, -inf)``) or read a tensor
    holding one (a ``finfo.min`` mask)."""
    return has_sentinel_constant(entry) or any(meta[M_IDENT] in sentinel_holders for meta in entry_inputs(entry))


def _holds_what_it_moved(facts, output) -> bool:
    """Whether an output of an op that only moves values holds what its input held: a floating
    one, or a view to another dtype (``x.view(torch.int32)`` still holds the bits)."""
    return output[M_DTYPE] in CHECKED_DTYPES or facts.is_view


def _holds_unread(key, output, checked) -> bool:
    """Whether a floating output whose values the check did not read (sparse, nested,
    subclasses) is taken to hold what its inputs held."""
    return key not in checked and output[M_DTYPE] in CHECKED_DTYPES


def _input_ranges(state, entry) -> list:
    """Of each floating input: a range, or a recipe to work it out at report time
    (:func:`.cause.decide_causes`)."""
    return [
        (meta, range_of(state, meta) or state.recipes.get(meta[M_IDENT]) or LeafRecipe(meta, entry[E_INDEX]))
        for meta in entry_inputs(entry)
        if meta[M_DTYPE] in CHECKED_DTYPES
    ]


def _written_in_place(state, entry, outputs) -> list | None:
    """An op that writes in place (``x.sqrt_()``, ``buf.copy_(src)``): its output is its input,
    so the range noted for the output is the value written, not the one read. Returns its
    inputs' ranges as they were before the write (what the op that last wrote each one left:
    a range, a recipe, or a :class:`~.origin.LeafRecipe` that :func:`.cause.decide_causes`
    does not read from the tensor, which holds the result now), when an output of it was found
    non-finite (an origin may be made of it); else ``None``. The other tensors that share the
    written one's storage (its base, its views: see :class:`~.aliases.Aliases`) hold other values
    now: their ranges are not known any more."""
    index = entry[E_INDEX]
    flags = state.flags
    positions = range(len(outputs))
    before = _input_ranges(state, entry) if any((index, position) in flags.flagged for position in positions) else None
    if state.aliases:
        for ident in written_inputs(entry_inputs(entry), outputs):
            _forget_aliases(state, ident)
    if flags.written_bases:  # also a base the log shows no view of (made before these windows)
        for position in positions:
            base = flags.written_bases.get(index << 32 | position)
            if base is not None:
                base_ident, _ = base
                state.value_ranges[base_ident] = None
                state.recipes.pop(base_ident, None)
    return before


def _reduces(entry, output, holders) -> bool:
    """Whether ``output`` holds fewer values than an input among ``holders`` (idents of those
    that held nan/inf, or a sentinel): the op combined several of its values into one (a sum, a
    mean, a max over a dim)."""
    shape = output[M_SHAPE]
    if shape is None:
        return False
    size = math.prod(shape)
    return any(meta[M_SHAPE] is not None and math.prod(meta[M_SHAPE]) > size for meta in entry_inputs(entry) if meta[M_IDENT] in holders)


def _note_picked(state, entry, input_states):
    """A forward op that picks the indices of the largest or smallest values (argmax, top-k)
    read an origin's nan: it decided what was picked, and its integer results carry no nan on.
    Returns the entry's record when one was made."""
    record = None
    for found in input_states:
        origin = found[ST_ORIGIN]
        if origin is not None and found[ST_KIND] == "nan" and origin.picked_by is None and not origin.reduces_deliberate:
            record = record or state.log.view(entry)
            origin.picked_by = record
    return record


def _overflowed_in_forward(origin) -> bool:
    """A forward op whose inf is an overflow (of its dtype, finite in a wider one; or beyond
    float64 too: ``exp(1000)``), not a deliberate constant nor ``log(0)``: absorbed later, it
    still made wrong values."""
    cause = origin.cause
    if origin.kind != "inf" or cause is None or origin.record.phase == BACKWARD:
        return False
    return cause.kind == PRECISION or (cause.kind == MATH and cause.detail in OVERFLOWS)


def _step_lift(state, entry, outputs, origins) -> None:
    """Python data: new here (its input's id may be a dead tensor's, whose state it must not
    inherit). A non-finite value in it is a constant the program wrote on purpose, when it is
    one value (a Python scalar: ``x[i] = float("nan")`` lifts its nan); a nan one is followed
    as an origin to be (:meth:`Origins._nan_constant`). A nan in an array (``torch.from_numpy``,
    ``torch.tensor(array)``, a DataLoader's collate) came with the data: an origin whose cause
    is the input (:meth:`Origins._data`). An inf stays a constant; in an array it may be a mask
    built in numpy or data holding inf (a feature divided by a zero scale), so it is noted as
    having come in (``entered_infs``), as one in a tensor made before the watch is: a nan later
    made of it tells both (``Origin.entered_inf``)."""
    index = entry[E_INDEX]
    flags = state.flags
    for position, meta in enumerate(outputs):
        ident = meta[M_IDENT]
        key = (index, position)
        kind = flags.flagged.get(key)
        _note_range(state, meta, key)
        if kind is None:
            state.status.pop(ident, None)
            continue
        origin = None
        if kind == "nan" and entry[E_PHASE] != BACKWARD:
            record = state.log.view(entry)
            origin = origins._nan_constant(state, entry, record) if not meta[M_SHAPE] else origins._data(state, entry, record, meta)
            _mark_sinks(origin, flags.refs[key], state.accumulates)
        elif meta[M_SHAPE]:
            state.entered_infs.setdefault(ident, meta)
        state.status[ident] = (kind, origin)
        state.live[ident] = flags.refs[key]


def _copied_from_storage(state, entry) -> bool:
    """Whether a copy's source was made by an op that aliases a storage filled with no op
    (``set_``: torch.load's tensors), as the log shows (slow: asked for a non-finite copy only)."""
    inputs = entry_inputs(entry)
    if not inputs or len(inputs) < 2:
        return False
    _, source, *_ = inputs
    maker = state.log.producer_of(source[M_IDENT], before=entry[E_INDEX])
    return maker is not None and facts_of(maker.func).aliases_storage


def _forget_written(state, entry) -> None:
    """An op that wrote in place and returned nothing (``_foreach_add_`` of an optimizer): the
    ranges of its tensors, and of those that share their storage, are not known any more."""
    for meta in entry_inputs(entry):
        state.value_ranges[meta[M_IDENT]] = None
        state.recipes.pop(meta[M_IDENT], None)
        if state.aliases:
            _forget_aliases(state, meta[M_IDENT])


def _forget_aliases(state, ident) -> None:
    """``ident`` was written in place: the others that share its storage hold other values now."""
    for other in state.aliases.sharing(ident):
        if other != ident:
            state.value_ranges[other] = None
            state.recipes.pop(other, None)


def _entered_nonfinite(flags) -> bool:
    """Whether a tensor made before the watch held nan/inf when an op of the window first read it."""
    flagged = flags.flagged
    return any((index, position) in flagged for index, seen in flags.first_seen.items() for position, _ in seen)


def _step_grad_scaler(state, fed, below_one, dummy: bool) -> None:
    """GradScaler's overflow check: what it finds in the scaled gradients makes it skip the
    step. Gradients are born in backward; a forward overflow is no business of the scaler's
    (the scale does not touch the forward pass). With its scale below 1 (``below_one``: that
    scale) the gradients are not finite unscaled either, which no scale mends (a scale falls
    that low only after a run of skipped steps): their origins are anomalies, the scale kept.
    A fused optimizer's check (``dummy``: its ``inv_scale`` is exactly 1) does not know the
    scale: the fused step after it does (:func:`_step_fused_under_scaler`), and its origins wait
    for it (kept in ``fused_checked``)."""
    status = state.status
    if not dummy:  # a check that knew its scale: those an earlier one left waiting get no fused step
        _left_to_the_check(state.fused_checked)
    for ident in fed:
        origin = status[ident][ST_ORIGIN]
        if origin is not None and origin.record.phase == BACKWARD:
            if dummy:
                state.fused_checked[ident] = (origin, state.number)
            elif below_one is None:
                origin.skipped_by_grad_scaler = True
            else:
                origin.grad_scaler_scale = below_one


def _step_fused_under_scaler(state, entry) -> None:
    """A fused optimizer's step under GradScaler, after a check that did not know the scale: its
    ``grad_scale`` (the second to last tensor argument, then a float32 scalar) is the scale, and
    the origins of the gradients it reads are judged as at a check that knew it."""
    inputs = entry_inputs(entry)
    if len(inputs) < 2:
        return
    *_, grad_scale, _found_inf = inputs
    known = range_of(state, grad_scale) if grad_scale[M_SHAPE] == () and grad_scale[M_DTYPE] == torch.float32 else None
    below_one = known is not None and not known.within and known.high < 1
    checked = state.fused_checked
    for meta in inputs:
        origin, _ = checked.pop(meta[M_IDENT], (None, 0))
        if origin is None:
            continue
        if below_one:
            origin.grad_scaler_scale = known.high
        else:
            origin.skipped_by_grad_scaler = True


def _left_to_the_check(fused_checked: dict, keep=frozenset()) -> None:
    """The origins a fused optimizer's check saw whose fused step did not come (but those whose
    id is in ``keep``): skipped by GradScaler at a scale not known to be below 1 (a real check at
    a scale of exactly 1 looks the same), contained."""
    for ident, (origin, _) in list(fused_checked.items()):
        if id(origin) not in keep:
            origin.skipped_by_grad_scaler = True
            del fused_checked[ident]


def _scale_below_one(state, entry) -> tuple:
    """``(below_one, dummy)`` of GradScaler's check: the scale it ran at when it is below 1 (its
    ``inv_scale``, the last input, known to be above 1), else ``None`` (1 or more, or not known);
    and whether that ``inv_scale`` is exactly 1, the dummy a fused optimizer's check passes."""
    *_, inv_scale = entry_inputs(entry)
    known = range_of(state, inv_scale)
    if known is None or known.within:
        return None, False
    return (1 / known.low if known.low > 1 else None), known.low == known.high == 1


def range_of(state, meta) -> ValueRange | None:
    """The range of the tensor ``meta`` when known (read at a check point, or carried
    through ops that only move values), else ``None``."""
    ident = meta[M_IDENT]
    known = state.value_ranges[ident] if ident in state.value_ranges else state.known_ranges.get(ident)
    if known is None:
        return None
    shape, dtype, value_range = known  # a reused id: another shape or dtype
    return value_range if shape == meta[M_SHAPE] and dtype == meta[M_DTYPE] else None


def _carry_range(state, entry, facts, outputs) -> None:
    """An op that only moves values: its output's range is its inputs' (see
    :func:`.rules.moved_range`); unknown when the output is another dtype
    (``x.view(torch.int32)``). Where an input's range is unknown, a recipe is kept instead
    (a :class:`~.origin.MovedRecipe`, each part a range, a recipe or a
    :class:`~.origin.LeafRecipe`): the range may be read at report time from the tensors it came from, if
    they are still alive (a parameter that was repeated). An empty input holds no values and
    takes no part (a cache's ``cat`` of an empty tensor and the new keys holds the keys' range)."""
    inputs = [meta for meta in entry_inputs(entry) if meta[M_DTYPE] in CHECKED_DTYPES and not _empty(meta)]
    dtypes = {meta[M_DTYPE] for meta in inputs}
    ranges = [range_of(state, meta) for meta in inputs]
    carried = recipe = None
    if ranges and None not in ranges:
        carried = moved_range(facts, ranges)
    elif ranges:
        index = entry[E_INDEX]
        parts = tuple(
            known if known is not None else state.recipes.get(meta[M_IDENT]) or LeafRecipe(meta, index)
            for meta, known in zip(inputs, ranges)
        )
        recipe = MovedRecipe(facts, index, parts)
    for meta in outputs:
        same = dtypes == {meta[M_DTYPE]}
        state.value_ranges[meta[M_IDENT]] = (meta[M_SHAPE], meta[M_DTYPE], carried) if carried is not None and same else None
        if recipe is not None and same:
            state.recipes[meta[M_IDENT]] = recipe
        else:
            state.recipes.pop(meta[M_IDENT], None)


def _empty(meta) -> bool:
    shape = meta[M_SHAPE]
    return shape is not None and 0 in shape


def _step_carrier(state, entry, facts, outputs, fed) -> None:
    """An op that only moves values: its outputs hold what its inputs held (their ranges are
    carried by ``_carry_range``)."""
    index = entry[E_INDEX]
    status, live = state.status, state.live
    # An origin's values first, then a followed reduction of deliberate infs's.
    source = next((ident for ident in fed if status[ident][ST_ORIGIN] is not None and not status[ident][ST_ORIGIN].reduces_deliberate), None)
    if source is None:
        source = next((ident for ident in fed if status[ident][ST_ORIGIN] is not None), None)
    if source is None and fed:
        source = fed[0]
    carrier = status[source] if source is not None else None
    if carrier is not None and carrier[ST_ORIGIN] is not None and carrier[ST_ORIGIN].last.index != index:
        carrier[ST_ORIGIN].carried_by(state.log.view(entry))
    for position, meta in enumerate(outputs):
        if carrier is not None and _holds_what_it_moved(facts, meta):
            status[meta[M_IDENT]] = carrier
            # A view holds its base alive: the base's reference stands in for it.
            ref = state.flags.carriers.get(index << 32 | position) or live.get(source)
            if ref is not None:
                live[meta[M_IDENT]] = ref
        else:
            status.pop(meta[M_IDENT], None)


def _note_first_seen(state, entry, seen) -> None:
    """Inputs made before the watch, checked when this op first read them: their range, a
    sentinel they hold, what non-finite value they held. A nan entered the watch here: an
    origin at this op, its cause that input (``Origin.entered``). An inf counts as a constant,
    as one written on purpose (a mask made before the watch): followed, reported when a nan is
    made of it or it becomes the loss."""
    flags = state.flags
    index = entry[E_INDEX]
    metas = {meta[M_IDENT]: meta for meta in entry_inputs(entry)}
    for position, ident in seen:
        key = (index, position)
        meta = metas.get(ident)
        if meta is None or key not in flags.checked or ident in state.status:
            continue
        if key in flags.sentinels:
            state.holds_sentinel.add(ident)
            state.sentinel_refs[ident] = flags.sentinels[key]
        kind = flags.flagged.get(key)
        if kind is None:
            read = flags.ranges.get(key)
            if read is not None and ident not in state.value_ranges:
                state.value_ranges[ident] = (meta[M_SHAPE], meta[M_DTYPE], ValueRange(*read))
            continue
        origin = None
        if kind == "nan":
            origin = Origin(state.log.view(entry), kind)
            origin.entered = meta
            origin.input_ranges = _input_ranges(state, entry)
            state.origins.append(origin)
        else:
            state.entered_infs.setdefault(ident, meta)
        state.status[ident] = (kind, origin)
        state.live[ident] = flags.refs[key]
        state.entered.add(ident)


def _step_quiet(state, entry, facts, outputs) -> None:
    """``Origins._step_checked`` of an op that no followed tensor feeds, with no non-finite
    output: what its writes make stale, its outputs' ranges and sentinels; they are new
    tensors, followed by nothing."""
    if facts.mutated_args:
        _written_in_place(state, entry, outputs)
    index = entry[E_INDEX]
    status = state.status
    position = 0
    for meta in outputs:
        _note_sentinel_and_range(state, meta, (index, position))
        status.pop(meta[M_IDENT], None)
        position += 1


def _note_sentinel_and_range(state, meta, key) -> None:
    """A checked output: whether it holds a sentinel, and its range when one was read."""
    flags = state.flags
    ident = meta[M_IDENT]
    if key in flags.sentinels:
        state.holds_sentinel.add(ident)
        state.sentinel_refs[ident] = flags.sentinels[key]
    else:
        state.holds_sentinel.discard(ident)
    _note_range(state, meta, key)


def _note_range(state, meta, key) -> None:
    """A new tensor: its range, when one was read (else unknown), and no recipe."""
    ident = meta[M_IDENT]
    read = state.flags.ranges.get(key)  # (min, max), as the check point read it
    state.value_ranges[ident] = None if read is None else (meta[M_SHAPE], meta[M_DTYPE], ValueRange(*read))
    state.recipes.pop(ident, None)


def _step_finite(state, entry, facts, meta, key, input_states, input_origin, record):
    """An output found finite (or not checked): a forward masking op may have dropped an
    origin's values; an unchecked output holds what its inputs held. Returns the entry's
    record, made when needed."""
    flags = state.flags
    ident = meta[M_IDENT]
    if input_origin is not None and input_origin.absorbed_by is None and key in flags.checked and meta[M_DTYPE] in CHECKED_DTYPES:
        record = record or state.log.view(entry)
        input_origin.absorbed_by = record  # read its values, made finite ones
    if input_origin is not None and facts.is_masking and entry[E_PHASE] != BACKWARD and key in flags.checked:
        for found in input_states:
            if found[ST_ORIGIN] is not None and found[ST_ORIGIN].masked_by is None:
                record = record or state.log.view(entry)
                found[ST_ORIGIN].masked_by = record
    if input_states and _holds_unread(key, meta, flags.checked):
        state.status[ident] = input_states[0]
        index, position = key
        ref = flags.carriers.get(index << 32 | position)
        if ref is not None:
            state.live[ident] = ref
    else:
        state.status.pop(ident, None)
    return record


def _dtensors_hold_their_shards(state, inputs) -> None:
    """A DTensor holds what its local shard holds: also one made around a shard where opwatch
    saw no op (``DTensor.from_local``, a redistribution), whose id may be a dead tensor's."""
    status, live = state.status, state.live
    for meta in inputs:
        if len(meta) > M_SHARDING:
            ident, local = meta[M_IDENT], meta[M_SHARDING][SH_LOCAL_IDENT]
            found = status.get(local)
            if found is None:
                status.pop(ident, None)
                continue
            status[ident] = found
            if local in live:
                live[ident] = live[local]


def _shards_hold_their_dtensors(state, outputs) -> None:
    """The local shard of a DTensor an op made (inside DTensor's dispatch, where opwatch sees
    no op) holds what the DTensor holds: a collective on it (a redistribution) is fed by it."""
    status = state.status
    for meta in outputs:
        if len(meta) > M_SHARDING:
            local = meta[M_SHARDING][SH_LOCAL_IDENT]
            found = status.get(meta[M_IDENT])
            if found is None:
                status.pop(local, None)
            else:
                status[local] = found
                if meta[M_IDENT] in state.live:
                    state.live[local] = state.live[meta[M_IDENT]]


def _mark_sinks(origin, ref, accumulates) -> None:
    """A parameter written by an op, or a ``.grad`` accumulation."""
    if isinstance(ref(), Parameter):
        origin.reached_parameter = True
    if accumulates:
        origin.reached_gradient = True
