"""The checks end to end: the user stories, the must-not-flag list, strict(), warnings, syncs."""

from __future__ import annotations

import sys
import warnings
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import opwatch
from opwatch.render.messages import explain
from support import SCENARIOS, CountingMode, assert_golden, needs_columns
from support.helpers import watch_story

import stories  # noqa: E402

STORIES = str(SCENARIOS / "stories.py")


def line_of(text: str) -> int:
    lines = open(STORIES).read().splitlines()
    matches = [number for number, line in enumerate(lines, 1) if text in line]
    assert len(matches) == 1, (text, matches)
    return matches[0]


run = watch_story


def kinds(w):
    return [(a.kind, a.op, a.lineno, a.phase) for a in w.anomalies]


# -- the bugs ------------------------------------------------------------------------------

def test_device_mix_on_meta_is_flagged_at_the_op():
    w = run(stories.device_mix)
    assert kinds(w) == [("device_mismatch", "aten.masked_scatter_.default", line_of("y.masked_scatter_(mask, source)"), "forward")]
    assert "cpu" in w.anomalies[0].message and "meta" in w.anomalies[0].message


def test_zero_dim_cpu_tensor_mixes_with_any_device():
    with opwatch.watch(warn=False) as w:
        torch.ones(3, device="meta") * torch.tensor(2.0)
    assert w.anomalies == []


def test_mask_dtype():
    w = run(stories.mask_dtype, expect_error=RuntimeError)
    assert kinds(w) == [("dtype_mismatch", "aten.masked_scatter_.default", line_of("y.masked_scatter_(mask, torch.tensor"), "forward")]


def test_matmul_dtype_mismatch():
    w = run(stories.double_matmul, expect_error=RuntimeError)
    assert kinds(w) == [("dtype_mismatch", "aten.mm.default", line_of("return x.double() @ w"), "forward")]


def test_silent_float64_promotion_from_numpy():
    w = run(stories.numpy_upcast)
    assert kinds(w) == [("dtype_mismatch", "aten.mul.Tensor", line_of("return features * weights"), "forward")]
    assert "f32 with f64 -> f64" in w.anomalies[0].message


def test_broadcast_loss_is_flagged_on_the_subtraction():
    w = run(stories.broadcast_loss)
    assert kinds(w) == [("broadcast", "aten.sub.Tensor", line_of("loss = ((y - pred) ** 2).mean()"), "forward")]
    record = w.anomalies[0].record
    assert record.flags == ("broadcast",)
    assert [m.shape for m in record.outputs] == [(4, 4)]


def test_broadcast_from_reshape_and_module_output():
    assert [a.kind for a in run(stories.reshape_column).anomalies] == ["broadcast"]
    w = run(stories.module_column)
    assert [(a.kind, a.op) for a in w.anomalies] == [("broadcast", "aten.sub.Tensor")]


def test_log_zero_inf_origin_and_backward():
    w = run(stories.log_zero)
    found = kinds(w)
    assert found[0] == ("inf", "aten.log.default", line_of("log_likelihood = likelihood.log()"), "forward")
    # Its gradient 1/0 is a new inf born in backward, pointing at the same forward line.
    assert ("inf", "aten.div.Tensor", line_of("log_likelihood = likelihood.log()"), "backward") in found
    # Propagation through mean and neg is not reported again.
    assert not any(op in ("aten.mean.default", "aten.neg.default") for _, op, _, _ in found)


def test_inf_born_in_backward_points_at_the_forward_line():
    w = run(stories.sqrt_grad_at_zero)
    assert kinds(w) == [("inf", "aten.div.Tensor", line_of("distance = x.sqrt()"), "backward")]


def test_diverging_training_loop_points_at_the_first_overflow():
    w = run(stories.diverging)
    loss_line = line_of("loss = ((model(x) - y) ** 2).mean()")
    first = w.anomalies[0]
    assert (first.kind, first.op, first.lineno, first.phase) == ("inf", "aten.pow.Tensor_Scalar", loss_line, "forward")
    # Ops that only carried the values on (mean, the backward of mean, the optimizer) are
    # not anomalies of their own.
    assert {a.op for a in w.anomalies} <= {"aten.pow.Tensor_Scalar", "aten.addmm.default", "aten.mul.Tensor", "aten.mm.default"}


