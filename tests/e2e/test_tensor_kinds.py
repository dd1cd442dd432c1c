"""Every kind of tensor under a watch: opwatch stays transparent and raises no false alarm.

Each case runs the same function twice, once under a do-nothing ``TorchDispatchMode``
(:class:`equivalence.PassthroughMode`, the reference: merely having a dispatch mode active can
change a few backward formulas, which is PyTorch's doing) and once under ``opwatch.watch()``,
reseeding the RNG before each run. Every case asserts

- no crash and no ``OpwatchWarning`` at all (neither an internal error nor an anomaly warning),
- the watched result equals the reference bitwise (:func:`equivalence.diff`: dtype, shape,
  strides, layout, conj/neg/zero-tensor bits, grad_fn type and the raw bits of the values, so
  nan payloads and signed zeros must match; sparse tensors are compared densified, quantized
  ones by their integer representation, nested ones component by component),
- ``w.anomalies == []`` (the code is healthy),

plus whatever the records show that is specific to the kind of tensor.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch

import opwatch

from support.equivalence import assert_transparent, ops  # noqa: E402

HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def records_of(w, op):
    """The records of ``op`` in watch ``w``; fails, listing what was recorded, if there are none."""
    found = [r for r in w.records if r.op == op]
    assert found, f"{op} not recorded; saw {ops(w.records)}"
    return found


# --------------------------------------------------------------------------------------------
# meta and fake tensors
# --------------------------------------------------------------------------------------------


def test_meta_tensors_forward_and_backward():
    def fn():
        a = torch.randn(3, 4, device="meta", requires_grad=True)
        b = torch.randn(4, 5, device="meta")
        out = (a @ b).relu().sum()
        out.backward()
        return out, a.grad

    got, w = assert_transparent(fn, values=False)
    mm = records_of(w, "aten.mm.default")[0]
    assert [(tuple(m.shape), m.device.type) for m in mm.inputs] == [((3, 4), "meta"), ((4, 5), "meta")]
    assert [(tuple(m.shape), m.device.type) for m in mm.outputs] == [((3, 5), "meta")]
    assert {r.phase for r in w.records} == {"forward", "backward"}


def test_fake_tensor_mode_entered_inside_the_watch():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def fn():
        with FakeTensorMode():
            a = torch.randn(3, 4)
            b = torch.randn(4, 5)
            return (a @ b).relu().sum(), a

    got, w = assert_transparent(fn, values=False)
    assert type(got[0]) is FakeTensor
    # The fake mode, entered last, is innermost: it runs each op through the watch beneath it,
    # so the watch records every op, with the fake tensors' shapes.
    assert ops(w.records) == ["aten.randn.default", "aten.randn.default", "aten.mm.default", "aten.relu.default", "aten.sum.default"]
    assert tuple(records_of(w, "aten.mm.default")[0].outputs[0].shape) == (3, 5)


# --------------------------------------------------------------------------------------------
# sparse
# --------------------------------------------------------------------------------------------


def test_sparse_coo():
    def fn():
        indices = torch.tensor([[0, 1, 1], [2, 0, 2]])
        values = torch.tensor([3.0, 4.0, 5.0], requires_grad=True)
        s = torch.sparse_coo_tensor(indices, values, (2, 3))
        dense = torch.randn(3, 2, requires_grad=True)
        product = torch.sparse.mm(s, dense)
        product.sum().backward()
        doubled = (s + s).coalesce()
        return product, doubled, doubled.indices(), doubled.values(), s.to_dense(), dense.grad, values.grad

    got, w = assert_transparent(fn)
    assert got[1].layout == torch.sparse_coo and got[1].is_coalesced()
    assert "aten._sparse_coo_tensor_with_dims_and_tensors.default" in ops(w.records)
    assert any(r.phase == "backward" for r in w.records)


def test_sparse_csr():
    def fn():
        dense = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
        csr = dense.to_sparse_csr()
        other = torch.randn(3, 2)
        return csr @ other, csr.to_dense(), csr.crow_indices(), csr.col_indices(), csr.values(), (csr * 2).to_dense()

    got, w = assert_transparent(fn)
    assert got[1].layout == torch.strided
    assert any("sparse_csr" in op for op in ops(w.records)), ops(w.records)


# --------------------------------------------------------------------------------------------
# complex, conj and neg views
# --------------------------------------------------------------------------------------------


def test_complex_forward_backward_and_conj_views():
    def fn():
        z = torch.randn(4, dtype=torch.complex64, requires_grad=True)
        w_ = torch.randn(4, dtype=torch.complex64)
        conj = w_.conj()  # a lazy conjugate view: the conj bit is set
        prod = z * conj
        spectrum = torch.fft.fft(prod)
        loss = spectrum.abs().sum() + prod.angle().sum()
        loss.backward()
        return prod, spectrum, loss, z.grad, conj, torch.view_as_real(prod), w_.imag.neg()

    got, w = assert_transparent(fn)
    assert got[4].is_conj()
    dtypes = {m.dtype for r in w.records for m in r.inputs}
    assert torch.complex64 in dtypes


def test_complex_nan_is_a_nan_origin():
    """Complex outputs are checked too (through view_as_real): the first nan is found."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with opwatch.watch(warn=False) as w:
            z = torch.zeros(3, dtype=torch.complex64)
            q = z / z  # 0 / 0 = nan + nanj
    assert [(a.kind, a.op) for a in w.anomalies] == [("nan", "aten.div.Tensor")]
    assert torch.isnan(torch.view_as_real(q)).all()


