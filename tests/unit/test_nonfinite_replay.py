"""The nan/inf replay and judgement on hand-built log entries: no mode, no kernels, only the
rules that tell an origin from spread and a mattering origin from an absorbed one."""

from __future__ import annotations

import weakref

import torch

from opwatch.checks.nonfinite import NonFiniteTracker
from opwatch.checks.nonfinite.origin import LeafRecipe, MovedRecipe
from opwatch.checks.nonfinite.replay import DELIBERATE, NAN_CONSTANT, ORIGIN, REDUCES_DELIBERATE, SPREAD, Flags, flagged_verdict
from opwatch.checks.nonfinite.rules import ValueRange
from opwatch.render.messages import explain
from opwatch.core.records import BACKWARD, FORWARD, M_IDENT, OpLog

aten = torch.ops.aten
F32 = torch.float32
CPU = torch.device("cpu")


class Program:
    """Builds log entries the way the interceptor does, with tensors standing for outputs."""

    def __init__(self):
        self.log = OpLog(100)
        self.tracker = NonFiniteTracker(self.log)
        self.keep = {}  # tensors the "program" holds alive, by name
        self.flagged, self.refs, self.checked = {}, {}, set()
        self.written_bases = {}
        self.index = 0
        self.shapes = {}  # name -> shape, where not (1,)

    def op(self, func, inputs=(), outputs=("out",), kind=None, args=(), phase=FORWARD, site=0, forward_func=-1, unchecked=False, inplace=False):
        """One op: ``inputs``/``outputs`` name tensors (``inplace``: the outputs are existing
        tensors written in place); ``kind`` is what its first output held."""
        metas_in = tuple(self._meta(name) for name in inputs)
        tensors_out = []
        for name in outputs:
            if not inplace:
                self.keep[name] = torch.zeros(1)  # a fresh tensor (a new identity)
            tensors_out.append(self.keep[name])
        metas_out = tuple(self._meta(name) for name in outputs)
        entry = (self.index, self.log.func_id(func), site, None, phase, forward_func, tuple(args), 0, 1, len(metas_in), len(metas_out), *metas_in, *metas_out)
        self.log.entries.append(entry)
        for position, tensor in enumerate(tensors_out):
            key = (self.index, position)
            if not unchecked:
                self.checked.add(key)
            if kind is not None and position == 0:
                self.flagged[key] = kind
                self.refs[key] = weakref.ref(tensor)
        self.index += 1
        return entry

    def _meta(self, name):
        return (self.shapes.get(name, (1,)), F32, CPU, id(self.keep[name]))

    def drop(self, *names):
        for name in names:
            del self.keep[name]

    def resolve(self, *, final=False, reading=()):
        origins = self.tracker._origins
        flags = Flags(self.flagged, self.refs, self.checked, written_bases=self.written_bases)
        new = origins.replay(list(self.log.entries), flags, tuple(id(self.keep[n]) for n in reading))
        return origins.judge(new, final)


def test_non_finite_from_finite_inputs_is_an_origin_and_what_it_feeds_is_spread():
    p = Program()
    p.op(aten.ones.default, outputs=("x",))
    p.op(aten.log.default, ("x",), ("y",), kind="inf")
    p.op(aten.neg.default, ("y",), ("z",), kind="inf")
    p.op(aten.sub.Tensor, ("z", "z"), ("w",), kind="nan")  # inf - inf: still its spread
    (origin,) = p.resolve(final=True)
    assert origin.record.op == "aten.log.default" and origin.kind == "inf"
    assert origin.spread == 2 and origin.became_nan.op == "aten.sub.Tensor"
    assert origin.matters  # alive at the end of the block


def test_an_origin_whose_values_died_was_absorbed():
    p = Program()
    p.op(aten.log.default, (), ("y",), kind="inf")
    p.op(aten.clamp.default, ("y",), ("z",))  # finite again
    p.drop("y")
    (origin,) = p.resolve(final=True)
    assert not origin.matters


