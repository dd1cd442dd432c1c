"""Why an origin's values are not finite: its :class:`Cause`, a fact of its finding, decided
at report time (once per check point that found origins, never on a healthy step).

The causes, tried in this order:

- ``input`` / ``weights``: an input already held nan/inf when the op ran: data that came into
  torch holding nan (``detail`` ``"data"``: an array lifted by ``torch.from_numpy`` or
  ``torch.tensor``, known when the replay finds it), a tensor made before the watch (a batch
  from a DataLoader worker, a buffer) or not checked when it was made (``torch.empty``), or an
  ``nn.Parameter`` (``weights``; ``loaded`` names the copy that wrote it from a checkpoint:
  load_state_dict's ``copy_`` of torch.load's tensors, which no op fills and which the replay
  leaves unknown, so that the first op they feed is the origin). Found by looking up the op's input
  tensors, and the tensors its inputs were only viewed or copied from, among the live objects
  (they must not have been written since the op ran);
- ``precision``: the op's result is not finite in its dtype, but is when the op runs in a
  wider one (float32, else float64): decided by running the op again on its inputs, copied
  to the wider dtype, when they are all still alive and small enough; else from the inputs'
  ranges for the ops whose result they bound (``pow``, ``mul``, ``exp``, ``mm``, a
  convolution, a cast; a layer or group norm whose float32 variance overflows:
  ``norm_variance``);
  Or decided on the chain that made the op's inputs (``went``): where the op alone is not
  finite in float64 (its input is already 0: ``b / (K.T @ u)``, ``log(prod)``), the ops that
  led to it from finite inputs are run again in float64; when the op is then finite, the first
  of them whose result went to 0 (below the smallest normal of its dtype) or to inf is named
  (:class:`_Chain`);
  Or, for a fused attention kernel's backward, from its query and key ranges alone
  (``attention_scores``, tried before the mask's ``masked``): scores past what float32 rounds
  finely enough for the kernel's exp make nan whatever the mask (:func:`~.rules.attention_scores`);
- ``math``: not finite in float64 either: ``log(0)``, ``0 / 0``, ``inf - inf``, ``sqrt`` of
  a negative number, a fully masked softmax row (``detail`` names what the inputs' ranges
  show, when they do);
  an nll_loss mean over finite log-probabilities that is nan divided by a total weight of 0
  (``all_ignored``: every target was ``ignore_index``; ``zero_weight``: each target was
  ignored or of a class of weight 0); a mean over no values or a variance over no more values
  than its correction (``empty_mean``, ``too_few_for_spread``: :func:`_too_few_values`); a
  nan made of infs where one came in with a tensor made
  before the watch or an array of Python data (``entered_inf``, ``tensor`` names it, ``made``
  where it came into torch: a mask made before the watch or built in NumPy, or data holding
  inf; else ``masked``, the infs of masks the watched ops made);
- ``unknown``: an input made before the watch is no longer alive, or the op wrote its result
  into it (``detail`` ``"written"``: ``buf.mul_(0.9)`` on a buffer made before the watch, its
  values before the write never read): whether it held the value cannot be told (``tensor``
  names it);
- ``deliberate``: a forward reduction took deliberate infs (masking constants) into its result,
  which became the loss (cross_entropy's label smoothing averages the log-probabilities of
  every class, masked ones too). Known when the replay finds it: no lookup.

Where none applies the finding has no cause (``None``).

An op that writes in place (``x.sqrt_()``, ``buf.copy_(src)``) reads an input that holds its
result by the check point: that input's range is the one the replay knew before the write
(``replay._written_in_place``), never read from the tensor now, and the tensors it was viewed
from are not read either; ``copy_``'s destination is not read by the op at all, so its range
takes no part in the cause (:func:`read_ranges`).
"""

from __future__ import annotations

import gc
import math
from itertools import compress
from typing import Any, NamedTuple

import torch

from ...core.compat import dtensor_class, dtensor_parts, module_class_name
from ...core.fact_tuples import fact_tuple
from ...core.finite import value_extremes
from ...core.notation import TensorMeta
from ...core.ops import facts_of
from ...core.records import E_FUNC, E_INDEX, M_DEVICE, M_DTYPE, M_IDENT, M_SHAPE, ModuleCall, entry_inputs, entry_outputs
from ..finding import BeforeWatch, MadeBy, Owned, Place
from .aliases import Aliases
from .origin import LeafRecipe, MovedRecipe
from .rules import CHECKED_DTYPES, COMPLEX, PLAIN_TYPES, STRIDED, ValueRange, attention_scores, largest_magnitude, moved_range, read_ranges, written_inputs

__all__ = ["Cause", "decide_causes", "fold_same_source", "range_cause", "read_ranges", "written_inputs", "WRITTEN", "PRECISION", "MATH", "INPUT", "WEIGHTS", "UNKNOWN", "DELIBERATE", "DELIBERATE_CAUSE", "NAN_CONSTANT_CAUSE", "NLL_OPS", "DATA", "ENTERED_INF", "ATTENTION_SCORES", "NORM_VARIANCE", "EMPTY_MEAN", "TOO_FEW_FOR_SPREAD"]

PRECISION, MATH, INPUT, WEIGHTS, UNKNOWN, DELIBERATE = "precision", "math", "input", "weights", "unknown", "deliberate"

# The largest inputs, in elements, an op is run again on (copied to float64: 128 MiB).
_MAX_RERUN_NUMEL = 1 << 24


@fact_tuple("nonfinite_cause")
class Cause(NamedTuple):
    """Why an origin's values are not finite (see the module's docstring for each ``kind``)."""

    kind: str  # PRECISION, MATH, INPUT, WEIGHTS, UNKNOWN or DELIBERATE
    # MATH / PRECISION: what the inputs' ranges show (``log_zero``, ``div_zero``, ``overflow``,
    # ``exp_overflow``, ``masked``, ...; the keys of render.nonfinite's fixes), or None;
    # DELIBERATE: ``reduced`` (masking infs a reduction took in) or ``nan_constant``
    detail: str | None = None
    dtype: Any = None  # PRECISION: the op's dtype
    wider: Any = None  # PRECISION: the dtype in which its result is finite
    largest: float | None = None  # PRECISION: the largest magnitude of that result (or a bound of it)
    bound: bool = False  # PRECISION: ``largest`` is a bound worked out from the inputs' ranges
    tensor: Any = None  # INPUT / WEIGHTS / UNKNOWN: the tensor (its meta)
    held: str | None = None  # INPUT / WEIGHTS: "nan" or "inf"
    made: Any = None  # INPUT / WEIGHTS / UNKNOWN: where it came from (Owned, MadeBy, BeforeWatch)
    through: Any = None  # INPUT / WEIGHTS: the op's input that carried it (``tensor`` or a view or copy of it)
    constant: Any = None  # MATH ``all_ignored``: the ``ignore_index`` every target held
    # INPUT / WEIGHTS: the Place of the copy that wrote it from loaded state (load_state_dict's
    # copy_ of torch.load's tensors), when that is how it got its values
    loaded: Any = None
    # PRECISION of a chain (the op's own inputs already held the 0 or inf, made by an earlier op
    # that underflowed or overflowed): the Place of that op, and what it went to ("0" or "inf");
    # ``largest`` is then the magnitude it had there in ``wider`` (the smallest, for an underflow)
    went: Any = None
    went_to: str | None = None