# --------------------------------------------------------------------------------------------
# quantized
# --------------------------------------------------------------------------------------------


def test_quantized_per_tensor_and_per_channel():
    def fn():
        x = torch.randn(4, 4)
        q = torch.quantize_per_tensor(x, 0.1, 3, torch.quint8)
        qc = torch.quantize_per_channel(x, torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0, 1, 2, 3]), 0, torch.qint8)
        relu = torch.relu(q)
        return q, qc, relu, q.dequantize(), qc.int_repr(), q.q_scale(), q.q_zero_point()

    got, w = assert_transparent(fn)
    assert got[0].is_quantized and got[2].is_quantized
    dtypes = {m.dtype for r in w.records for m in (r.outputs or ())}
    assert {torch.quint8, torch.qint8} <= dtypes


# --------------------------------------------------------------------------------------------
# nested tensors
# --------------------------------------------------------------------------------------------


def test_nested_tensor_strided_layout():
    def fn():
        nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
        out = (nt * 2).relu() + nt
        return out, out.unbind()

    assert_transparent(fn)


def test_nested_tensor_jagged_layout():
    def fn():
        nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
        out = nt.sin() * 2
        return out, out.values()

    got, w = assert_transparent(fn)
    assert got[0].is_nested


# --------------------------------------------------------------------------------------------
# zero tensors
# --------------------------------------------------------------------------------------------


def test_efficient_zero_tensor_arithmetic():
    def fn():
        z = torch._efficientzerotensor((3, 3))
        ones = torch.ones(3, 3)
        return z, z + ones, z * ones, ones - z, z.t()

    got, w = assert_transparent(fn)
    assert got[0]._is_zerotensor()
    assert "aten._efficientzerotensor.default" in ops(w.records)


def test_zero_tensors_made_by_forward_mode_autodiff():
    import torch.autograd.forward_ad as fwAD

    def fn():
        with fwAD.dual_level():
            primal = torch.randn(3)
            dual = fwAD.make_dual(primal, torch.ones(3))
            # The tangent of the plain operand is an efficient zero tensor inside autograd.
            out = dual * torch.randn(3) + torch.randn(3).sin()
            unpacked = fwAD.unpack_dual(out)
            return unpacked.primal.clone(), unpacked.tangent.clone()

    got, w = assert_transparent(fn)
    assert "aten._efficientzerotensor.default" in ops(w.records)


def test_zero_tensors_in_jvp():
    from torch.func import jvp

    def fn():
        a, b = torch.randn(3), torch.randn(3)
        return jvp(lambda x, y: x * y + y.sin(), (a, b), (torch.ones(3), torch.zeros(3)))

    assert_transparent(fn)


# --------------------------------------------------------------------------------------------
# views and in-place ops
# --------------------------------------------------------------------------------------------


def test_views_written_in_place():
    def fn():
        x = torch.arange(12.0).reshape(3, 4)
        t = x.t()
        t.add_(1)
        x[1].mul_(2)
        x.diagonal().zero_()
        x[:, ::2].clamp_(max=5)
        y = x.view(2, 6)
        y[0, 1:3] = torch.tensor([-1.0, -2.0])
        x.unsqueeze(0).squeeze_(0).neg_()
        return x, t, y, x._version

    got, w = assert_transparent(fn)
    assert "aten.add_.Tensor" in ops(w.records)
    # An in-place op's output is its (view) target; the record keeps the view's shape.
    add = records_of(w, "aten.add_.Tensor")[0]
    assert tuple(add.outputs[0].shape) == (4, 3)


def test_in_place_on_a_view_with_autograd():
    def fn():
        leaf = torch.randn(3, 4, requires_grad=True)
        x = leaf.clone()
        x[:, 1].mul_(3)
        x.t()[0].add_(leaf[:, 0])
        x.relu_()
        loss = (x * x).sum()
        loss.backward()
        return x, leaf.grad, loss

    got, w = assert_transparent(fn)
    assert any(r.phase == "backward" for r in w.records)
    assert all(r.filename == HERE for r in w.records if r.phase == "forward")


