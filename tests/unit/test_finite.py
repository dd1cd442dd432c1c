"""opwatch.core.finite: the fused finiteness check guard and leave-on share."""

from __future__ import annotations

import pytest
import torch

from opwatch.core.finite import FusedFiniteCheck, finite_by_device
from support import CountingMode


def gradients(*special):
    grads = [torch.randn(3, 4), torch.randn(5, dtype=torch.bfloat16), torch.randn(2, 2, dtype=torch.float16), torch.randn(7, dtype=torch.float64)]
    return grads + list(special)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: torch.tensor([1.0, float("nan")], dtype=torch.bfloat16),
        lambda: torch.tensor([float("inf"), 0.0], dtype=torch.float16),
        lambda: torch.tensor([-float("inf")], dtype=torch.float64),
        lambda: torch.tensor([complex(float("nan"), 0.0)]),
    ],
    ids=["bf16 nan", "fp16 inf", "f64 -inf", "complex nan"],
)
def test_each_non_finite_value_is_found_and_a_healthy_call_after_it_passes(bad):
    check = FusedFiniteCheck()
    assert check(gradients())
    assert not check(gradients(bad()))
    assert check(gradients())  # the flag was cleared (or the check went per device)


def test_a_healthy_call_is_one_kernel_and_one_host_read_and_leaves_the_values_bitwise():
    check = FusedFiniteCheck()
    grads = gradients()
    before = [grad.clone() for grad in grads]
    with CountingMode() as counted:
        assert check(grads)
    assert counted.ops == ["aten._amp_foreach_non_finite_check_and_unscale_.default", "aten._local_scalar_dense.default"]
    assert all(torch.equal(grad, kept) for grad, kept in zip(grads, before)) and not check.by_device


def test_read_only_tensors_join_through_their_largest_magnitude_and_are_never_written():
    check = FusedFiniteCheck()
    loss = torch.tensor([2.0, 3.0], requires_grad=True) * 2  # part of a graph
    version = loss._version
    assert check(gradients(), [loss])
    assert loss._version == version
    assert not check(gradients(), [loss * float("inf")])


def test_gradients_in_a_graph_are_read_not_written():
    weight = torch.ones(3, requires_grad=True)
    (weight ** 3).sum().backward(create_graph=True)  # weight.grad is part of a graph
    version = weight.grad._version
    assert FusedFiniteCheck()([weight.grad])
    assert weight.grad._version == version


def test_integer_and_meta_tensors_are_left_out_and_sparse_ones_read_through_their_values():
    check = FusedFiniteCheck()
    assert check(gradients())
    others = [torch.arange(4), torch.empty(3, device="meta")]
    assert check(gradients(*others))
    sparse_nan = torch.sparse_coo_tensor([[0]], [float("nan")], (2,))
    assert not check(gradients(*others, sparse_nan))
    assert not check(gradients(*others, torch.tensor([float("nan")])))
    assert check(gradients(*others, torch.sparse_coo_tensor([[1]], [1.0], (2,))))


def test_finite_by_device_finds_a_non_finite_value_and_an_empty_list_is_finite():
    assert finite_by_device([])
    assert finite_by_device(gradients())
    assert not finite_by_device(gradients(torch.tensor([float("inf")])))


def test_nonfinite_kind_says_nan_before_inf_and_reads_sparse_values():
    from opwatch.core.finite import nonfinite_kind

    assert nonfinite_kind(torch.tensor([1.0, float("inf"), float("nan")])) == "nan"
    assert nonfinite_kind(torch.tensor([-float("inf")], dtype=torch.bfloat16)) == "inf"
    assert nonfinite_kind(torch.ones(3)) is None
    assert nonfinite_kind(torch.arange(3)) is None and nonfinite_kind(torch.empty(2, device="meta")) is None
    assert nonfinite_kind(torch.sparse_coo_tensor([[0]], [float("inf")], (2,))) == "inf"
    assert nonfinite_kind(torch.tensor([[0.0, float("nan")]]).to_sparse_csr()) == "nan"
    assert nonfinite_kind(torch.tensor([1 + 1j, complex(0, float("inf"))])) == "inf"
    assert nonfinite_kind(torch.tensor([], dtype=torch.float16)) is None


def test_value_extremes_is_the_one_reading_of_values_nan_carrying_through():
    from opwatch.checks.nonfinite.rules import CHECKED_DTYPES as checked_by_the_check
    from opwatch.core.finite import CHECKED_DTYPES, value_extremes

    assert checked_by_the_check is CHECKED_DTYPES  # one list of checked dtypes
    assert value_extremes(torch.tensor([3.0, -2.0, 0.5], dtype=torch.float16)) == (-2.0, 3.0)
    assert value_extremes(torch.tensor([2 - 5j, -1 + 4j])) == (-5.0, 4.0)  # real and imaginary parts
    low, high = value_extremes(torch.tensor([1.0, float("-inf"), float("nan")]))
    assert low != low and high != high  # nan wins over inf, on both sides
    assert value_extremes(torch.tensor([1.0, float("inf")])) == (1.0, float("inf"))
    assert value_extremes(torch.arange(4)) is None and value_extremes(torch.empty(0)) is None


def test_tensors_in_walks_nested_arguments_in_order():
    from opwatch.core.finite import tensors_in

    a, b, c, d = (torch.full((n,), float(n)) for n in (1, 2, 3, 4))
    batch = {"input_ids": a, "extra": [b, (c, "text", 7)], "mask": None}
    assert [t.numel() for t in tensors_in(batch)] == [1, 2, 3]
    assert [t.numel() for t in tensors_in((d, batch))] == [4, 1, 2, 3]
    assert tensors_in("no tensor") == [] and tensors_in(a)[0] is a