# The cause of a reduction of deliberate infs (``Origin.reduces_deliberate``).
DELIBERATE_CAUSE = Cause(DELIBERATE, "reduced")
# The cause of a nan the program wrote itself (``full(nan)``, ``x[i] = float("nan")``).
NAN_CONSTANT_CAUSE = Cause(DELIBERATE, "nan_constant")
# The ``detail`` of an INPUT cause whose tensor came into torch holding nan: an array lifted
# (``torch.from_numpy``, ``torch.tensor(array)``, a DataLoader's collate); no op made it.
DATA = "data"
# The ``detail`` of a MATH cause: a nan made of infs, one of which came in with a tensor made
# before the watch (``tensor``; a mask made before it, or data holding inf): not told "masked".
ENTERED_INF = "entered_inf"
# The ``detail`` of a PRECISION cause: a fused attention kernel's scores, bounded by its query
# and key ranges (``largest``), past what ``dtype`` (the kernel's float32) rounds finely enough
# for its exp (:func:`~.rules.attention_scores`).
ATTENTION_SCORES = "attention_scores"
# The ``detail`` of a PRECISION cause: a layer or group norm (not of float64) whose input
# spans more than sqrt(float32's max), so that the variance it computes in float32 overflows;
# ``largest`` bounds the squared deviation.
NORM_VARIANCE = "norm_variance"
# The ``detail`` of an UNKNOWN cause whose tensor the op wrote its result into (see the docstring).
WRITTEN = "written"


def decide_causes(origins, log, blocks=None, earlier_blocks=None) -> None:
    """Work out, for the origins found at a check point, the input ranges the replay left as
    recipes (see ``replay._carry_range``), where each input whose range stays unknown was made
    and whether it was alive (``origin.input_made`` / ``origin.input_alive``, see
    :mod:`.origin`), and each origin's :class:`Cause` (``origin.cause``). The tensors needed
    (recipes' leaves, the origin ops' own inputs) are looked up among the live objects in one
    walk of the garbage collector's list, and only those that no op wrote after the origin's op
    read them (else they hold other values now); each is read once
    (:func:`~opwatch.core.finite.value_extremes`). ``blocks``: the watch's
    :class:`~.tracker.EarlierBlocks`, whose :meth:`~.tracker.EarlierBlocks.outside_since` tells
    a tensor made outside the watch's ops from an older one whose id it took, and whose
    :meth:`~.tracker.EarlierBlocks.may_be` tells a live object from a tensor that took a dead
    one's id; ``earlier_blocks``: the watch's :class:`~.tracker.EarlierBlocks`, which tells the same for
    a tensor read only through views and which tensors an earlier block made; given (after a
    guard told a failure), ``origin.reads_made_before`` is worked
    out too, else it stays ``False``. Never on a healthy step."""
    # A reduction of deliberate infs has its cause already, and needs no walk of the live
    # objects (most are masking constants that never reach a loss).
    # So has data that came into torch holding nan (``DATA``).
    origins = [origin for origin in origins if not origin.reduces_deliberate and origin.cause is None]
    if not origins:
        return
    wanted: dict = {}
    writes = _Writes(log, blocks, earlier_blocks)
    # GradScaler's skipped steps tell their own story (how the scaler finds its scale): no cause,
    # and no walk of the live objects at every skipped step of a float16 run.
    decided = [origin for origin in origins if not origin.skipped_by_grad_scaler]
    for origin in decided:
        written = written_inputs(origin.record.inputs, origin.record.outputs)
        for meta, value in origin.input_ranges:
            if meta[M_IDENT] not in written:  # it holds the result now, and so may its base
                _want(value, wanted, writes)
        if origin.from_deliberate and origin.entered_inf is not None:
            _wanted_at(wanted, origin.entered_inf, origin.record.index)  # is it a module's mask?
        if not facts_of(origin.record.func).is_collective:
            index = origin.record.index
            target = _nll_target(origin)
            target = None if target is None else target[M_IDENT]  # an integer input it must read
            for meta in origin.record.inputs:
                # Not written by the op itself either (``x.log_()``): it holds the result now.
                if (meta[M_DTYPE] in CHECKED_DTYPES or meta[M_IDENT] == target) and not writes.after(meta[M_IDENT], index - 1):
                    _wanted_at(wanted, meta, index)
    live = _LiveObjects(None if blocks is None else blocks.may_be)
    found = live.tensors(wanted)
    health = {ident: _health(tensor) for ident, tensor in found.items() if tensor.dtype in CHECKED_DTYPES}
    for origin in origins:
        recipes = origin.input_ranges
        written = written_inputs(origin.record.inputs, origin.record.outputs)
        origin.input_ranges = [(meta, _worked_out(value, health if meta[M_IDENT] not in written else {})) for meta, value in recipes]
        _where_made(origin, recipes, found, wanted, writes)
        if earlier_blocks is not None:
            origin.reads_made_before = _reads_made_before(origin, recipes, writes)
        if not origin.skipped_by_grad_scaler and not facts_of(origin.record.func).is_collective:
            origin.cause = _decide(origin, recipes, found, health, writes, live)


def _reads_made_before(origin, recipes, writes) -> bool:
    """Whether an input of ``origin`` whose range stays unknown, or is known only as not finite
    (read at the check point, after a collective wrote into it), holds what a tensor no op of
    the watch made held (a leaf of its recipe: what it was viewed, copied or moved from), by
    the log alone: no live object is asked, whose id may be a newer tensor's."""
    index = origin.record.index
    for (meta, value), (_, known) in zip(recipes, origin.input_ranges):
        if known is not None and math.isfinite(known.low) and math.isfinite(known.high):
            continue
        leaves = list(_leaves(value)) or [meta]
        if any(_moved_from_before(leaf, index, writes) for leaf in leaves):
            return True
    return False


_MOVES_FOLLOWED = 8  # value-moving ops followed back from an input (detach, clone, a view, .to)


def _moved_from_before(meta, index, writes) -> bool:
    """Whether the tensor ``meta`` read by op ``index`` holds what a tensor made before the
    block held: made by no op of the watch, or by an op of an earlier block and kept (a
    running total ``+=`` each step: the steps between the blocks wrote it unwatched), or by
    ops that only move values (``x.detach().clone()``) from one such."""
    for _ in range(_MOVES_FOLLOWED):
        ident = meta[M_IDENT]
        maker = writes.made_by(ident, index, like=meta)
        blocks = writes.earlier_blocks
        if maker is not None and blocks is not None and maker.index < blocks.block_start:
            if blocks.made_by_an_earlier_block(ident, maker.index):
                return True  # kept from an earlier block: the ops between the blocks (unwatched) may have written it
            maker = None  # an older tensor's op, whose id this one took (read only through views, never first read)
        if maker is None:
            return not writes.lost_ops or writes.outside(ident, index)
        source = _moved_source(maker)
        if source is None:
            return False
        meta, index = source, maker.index
    return False