# -- must not flag ------------------------------------------------------------------------

@pytest.mark.parametrize(
    "story",
    [
        stories.centered,
        stories.attention_mask,
        stories.outer_products,
        stories.pairwise,
        stories.rotary,
        stories.masked_attention,
        stories.constants,
        stories.mixed_ints_and_scalars,
        stories.healthy_training,
    ],
    ids=lambda story: story.__name__,
)
def test_healthy_code_is_not_flagged(story):
    with warnings.catch_warnings():
        warnings.simplefilter("error", opwatch.OpwatchWarning)
        with opwatch.watch() as w:
            story()
    assert w.anomalies == []


def test_pairwise_with_equal_row_counts_is_not_flagged():
    assert run(stories.pairwise, 6).anomalies == []
    assert run(stories.pairwise, 3).anomalies == []


def _pairwise_distance_step(make_rows):
    """A training step on a pairwise distance table: an embedding's rows against a second
    batch's, the size-1 dim made by ``make_rows``, then a full-width slice of it (what torch 2.6
    dispatches for the last ``:`` of ``x[:, None, :]``)."""
    torch.manual_seed(0)
    embed = torch.nn.Linear(3, 4)
    anchors, others = torch.randn(5, 3), torch.randn(5, 3)
    with opwatch.watch(warn=False) as w:
        rows = make_rows(embed(anchors)).narrow(2, 0, 4)
        distances = (rows - embed(others)).norm(dim=-1)
        distances.diagonal().mean().backward()
    return w


def test_a_full_width_slice_keeps_a_deliberate_dim():
    assert _pairwise_distance_step(lambda h: h[:, None]).anomalies == []


def test_a_full_width_slice_of_a_reshaped_dim_is_still_flagged():
    w = _pairwise_distance_step(lambda h: h.reshape(5, 1, 4))
    assert [(a.kind, a.op, a.phase) for a in w.anomalies] == [("broadcast", "aten.sub.Tensor", "forward")]


def test_rotary_with_inv_freq_as_long_as_the_sequence():
    assert run(stories.rotary, 8, 16).anomalies == []


def test_t5_log_zero_is_contained_not_an_anomaly():
    with opwatch.strict(warn=False) as w:
        buckets = stories.t5_buckets()
    assert w.anomalies == []
    assert [(a.kind, a.op, a.lineno) for a in w.contained] == [("inf", "aten.log.default", line_of("torch.log(relative.float() / max_exact)"))]
    assert buckets.dtype == torch.int64


def test_inf_alive_at_the_check_point_matters():
    with opwatch.watch(warn=False) as w:
        kept = torch.zeros(3).log()
    assert [a.kind for a in w.anomalies] == ["inf"]
    del kept


def _log_zero_kept_through(make_alias):
    """An inf origin whose own output dies; only an alias of it is still held at the check point."""
    with opwatch.watch(warn=False) as w:
        origin = torch.zeros(4).log()
        kept = make_alias(origin)
        del origin
    return w, kept


@pytest.mark.parametrize(
    "make_alias",
    [
        lambda x: x.view(2, 2),
        lambda x: x[1:].unsqueeze(0).expand(3, 3),  # a chain of views: the first one dies too
        lambda x: x.detach(),  # an alias without a link to its base
        lambda x: x.view(torch.int32).view(torch.float32),  # dtype views: no link either
        lambda x: x.clone(),
    ],
    ids=["view", "view-chain", "detach", "dtype-view", "clone"],
)
def test_inf_alive_only_through_an_alias_matters(make_alias):
    w, kept = _log_zero_kept_through(make_alias)
    assert [(a.kind, a.op) for a in w.anomalies] == [("inf", "aten.log.default")]
    assert w.contained == []
    del kept