def test_an_alive_origin_waits_until_it_reaches_a_sink_or_the_end():
    p = Program()
    p.op(aten.log.default, (), ("y",), kind="inf")
    assert p.resolve() == []  # alive, no sink yet: the program may still drop it
    (origin,) = p.tracker._origins.judge([], final=True)
    assert origin.matters


def test_a_host_read_of_its_values_makes_it_matter_at_once():
    p = Program()
    p.op(aten.log.default, (), ("y",), kind="inf")
    (origin,) = p.resolve(reading=("y",))
    assert origin.matters and origin.read_on_host


def test_writing_into_a_parameter_makes_it_matter_at_once():
    p = Program()
    p.op(aten.log.default, (), ("g",), kind="inf")
    p.keep["w"] = torch.nn.Parameter(torch.zeros(1))
    p.op(aten.add_.Tensor, ("w", "g"), ("w",), kind="inf", inplace=True)  # an optimizer update
    p.drop("g")
    (origin,) = p.resolve()
    assert origin.reached_parameter and origin.matters


def test_deliberate_constants_and_what_they_feed_are_not_origins():
    p = Program()
    p.op(aten.ones.default, outputs=("scores",))
    p.op(aten.masked_fill.Scalar, ("scores",), ("masked",), kind="inf", args=(2, float("-inf")))
    p.op(aten.add.Tensor, ("masked", "scores"), ("shifted",), kind="inf")
    assert p.resolve(final=True) == []


def test_a_finfo_min_constant_is_deliberate_too():
    p = Program()
    p.op(aten.masked_fill.Scalar, (), ("masked",), kind="inf", args=(2, torch.finfo(torch.float32).min))
    assert p.resolve(final=True) == []


def test_nan_made_from_deliberate_infs_is_an_origin():
    p = Program()
    p.op(aten.masked_fill.Scalar, (), ("masked",), kind="inf", args=(2, float("-inf")))
    p.op(aten._softmax.default, ("masked",), ("probs",), kind="nan")
    (origin,) = p.resolve(final=True)
    assert origin.record.op == "aten._softmax.default" and origin.from_deliberate
    finding = origin.finding(contained=False)
    assert (finding.rule, finding.facts["from_deliberate"], finding.facts["op_name"]) == ("nonfinite.origin", True, "_softmax")
    assert "every entry of a row was masked" in explain(finding)[2]


def test_views_carry_their_inputs_state():
    p = Program()
    p.op(aten.log.default, (), ("y",), kind="inf")
    p.op(aten.view.default, ("y",), ("v",), unchecked=True)
    p.op(aten.mul.Tensor, ("v",), ("m",), kind="inf")
    (origin,) = p.resolve(final=True)
    assert origin.record.op == "aten.log.default" and origin.spread == 2


def test_unchecked_outputs_inherit_their_inputs_state():
    p = Program()
    p.op(aten.log.default, (), ("y",), kind="inf")
    p.op(aten._to_sparse.default, ("y",), ("s",), unchecked=True)
    p.op(aten.to_dense.default, ("s",), ("d",), kind="inf")
    origins = p.resolve(final=True)
    assert [origin.record.op for origin in origins] == ["aten.log.default"]


def test_a_write_through_a_view_gives_its_base_the_state():
    p = Program()
    p.op(aten.randn.default, outputs=("h",))
    p.op(aten.select.int, ("h",), ("column",), unchecked=True)
    entry = p.op(aten.div_.Tensor, ("column",), ("column",), kind="inf", inplace=True)
    p.written_bases[entry[0] << 32 | 0] = (id(p.keep["h"]), weakref.ref(p.keep["h"]))
    p.drop("column")
    p.op(aten.sum.default, ("h",), ("total",), kind="inf")
    (origin,) = p.resolve(final=True)
    assert origin.record.op == "aten.div_.Tensor" and origin.spread == 1


