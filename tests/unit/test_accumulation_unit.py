"""The rules on writes into a tensor (opwatch.checks.accumulation) on plain metadata, no mode
running: which ops they bind to, the facts of each rule, their exemptions, their sentences."""

from __future__ import annotations

import pytest
import torch

from opwatch.checks import accumulation
from opwatch.core.notation import TensorMeta
from opwatch.core.ops import facts_of
from opwatch.render.messages import explain
from support.helpers import StubContext

aten = torch.ops.aten
CPU, META = torch.device("cpu"), torch.device("meta")
F32, F64, BF16, F16, I64, I32, BOOL = torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool


def t(*shape, dtype=F32, device=CPU, ident=0):
    return TensorMeta(tuple(shape), dtype, device, ident)


def check(op, *metas, phase="forward", args=()):
    bound = accumulation.for_op(op)
    assert bound is not None, op
    context = StubContext()
    context.phase = phase
    context.args = args
    return bound(metas, context)


# -- which ops, which arguments ----------------------------------------------------------------


@pytest.mark.parametrize(
    "op, written, source",
    [
        (aten.index_add_.default, 0, 2), (aten.index_add.out, -1, 2), (aten.index_copy_.default, 0, 2),
        (aten.scatter_add_.default, 0, 2), (aten.scatter_.src, 0, 2), (aten.scatter_reduce_.two, 0, 2),
        (aten.masked_scatter_.default, 0, 2), (aten.put_.default, 0, 2), (aten.index_put_.default, 0, -1),
        (aten.index_put.out, -1, -2), (aten.lerp_.Scalar, 0, 1), (aten.index_put.default, None, -1),
    ],
)
def test_the_op_facts_name_the_written_tensor_and_the_source(op, written, source):
    facts = facts_of(op)
    assert (facts.written, facts.source) == (written, source)


@pytest.mark.parametrize(
    "op",
    [
        aten.copy_.default, aten.masked_fill_.Tensor, aten.index_fill_.int_Tensor, aten.fill_.Tensor,
        aten.scatter_.value, aten.mul_.Tensor, aten.div_.Tensor, aten.add.Tensor, aten._foreach_add_.List,
        aten.slice_scatter.default,
    ],
)
def test_deliberate_casts_scalars_scalings_and_functional_adds_are_not_bound(op):
    assert accumulation.for_op(op) is None


def test_narrows_orders_floating_dtypes_by_precision():
    assert accumulation.narrows(F32, BF16) and accumulation.narrows(F64, F32) and accumulation.narrows(F32, F16)
    assert accumulation.narrows(F16, BF16) and accumulation.narrows(BF16, F16)
    assert not accumulation.narrows(BF16, F32) and not accumulation.narrows(F32, F64) and not accumulation.narrows(F32, F32)
    assert not accumulation.narrows(I64, F32) and not accumulation.narrows(F32, I64)


# -- dtype.write_source ------------------------------------------------------------------------


def test_a_float32_source_into_a_bf16_buffer_is_a_write_source_finding():
    buf, index, source = t(16, 8, dtype=BF16), t(3, dtype=I64), t(3, 8, ident=7)
    finding = check(aten.index_add_.default, buf, index, source)
    assert finding.rule == "dtype.write_source" and finding.kind == "dtype_mismatch"
    assert finding.odd == (source,)
    facts = finding.facts
    assert (facts["op"], facts["source_name"], facts["source_wider"]) == ("index_add_", "source", True)
    assert facts["names"] == ["self", "index", "source"]
    problem, expected, fix = explain(finding)
    assert "index_add_ writes source f32[3, 8] cpu into self bf16[16, 8] cpu" in problem
    assert expected == "source in bf16, like self"
    assert "source.to(torch.bfloat16)" in fix and "(out * weight).to(buf.dtype)" in fix


def test_a_float64_src_names_numpy_and_a_narrower_source_is_cast_up():
    finding = check(aten.scatter_add_.default, t(5, 4), t(6, 4, dtype=I64), t(6, 4, dtype=F64))
    assert finding.facts["source_name"] == "src"
    assert "torch.from_numpy(a).float()" in explain(finding)[2]
    narrower = check(aten.scatter_add_.default, t(5, 4), t(6, 4, dtype=I64), t(6, 4, dtype=BF16))
    assert narrower.facts["source_wider"] is False
    assert explain(narrower)[2] == "cast the src where it is made (src.to(torch.float32), or dtype= at its factory)"


@pytest.mark.parametrize("op", [aten.index_add_.default, aten.index_copy_.default, aten.scatter_add_.default, aten.masked_scatter_.default])
def test_one_dtype_is_no_finding(op):
    assert check(op, t(4, 3, dtype=BF16), t(3, dtype=I64), t(3, 3, dtype=BF16)) is None