def test_inf_alive_through_an_inference_mode_view_matters():
    with torch.inference_mode():
        w, kept = _log_zero_kept_through(lambda x: x.view(2, 2))
    assert [(a.kind, a.op) for a in w.anomalies] == [("inf", "aten.log.default")]
    del kept


def test_inf_whose_aliases_all_died_is_contained():
    with opwatch.watch(warn=False) as w:
        finite = torch.zeros(4).log().view(2, 2).clamp(min=-1.0)
    assert w.anomalies == []
    assert [(a.kind, a.op) for a in w.contained] == [("inf", "aten.log.default")]
    assert torch.isfinite(finite).all()


def test_a_view_made_before_a_check_point_still_carries_its_origin_after_it():
    with opwatch.watch(warn=False) as w:
        kept = torch.zeros(4).log().view(2, 2)
        w.check()
        later = kept * 2  # spread of the reported origin, not a new one
    assert [(a.kind, a.op) for a in w.anomalies] == [("inf", "aten.log.default")]
    del kept, later


def test_python_data_never_inherits_a_dead_tensors_state():
    # torch.tensor([...]) lifts raw data no op made (aten.lift_fresh), and CPython often gives it
    # the id of a tensor that just died, inf and all (the demo hit this about 1 run in 13).
    # Lifting a tracked inf tensor directly stands for that id collision, deterministically:
    # the lifted tensor is new data, not the inf's spread.
    with opwatch.watch(warn=False) as w:
        bad = torch.zeros(4).log()
        torch.ops.aten.lift_fresh(bad)
    found = w.anomalies + w.contained
    assert [(a.op, "spread" in explain(a.finding)[0]) for a in found] == [("aten.log.default", False)]


# -- warnings and strict ------------------------------------------------------------------

def test_a_loop_warns_once_per_kind_and_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch() as w:
            stories.broadcast_loss(steps=50)
    ours = [c for c in caught if issubclass(c.category, opwatch.OpwatchWarning)]
    assert len(ours) == 1
    assert len(w.anomalies) == 50
    assert ours[0].filename == STORIES and ours[0].lineno == line_of("loss = ((y - pred) ** 2).mean()")


def test_strict_raises_before_the_kernel_runs():
    counter = CountingMode()
    with counter:
        with pytest.raises(opwatch.AnomalyError) as caught:
            with opwatch.strict(dump_on_error=False):
                stories.double_matmul()
    assert isinstance(caught.value, RuntimeError)
    assert caught.value.anomaly.kind == "dtype_mismatch"
    assert counter.count("aten.mm.default") == 0, "the kernel ran"


def test_strict_in_place_op_leaves_its_target_untouched():
    y = torch.zeros(4)
    with pytest.raises(opwatch.AnomalyError):
        with opwatch.strict(dump_on_error=False):
            y.add_(torch.ones(4, device="meta"))
    assert torch.equal(y, torch.zeros(4))


def test_strict_nonfinite_raises_at_the_host_read_naming_the_origin():
    with pytest.raises(opwatch.AnomalyError) as caught:
        with opwatch.strict(dump_on_error=False):
            stories.log_zero()
    anomaly = caught.value.anomaly
    assert (anomaly.kind, anomaly.op, anomaly.lineno) == ("inf", "aten.log.default", line_of("log_likelihood = likelihood.log()"))
    # Raised at target.item(), before backward ran.


def test_watch_check_returns_new_anomalies():
    with opwatch.watch(warn=False) as w:
        kept = torch.zeros(2).log()
        found = w.check()
        again = w.check()
    assert [a.kind for a in found] == ["inf"]
    assert again == []
    del kept


def test_checks_option_turns_checks_off():
    w = run(stories.broadcast_loss, checks=["nonfinite"])
    assert w.anomalies == []
    w = run(stories.broadcast_loss, checks=())
    assert w.anomalies == [] and w.records


# -- the cost of the nan/inf check: syncs and extra ops -------------------------------------