def test_grad_scaler_skips_are_contained_and_forward_origins_are_not_its_business():
    p = Program()
    p.op(aten.mm.default, (), ("grad",), kind="inf", phase=BACKWARD, forward_func=0)
    p.op(aten.log.default, (), ("activation",), kind="inf")
    p.op(aten._amp_foreach_non_finite_check_and_unscale_.default, ("grad", "activation"), ("grad",), kind="inf", inplace=True)
    origins = {origin.record.op: origin for origin in p.resolve(final=True)}
    assert origins["aten.mm.default"].skipped_by_grad_scaler and not origins["aten.mm.default"].matters
    finding = origins["aten.mm.default"].finding(contained=True)
    assert finding.facts["skipped_by_grad_scaler"] and finding.facts["contained"]
    assert "GradScaler" in explain(finding)[0]
    assert not origins["aten.log.default"].skipped_by_grad_scaler and origins["aten.log.default"].matters


def test_a_forward_op_recomputed_in_backward_is_the_same_origin():
    p = Program()
    site = p.log.site_id(test_a_forward_op_recomputed_in_backward_is_the_same_origin.__code__, 0)
    p.op(aten.log.default, (), ("y",), kind="inf", site=site)
    # The checkpoint's recomputation: user code run during backward (no forward_func).
    p.op(aten.log.default, (), ("y2",), kind="inf", site=site, phase=BACKWARD)
    origins = p.resolve(final=True)
    assert len(origins) == 1 and origins[0].record.phase == "forward"


# -- the inputs' ranges at an origin -----------------------------------------------------------


def _ranges_flags(p, ranges):
    """Flags whose ranges were read (something was not finite): ``ranges`` by op index."""
    return Flags(p.flagged, p.refs, p.checked, ranges={(index, 0): value for index, value in ranges.items()})


def test_a_range_is_carried_through_ops_that_only_move_values():
    """A view keeps its source's range exactly; cat, index and repeat give a bound (within);
    neg maps it; an input whose range is unknown leaves a recipe naming the tensor it came from."""

    p = Program()
    p.op(aten.sigmoid.default, (), ("a",))  # op 0: range (0, 0.5)
    p.op(aten.exp.default, (), ("b",))  # op 1: range (1, 2)
    p.op(aten.view.default, ("a",), ("v",), unchecked=True)  # 2
    p.op(aten.cat.default, ("v", "b"), ("c",), unchecked=True)  # 3
    p.keep["param"] = torch.zeros(1)  # made before the watch: range unknown to the replay
    p.op(aten.repeat.default, ("param",), ("r",), unchecked=True)  # 4
    p.op(aten.log.default, ("v",), ("l1",), kind="inf")  # 5
    p.op(aten.log.default, ("c",), ("l2",), kind="inf")  # 6
    p.op(aten.log.default, ("r",), ("l3",), kind="inf")  # 7
    p.op(aten.neg.default, ("a",), ("n",), unchecked=True)  # 8
    p.op(aten.log.default, ("n",), ("l4",), kind="nan")  # 9
    flags = _ranges_flags(p, {0: (0.0, 0.5), 1: (1.0, 2.0)})
    origins = p.tracker._origins.replay(list(p.log.entries), flags)
    by_op = {origin.record.index: origin.input_ranges[0][1] for origin in origins}
    assert by_op[5] == ValueRange(0.0, 0.5, within=False)  # a view: exact
    assert by_op[6] == ValueRange(0.0, 2.0, within=True)  # cat: within the hull
    moved = by_op[7]  # worked out at report time from the live parameter
    assert type(moved) is MovedRecipe and moved.read_at == 4
    (leaf,) = moved.parts
    assert type(leaf) is LeafRecipe and leaf.meta[M_IDENT] == id(p.keep["param"])
    assert by_op[9] == ValueRange(-0.5, -0.0, within=False)  # neg: mapped, exact


