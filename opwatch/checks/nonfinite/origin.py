"""What the replay found, as facts: a nan/inf :class:`Origin` (how far its values spread,
whether they reached a sink) and an :class:`OverflowRisk`. Their findings hold no prose:
:mod:`opwatch.render.nonfinite` makes every sentence from the facts.

Rules and their facts:

- ``nonfinite.origin``: an op made nan/inf from finite inputs (or nan from deliberate infs, or
  took deliberate infs into a loss: a sum over masked log-probabilities);
- ``nonfinite.received``: a collective's output held nan/inf while this rank's inputs to it
  were finite: another rank sent it;
- ``nonfinite.overflow_risk``: a float16 forward output within ``HEADROOM_FACTOR`` of its limit.

Facts of the first two: ``op``, ``inputs``, ``outputs`` (the record's signature: op name and
tensor metadata), ``op_name`` (short, ``div``), ``forward_op_name`` (for a backward op autograd
ran, the forward op's short name, else ``None``), ``spread`` (later ops that carried it),
``last`` / ``became_nan`` / ``masked_by`` / ``back_in_backward`` (:class:`Place` or ``None``),
``masked_by_name``, ``reached_parameter``, ``reached_gradient``, ``reached_backward`` (``backward()``
ran on a tensor holding them: the loss), ``contained``,
``skipped_by_grad_scaler``, ``grad_scaler_scale`` (the scale, below 1, at which GradScaler's
check found it: not finite unscaled either, so not skipped in passing; else ``None``),
``from_deliberate``, ``input_ranges`` (``(meta, ValueRange or
None)`` per floating input), ``input_made`` (per floating input whose range is unknown, where it
was made: the :class:`Place` of the op that made it in the watch, ``"before_watch"``, or
``"left_log"`` when that op has left the bounded log; ``None`` for a known range),
``input_alive`` (per floating input, whether one of those was still alive at the check point,
its values unreadable then: nan/inf, or a kind of tensor not measured; ``"written"`` when it, or
a tensor sharing its storage, was written in place after the op read it), ``cause`` (a
:class:`~.cause.Cause` or ``None``: precision, undefined math, an input or a parameter that
already held it), ``absorbed`` (a forward overflow reported although its values died before a
sink: what they fed is finite and wrong); and, for a forward reduction of deliberate infs that
reached a loss (``from_deliberate`` and a ``deliberate`` cause), ``loss`` (the :class:`Place` of
the first op whose one-value output held them) and ``loss_kind`` (what it held). Of the third:
``op``, ``inputs``, ``outputs``, ``largest``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ...core.fact_tuples import RuleFacts, rule_facts
from ...core.notation import as_meta
from ...core.ops import facts_of
from ...core.records import BACKWARD, E_INDEX, E_PHASE, M_DTYPE, M_SHAPE
from ..finding import Finding, Place
from .rules import HEADROOM_LIMIT, RISK_KIND, SENTINELS, read_ranges, written_inputs

__all__ = ["Origin", "OriginFacts", "read_facts", "OverflowRisk", "RiskFacts", "Verdict", "verdict", "headroom_risks", "LeafRecipe", "MovedRecipe"]


@rule_facts("nonfinite.origin", "nonfinite.received")
class OriginFacts(RuleFacts):
    """The facts of an origin (each described in the module's docstring); those after
    ``outputs`` have defaults, for logs written before a fact was added."""

    op: str
    inputs: tuple
    outputs: tuple
    op_name: str | None = None
    forward_op_name: str | None = None
    spread: int = 0
    last: Place | None = None
    became_nan: Place | None = None
    masked_by: Place | None = None
    masked_by_name: str | None = None
    back_in_backward: Place | None = None
    reached_parameter: bool = False
    reached_gradient: bool = False
    reached_backward: bool = False
    contained: bool = False
    skipped_by_grad_scaler: bool = False
    grad_scaler_scale: float | None = None
    from_deliberate: bool = False
    input_ranges: tuple = ()
    input_made: tuple = ()
    input_alive: tuple = ()
    cause: object = None  # a cause.Cause, or None
    absorbed: bool = False
    absorbed_by: Place | None = None
    picked_by: Place | None = None
    loss: Place | None = None
    loss_kind: str | None = None
    # What the inputs show, worked out with the other facts (for an older log, when it is read):
    written: tuple = ()  # the idents of the inputs the op wrote its result into (``x.sqrt_()``)
    largest_read: float | None = None  # the largest magnitude of the known ranges the op reads


def read_facts(op_name, inputs, outputs, input_ranges) -> dict:
    """The facts ``written`` and ``largest_read`` of an origin of op ``op_name`` (short) from
    its signature and its inputs' ranges (``(meta, ValueRange or None)`` each)."""
    ranges = [value_range for value_range in read_ranges(op_name, [value_range for _, value_range in input_ranges]) if value_range is not None]
    largest = max((max(abs(known.low), abs(known.high)) for known in ranges), default=None)
    return {"written": tuple(sorted(written_inputs(inputs, outputs or ()))), "largest_read": largest}


@rule_facts("nonfinite.overflow_risk")
class RiskFacts(RuleFacts):
    op: str
    inputs: tuple
    outputs: tuple
    largest: float  # the largest magnitude its outputs held


# How to work out at report time a range the replay did not know (see ``replay._carry_range``;
# worked out by :func:`.cause.decide_causes`):
class LeafRecipe(NamedTuple):
    """The range of the tensor ``meta`` as it was when op ``read_at`` read it."""

    meta: tuple
    read_at: int


class MovedRecipe(NamedTuple):
    """The range of the output of op ``read_at`` (its op ``facts``), which only moved the values
    of its floating inputs: ``parts``, each a :class:`ValueRange` or a recipe."""

    facts: object
    read_at: int
    parts: tuple


_RECIPES = (LeafRecipe, MovedRecipe)


def _place(record):
    return None if record is None else Place.of(record)


def _signature(record) -> dict:
    """The record's signature parts, as facts."""
    return {"op": record.op, "inputs": tuple(map(as_meta, record.inputs)), "outputs": tuple(map(as_meta, record.outputs or ()))}


class Verdict(NamedTuple):
    """A judged origin (or risk) as the reporter takes it."""

    finding: Finding
    record: object  # the OpRecord of the op that made the value
    contained: bool  # its values reached no sink: kept apart, not an anomaly


def verdict(judged) -> Verdict:
    """The verdict on an :class:`Origin` or :class:`OverflowRisk` judged at a check point
    (``matters`` set): an origin that did not matter is contained."""
    contained = not judged.matters
    return Verdict(judged.finding(contained=contained), judged.record, contained)


class Origin:
    """A nan/inf origin found at a check point, with how far its values spread and whether they
    reached a sink: a host read, a parameter. Judged once it is known whether it mattered."""

    __slots__ = ("record", "kind", "from_deliberate", "reduces_deliberate", "loss", "loss_kind", "held", "input_ranges", "input_made", "input_alive", "masked_by", "back_in_backward", "spread", "last", "became_nan", "read_on_host", "reached_backward", "reached_gradient", "reached_parameter", "skipped_by_grad_scaler", "grad_scaler_scale", "matters", "cause", "absorbed", "absorbed_by", "picked_by", "entered", "entered_inf", "reads_made_before")

    def __init__(self, record, kind, from_deliberate=False, reduces_deliberate=False):
        self.record = record  # the OpRecord of the op that made the value
        self.kind = kind
        # Made nan from inputs holding only deliberate infs (masking constants).
        self.from_deliberate = from_deliberate
        # A forward reduction that took deliberate infs into its result (a sum over masked
        # log-probabilities: cross_entropy's label smoothing), or a nan the program wrote
        # itself (a placeholder): followed, not an origin unless its values reach a loss
        # (``loss``: the first op whose one-value output held them, ``loss_kind`` what it
        # held) that the program reads or keeps (see ``Origins.judge``).
        self.reduces_deliberate = reduces_deliberate
        self.loss = None
        self.loss_kind = None
        self.held = kind  # what the last op that carried its values held
        # (tensor meta, (min, max) or None when unknown) of each floating input
        self.input_ranges: list = []
        # where each input whose range stays unknown was made (see the module's docstring)
        self.input_made: tuple = ()
        self.input_alive: tuple = ()  # of those, the ones still alive at the check point
        self.masked_by = None  # a forward where/masked_fill that dropped its values
        self.back_in_backward = None  # then the first backward op its values reached
        self.spread = 0  # later ops that carried its values on
        self.last = record  # the last of them
        self.became_nan = None  # for an inf origin: the first op that turned its inf into nan
        self.read_on_host = False  # the program read one of its values (``.item()``, ``bool(t)``)
        self.reached_backward = False  # ``backward()`` ran on a tensor holding its values (the loss)
        self.reached_gradient = False  # autograd accumulated its values into a ``.grad``
        self.reached_parameter = False  # an op wrote its values into an ``nn.Parameter``
        # Born in backward and found by GradScaler's overflow check, which skips the step.
        self.skipped_by_grad_scaler = False
        # Found by that check with its scale below 1 (that scale): not finite unscaled either, not skipped in passing.
        self.grad_scaler_scale = None
        self.matters = True
        self.cause = None  # why its values are not finite (a cause.Cause), decided at report time
        self.absorbed = False  # a forward overflow whose values died before a sink: reported all the same
        # The first op that read its values and made finite ones of them (rsqrt(inf) = 0): an
        # overflow no op read changed nothing, and is not reported as absorbed.
        self.absorbed_by = None
        # The first forward op that picked indices by comparing its nan values (argmax over nan
        # logits): what it chose is wrong though no nan is left to see, so it matters.
        self.picked_by = None
        # The input (its meta) made before the watch that already held nan when this op first
        # read it: the values entered the watch here (see tracker.FIRST_SEEN); else None.
        self.entered = None
        # A nan made of deliberate infs (from_deliberate) where an input made before the watch
        # held inf when first read (a mask made before it, or data): its meta; else None.
        self.entered_inf = None
        # An input whose range stays unknown holds what a tensor made before the watch held
        # (decided with its cause, by the log alone: cause._reads_made_before).
        self.reads_made_before = False

    def carried_by(self, record, kind=None) -> None:
        self.spread += 1
        self.last = record
        if kind is not None:
            self.held = kind
        if kind == "nan" and self.kind == "inf" and self.became_nan is None:
            self.became_nan = record
        if self.reduces_deliberate and self.loss is None and (self.kind != "nan" or _of_many(record)):
            # (a nan written on purpose becomes the loss through an op that computes one value
            # of many, not through a copy or a select of one placeholder)
            self.note_loss(record)
        if self.masked_by is not None and self.back_in_backward is None and record.phase == BACKWARD and not facts_of(record.func).preserves_values:
            self.back_in_backward = record

    def note_loss(self, record) -> None:
        """For a reduction of deliberate infs: ``record`` made a forward value of one element
        holding them, the loss (a reduced loss is a one-value tensor)."""
        if record.phase != BACKWARD and any(_one_value(meta) for meta in record.outputs or ()):
            self.loss = record
            self.loss_kind = self.held

    def finding(self, *, contained: bool) -> Finding:
        record = self.record
        forward = record.forward_func
        loss = _place(self.loss) if self.reduces_deliberate else None
        signature = _signature(record)
        op_name = facts_of(record.func).name
        input_ranges = tuple((as_meta(meta), None if _is_recipe(value_range) else value_range) for meta, value_range in self.input_ranges)
        facts = OriginFacts(
            **signature,
            op_name=op_name,
            forward_op_name=facts_of(forward).name if forward is not None else None,
            spread=self.spread,
            last=_place(self.last) if self.spread else None,
            became_nan=_place(self.became_nan),
            masked_by=_place(self.masked_by),
            masked_by_name=facts_of(self.masked_by.func).name if self.masked_by is not None else None,
            back_in_backward=_place(self.back_in_backward),
            reached_parameter=self.reached_parameter,
            reached_gradient=self.reached_gradient,
            reached_backward=self.reached_backward,
            contained=contained,
            skipped_by_grad_scaler=self.skipped_by_grad_scaler,
            grad_scaler_scale=self.grad_scaler_scale,
            from_deliberate=self.from_deliberate,
            input_ranges=input_ranges,
            input_made=self.input_made,
            input_alive=self.input_alive,
            cause=self.cause,
            absorbed=self.absorbed,
            absorbed_by=_place(self.absorbed_by) if self.absorbed else None,
            picked_by=_place(self.picked_by),
            loss=loss,
            loss_kind=self.loss_kind if self.reduces_deliberate else None,
            **read_facts(op_name, signature["inputs"], signature["outputs"], input_ranges),
        )
        # A collective's outputs hold what other ranks sent: this rank's own inputs were finite.
        rule = "nonfinite.received" if facts_of(record.func).is_collective else "nonfinite.origin"
        return Finding(self.kind, rule, facts)


class OverflowRisk:
    """A float16 forward output within ``HEADROOM_FACTOR`` of the float16 limit: reported as
    kind ``overflow_risk`` before it overflows. Judged like an origin that matters."""

    __slots__ = ("record", "largest", "matters")

    def __init__(self, record, largest):
        self.record = record
        self.largest = largest
        self.matters = True

    def finding(self, *, contained: bool) -> Finding:
        facts = RiskFacts(**_signature(self.record), largest=self.largest)
        return Finding(RISK_KIND, "nonfinite.overflow_risk", facts)


def headroom_risks(window, half, ranges, log) -> list[OverflowRisk]:
    """Float16 outputs of forward ops near the float16 limit (finite: an inf is an origin).
    ``half``: the packed keys (op index << 32 | position) of queued float16 outputs."""
    risks = []
    by_index = None
    for (index, position), (low, high) in ranges.items():
        if index << 32 | position not in half:
            continue
        # A finfo.min/max mask value is deliberate; the other end tells the headroom.
        ends = [abs(value) for value in (low, high) if value not in SENTINELS]
        largest = max(ends) if ends else 0.0
        if not (HEADROOM_LIMIT <= largest < math.inf):
            continue
        if by_index is None:
            by_index = {entry[E_INDEX]: entry for entry in window}
        entry = by_index.get(index)
        if entry is None or entry[E_PHASE] == BACKWARD:
            continue  # GradScaler's scaled gradients live near the limit on purpose
        risks.append(OverflowRisk(log.view(entry), largest))
    return risks


def _of_many(record) -> bool:
    """An op that computes from a tensor of more than one value (a reduction, when its result
    is one value): not a view, a copy or an op that only moves values (a select of one)."""
    facts = facts_of(record.func)
    if facts.is_view or facts.preserves_values or facts.mutated_args:
        return False
    return any(meta[M_SHAPE] is not None and math.prod(meta[M_SHAPE]) > 1 for meta in record.inputs or ())


def _one_value(meta) -> bool:
    shape = meta[M_SHAPE]
    return shape is not None and math.prod(shape) == 1 and meta[M_DTYPE].is_floating_point


def _is_recipe(value) -> bool:
    return isinstance(value, _RECIPES)