def test_out_variants_and_resize():
    def fn():
        out = torch.empty(0)
        torch.add(torch.ones(2, 3), torch.ones(2, 3), out=out)  # resizes out
        buf = torch.zeros(4)
        torch.mul(torch.arange(4.0), 2, out=buf)
        return out, buf

    got, w = assert_transparent(fn)
    assert "aten.add.out" in ops(w.records)


# --------------------------------------------------------------------------------------------
# non-contiguous and 0-size
# --------------------------------------------------------------------------------------------


def test_non_contiguous_tensors():
    def fn():
        base = torch.randn(4, 6, requires_grad=True)
        t = base.t()
        strided = base[:, ::2]
        expanded = torch.randn(1, 6).expand(4, 6)
        permuted = torch.randn(2, 3, 4).permute(2, 0, 1)
        as_strided = torch.arange(10.0).as_strided((3, 3), (1, 2))
        out = (t.T * expanded).sum(0) + strided.sum()
        out.sum().backward()
        return out, permuted.contiguous(), permuted.sum(1), as_strided * 2, t @ base, base.grad, strided.stride()

    got, w = assert_transparent(fn)
    # The record keeps the shapes of the non-contiguous operands as the program saw them.
    mm = records_of(w, "aten.mm.default")[0]
    assert [tuple(m.shape) for m in mm.inputs] == [(6, 4), (4, 6)]


def test_zero_size_tensors():
    def fn():
        e = torch.randn(0, 3, requires_grad=True)
        s = e.sum(0)
        m = e.t() @ torch.randn(0, 5)  # (3, 0) @ (0, 5) = zeros(3, 5)
        c = torch.cat([e, torch.ones(2, 3)])
        r = (e * 2).relu().sum(0) + torch.ones(3)
        (s.sum() + m.sum() + c.sum() + r.sum()).backward()
        # No elements, so no inf or nan: log(0) and 0/0 over empty tensors are clean.
        return s, m, c, r, e.grad, torch.zeros(0).log(), torch.ones(0, 4) / torch.zeros(0, 4)

    got, w = assert_transparent(fn)
    assert tuple(records_of(w, "aten.mm.default")[0].outputs[0].shape) == (3, 5)
    assert tuple(records_of(w, "aten.mul.Tensor")[0].inputs[0].shape) == (0, 3)


# --------------------------------------------------------------------------------------------
# tensor subclasses
# --------------------------------------------------------------------------------------------


class PlainSubclass(torch.Tensor):
    """A Python subclass without any torch function/dispatch override."""


class TracingSubclass(torch.Tensor):
    """A ``__torch_function__`` subclass that counts the calls it sees."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_python_subclass_and_parameter():
    def fn():
        a = torch.randn(3).as_subclass(PlainSubclass)
        p = torch.nn.Parameter(torch.randn(3))
        out = (a * 2 + p).sum()
        out.backward()
        return a * 2, out, p.grad

    got, w = assert_transparent(fn)
    assert type(got[0]) is PlainSubclass


def test_torch_function_subclass():
    def fn():
        a = torch.randn(3, 3).as_subclass(TracingSubclass)
        return (a @ a).relu().sum(0)

    TracingSubclass.calls = 0
    got, w = assert_transparent(fn)
    assert type(got) is TracingSubclass
    assert TracingSubclass.calls > 0
    assert "aten.mm.default" in ops(w.records)


def test_wrapper_subclass_two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor

    def fn():
        a = TwoTensor(torch.randn(3), torch.randn(3))
        out = (a * 2 + a).sin()
        return out, out.a, out.b

    got, w = assert_transparent(fn)
    assert type(got[0]) is TwoTensor
    # The watch sees the op once, at the wrapper's level, from the user's line.
    sins = records_of(w, "aten.sin.default")
    assert len(sins) == 1 and sins[0].filename == HERE


# --------------------------------------------------------------------------------------------
# values that carry nan/inf on purpose
# --------------------------------------------------------------------------------------------


def test_deliberate_non_finite_constants_are_not_anomalies():
    def fn():
        x = torch.randn(4, 5)
        mask = torch.rand(4, 5) > 0.5
        mask[:, 0] = False  # no row is fully masked: softmax stays finite
        masked = x.masked_fill(mask, float("-inf"))
        soft = masked.softmax(-1)
        filled = torch.full((3,), float("nan"))
        return masked, soft, torch.nansum(filled), filled, torch.where(mask, x, math.inf)

    got, w = assert_transparent(fn)
    assert torch.isinf(got[0]).any() and torch.isnan(got[3]).all()
    assert torch.isfinite(got[1]).all()
