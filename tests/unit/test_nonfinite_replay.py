"""The nan/inf replay and judgement on hand-built log entries: no mode, no kernels, only the
rules that tell an origin from spread and a mattering origin from an absorbed one."""

from __future__ import annotations

import weakref

import torch

from opwatch.checks.nonfinite import NonFiniteTracker
from opwatch.checks.nonfinite.replay import Flags
from opwatch.render.messages import explain
from opwatch.records import BACKWARD, FORWARD, OpLog

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
        return ((1,), F32, CPU, id(self.keep[name]))

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