def test_a_range_known_at_one_check_point_is_known_at_the_next_while_every_window_is_replayed():
    p = Program()
    p.op(aten.sigmoid.default, (), ("a",))  # op 0
    p.op(aten.log.default, ("a",), ("l",), kind="inf")  # op 1: something not finite: ranges read
    origins = p.tracker._origins
    origins.replay(list(p.log.entries), _ranges_flags(p, {0: (0.0, 0.9)}))

    def next_window(first_index):
        p.log.entries.clear()
        p.flagged.clear()
        p.op(aten.exp.default, (), ("c",))
        p.op(aten.div.Tensor, ("c", "a"), ("d",), kind="inf")  # reads `a`, made a window ago
        (origin,) = origins.replay(list(p.log.entries), _ranges_flags(p, {first_index: (1.0, 2.0)}))
        return [value for _, value in origin.input_ranges]

    assert next_window(2) == [ValueRange(1.0, 2.0), ValueRange(0.0, 0.9)]
    origins.forget_ranges()  # a window not replayed: what it wrote is not known
    c_range, a_range = next_window(4)
    assert c_range == ValueRange(1.0, 2.0) and type(a_range) is LeafRecipe


def test_a_view_to_another_dtype_carries_no_range():
    p = Program()
    p.op(aten.sigmoid.default, (), ("a",))
    p.keep["bits"] = torch.zeros(1)
    entry = p.op(aten.view.dtype, ("a",), ("bits",), unchecked=True, inplace=True)
    # the view's output is an int32 reinterpretation: give it that dtype in the entry
    meta_out = ((1,), torch.int32, CPU, id(p.keep["bits"]))
    p.log.entries[-1] = (*entry[:-1], meta_out)
    origins = p.tracker._origins
    origins.replay(list(p.log.entries), _ranges_flags(p, {0: (0.0, 0.5)}))
    assert id(p.keep["bits"]) not in origins.ranges and id(p.keep["a"]) in origins.ranges


# -- a window whose only non-finite values are a mask's constants, absorbed ----------------------


def _only_constants(p) -> bool:
    flags = Flags(p.flagged, p.refs, p.checked, written_bases=p.written_bases)
    return p.tracker._origins.only_absorbed_constants(list(p.log.entries), flags)


def _masked_attention(p):
    """An attention mask's -inf in forward, the way Hugging Face's SDPA path builds it: a
    constant, a where, an add into the scores, a softmax that absorbs it; a view on the way."""
    p.op(aten.scalar_tensor.default, (), ("neg_inf",), kind="inf", args=(0, float("-inf")))
    p.op(aten.where.self, ("neg_inf",), ("mask",), kind="inf")
    p.op(aten.unsqueeze.default, ("mask",), ("mask4d",), unchecked=True)
    p.op(aten.mm.default, (), ("scores",))
    p.op(aten.add.Tensor, ("scores", "mask4d"), ("masked",), kind="inf")
    p.op(aten._softmax.default, ("masked",), ("probs",))


def test_a_mask_absorbed_by_its_softmax_needs_no_replay():
    p = Program()
    _masked_attention(p)
    p.op(aten.mean.default, ("probs",), ("loss",))
    p.drop("neg_inf", "mask", "mask4d", "masked")  # the forward is over: the mask is gone
    assert _only_constants(p)
    assert p.resolve(final=True) == []  # what the replay finds in the same window: nothing


def test_a_mask_still_alive_at_the_check_point_is_replayed():
    p = Program()
    _masked_attention(p)
    p.drop("neg_inf", "masked")  # the module keeps its mask: carried to the next window
    assert not _only_constants(p)


def test_an_overflow_beside_a_mask_is_replayed_and_is_an_origin():
    p = Program()
    _masked_attention(p)
    p.op(aten.exp.default, ("probs",), ("big",), kind="inf")  # inf from finite inputs
    p.drop("neg_inf", "mask", "mask4d", "masked")
    assert not _only_constants(p)
    (origin,) = p.resolve(final=True)
    assert origin.record.index == 6