def _where_made(origin, recipes, found, wanted, writes) -> None:
    """``input_made`` and ``input_alive`` of an origin with an input whose range stays unknown:
    where it was made (:func:`_made`), and whether it was alive at the check point (found, its
    values unreadable: nan/inf, or a kind of tensor not measured). ``None`` for alive when it
    was not looked for (a step GradScaler skipped: no walk of the live objects)."""
    if all(known is not None for _, known in origin.input_ranges):
        return
    pairs = list(zip(recipes, origin.input_ranges))
    origin.input_made = tuple(None if known is not None else _made(value, writes, found) for (_, value), (_, known) in pairs)
    looked = not origin.skipped_by_grad_scaler
    origin.input_alive = tuple(_alive(value, found, wanted, writes, looked) if known is None else False for (_, value), (_, known) in pairs)


def _alive(value, found, wanted, writes, looked) -> bool | str | None:
    """Whether the tensor of an input whose range stays unknown was alive at the check point
    (found, but unreadable); :data:`WRITTEN` when an op wrote it in place (or a tensor sharing
    its storage) since the op read it, so that it was not read; ``None`` when it was not looked
    for and may be."""
    if not isinstance(value, LeafRecipe):
        return False
    ident = value.meta[M_IDENT]
    if ident in found:
        return True
    if writes.wrote(ident, value.read_at - 1):
        return WRITTEN
    if looked or ident in wanted or writes.after(ident, value.read_at - 1):
        return False  # not found, or its id is a later tensor's: dead
    return None


def _made(value, writes, found):
    """Where an input whose range stays unknown was made: the :class:`Place` of the op that
    made it in the watch (for a recipe, the op whose output it was), ``"left_log"`` when that
    op has left the bounded log, ``"before_watch"`` when the log holds every op of the watch or
    no op of the watch made it."""
    record = None
    if isinstance(value, MovedRecipe):
        record = writes.find(value.read_at)
    elif isinstance(value, LeafRecipe):
        ident = value.meta[M_IDENT]
        record = writes.made_by(ident, value.read_at, found.get(ident), like=value.meta)
        if record is None and writes.outside(ident, value.read_at, found.get(ident)):
            return "before_watch"
    if record is not None:
        return Place.of(record)
    return "left_log" if writes.lost_ops else "before_watch"


class _Health(NamedTuple):
    """A live tensor's values now: its range when finite, else which non-finite kind it holds."""

    range: ValueRange | None
    held: str | None  # "nan", "inf" or None


class _Writes:
    """Which ops wrote a tensor, by op index (a walk of the log, once, when first asked): an op
    that made it or wrote it in place, or wrote in place a tensor that shares its storage (a
    view of it, its base: :class:`~.aliases.Aliases`). ``blocks``: the watch's
    :class:`~.tracker.EarlierBlocks`, which tells a tensor from an older one whose id it took."""

    def __init__(self, log, blocks=None, earlier_blocks=None):
        self._log = log
        self._blocks = blocks
        self.earlier_blocks = earlier_blocks
        self._last = None
        self._wrote: dict = {}  # ident -> the last op that wrote it in place

    def after(self, ident, index) -> bool:
        """Whether an op after op ``index`` wrote (or made, the id reused) the tensor ``ident``."""
        if self._last is None:
            self._last = last = {}
            aliases = Aliases()
            for entry in self._log.entries:
                at = entry[E_INDEX]
                outputs = entry_outputs(entry) or ()
                for meta in outputs:
                    last[meta[M_IDENT]] = at
                func = self._log.funcs[entry[E_FUNC]]
                if isinstance(func, ModuleCall):
                    continue  # a module or function call judged before it ran: no op wrote anything
                facts = facts_of(func)
                if aliases and not facts.is_view and not facts.mutated_args:
                    for meta in outputs:  # a new tensor: its id's old views are not its
                        aliases.forget(meta[M_IDENT])
                if facts.is_view and outputs:
                    inputs = entry_inputs(entry)
                    if inputs:
                        aliases.view(_first(inputs)[M_IDENT], [meta[M_IDENT] for meta in outputs])
                elif facts.mutated_args:
                    inputs = entry_inputs(entry)
                    written = written_inputs(inputs, outputs) if outputs else [meta[M_IDENT] for meta in inputs]
                    for written_ident in written:  # (not ``ident``: the one asked about)
                        for other in aliases.sharing(written_ident):
                            last[other] = self._wrote[other] = at
        return self._last.get(ident, -1) > index

    def wrote(self, ident, index) -> bool:
        """Whether the last op after op ``index`` that wrote ``ident`` wrote it in place (its
        values changed; its id is not a newer tensor's)."""
        self.after(ident, index)  # the walk
        wrote = self._wrote.get(ident, -1)
        return wrote > index and wrote >= self._last.get(ident, -1)

    def made_by(self, ident, index, tensor=None, like=None):
        """The latest op before op ``index`` that output ``ident``, or ``None``; not an op
        from before the watch knew a tensor no op of it made (``tensor``: the object, when
        alive), nor one whose output under the id differed from ``like`` (the tensor's
        metadata) in shape, dtype or device, nor an earlier block's op whose tensor was dead
        when this block began: that op made an older tensor, whose id this one took."""
        record = self._log.producer_of(ident, before=index, like=like)
        blocks = self._blocks
        if record is not None and blocks is not None:
            since = blocks.outside_since(ident, index, tensor)
            if (since is not None and record.index < since) or blocks.read_a_newer_tensor(ident, record.index):
                return None
        return record

    def outside(self, ident, index, tensor=None) -> bool:
        """Whether no op of the watch made the tensor ``ident`` read by op ``index`` (made
        before the watch or outside torch ops: its first read found it unknown)."""
        return self._blocks is not None and self._blocks.outside_since(ident, index, tensor) is not None

    def find(self, index):
        """The logged op of index ``index``, or ``None``."""
        return self._log.find(index)

    @property
    def lost_ops(self) -> bool:
        """Whether ops have left the bounded log (then "made by no logged op" is not "made before the watch")."""
        return self._log.lost_ops


def _want(value, wanted, writes) -> None:
    """Note the live tensors a recipe needs."""
    if isinstance(value, MovedRecipe):
        for part in value.parts:
            _want(part, wanted, writes)
    elif isinstance(value, LeafRecipe) and not writes.after(value.meta[M_IDENT], value.read_at - 1):
        _wanted_at(wanted, value.meta, value.read_at)


def _wanted_at(wanted, meta, index) -> None:
    """Note that op ``index`` read the tensor ``meta``: its live object is looked for as the
    tensor its latest read read (ident -> (metadata, op index))."""
    ident = meta[M_IDENT]
    _, noted_at = wanted.get(ident, (None, -1))
    if noted_at < index:
        wanted[ident] = (meta, index)


