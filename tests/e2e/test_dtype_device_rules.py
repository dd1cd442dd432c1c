"""dtype and device rules where torch promotes silently or raises late (or cryptically), in real
training loops; and module calls judged before torch's own Python checks raise.

Each rule has loops that must be flagged and healthy twins that must not. The facts each rule
rests on were checked on torch 2.13 (CPU): what raises, what promotes, what the error says.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn

import opwatch
from support import SCENARIOS
from support.helpers import StubContext, watch_story
from support.helpers import line_of as _line_of
from opwatch.checks import device, dtype
from opwatch.core.notation import TensorMeta, format_dtype
from opwatch.render.messages import explain
from opwatch.core.sites import position_of

import training_rules as rules  # noqa: E402

SCENARIO = str(SCENARIOS / "training_rules.py")
aten = torch.ops.aten
CPU, META = torch.device("cpu"), torch.device("meta")
F32, F64, BF16, I64, I32, I16, U8, B8 = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32,
                                         torch.int16, torch.uint8, torch.bool)


def line_of(text: str) -> int:
    return _line_of(text, SCENARIO)


def found(w):
    return [(a.kind, a.op, a.lineno, a.phase) for a in w.anomalies]


def watched(story, *args, expect_error=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own (uint8 indexing, index_reduce beta)
        return watch_story(story, *args, expect_error=expect_error)


def strictly(story, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error", opwatch.OpwatchWarning)
        with opwatch.strict() as w:
            story(*args)
    assert w.anomalies == []
    return w


def t(*shape, dtype=F32, device=CPU):
    return TensorMeta(tuple(shape), dtype, device, 0)


def run(check, func, *tensors):
    bound = check.for_op(func)
    assert bound is not None, func
    return bound(tensors, StubContext())


# == elementwise losses: the target in another floating dtype ===================================


@pytest.mark.parametrize(
    "op, consequence",
    [
        (aten.mse_loss.default, "promotes silently: the loss and its backward run in f64"),
        (aten.smooth_l1_loss.default, "promotes silently"),
        (aten.huber_loss.default, "the backward raises 'Found dtype Double but expected Float'"),
        (aten.binary_cross_entropy_with_logits.default, "takes the target's dtype"),
        (aten.binary_cross_entropy.default, "raises 'Found dtype Double but expected Float'"),
        (aten.soft_margin_loss.default, "converts the target to f32"),
    ],
)
def test_unit_loss_target_of_another_floating_dtype(op, consequence):
    finding = run(dtype, op, t(8), t(8, dtype=F64))
    assert finding.kind == "dtype_mismatch" and finding.rule == "dtype.loss_target"
    assert (finding.facts["got"], finding.facts["wanted"], finding.facts["promoted"]) == (F64, torch.float32, F64)
    problem = explain(finding)[0]
    assert "gets a f64 target for a f32 input" in problem and consequence in problem
    assert run(dtype, op, t(8), t(8)) is None


def test_unit_loss_targets_torch_takes():
    assert run(dtype, aten.mse_loss.default, t(8), t(8, dtype=I64)) is None  # counts: exact
    assert run(dtype, aten.mse_loss.default, t(8), t(8, dtype=B8)) is None
    finding = run(dtype, aten.binary_cross_entropy_with_logits.default, t(4, 3), t(4, 3, dtype=I64))
    assert finding.rule == "dtype.loss_floating_target" and finding.facts["got"] == I64
    assert "needs a floating target, got i64" in explain(finding)[0]
    assert run(dtype, aten.binary_cross_entropy.default, t(4, 3), t(4, 3, dtype=B8)) is not None


# Stories torch 2.13 takes and torch 2.6 refuses itself (mse_loss's backward wants the target in
# the input's dtype; gather wants int64 indices): what these tests pin is torch 2.13's behaviour.
REFUSED_BEFORE_2_13 = {"regress_numpy_targets", "regress_ratings_as_integers_with_mse", "regress_integer_targets", "gather_log_probs"}


def torch_takes(story):
    if torch.__version__ < "2.13" and story.__name__ in REFUSED_BEFORE_2_13:
        pytest.skip(f"torch {torch.__version__} refuses {story.__name__} itself; the rule follows torch 2.13, which takes it")


def test_regression_on_a_float64_numpy_target_is_flagged_at_the_loss_once_per_step():
    torch_takes(rules.regress_numpy_targets)
    w = watched(rules.regress_numpy_targets)
    loss_line = line_of("loss = loss_fn(pred, target)")
    assert found(w) == [("dtype_mismatch", "aten.mse_loss.default", loss_line, "forward")] * 3
    assert "mse_loss gets a f64 target for a f32 input" in w.anomalies[0].message


def test_huber_loss_with_a_float64_target_is_flagged_before_its_backward_raises():
    w = watched(rules.regress_huber_numpy_targets, expect_error=RuntimeError)
    assert found(w)[0] == ("dtype_mismatch", "aten.huber_loss.default", line_of("loss = loss_fn(pred, target)"), "forward")


def test_huber_loss_with_integer_ratings_is_flagged_at_the_loss_line_before_its_backward_raises():
    w = watched(rules.regress_ratings_as_integers, expect_error=RuntimeError)  # the backward's own error
    assert found(w) == [("dtype_mismatch", "aten.huber_loss.default", line_of("# RATING LOSS"), "forward")]
    (anomaly,) = w.anomalies
    assert anomaly.finding.rule == "dtype.loss_target" and anomaly.finding.facts["got"] == I64
    assert "huber_loss gets an integer target (i64) for a f32 input" in anomaly.message
    assert "the backward raises 'Found dtype Long but expected Float'" in anomaly.message
    with pytest.raises(opwatch.AnomalyError):  # strict stops it at the loss, before the backward
        with opwatch.strict(warn=False, dump_on_error=False):
            rules.regress_ratings_as_integers()


@pytest.mark.parametrize("story", [rules.regress_ratings_as_floats, rules.regress_ratings_as_integers_with_mse, rules.rate_classes_as_integers],
                         ids=lambda story: story.__name__)
def test_integer_targets_a_loss_takes_are_not_flagged(story):
    torch_takes(story)
    strictly(story)


def test_multilabel_with_integer_targets_is_flagged_before_the_cast_error():
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict(warn=False, dump_on_error=False):
            rules.multilabel_int64_targets()
    anomaly = raised.value.anomaly
    assert (anomaly.op, anomaly.lineno) == ("aten.binary_cross_entropy_with_logits.default", line_of("loss = F.binary_cross_entropy_with_logits"))
    assert "needs a floating target, got i64" in anomaly.message


@pytest.mark.parametrize("story", [rules.regress_float32_targets, rules.regress_integer_targets, rules.multilabel_float_targets],
                         ids=lambda story: story.__name__)
def test_loss_targets_torch_handles_are_not_flagged(story):
    torch_takes(story)
    strictly(story)


# == class-index targets ==========================================================================


@pytest.mark.parametrize("target", [I32, I16, F32, F64], ids=str)
def test_unit_class_index_target_must_be_int64(target):
    finding = run(dtype, aten.nll_loss_forward.default, t(6, 4), t(6, dtype=target))
    assert finding.rule == "dtype.class_target" and finding.facts["got"] == target
    assert finding.facts["floating"] == target.is_floating_point
    problem = explain(finding)[0]
    assert f"class-index target of nll_loss/cross_entropy is {format_dtype(target)}" in problem
    assert "expected target dtype to be Long or Byte" in problem
    assert run(dtype, aten.nll_loss2d_forward.default, t(2, 4, 8, 8), t(2, 8, 8, dtype=target)) is not None


def test_unit_class_index_targets_torch_takes():
    assert run(dtype, aten.nll_loss_forward.default, t(6, 4), t(6, dtype=I64)) is None
    assert run(dtype, aten.nll_loss_forward.default, t(6, 4), t(6, dtype=U8)) is None


def test_int32_labels_from_numpy_are_flagged_before_the_kernel_raises():
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict(warn=False, dump_on_error=False):
            rules.classify_int32_from_numpy()
    anomaly = raised.value.anomaly
    assert (anomaly.op, anomaly.lineno, anomaly.phase) == (
        "aten.nll_loss_forward.default", line_of("loss = F.cross_entropy(logits, labels, label_smoothing"), "forward")
    assert "is i32" in anomaly.message and "target.long()" in anomaly.message


def test_float_labels_are_flagged_with_the_soft_label_alternative():
    w = watched(rules.classify_float_labels, expect_error=RuntimeError)
    assert found(w) == [("dtype_mismatch", "aten.nll_loss_forward.default", line_of("loss = F.cross_entropy(logits, labels, label_smoothing"), "forward")]
    assert "class probabilities" in w.anomalies[0].message and "[6, 4]" in w.anomalies[0].message


def test_int32_segmentation_masks_are_flagged():
    w = watched(rules.segment_int32, expect_error=RuntimeError)
    assert found(w) == [("dtype_mismatch", "aten.nll_loss2d_forward.default", line_of("loss = F.cross_entropy(model(images), labels)  # per-pixel"), "forward")]


@pytest.mark.parametrize("story", [rules.classify_int64, rules.classify_uint8, rules.classify_soft_labels, rules.segment_int64],
                         ids=lambda story: story.__name__)
def test_class_targets_torch_takes_are_not_flagged(story):
    strictly(story)


# == cat / stack ===================================================================================


def test_unit_cat_and_stack_of_mixed_floating_dtypes():
    finding = run(dtype, aten.cat.default, t(4, 6), t(4, 2, dtype=F64))
    assert finding.rule == "dtype.silent_upcast" and finding.odd == (t(4, 2, dtype=F64),)
    assert "silent promotion f32 with f64 -> f64" in explain(finding)[0]
    assert run(dtype, aten.stack.default, t(4), t(4, dtype=BF16)) is not None
    assert run(dtype, aten.cat.default, t(4, 6), t(4, 2, dtype=I64)) is None
    assert run(dtype, aten.cat.default, t(4, 6), t(4, 2)) is None


def test_numpy_side_features_concatenated_into_a_float32_model_are_flagged_at_the_cat():
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict(warn=False, dump_on_error=False):
            rules.side_features_numpy()
    anomaly = raised.value.anomaly
    assert (anomaly.op, anomaly.lineno) == ("aten.cat.default", line_of("h = torch.cat([torch.relu(self.encode(x)), side], dim=-1)"))
    assert anomaly.module == "SideFeatures"


def test_float32_side_features_are_not_flagged():
    strictly(rules.side_features_float32)


# == index dtypes ==================================================================================


@pytest.mark.parametrize("index", [F32, I16, torch.int8], ids=str)
def test_unit_tensors_used_as_indices_must_be_integer_or_bool(index):
    finding = run(dtype, aten.index.Tensor, t(4, 3), t(2, dtype=index))
    assert finding.rule == "dtype.index_dtype" and finding.facts["position"] == 1
    assert finding.facts["index"] == t(2, dtype=index)
    assert "is neither integer nor bool" in explain(finding)[0]
    assert run(dtype, aten.index_put_.default, t(4, 3), t(2, dtype=index), t()) is not None


@pytest.mark.parametrize("index", [I64, I32, U8, B8], ids=str)
def test_unit_indices_torch_takes(index):
    assert run(dtype, aten.index.Tensor, t(4, 3), t(4, dtype=index)) is None
    assert run(dtype, aten.index_put_.default, t(4, 3), t(4, dtype=index), t(3, dtype=F64)) is None


@pytest.mark.parametrize(
    "op, tensors",
    [
        (aten.gather.default, (t(4, 3), t(4, 3, dtype=I32))),
        (aten.scatter.src, (t(4, 3), t(4, 3, dtype=I32), t(4, 3))),
        (aten.scatter_add.default, (t(4, 3), t(4, 3, dtype=I32), t(4, 3))),
        (aten.scatter_reduce.two, (t(4, 3), t(4, 3, dtype=I32), t(4, 3))),
        (aten.index_select.default, (t(4, 3), t(2, dtype=I32))),
        (aten.index_add.default, (t(4, 3), t(2, dtype=I32), t(2, 3))),
        (aten.index_reduce.default, (t(4, 3), t(2, dtype=I32), t(2, 3))),
        (aten.embedding.default, (t(4, 3), t(2, dtype=I32))),
    ],
    ids=lambda value: str(value) if not isinstance(value, tuple) else "",
)
def test_unit_int32_indices_torch_takes(op, tensors):
    assert run(dtype, op, *tensors) is None
    wrong = tuple(m._replace(dtype=I16) if m.dtype == I32 else m for m in tensors)
    assert run(dtype, op, *wrong) is not None


@pytest.mark.parametrize(
    "op, tensors",
    [
        (aten.index_copy.default, (t(4, 3), t(2, dtype=I32), t(2, 3))),
        (aten.index_fill.int_Scalar, (t(4, 3), t(2, dtype=I32))),
        (aten.take.default, (t(4, 3), t(2, dtype=I32))),
    ],
    ids=lambda value: str(value) if not isinstance(value, tuple) else "",
)
def test_unit_int64_only_indices(op, tensors):
    finding = run(dtype, op, *tensors)
    assert finding.rule == "dtype.arg_dtype" and finding.facts["accepted"] == [I64]
    assert "needs i64" in explain(finding)[0]


def test_float_positions_are_flagged_at_the_indexing_line():
    w = watched(rules.pick_tokens_float_positions, expect_error=IndexError)
    assert found(w) == [("dtype_mismatch", "aten.index.Tensor", line_of("return scores[:, positions]"), "forward")]
    assert "idx.long()" in w.anomalies[0].message


@pytest.mark.parametrize("story", [rules.pick_tokens_int_positions, rules.pick_tokens_mask, rules.gather_log_probs, rules.embed_int32_ids],
                         ids=lambda story: story.__name__)
def test_indices_torch_takes_are_not_flagged(story):
    torch_takes(story)
    strictly(story)


# == devices of index tensors =====================================================================


def test_unit_index_on_another_non_cpu_device():
    finding = run(device, aten.index.Tensor, t(16, 4), t(5, dtype=I64, device=META))
    assert finding.kind == "device_mismatch" and finding.rule == "device.index"
    assert (finding.facts["op"], finding.facts["position"]) == ("index", 1)
    problem = explain(finding)[0]
    assert "index tensor i64[5] meta (index #1) of index is on meta, the indexed tensor f32[16, 4] cpu on cpu" in problem
    assert "meta device" in problem
    assert run(device, aten.index_put_.default, t(16, 4), t(5, dtype=I64, device=META), t(5, 4)) is not None
    # CPU indices into a tensor on another device stay legal, and so do indices on its device.
    assert run(device, aten.index.Tensor, t(16, 4, device=META), t(5, dtype=I64)) is None
    assert run(device, aten.index.Tensor, t(16, 4, device=META), t(5, dtype=I64, device=META)) is None
    assert run(device, aten.index_put_.default, t(16, 4, device=META), t(5, dtype=I64), t()) is None


def test_a_buffer_left_on_meta_indexing_a_loaded_parameter_is_flagged():
    w = watched(rules.materialised_from_meta)
    line = line_of("positions = self.table[self.position_ids[: x.shape[1]]]")
    assert [a for a in found(w) if a[0] == "device_mismatch"][0] == ("device_mismatch", "aten.index.Tensor", line, "forward")
    assert w.anomalies[0].module == "LearnedPositions"


@pytest.mark.parametrize("story", [rules.cpu_positions_into_meta_table, rules.learned_positions_healthy],
                         ids=lambda story: story.__name__)
def test_legal_index_devices_are_not_flagged(story):
    strictly(story)


# == module calls: composite modules that raise before any op ===================================


def check_call(module, args):
    from opwatch.checks.module_calls import check_call

    return check_call(module, args)


def _state(cell, make):
    return rules._initial_state(cell, make)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN], ids=lambda cell: cell.__name__)
def test_unit_rnn_initial_state_on_another_device_or_dtype(cell):
    rnn = cell(4, 8, batch_first=True)
    x = torch.randn(2, 5, 4)
    finding = check_call(rnn, (x, _state(cell, lambda h: h.to("meta"))))
    assert finding.kind == "device_mismatch" and finding.rule == "module.rnn_state_device"
    assert (finding.facts["module"], finding.facts["label"]) == (cell.__name__, "h_0")
    problem = explain(finding)[0]
    assert f"{cell.__name__}'s initial state h_0 f32[1, 2, 8] meta is not on the input's device (cpu)" in problem
    assert "Input and hidden tensors are not at the same device" in problem
    finding = check_call(rnn, (x, _state(cell, torch.Tensor.double)))
    assert finding.kind == "dtype_mismatch" and finding.rule == "module.rnn_state_dtype"
    assert "initial state h_0 f64[1, 2, 8] cpu" in explain(finding)[0]
    assert check_call(rnn, (x.double(),)).kind == "dtype_mismatch"
    assert check_call(rnn, (x.to("meta"),)).kind == "device_mismatch"
    # Healthy calls.
    assert check_call(rnn, (x,)) is None
    assert check_call(rnn, (x, _state(cell, lambda h: h))) is None
    with torch.autocast("cpu", dtype=BF16):
        assert check_call(rnn, (x.bfloat16(), _state(cell, lambda h: h))) is None


def test_unit_lstm_cell_state_alone_on_another_device():
    rnn = nn.LSTM(4, 8)
    h = torch.zeros(1, 2, 8)
    finding = check_call(rnn, (torch.randn(5, 2, 4), (h, h.to("meta"))))
    assert finding.rule == "module.rnn_state_device" and finding.facts["label"] == "c_0"
    assert "initial state c_0" in explain(finding)[0]


def test_unit_packed_sequences():
    from torch.nn.utils.rnn import pack_padded_sequence

    rnn = nn.GRU(4, 8, batch_first=True)
    packed = pack_padded_sequence(torch.randn(2, 5, 4), [5, 3], batch_first=True)
    assert check_call(rnn, (packed,)) is None
    assert check_call(rnn, (packed, torch.zeros(1, 2, 8, device="meta"))).kind == "device_mismatch"


def test_unit_conv_input_against_its_bias():
    conv = nn.Conv2d(3, 4, 3)
    finding = check_call(conv, (torch.randn(1, 3, 5, 5, dtype=F64),))
    assert finding.kind == "dtype_mismatch" and finding.rule == "module.conv_input_dtype"
    assert (finding.facts["bias_dtype"], finding.facts["weight_dtype"]) == (torch.float32, torch.float32)
    problem = explain(finding)[0]
    assert "Conv2d gets an input f64[1, 3, 5, 5] cpu for f32 parameters" in problem
    assert "Input type (double) and bias type (float) should be the same" in problem
    assert check_call(nn.Conv1d(3, 4, 3), (torch.randn(1, 3, 5, dtype=BF16),)) is not None
    odd_bias = nn.Conv2d(3, 4, 3)
    odd_bias.bias.data = odd_bias.bias.data.double()
    finding = check_call(odd_bias, (torch.randn(1, 3, 5, 5),))
    assert finding.rule == "module.conv_bias_dtype" and finding.facts["bias_dtype"] == F64
    assert "Conv2d's bias is f64 but its weight and input are f32" in explain(finding)[0]
    assert check_call(conv, (torch.randn(1, 3, 5, 5),)) is None
    # Without a bias the mismatch reaches aten.convolution, where the per-op check sees it.
    assert check_call(nn.Conv2d(3, 4, 3, bias=False), (torch.randn(1, 3, 5, 5, dtype=F64),)) is None
    with torch.autocast("cpu", dtype=BF16):
        assert check_call(conv, (torch.randn(1, 3, 5, 5, dtype=BF16),)) is None
        assert check_call(conv, (torch.randn(1, 3, 5, 5, dtype=F64),)) is not None


def test_unit_only_torchs_own_forwards_are_judged():
    class CastingConv(nn.Conv2d):
        def forward(self, x):
            return super().forward(x.to(self.weight.dtype))

    assert check_call(CastingConv(3, 4, 3), (torch.randn(1, 3, 5, 5, dtype=F64),)) is None
    assert check_call(nn.Linear(3, 4), (torch.randn(2, 3, dtype=F64),)) is None  # seen per op
    assert check_call(nn.LSTM(4, 8), ()) is None


class Calls:
    """A ModuleStack whose ``on_call`` collects findings with the line the module was called on."""

    def __init__(self):
        from opwatch.modes.modules import ModuleStack

        self.found = []
        self.stack = ModuleStack(on_call=self.on_call)

    def on_call(self, module, args):
        finding = check_call(module, args)
        if finding is not None:
            code, lasti, _ = self.stack.call_answer
            self.found.append((finding.kind, self.stack.path, position_of(code, lasti).lineno))

    def run(self, story, *args, expect_error=None):
        self.stack.install()
        try:
            if expect_error is None:
                story(*args)
            else:
                with pytest.raises(expect_error):
                    story(*args)
        finally:
            self.stack.uninstall()
        return self.found


RNN_LINE = "hidden, _ = self.rnn(x, state) if state is not None else self.rnn(x)"


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN], ids=lambda cell: cell.__name__)
def test_tagger_with_its_initial_state_on_meta_is_diagnosed_on_the_users_line(cell):
    found_calls = Calls().run(rules.tag, cell, lambda h: h.to("meta"), expect_error=RuntimeError)
    assert found_calls == [("device_mismatch", "rnn", line_of(RNN_LINE))]


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU], ids=lambda cell: cell.__name__)
def test_tagger_with_a_float64_initial_state_is_diagnosed(cell):
    found_calls = Calls().run(rules.tag, cell, torch.Tensor.double, expect_error=RuntimeError)
    assert found_calls == [("dtype_mismatch", "rnn", line_of(RNN_LINE))]


def test_conv_net_fed_float64_numpy_images_is_diagnosed_at_the_first_conv():
    found_calls = Calls().run(rules.classify_numpy_images, expect_error=RuntimeError)
    assert found_calls == [("dtype_mismatch", "stem.0", line_of("features = self.stage(self.stem(images))"))]


@pytest.mark.parametrize(
    "story, args",
    [
        (rules.tag, (nn.LSTM,)),
        (rules.tag, (nn.GRU, lambda h: h)),
        (rules.tag, (nn.RNN, lambda h: h)),
        (rules.classify_int64, ()),
        (rules.classify_under_autocast, ()),
    ],
    ids=["lstm", "gru-state", "rnn-state", "convnet", "convnet-autocast"],
)
def test_healthy_module_calls_are_not_flagged(story, args):
    assert Calls().run(story, *args) == []


# -- module calls through a real watch: reported on the user's line, raised before forward --


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN], ids=lambda cell: cell.__name__)
def test_a_watch_reports_the_initial_state_on_meta_at_the_module_call(cell):
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        with pytest.raises(RuntimeError):  # torch's own error follows: watch() only reports
            rules.tag(cell, lambda h: h.to("meta"))
    (anomaly,) = [a for a in w.anomalies if a.op == f"{cell.__name__}.forward"]
    assert (anomaly.kind, anomaly.module, anomaly.lineno) == ("device_mismatch", "rnn", line_of(RNN_LINE))
    assert f"device_mismatch in {cell.__name__}.forward at training_rules.py:{line_of(RNN_LINE)}, module rnn (forward)" in anomaly.message


def test_strict_raises_before_the_modules_forward_runs():
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict(dump_on_error=False):
            rules.tag(nn.LSTM, torch.Tensor.double)
    assert raised.value.anomaly.kind == "dtype_mismatch"
    assert raised.value.anomaly.record.outputs is None  # LSTM.forward never ran


def test_a_module_call_in_the_log_is_passed_over_by_the_nan_inf_replay():
    """A module call judged before its forward (torch then raises) is logged with no outputs;
    the nan/inf replay at the next check point passes it over, and finds the log(0) after it."""
    torch.manual_seed(0)
    rnn, head = nn.GRU(4, 3), nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch(warn=False, dump_on_error=False) as w:
            with pytest.raises(ValueError):  # torch's own error after the report
                rnn(torch.randn(5, 2, 4, dtype=torch.float64))
            out, _ = rnn(torch.randn(5, 2, 4))
            probability = torch.sigmoid(head(out)).squeeze(-1) * 0  # every probability 0
            loss = -probability.log().mean()
            loss.backward()
    assert not [warning for warning in caught if "internal error" in str(warning.message)]
    assert [a.finding.rule for a in w.anomalies][:1] == ["module.rnn_input_dtype"]
    assert "nonfinite.origin" in [a.finding.rule for a in w.anomalies]


def test_module_call_checks_follow_the_enabled_kinds():
    with opwatch.watch(warn=False, dump_on_error=False, checks=["broadcast"]) as w:
        with pytest.raises(RuntimeError):
            rules.tag(nn.LSTM, lambda h: h.to("meta"))
    assert w.anomalies == []


# == arguments that must match another argument's dtype ============================================


def test_unit_embedding_bag_weights_must_match_the_table():
    func = aten._embedding_bag.default
    finding = run(dtype, func, t(50, 8, dtype=torch.float16), t(8, dtype=I64), t(3, dtype=I64), t(8))
    assert finding is not None and finding.rule == "dtype.arg_dtype"
    assert finding.facts["arg"] == "per_sample_weights" and finding.facts["accepted"] == [torch.float16]
    assert run(dtype, func, t(50, 8, dtype=torch.float16), t(8, dtype=I64), t(3, dtype=I64), t(8, dtype=torch.float16)) is None
    assert run(dtype, func, t(50, 8, dtype=torch.float16), t(8, dtype=I64), t(3, dtype=I64)) is None  # no weights


def test_half_embedding_bag_given_float_weights_is_flagged_before_the_kernel_raises():
    w = watched(rules.recommend_half_with_float_dwell, expect_error=RuntimeError)
    assert found(w) == [("dtype_mismatch", "aten._embedding_bag.default", line_of("return self.head(self.items(clicks, offsets, per_sample_weights=dwell))"), "forward")]
    message = w.anomalies[0].message
    assert "argument 'per_sample_weights' is f32 but _embedding_bag needs f16" in message
    assert "weight=f16[50, 8] cpu" in message and "per_sample_weights=f32[8] cpu" in message


def test_half_embedding_bag_with_matching_weights_is_not_flagged():
    strictly(rules.recommend_half_with_half_dwell)


def test_a_float32_codebook_in_a_half_model_is_named_as_the_parameter_it_is():
    w = watched(rules.quantize_half_with_float_codebook)
    assert found(w) == [("dtype_mismatch", "aten.mul.Tensor", line_of("vectors = probs.unsqueeze(-1) * self.codevectors"), "forward")]
    message = w.anomalies[0].message
    assert "until it is cast back" in message and "everything downstream" not in message
    assert "the parameter codevectors of CodebookQuantizer is not in f16" in message
    assert "numpy" not in message.split("fix:")[1]


def test_a_float64_array_from_numpy_keeps_the_numpy_advice():
    w = watched(rules.side_features_numpy, expect_error=RuntimeError)  # the head's addmm raises next
    assert w.anomalies and "torch.from_numpy(a).to(f32)" in w.anomalies[0].message.split("fix:")[1]


# -- a module kept in float32 inside a float16 model -------------------------------------------


class FeedForward(nn.Module):
    """T5's feed-forward: ``wo`` kept in float32 (transformers' ``_keep_in_fp32_modules``) while
    the rest of the model runs in float16."""

    def __init__(self, width=16, keep_wo_in_fp32=True):
        super().__init__()
        self.wi = nn.Linear(width, 4 * width).half()
        self.wo = nn.Linear(4 * width, width)
        self.cast_back = not keep_wo_in_fp32
        if not keep_wo_in_fp32:
            self.wo.half()

    def forward(self, x):
        h = torch.relu(self.wi(x))
        return x + self.wo(h.to(self.wo.weight.dtype)).to(x.dtype if self.cast_back else self.wo.weight.dtype)  # RESIDUAL


def test_a_linear_kept_in_float32_names_its_weight_where_its_output_joins_the_float16_stream():
    torch.manual_seed(0)
    block = FeedForward()
    with opwatch.watch(warn=False) as w:
        block(torch.randn(2, 5, 16).half()).float().sum().item()
    (anomaly,) = [a for a in w.anomalies if a.kind == "dtype_mismatch"]
    assert anomaly.record.lineno == _line_of("# RESIDUAL", __file__)
    (made,) = anomaly.finding.made
    assert made.detail.how == "computed_from" and made.detail.path == "wo" and made.detail.name in ("weight", "bias"), made
    assert f"computed from the parameter {made.detail.name} of Linear (wo)" in anomaly.message
    assert "torch.from_numpy" not in anomaly.message and "must cast its output back (.to(f16))" in anomaly.message


def test_the_same_block_cast_back_to_float16_is_silent():
    torch.manual_seed(0)
    block = FeedForward(keep_wo_in_fp32=False)
    with opwatch.watch(warn=False) as w:
        block(torch.randn(2, 5, 16).half()).float().sum().item()
    assert [a for a in w.anomalies if a.kind == "dtype_mismatch"] == []
