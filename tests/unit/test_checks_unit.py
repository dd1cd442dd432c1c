"""Each check on its own: an op and tensor metadata as plain data, no mode running."""

from __future__ import annotations

import pytest
import torch

from support.helpers import PRODUCER, StubContext
from opwatch.checks import broadcast, device, dtype
from opwatch.core.notation import TensorMeta
from opwatch.render.messages import explain

aten = torch.ops.aten
CPU = torch.device("cpu")
META = torch.device("meta")
F32, F64, I64, B8 = torch.float32, torch.float64, torch.int64, torch.bool


def t(*shape, dtype=F32, device=CPU, ident=0):
    return TensorMeta(tuple(shape), dtype, device, ident)


def run(check, func, *tensors, context=None):
    bound = check.for_op(func)
    assert bound is not None
    return bound(tensors, context or StubContext())


# -- device ---------------------------------------------------------------------------------

def test_device_same_device_passes():
    assert run(device, aten.add.Tensor, t(3), t(3)) is None
    assert run(device, aten.add.Tensor, t(3, device=META), t(3, device=META)) is None


def test_device_cpu_with_meta_is_flagged_with_names():
    finding = run(device, aten.masked_scatter_.default, t(6), t(6, dtype=B8, device=META), t(3, device=META))
    assert finding.kind == "device_mismatch" and finding.rule == "device.mix"
    assert finding.facts["devices"] == ["cpu", "meta"] and finding.facts["names"] == ["self", "mask", "source"]
    assert finding.odd == (t(6),)
    problem = explain(finding)[0]
    assert "self=f32[6] cpu" in problem and "mask=b8[6] meta" in problem
    assert "meta device" in problem


def test_device_zero_dim_cpu_scalar_is_legal_anywhere():
    assert run(device, aten.mul.Tensor, t(3, device=META), t()) is None
    assert run(device, aten.mul.Tensor, t(), t(3, device=META)) is None


def test_device_copies_are_exempt_and_indices_may_stay_on_cpu():
    assert device.for_op(aten.copy_.default) is None
    assert device.for_op(aten._to_copy.default) is None
    assert device.for_op(aten._foreach_add_.List) is None
    assert run(device, aten.index.Tensor, t(5, device=META), t(2, dtype=I64)) is None
    assert run(device, aten.index_put_.default, t(5, device=META), t(2, dtype=I64), t(2, device=META)) is None
    assert run(device, aten.index_put_.default, t(5, device=META), t(2, dtype=I64), t(2)) is not None


# -- dtype ------------------------------------------------------------------------------------

def test_dtype_matmul_needs_one_dtype():
    finding = run(dtype, aten.mm.default, t(5, 3, dtype=F64), t(3, 2))
    assert finding.kind == "dtype_mismatch" and finding.rule == "dtype.one_dtype"
    assert finding.facts["op"] == "mm" and finding.facts["dtypes"] == [F64, F32]
    assert "mm needs one dtype for all operands, got f64, f32" in explain(finding)[0]
    assert run(dtype, aten.mm.default, t(5, 3), t(3, 2)) is None


def test_dtype_mask_and_index_arguments():
    finding = run(dtype, aten.masked_fill.Scalar, t(4), t(4, dtype=I64))
    assert finding.rule == "dtype.arg_dtype" and finding.facts["arg"] == "mask" and finding.facts["got"] == I64
    assert "argument 'mask' is i64" in explain(finding)[0]
    assert run(dtype, aten.masked_fill.Scalar, t(4), t(4, dtype=B8)) is None
    assert run(dtype, aten.index_select.default, t(4, 2), t(3, dtype=F32)) is not None
    assert run(dtype, aten.index_select.default, t(4, 2), t(3, dtype=I64)) is None
    assert run(dtype, aten.gather.default, t(4, 2), t(4, 2, dtype=torch.int32)) is None


def test_dtype_silent_float_promotion():
    finding = run(dtype, aten.mul.Tensor, t(4), t(4, dtype=F64))
    assert finding.rule == "dtype.silent_upcast" and finding.facts["result"] == F64
    assert finding.odd == (t(4, dtype=F64),)
    assert "silent promotion f32 with f64 -> f64" in explain(finding)[0]
    assert run(dtype, aten.add.Tensor, t(4, dtype=torch.bfloat16), t(4)) is not None


@pytest.mark.parametrize(
    "other",
    [t(4, dtype=I64), t(4, dtype=B8), t(dtype=F64), t(4)],
    ids=["int", "bool", "0-dim f64", "same"],
)
def test_dtype_ints_bools_scalars_are_not_promotions(other):
    assert run(dtype, aten.mul.Tensor, t(4), other) is None


def test_dtype_copies_and_in_place_ops_are_not_promotions():
    assert dtype.for_op(aten.copy_.default) is None
    assert dtype.for_op(aten.add_.Tensor) is None


# -- broadcast -------------------------------------------------------------------------------

def test_broadcast_shape():
    assert broadcast.broadcast_shape([(4,), (4, 1)]) == (4, 4)
    assert broadcast.broadcast_shape([(2, 1, 3), (5, 1)]) == (2, 5, 3)
    assert broadcast.broadcast_shape([(3,), (4,)]) is None


def test_broadcast_vector_minus_column_is_flagged():
    finding = run(broadcast, aten.sub.Tensor, t(4), t(4, 1, ident=7))
    assert finding.kind == "broadcast" and finding.rule == "broadcast.implicit"
    facts = finding.facts
    assert (facts["vector"], facts["column"], facts["dims"]) == (t(4), t(4, 1, ident=7), [-1])
    assert (facts["result"], facts["growth"], facts["made_by"]) == ((4, 4), 4, PRODUCER)
    problem = explain(finding)[0]
    assert "f32[4] cpu gets new leading dims" in problem
    assert "f32[4, 1] cpu (made by aten.addmm at model.py:3) is stretched along dim 1" in problem
    assert "[4, 4], 4x more elements" in problem


def test_broadcast_column_made_on_purpose_is_not_flagged():
    assert run(broadcast, aten.sub.Tensor, t(4), t(4, 1, ident=7), context=StubContext({7: {-1}})) is None


@pytest.mark.parametrize(
    "a, b",
    [
        (t(8, 5), t(8, 1)),  # x - x.mean(-1, keepdim=True): no growth
        (t(2, 1, 1, 6), t(2, 4, 6, 6)),  # attention mask: no growth
        (t(5, 1), t(1, 7)),  # both sides explicit: an outer product written out
        (t(3), t(3)),
        (t(), t(4, 4)),
    ],
)
def test_broadcast_deliberate_shapes_are_not_flagged(a, b):
    assert run(broadcast, aten.add.Tensor, a, b) is None


def test_broadcast_applies_to_pointwise_out_of_place_ops_only():
    assert broadcast.for_op(aten.mul.Tensor) is not None
    assert broadcast.for_op(aten.add_.Tensor) is None
    assert broadcast.for_op(aten.mm.default) is None


def test_broadcast_ignores_shapeless_nested_tensors():
    assert broadcast.check(aten.add.Tensor, (TensorMeta(None, F32, CPU, 0), t(4, 1)), StubContext()) is None