def _healthy_program_with_host_reads():
    stories.healthy_training(steps=5)  # Adam reads its step counters with .item()
    for _ in range(5):
        torch.ones(3).sum().item()


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that only runs each op: what any mode nested inside another changes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_modes_outside_the_watch_see_exactly_the_programs_ops():
    # The baseline has a mode inside too: a nested mode alone changes the detaches the outer one
    # sees (autograd saving a result: one more on torch 2.6, one fewer in backward on 2.13).
    _healthy_program_with_host_reads()  # torch 2.6: the first optimizer step imports Dynamo, whose import runs ops
    baseline = CountingMode()
    with baseline:
        with _PassThrough():
            _healthy_program_with_host_reads()
    counter = CountingMode()
    with counter:
        with opwatch.watch(warn=False):
            _healthy_program_with_host_reads()
    # The reductions and their read-back run with Python dispatch off: not the program's ops.
    assert counter.ops == baseline.ops


def _profiled_op_counts(mode) -> Counter:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with mode:
            _healthy_program_with_host_reads()
    # The raw events: the merged list (``profile.events()``) folds an op into its parent of the
    # same name when it is the parent's only child, as a mode's call of the op it handles is on
    # torch 2.6 (on 2.13 a PythonDispatchMode event sits between them), so it would count a
    # program's read once under a plain mode and twice where opwatch runs a reduction before it.
    return Counter(event.name() for event in profile.profiler.kineto_results.events())


def test_one_batched_read_per_check_point_and_one_reduction_per_floating_output():
    # The profiler records at the dispatcher, so it sees the ops no mode sees. Both sides run
    # under a Python mode, which the profiler records the same way.
    _healthy_program_with_host_reads()  # torch 2.6: the first optimizer step imports Dynamo, whose import runs ops
    reference = _profiled_op_counts(CountingMode())
    watched = opwatch.watch(warn=False)
    counts = _profiled_op_counts(watched)
    assert reference["aten::_local_scalar_dense"] >= 10
    # opwatch issues no host read op of its own: its read is one .tolist() per check point, at
    # a read the program makes anyway or at the block's end.
    assert counts["aten::_local_scalar_dense"] == reference["aten::_local_scalar_dense"]
    floating_outputs = sum(1 for r in watched.records for m in (r.outputs or ()) if m.dtype.is_floating_point)
    reductions = counts["aten::aminmax"] - reference["aten::aminmax"]
    assert 0 < reductions <= floating_outputs
    # One stack per 32 reductions and one cat per check point at most (a check point per read).
    check_points = reference["aten::_local_scalar_dense"] + 1
    assert counts["aten::stack"] - reference["aten::stack"] <= reductions // 32 + check_points
    assert counts["aten::cat"] - reference["aten::cat"] <= check_points


# -- messages users read ------------------------------------------------------------------

@needs_columns
@pytest.mark.parametrize(
    "story, error",
    [
        (stories.device_mix, None),
        (stories.mask_dtype, RuntimeError),
        (stories.double_matmul, RuntimeError),
        (stories.numpy_upcast, None),
        (stories.broadcast_loss, None),
        (stories.log_zero, None),
        (stories.sqrt_grad_at_zero, None),
    ],
    ids=lambda value: getattr(value, "__name__", str(value)),
)
def test_message_golden(story, error):
    w = run(story, expect_error=error)
    text = "\n\n".join(str(a) for a in w.anomalies) + "\n"
    assert_golden(f"message_{story.__name__}.txt", text)


def test_message_names_op_line_module_tensors_expectation_and_fix():
    w = run(stories.module_column)
    message = str(w.anomalies[0])
    first_line = message.splitlines()[0]
    assert first_line.startswith("broadcast in aten.sub.Tensor at stories.py:")
    assert "return ((head(torch.randn(5, 3)) - target) ** 2).mean()" in message
    assert "f32[5] cpu" in message and "f32[5, 1] cpu" in message
    assert "made by aten.sigmoid at stories.py" in message
    assert "expected:" in message and "fix:" in message