class _LiveObjects:
    """The tensors and modules alive now, from one walk of the garbage collector's list, made
    when first asked. The causes of one check point ask several times (the origins' inputs, then
    the ops before an origin that :class:`_Chain` runs again), and a walk visits every object of
    the process: 50-100 ms with torch loaded, more in a large program. ``may_be(ident, tensor,
    index)``: whether a live ``tensor`` may be the one op ``index`` read under its id
    (:meth:`~.tracker.EarlierBlocks.may_be`); else same id, shape, dtype and device are taken
    as the same tensor."""

    def __init__(self, may_be=None):
        self._tensors: dict | None = None  # ident -> tensor
        self._modules: list = []
        self._may_be = may_be

    def tensors(self, wanted) -> dict:
        """ident -> tensor, for the ``wanted`` tensors (ident -> (metadata, the op index that
        read it)) still alive with the shape, dtype and device they had: the objects themselves,
        not newer tensors that took a dead one's id, as far as the watch can tell."""
        if not wanted:
            return {}
        if self._tensors is None:
            self._walk()
        found = {}
        may_be = self._may_be
        for ident, (meta, index) in wanted.items():
            candidate = self._tensors.get(ident)
            if candidate is not None and tuple(candidate.shape) == tuple(meta[M_SHAPE]) and candidate.dtype == meta[M_DTYPE] and candidate.device == meta[M_DEVICE]:
                if may_be is None or may_be(ident, candidate, index):
                    found[ident] = candidate
        return found

    @property
    def modules(self) -> list:
        """The live modules (to name a parameter or buffer)."""
        if self._tensors is None:
            self._walk()
        return self._modules

    def _walk(self) -> None:
        # One pass in C (map, compress) over every object, choosing by type (no isinstance:
        # no __class__ lookups, which deprecated objects answer with a warning): a Python loop
        # over them costs twice the walk itself.
        objects = gc.get_objects()
        chosen = list(compress(objects, map(_TensorOrModule().__getitem__, map(type, objects))))
        del objects
        self._tensors = {id(candidate): candidate for candidate in chosen if isinstance(candidate, torch.Tensor)}
        self._modules = [candidate for candidate in chosen if not isinstance(candidate, torch.Tensor)]


class _TensorOrModule(dict):
    """type -> whether it is a tensor's or a module's type, worked out once per type."""

    def __missing__(self, kind) -> bool:
        chosen = self[kind] = issubclass(kind, (torch.Tensor, torch.nn.Module))
        return chosen


def fold_same_source(origins) -> tuple[list, dict]:
    """Origins that an input which already held nan/inf explains, one per such tensor: the
    later ones (its backward ``mm``, another layer that read it) are the first one's spread.
    Returns the origins kept, and the folded ones by id: ``id(folded) -> the one kept``."""
    first: dict = {}
    kept = []
    folded: dict = {}
    for origin in origins:
        cause = origin.cause
        if cause is None or cause.kind not in (INPUT, WEIGHTS):
            kept.append(origin)
            continue
        earlier = first.setdefault(cause.tensor[M_IDENT], origin)
        if earlier is origin:
            kept.append(origin)
            continue
        earlier.spread += 1 + origin.spread
        earlier.reached_gradient |= origin.reached_gradient
        earlier.reached_parameter |= origin.reached_parameter
        earlier.read_on_host |= origin.read_on_host
        earlier.picked_by = earlier.picked_by or origin.picked_by
        folded[id(origin)] = earlier
    return kept, folded


def _health(tensor) -> _Health:
    try:
        if type(tensor) not in PLAIN_TYPES and type(tensor) is dtensor_class():
            tensor, _, _ = dtensor_parts(tensor)  # this rank's shard, what its ops read: no collective
        if type(tensor) not in PLAIN_TYPES or tensor.layout is not STRIDED:
            return _Health(None, None)
        extremes = value_extremes(tensor)
    except Exception:
        return _Health(None, None)
    if extremes is None:
        return _Health(None, None)
    low, high = extremes
    if math.isnan(low) or math.isnan(high):
        return _Health(None, "nan")
    if math.isinf(low) or math.isinf(high):
        return _Health(None, "inf")
    return _Health(ValueRange(low, high), None)


def _worked_out(value, health):
    """A recipe's range, from the live tensors' ``health``; ``None`` when a part is unknown
    (or not finite: then the cause says so)."""
    if isinstance(value, LeafRecipe):
        known = health.get(value.meta[M_IDENT])
        return None if known is None else known.range
    if isinstance(value, MovedRecipe):
        ranges = [_worked_out(part, health) for part in value.parts]
        return None if None in ranges else moved_range(value.facts, ranges)
    return value


def _leaves(value):
    """The tensors (metas) a recipe's range would be read from."""
    if isinstance(value, LeafRecipe):
        yield value.meta
    elif isinstance(value, MovedRecipe):
        for part in value.parts:
            yield from _leaves(part)


# -- the decision ---------------------------------------------------------------------------


def _decide(origin, recipes, found, health, writes, live) -> Cause | None:
    record = origin.record
    index = record.index
    held = _held_input(origin, recipes, found, health, writes, live)
    # Made of deliberate infs: an input holding inf is the masking constant itself, the math
    # is the cause (a nan an input held is never deliberate).
    if held is not None and not (origin.from_deliberate and held.held == "inf"):
        return held
    if origin.entered is not None:
        # It held nan when first read (checked then), and is gone or written since: made before
        # the watch, or by an op whose values opwatch does not read (``set_``).
        meta = TensorMeta(*origin.entered)
        return Cause(INPUT, tensor=meta, held=origin.kind, made=_made_where(writes, meta.ident, index, found.get(meta.ident), like=meta), through=meta)
    scores = attention_scores(facts_of(record.func).name, origin.input_ranges, dict(record.args).get("scale"))
    if scores is not None:
        # Scores past float32's precision make nan in a fused attention kernel whatever the
        # mask: its -inf is not the matter then.
        return Cause(PRECISION, ATTENTION_SCORES, scores.dtype, torch.float64 if scores.dtype != torch.float64 else None, scores.bound, bound=True)
    if origin.from_deliberate and origin.entered_inf is not None:
        # An inf came in with a tensor made before the watch, or with an array of Python data:
        # a module's mask (a buffer, an attribute) is deliberate; anything else may be data
        # holding inf, not a mask.
        entered = TensorMeta(*origin.entered_inf)
        tensor = found.get(entered.ident)
        if tensor is None or not _kept_by_a_module(tensor, live.modules):
            lift = writes.made_by(entered.ident, index, tensor, like=entered)
            made = MadeBy("made_by", Place.of(lift)) if lift is not None and facts_of(lift.func).is_lift else BeforeWatch()
            return Cause(MATH, ENTERED_INF, tensor=entered, made=made)
    if origin.from_deliberate:
        return Cause(MATH, "masked")
    few = _too_few_values(origin)
    if few is not None:
        return Cause(MATH, few)
    counted = _nothing_counted(origin, found)
    if counted is not None:
        return Cause(MATH, counted, constant=dict(record.args).get("ignore_index", -100) if counted == "all_ignored" else None)
    name = facts_of(record.func).name
    ranges = [value_range for _, value_range in origin.input_ranges]
    detail = range_cause(name, origin.kind, record.outputs or (), ranges)
    rerun = _rerun(record, found)
    if rerun is not None:
        wider, largest = rerun
        if wider is None:
            return _chain_cause(origin, writes, detail, live) or Cause(MATH, detail)
        return Cause(PRECISION, detail, _dtype_of(record), wider, largest)
    if detail == NORM_VARIANCE:
        return Cause(PRECISION, detail, _dtype_of(record), torch.float64, _deviation_squared(next(iter(ranges))), bound=True)
    if detail is not None and detail not in OVERFLOWS:
        return _chain_cause(origin, writes, detail, live) or Cause(MATH, detail)
    bound = _bound(record, origin.kind, read_ranges(name, ranges))
    if bound is not None:
        dtype = _dtype_of(record)
        for wider in (torch.float32, torch.float64):
            if _rank(wider) > _rank(dtype) and bound < torch.finfo(wider).max:
                return Cause(PRECISION, detail, dtype, wider, bound, bound=True)
        # A bound beyond float64 tells nothing: the exact result may still be far below it.
    chain = _chain_cause(origin, writes, detail, live)
    if chain is not None:
        return chain
    if detail is not None:
        return Cause(MATH, detail)
    # An input whose range is unknown, made before the watch (or by an op whose values are not
    # read: empty*, set_) and gone, or written by the op itself: it may have held it.
    written = written_inputs(record.inputs, record.outputs)
    unread = _unread(name, recipes)
    for (meta, value), (_, known) in zip(recipes, origin.input_ranges):
        if known is None and meta[M_IDENT] != unread:
            for leaf in _leaves(value):
                if leaf[M_IDENT] in found:
                    continue
                how = WRITTEN if meta[M_IDENT] in written else None
                maker = writes.made_by(leaf[M_IDENT], index, like=leaf)
                if maker is None and (not writes.lost_ops or writes.outside(leaf[M_IDENT], index)):
                    return Cause(UNKNOWN, how, tensor=TensorMeta(*leaf), made=BeforeWatch())
                if maker is not None and facts_of(maker.func).makes_new_data:
                    return Cause(UNKNOWN, how, tensor=TensorMeta(*leaf), made=MadeBy("made_by", Place.of(maker)))
    return None