def test_a_reduction_of_the_mask_and_a_nan_made_of_it_are_replayed():
    p = Program()
    p.shapes["masked"] = (4, 4)
    _masked_attention(p)
    p.op(aten.sum.default, ("masked",), ("total",), kind="inf")  # -inf summed into one value
    p.drop("neg_inf", "mask", "mask4d", "masked", "total")
    assert not _only_constants(p)
    q = Program()
    _masked_attention(q)
    q.op(aten.mul.Tensor, ("masked",), ("zeroed",), kind="nan")  # -inf * 0
    q.drop("neg_inf", "mask", "mask4d", "masked", "zeroed")
    assert not _only_constants(q)


def test_a_mask_constant_in_backward_or_a_window_with_something_carried_is_replayed():
    p = Program()
    p.op(aten.scalar_tensor.default, (), ("neg_inf",), kind="inf", args=(0, float("-inf")), phase=BACKWARD)
    p.drop("neg_inf")
    assert not _only_constants(p)
    q = Program()
    _masked_attention(q)  # the mask alive: replayed, and carried on
    q.resolve()
    q.log.entries.clear()
    q.flagged.clear()
    q.drop("neg_inf", "mask", "mask4d", "masked")
    q.op(aten.relu.default, (), ("h",))
    assert q.tracker._origins.carry and not _only_constants(q)


# -- the one set of rules for a non-finite output (flagged_verdict) ------------------------------


def test_the_verdict_on_a_non_finite_output_follows_what_fed_it():
    p = Program()
    p.shapes.update(masked=(4, 4), shifted=(4, 4), zeroed=(4, 4))
    fill = p.op(aten.masked_fill.Scalar, (), ("masked",), kind="inf", args=(2, float("-inf")))
    total = p.op(aten.sum.default, ("masked",), ("total",), kind="inf")
    shifted = p.op(aten.add.Tensor, ("masked",), ("shifted",), kind="inf")
    zeroed = p.op(aten.mul.Tensor, ("masked",), ("zeroed",), kind="nan")
    masked = {id(p.keep["masked"])}

    def verdict(entry, kind, *, spread=False, fed_kinds=(), deliberate=False, sentinels=frozenset()):
        *_, output = entry  # its one output's metadata
        return flagged_verdict(kind, entry, output, spread=spread, fed_kinds=fed_kinds, deliberate=deliberate, fed_holders=masked, sentinel_holders=sentinels)

    # fed by an origin's values: spread, whatever it made
    assert verdict(zeroed, "nan", spread=True, fed_kinds=("inf",)) is SPREAD
    # fed by deliberate infs: carried on, unless a forward reduction took them in, or a nan was made of them
    assert verdict(shifted, "inf", fed_kinds=("inf",)) is DELIBERATE
    assert verdict(total, "inf", fed_kinds=("inf",)) is REDUCES_DELIBERATE
    assert verdict(zeroed, "nan", fed_kinds=("inf",)) is ORIGIN
    assert verdict(zeroed, "nan", fed_kinds=("nan",)) is DELIBERATE  # a written nan, carried
    # nothing followed fed it: a constant written on purpose, or an origin
    assert verdict(fill, "inf", deliberate=True) is DELIBERATE
    assert verdict(fill, "nan", deliberate=True) is NAN_CONSTANT
    assert verdict(total, "inf", deliberate=True, sentinels=masked) is REDUCES_DELIBERATE  # overflowed a finfo.min
    assert verdict(shifted, "inf") is ORIGIN
    backward = p.op(aten.sum.default, ("masked",), ("g",), kind="inf", phase=BACKWARD)
    assert verdict(backward, "inf", fed_kinds=("inf",)) is DELIBERATE  # gradients are not followed to a loss
    assert verdict(backward, "nan", deliberate=True) is DELIBERATE