def test_write_source_is_judged_in_backward_and_under_autocast_too():
    args = (t(4, 3, dtype=BF16), t(3, dtype=I64), t(3, 3))
    assert check(aten.index_add_.default, *args, phase="backward") is not None
    with torch.autocast("cpu", dtype=BF16):
        assert check(aten.index_add_.default, *args) is not None


def test_index_put_of_a_one_element_value_under_one_bool_mask_runs_as_masked_fill():
    buf, mask = t(4, 3, dtype=BF16), t(4, 3, dtype=BOOL)
    assert check(aten.index_put_.default, buf, mask, t()) is None  # buf[mask] = torch.tensor(1.5)
    assert check(aten.index_put_.default, buf, t(4, dtype=BOOL), t(1)) is None
    # Not that shortcut: accumulate, an integer index, two indices, a longer or non-CPU value.
    assert check(aten.index_put_.default, buf, mask, t(), args=(3, True)) is not None
    assert check(aten.index_put_.default, buf, mask, t(), args=("accumulate", True)) is not None
    assert check(aten.index_put_.default, buf, mask, t(), args=(3, False)) is None
    assert check(aten.index_put_.default, buf, t(2, dtype=I64), t()) is not None
    assert check(aten.index_put_.default, buf, t(4, dtype=BOOL), t(3, dtype=BOOL), t()) is not None
    assert check(aten.index_put_.default, buf, mask, t(6)) is not None
    assert check(aten.index_put_.default, buf, mask, t(device=META)) is not None


def test_index_put_names_its_values_and_its_tensors_by_position():
    finding = check(aten.index_put_.default, t(4, 3, dtype=BF16), t(2, dtype=I64), t(2, 3))
    assert finding.facts["source_name"] == "values" and finding.facts["names"] == ["#1", "#2", "#3"]
    assert "index_put_ writes values f32[2, 3] cpu into self bf16[4, 3] cpu" in explain(finding)[0]


# -- dtype.narrowing_write ---------------------------------------------------------------------


def test_a_float32_operand_added_into_a_bf16_tensor_is_a_narrowing_write():
    acc, update = t(8, dtype=BF16), t(8, ident=3)
    finding = check(aten.add_.Tensor, acc, update)
    assert finding.rule == "dtype.narrowing_write" and finding.odd == (update,)
    assert (finding.facts["written"], finding.facts["computed"]) == ("self", F32)
    problem, expected, fix = explain(finding)
    assert "add_ computes in f32 (f32[8] cpu) and rounds the result into self bf16[8] cpu silently" in problem
    assert expected == "the tensor written in the dtype of what is added to it (f32)"
    assert "make the accumulator with dtype=torch.float32" in fix and "y.to(torch.bfloat16)" in fix


def test_out_is_the_tensor_written_for_an_out_variant():
    finding = check(aten.add.out, t(8, dtype=F64), t(8, dtype=F64), t(8))
    assert finding.facts["written"] == "out" and finding.facts["computed"] == F64
    assert "make the out= tensor with dtype=torch.float64" in explain(finding)[2]


@pytest.mark.parametrize(
    "written, other",
    [(F32, BF16), (F64, F32), (F32, F32), (BF16, BF16), (BF16, I64), (BF16, BOOL), (I64, I32)],
    ids=["widening", "widening-f64", "same", "same-bf16", "integer", "bool", "integers"],
)
def test_widening_same_and_non_floating_operands_are_no_finding(written, other):
    assert check(aten.add_.Tensor, t(8, dtype=written), t(8, dtype=other)) is None


def test_a_0_dim_operand_is_a_scalar_and_backward_is_not_judged():
    assert check(aten.add_.Tensor, t(8, dtype=BF16), t()) is None
    assert check(aten.addcmul_.default, t(8, dtype=BF16), t(8, dtype=BF16), t(), ) is None
    assert check(aten.add_.Tensor, t(8, dtype=BF16), t(8), phase="backward") is None


def test_f16_and_bf16_narrow_into_each_other_and_every_odd_operand_is_named():
    finding = check(aten.addcmul_.default, t(8, dtype=F16), t(8, dtype=BF16, ident=1), t(8, dtype=BF16, ident=2))
    assert finding.facts["computed"] == F32 and len(finding.odd) == 2


def test_narrowing_write_is_judged_under_autocast():
    with torch.autocast("cpu", dtype=BF16):
        assert check(aten.add_.Tensor, t(8, dtype=BF16), t(8)) is not None