# The negative log-likelihood ops, forward and backward: a mean divides by the total weight of
# the targets counted (the backward by the forward's ``total_weight``, one of its inputs).
NLL_OPS = frozenset(("nll_loss_forward", "nll_loss2d_forward", "nll_loss_backward", "nll_loss2d_backward"))
_MEAN = 1  # torch's Reduction::Mean


def _nll_target(origin):
    """The target (its meta: the op's integer input) of an nll_loss op that made nan by a mean
    that may have divided by zero, else ``None``."""
    record = origin.record
    if origin.kind != "nan" or facts_of(record.func).name not in NLL_OPS or dict(record.args).get("reduction") != _MEAN:
        return None
    return next((meta for meta in record.inputs if not meta[M_DTYPE].is_floating_point), None)


def _nothing_counted(origin, found) -> str | None:
    """An nll_loss mean that is nan from finite log-probabilities (and finite class weights):
    the total weight it divides by is 0, a 0 / 0. ``"all_ignored"`` when every target was
    ``ignore_index``: certain without class weights (the total weight is then the count of the
    targets not ignored), else when the target, read, holds only ``ignore_index``;
    ``"zero_weight"`` otherwise (each target ignored or of a class of weight 0)."""
    target = _nll_target(origin)
    if target is None or any(value_range is None for _, value_range in origin.input_ranges):
        return None
    record = origin.record
    floating = sum(1 for meta in record.inputs if meta[M_DTYPE].is_floating_point)
    weighted = floating > (1 if facts_of(record.func).name.endswith("_forward") else 3)
    if not weighted:
        return "all_ignored"
    tensor = found.get(target[M_IDENT])
    if tensor is not None:
        try:
            if not bool((tensor != dict(record.args).get("ignore_index", -100)).any()):
                return "all_ignored"
        except Exception:  # a tensor subclass that does not compare: the weights may be why
            pass
    return "zero_weight"


# Ops that average their input's values (a loss by its default reduction, the mean), and those
# whose variance divides by the count of values less a correction (1 unless given): on too few
# values each divides by 0, a nan in any dtype.
_MEANS = frozenset(("mean", "nanmean"))
_MEAN_LOSSES = frozenset((
    "mse_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "nll_loss_forward", "nll_loss2d_forward",
))
_SPREADS = frozenset(("std", "var", "std_mean", "var_mean"))
# The ``detail`` of a MATH cause: a mean over no values (``x[mask].mean()`` with a mask that
# selected none, a loss of an empty batch); a variance over no more values than its correction
# (``x.std()`` of a batch of one).
EMPTY_MEAN = "empty_mean"
TOO_FEW_FOR_SPREAD = "too_few_for_spread"


def _too_few_values(origin) -> str | None:
    """:data:`EMPTY_MEAN` or :data:`TOO_FEW_FOR_SPREAD` for a nan such an op made from too few
    values, read from its first floating input's shape and its arguments; else ``None``."""
    record = origin.record
    if origin.kind != "nan":
        return None
    name = facts_of(record.func).name
    first = next((meta for meta in record.inputs if meta[M_DTYPE].is_floating_point), None)
    if first is None or first[M_SHAPE] is None:
        return None
    args = dict(record.args)
    if name in _MEANS or (name in _MEAN_LOSSES and args.get("reduction", _MEAN) == _MEAN):
        return EMPTY_MEAN if math.prod(first[M_SHAPE]) == 0 else None
    if name in _SPREADS:
        correction = args.get("correction")
        correction = (1 if args.get("unbiased", True) else 0) if correction is None else correction
        shape, dims = first[M_SHAPE], args.get("dim")
        if dims is None:
            count = math.prod(shape)
        else:
            dims = (dims,) if isinstance(dims, int) else dims
            count = math.prod(shape[dim] for dim in dims) if shape else 1
        return TOO_FEW_FOR_SPREAD if count <= correction else None
    return None


def _unread(name, recipes):
    """The ident of the floating input the op overwrites without reading (``copy_``'s
    destination, see :func:`read_ranges`), else ``None``."""
    if name == "copy" and len(recipes) > 1:
        (meta, _), *_ = recipes
        return meta[M_IDENT]
    return None


def _held_input(origin, recipes, found, health, writes, live) -> Cause | None:
    """An input (or a tensor an input was viewed or copied from) that held nan/inf when the op
    ran: alive now, unwritten since, and not finite."""
    index = origin.record.index
    recipes = dict((meta[M_IDENT], value) for meta, value in recipes)
    written = written_inputs(origin.record.inputs, origin.record.outputs)
    for through in origin.record.inputs:
        if through[M_IDENT] in written:
            continue  # it holds the op's result now, and so may the tensor it was viewed from
        for meta in [through, *_leaves(recipes.get(through[M_IDENT]))]:
            found_held = _held(meta, through, index, found, health, writes, origin.record.module, live)
            if found_held is not None:
                return found_held
    return None


def _held(meta, through, index, found, health, writes, path, live) -> Cause | None:
    ident = meta[M_IDENT]
    known = health.get(ident)
    if known is None or known.held is None:
        return None
    tensor = found[ident]
    meta, through = TensorMeta(*meta), TensorMeta(*through)
    owner = _owner(tensor, path, live.modules)
    loaded = _loaded_by(writes, ident, index, tensor, like=meta)
    if owner is not None:
        kind = WEIGHTS if owner.how == "parameter" else INPUT
        return Cause(kind, tensor=meta, held=known.held, made=owner, through=through, loaded=loaded)
    if isinstance(tensor, torch.nn.Parameter):
        return Cause(WEIGHTS, tensor=meta, held=known.held, through=through, loaded=loaded)
    return Cause(INPUT, tensor=meta, held=known.held, made=_made_where(writes, ident, index, tensor, like=meta), through=through, loaded=loaded)


def _loaded_by(writes, ident, index, tensor=None, like=None) -> Place | None:
    """The copy that last wrote ``ident`` before op ``index``, when it copied loaded values: a
    source made by an op that aliases a storage filled with no op (``set_``: torch.load)."""
    writer = writes.made_by(ident, index, tensor, like=like)
    if writer is None or not facts_of(writer.func).is_copy or len(writer.inputs) < 2:
        return None
    _, copied, *_ = writer.inputs
    source = writes.made_by(copied[M_IDENT], writer.index)
    return Place.of(writer) if source is not None and facts_of(source.func).aliases_storage else None


def _made_where(writes, ident, index, tensor=None, like=None) -> MadeBy | BeforeWatch | None:
    """The logged op that made ``ident`` before op ``index`` (``tensor``: the object, when
    alive); else before the watch, when no op of the watch made it or the log holds every op of
    the watch; else ``None`` (its maker may have left the bounded log). A maker that only moved
    the values of a tensor made before the watch (``labels.squeeze(-1)``, ``.float()`` of a
    batch) did not make them: before the watch, as that tensor was."""
    maker = writes.made_by(ident, index, tensor, like=like)
    if maker is None:
        return BeforeWatch() if not writes.lost_ops or writes.outside(ident, index, tensor) else None
    source = _moved_source(maker)
    if source is not None and _moved_from_before(source, maker.index, writes):
        return BeforeWatch()
    return MadeBy("made_by", Place.of(maker))


def _moved_source(record):
    """The floating input whose values op ``record`` only moved (a view, a copy, a cast), or ``None``."""
    facts = facts_of(record.func)
    if not facts.preserves_values or facts.mutated_args:
        return None
    return next((source for source in record.inputs if source[M_DTYPE] in CHECKED_DTYPES), None)


def _owner(tensor, path, modules) -> Owned | None:
    """The live module that holds ``tensor`` as a parameter or buffer (its own, not a child's)."""
    for module in modules:
        for how, named in (("parameter", module.named_parameters(recurse=False)), ("buffer", module.named_buffers(recurse=False))):
            for name, held in named:
                if held is tensor:
                    return Owned(how, path or "", name, module_class_name(module))
    return None


def _kept_by_a_module(tensor, modules) -> bool:
    """Whether a live module holds ``tensor`` as a parameter, a buffer or a plain attribute
    (``self.mask = torch.full(...)``)."""
    for module in modules:
        for held in (*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()):
            if held is tensor:
                return True
    return False


def _dtype_of(record):
    return next((meta[M_DTYPE] for meta in record.outputs or () if meta[M_DTYPE].is_floating_point), None)


def _rank(dtype) -> int:
    return {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}.get(dtype, 0)


# -- running the op again -------------------------------------------------------------------


def _rerun(record, found):
    """Run the op again on its inputs copied to float32, then float64 (wider than its dtype):
    ``(wider, largest)`` for the first whose result is finite, ``(None, None)`` when none is,
    ``None`` when it cannot be run again (an input is gone, too large, or its call cannot be
    rebuilt from the log)."""
    dtype = _dtype_of(record)
    if dtype is None or dtype in COMPLEX:
        return None
    tensors = []
    for meta in record.inputs:
        tensor = found.get(meta[M_IDENT])
        if tensor is None or not holds_its_data(tensor):
            return None
        tensors.append(tensor)
    if not tensors or sum(tensor.numel() for tensor in tensors) > _MAX_RERUN_NUMEL:
        return None
    func = record.func
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return None  # random (dropout): running it again would draw from the program's generator
    call = _call_of(func, record, len(tensors))
    if call is None:
        return None
    wider = [candidate for candidate in (torch.float32, torch.float64) if _rank(candidate) > _rank(dtype)]
    if not wider:
        return (None, None)  # non-finite in float64 already
    device = _first(tensors).device
    for candidate in wider:
        try:  # out of memory (the copies, the result) included: then the ranges decide
            copies = [tensor.detach().to(candidate, copy=True) if tensor.is_floating_point() else tensor.detach().clone() for tensor in tensors]
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                out = func(*_fill(call.args, copies), **_fill_kwargs(call.kwargs, copies))
        except Exception:
            return None
        results = [out] if isinstance(out, torch.Tensor) else [item for item in out if isinstance(item, torch.Tensor)] if isinstance(out, (tuple, list)) else []
        floating = [result for result in results if result.is_floating_point()]
        if not floating or any(result.dtype != candidate for result in floating):
            return None  # the op chose its dtype itself (a cast): its dtype is the question
        extremes = value_extremes(_first(floating))
        if extremes is None:
            return candidate, 0.0  # empty: nothing in it is not finite
        low, high = extremes
        if math.isfinite(low) and math.isfinite(high):
            return candidate, max(abs(low), abs(high))
    return (None, None)


def holds_its_data(tensor) -> bool:
    """Whether ``tensor`` may be read again to run an op on it: a plain strided tensor (no
    subclass such as a DTensor, whose ops would talk to other ranks) whose storage still holds
    every element it views. FSDP frees an unsharded parameter's storage after its forward
    (``resize_(0)``) while the tensor object lives on with its shape: reading it then reads
    freed memory."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided or tensor.is_meta:
        return False
    if tensor.numel() == 0:
        return True
    try:
        extent = tensor.storage_offset() + 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        return tensor.untyped_storage().nbytes() >= extent * tensor.element_size()
    except (RuntimeError, NotImplementedError):
        return False


# -- the chain that made it -------------------------------------------------------------------

# How many ops back from the origin's inputs the chain is run again, and how many in all.
_CHAIN_DEPTH = 12
_CHAIN_OPS = 48


class _Chain:
    """The ops that led to an origin's inputs, run again from the tensors they started from
    (alive and unwritten: the leaves), once in the ops' own dtypes and once with every floating
    tensor in float64: which op's result went to 0 (below the smallest normal of its dtype, non-
    zero in float64) or to inf (finite in float64) first, and whether the origin's op is finite
    in float64 on such inputs. Slow: asked only where the origin's op alone tells undefined math
    (or nothing)."""

    def __init__(self, writes, live):
        self._writes = writes
        self._objects = live  # the check point's _LiveObjects
        self._plan: dict = {}  # (ident, before) -> the producing record, or None for a leaf
        self._live: dict = {}
        self._values: dict = {}  # (ident, before) -> (narrow, wide) or None
        self._numel = 0
        self.events: list = []  # (op index, record, went_to, magnitude in float64)

    def plan(self, record) -> bool:
        """Walk the log back from ``record``'s inputs; look the leaves up among the live objects."""
        wanted: dict = {}
        frontier = [(meta, record.index, 0) for meta in record.inputs]
        while frontier:
            meta, before, depth = frontier.pop()
            key = (meta[M_IDENT], before)
            if key in self._plan:
                continue
            _wanted_at(wanted, meta, before)
            producer = self._writes.made_by(meta[M_IDENT], before) if depth < _CHAIN_DEPTH and len(self._plan) < _CHAIN_OPS else None
            if producer is not None and not _rerunnable(producer):
                producer = None
            self._plan[key] = producer
            if producer is not None:
                frontier.extend((inner, producer.index, depth + 1) for inner in producer.inputs)
        self._live = self._objects.tensors(wanted)
        return any(producer is not None for producer in self._plan.values())

    def value(self, meta, before):
        """``(narrow, wide)`` for the tensor ``meta`` as op ``before`` read it, or ``None``."""
        key = (meta[M_IDENT], before)
        if key in self._values:
            return self._values[key]
        self._values[key] = None  # a cycle reads as unknown
        found = self._computed(meta, before)
        if found is None:
            found = self._leaf(meta, before)
        self._values[key] = found
        return found

    def _leaf(self, meta, before):
        tensor = self._live.get(meta[M_IDENT])
        if tensor is None or not holds_its_data(tensor) or self._writes.after(meta[M_IDENT], before - 1) or not self._afford(tensor):
            return None
        narrow = tensor.detach().clone()
        return narrow, _widened(narrow)

    def _computed(self, meta, before):
        producer = self._plan.get((meta[M_IDENT], before))
        if producer is None:
            return None
        values = [self.value(inner, producer.index) for inner in producer.inputs]
        if None in values:
            return None
        results = run_call(producer, [narrow for narrow, _ in values], [wide for _, wide in values])
        if results is None:
            return None
        position = next((at for at, out in enumerate(producer.outputs or ()) if out[M_IDENT] == meta[M_IDENT]), None)
        if position is None or position >= len(results):
            return None
        narrow, wide = results[position]
        if not self._afford(narrow):
            return None
        self._note(producer, [narrow_in for narrow_in, _ in values], narrow, wide)
        return narrow, wide

    def _afford(self, tensor) -> bool:
        self._numel += tensor.numel()
        return self._numel <= _MAX_RERUN_NUMEL

    def _note(self, producer, inputs, narrow, wide) -> None:
        """Where this op's result went to 0 or inf from finite inputs, and not in float64."""
        if not narrow.is_floating_point() or narrow.dtype == torch.float64 or narrow.is_complex():
            return
        if any(inner.is_floating_point() and not bool(torch.isfinite(inner).all()) for inner in inputs):
            return
        info = torch.finfo(narrow.dtype)
        wide = wide.to(torch.float64)
        underflowed = (narrow == 0) & (wide != 0) & (wide.abs() < info.tiny)
        if bool(underflowed.any()):
            self.events.append((producer.index, producer, "0", float(wide.abs()[underflowed].max())))
            return
        overflowed = torch.isinf(narrow) & torch.isfinite(wide)
        if bool(overflowed.any()):
            self.events.append((producer.index, producer, "inf", float(wide.abs()[overflowed].max())))


def _widened(tensor):
    return tensor.detach().to(torch.float64) if tensor.is_floating_point() and not tensor.is_complex() else tensor.detach().clone()


def _wide_args(values) -> tuple:
    """Arguments for the float64 run: a floating dtype argument (``ones_like(x, dtype=f32)``,
    ``x.float()``) names float64."""
    return tuple(torch.float64 if isinstance(value, torch.dtype) and value.is_floating_point else value for value in values)


def _rerunnable(record) -> bool:
    """Whether the chain may run ``record``'s op again: not one that makes values opwatch does
    not read (``empty_like``, ``set_``), draws random numbers, lifts Python data or talks to
    other ranks (factories of given values, ``full``, ``ones_like``, are run)."""
    facts = facts_of(record.func)
    if facts.is_collective or facts.makes_new_data or facts.is_lift:
        return False
    return torch.Tag.nondeterministic_seeded not in getattr(record.func, "tags", ())


def run_call(record, narrow, wide):
    """Run ``record``'s op on ``narrow`` tensors and on ``wide`` ones (copies: the op may write
    in place): a ``(narrow, wide)`` pair per tensor output, or ``None`` when it cannot be run."""
    call = _call_of(record.func, record, len(narrow))
    if call is None:
        return None
    outs = []
    for tensors, args, kwargs in ((narrow, call.args, call.kwargs), (wide, _wide_args(call.args), dict(zip(call.kwargs, _wide_args(call.kwargs.values()))))):
        copies = [tensor.clone() for tensor in tensors]
        try:
            with torch.no_grad():
                out = record.func(*_fill(args, copies), **_fill_kwargs(kwargs, copies))
        except Exception:
            return None
        outs.append([out] if isinstance(out, torch.Tensor) else [item for item in out if isinstance(item, torch.Tensor)] if isinstance(out, (tuple, list)) else [])
    narrow_outs, wide_outs = outs
    wide_outs = [_widened(out) for out in wide_outs]
    if len(narrow_outs) != len(wide_outs):
        return None
    return list(zip(narrow_outs, wide_outs))


def _chain_cause(origin, writes, detail, live) -> Cause | None:
    """PRECISION when the ops that made the origin's inputs, run again in float64 from finite
    inputs, keep the origin's op finite, and one of them went to 0 or inf in its own dtype
    (the first in the program is named): a float32 ``exp`` that underflowed to 0 before
    ``b / (K.T @ u)``, a product of densities before ``log``."""
    record = origin.record
    dtype = _dtype_of(record)
    if dtype is None or dtype == torch.float64 or dtype in COMPLEX or facts_of(record.func).is_collective:
        return None
    chain = _Chain(writes, live)
    if not chain.plan(record):
        return None
    values = [chain.value(meta, record.index) for meta in record.inputs]
    if None in values or not chain.events:
        return None
    results = run_call(record, [narrow for narrow, _ in values], [wide for _, wide in values])
    if not results:
        return None
    (narrow, wide), *_ = results
    if not wide.is_floating_point() or bool(torch.isfinite(narrow).all()) or not bool(torch.isfinite(wide).all()):
        return None  # not reproduced, or not finite in float64 either
    _, went, went_to, magnitude = min(chain.events, key=_first)  # the first in the program (by op index)
    return Cause(PRECISION, detail, _dtype_of(went) or dtype, torch.float64, magnitude, went=Place.of(went), went_to=went_to)


class _Call(NamedTuple):
    args: tuple  # values, or _Slot(n) for the n-th tensor input
    kwargs: dict


class _Slot(NamedTuple):
    number: int


def _call_of(func, record, count) -> _Call | None:
    """The op's call, rebuilt from its schema and the log's non-tensor arguments: tensors fill
    the single ``Tensor`` arguments in order. ``None`` for a tensor list or a tensor passed by
    keyword (the log does not keep where they sat)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    given = dict(record.args)  # by argument name
    args, kwargs = [], {}
    used = 0
    positional = True
    for arg in schema.arguments:
        type_name = str(arg.type)
        if "Tensor" in type_name and type_name not in ("Tensor", "Tensor?"):
            return None  # a list of tensors
        if arg.name in given:
            value = given[arg.name]
            if isinstance(value, str) and value.startswith(("<", "ProcessGroup")):
                return None  # summarised in the log
        elif type_name in ("Tensor", "Tensor?") and used < count and not arg.kwarg_only:
            value = _Slot(used)
            used += 1
        elif type_name == "Tensor":
            return None  # a tensor the log does not place
        else:
            positional = False  # left to its default
            continue
        if positional and not arg.kwarg_only:
            args.append(value)
        else:
            kwargs[arg.name] = value
    if used != count:
        return None
    return _Call(tuple(args), kwargs)


def _fill(values, tensors):
    return [tensors[value.number] if type(value) is _Slot else value for value in values]


def _fill_kwargs(values, tensors):
    return {name: tensors[value.number] if type(value) is _Slot else value for name, value in values.items()}


# -- what the inputs' ranges show ------------------------------------------------------------

OVERFLOWS = frozenset(("overflow", "exp_overflow", "pow_overflow"))  # MATH details that are overflows


def range_cause(name, kind, outputs, ranges) -> str | None:
    """What in the inputs' ranges (``ValueRange`` or ``None`` each, floating inputs in order)
    made the result of op ``name`` non-finite, for the common ops, as a key (``log_zero``,
    ``div_zero``, ...); ``None`` when the ranges do not tell. The cause must fit the kind: log
    of a negative number is nan, log(0) is -inf. A range carried through indexing or cat
    (``within``) bounds the values: its ends are read as they are."""
    ranges = read_ranges(name, ranges)
    first, second, *_ = [*ranges, None, None]
    if name == "_ctc_loss" and kind == "inf":
        # From finite log-probabilities CTC's loss is inf only where no alignment exists.
        return "ctc_no_alignment"
    if name == "div" and _holds_zero(second):
        if kind == "nan" and _holds_zero(first):
            return "div_zero_zero"
        if kind == "inf":
            return "div_zero"
    if first is None:
        return None
    low, high = first.low, first.high
    if name in ("log", "log2", "log10"):
        if kind == "nan" and low < 0:
            return "log_negative"
        if kind == "inf" and low <= 0 <= high:
            return "log_zero"
    if name == "log1p" and low <= -1:
        return "log1p_low"
    if name == "sqrt" and kind == "nan" and low < 0:
        return "sqrt_negative"
    if name == "rsqrt":
        if kind == "nan" and low < 0:
            return "rsqrt_negative"
        if kind == "inf" and low <= 0 <= high:
            return "rsqrt_zero"
    if name == "pow":
        if kind == "nan" and low < 0:
            return "pow_negative_base"
        if kind == "inf" and low <= 0 <= high and max(abs(low), abs(high)) <= 1:
            return "pow_zero_base"
    if name in ("acos", "asin") and kind == "nan" and (low < -1 or high > 1):
        return "domain_unit"
    if name == "atanh" and (low <= -1 or high >= 1):
        return "atanh_unit"
    if name in _NORMS and kind == "nan" and _deviation_squared(first) > _FLOAT32_MAX and _computes_in_float32(outputs):
        return NORM_VARIANCE
    if kind != "inf":
        return None
    return _overflow_cause(name, outputs, ranges, high)


# The normalisations that square deviations from the mean in float32 (float64 for float64
# inputs), whatever the input's dtype: past sqrt(3.4e38) apart, the variance is inf, and the
# output nan. (Not batch_norm: on a CPU it stayed finite at any scale tried.)
_NORMS = frozenset(("native_layer_norm", "native_group_norm", "_fused_rms_norm"))
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _computes_in_float32(outputs) -> bool:
    """A norm of a float32, bfloat16 or float16 input (float64 ones compute in float64)."""
    return next((meta[M_DTYPE] for meta in outputs), None) in (torch.float32, torch.bfloat16, torch.float16)


def _deviation_squared(value_range) -> float:
    """The largest squared deviation from the mean that a range allows."""
    width = value_range.high - value_range.low
    return width * width


def _holds_zero(value_range) -> bool:
    return value_range is not None and value_range.low <= 0 <= value_range.high


def _overflow_cause(name, outputs, ranges, high) -> str | None:
    """Inputs beyond what the output's dtype holds (``high``: the first input's max)."""
    dtype = next((meta[M_DTYPE] for meta in outputs), None)
    if dtype is not None and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        bound = math.log2(limit) if name == "exp2" else math.log(limit)
        if name in ("exp", "exp2", "expm1") and high > bound:
            return "exp_overflow"
        largest = max(largest_magnitude(known) for known in ranges if known is not None)
        if largest > limit:
            return "overflow"
    return None


def _bound(record, kind, ranges) -> float | None:
    """A bound of the magnitude of an overflowing op's exact result, from its inputs' ranges,
    for the ops whose result they bound; ``None`` otherwise (or when a range is unknown)."""
    if kind != "inf" or not ranges or None in ranges:
        return None
    name = facts_of(record.func).name
    largest = [largest_magnitude(known) for known in ranges]
    first, *rest = largest
    args = dict(record.args)
    scalar = args.get("other")
    scalar = abs(scalar) if isinstance(scalar, (int, float)) else None
    try:
        if name in ("_to_copy", "to", "copy", "clone", "abs", "neg"):
            return first
        if name == "square":
            return first**2
        exponent = args.get("exponent")
        if name == "pow" and not rest and isinstance(exponent, (int, float)) and exponent > 0:
            return first**exponent
        if name == "mul":
            return math.prod(largest) * (scalar if scalar is not None else 1.0)
        if name in ("add", "sub"):
            alpha = args.get("alpha", 1)
            return sum(largest) * max(1.0, abs(alpha)) + (scalar or 0.0)
        if name in ("exp", "expm1"):
            return math.exp(max(known.high for known in ranges))
        if name == "exp2":
            return 2.0 ** max(known.high for known in ranges)
        inner = _inner_size(record)
        if name in ("mm", "bmm", "matmul") and len(rest) == 1 and inner is not None:
            return inner * math.prod(largest)
        if name == "addmm" and len(rest) == 2 and inner is not None:
            return first + inner * math.prod(rest)
        if name == "sum" and not rest:
            return _summed(record) * first
        if name in _CONVOLUTIONS and len(rest) in (1, 2) and len(record.inputs) > 1:
            # Each output value adds up in_channels / groups * kernel products, and the bias.
            _, weight, *_ = record.inputs
            weight_largest, *bias = rest
            _out_channels, *window = weight[M_SHAPE] or ()
            return math.prod(window) * first * weight_largest + sum(bias) if len(window) >= 2 else None
    except (OverflowError, TypeError):
        return math.inf
    return None


_CONVOLUTIONS = frozenset(("convolution", "_convolution", "conv1d", "conv2d", "conv3d"))


def _inner_size(record) -> int | None:
    """The contracted size of a matrix product: the last dim of its first matrix."""
    inputs = record.inputs
    if len(inputs) < 2:
        return None
    *_, first_matrix, _second = inputs
    if not first_matrix[M_SHAPE]:
        return None
    *_, size = first_matrix[M_SHAPE]
    return size


def _first(items):
    return next(iter(items))


def _summed(record) -> int:
    """How many input values each output value of a sum adds up."""
    source = _first(record.inputs)
    results = record.outputs or ()
    total = math.prod(source[M_SHAPE])
    return total // max(1, math.prod(_first(results)[M_SHAPE])) if results else total
