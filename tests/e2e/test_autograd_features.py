"""opwatch with autograd's features: grad modes (``no_grad``, ``inference_mode``, ``enable_grad``
inside ``no_grad``), autocast, activation checkpointing (reentrant and not) and double backward;
backward ops, recomputed ones included, point at the forward line that made them.

Where they apply, the common promises of :func:`equivalence.assert_transparent` are asserted:
no ``OpwatchWarning``, no anomaly, a result bitwise equal to the unwatched reference.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import opwatch

from support.equivalence import assert_transparent, ops, run_reference  # noqa: E402
from support.helpers import MLP, line_of  # noqa: E402

HERE = os.path.abspath(__file__)
MLP_FILE = MLP.forward.__code__.co_filename  # where the MLP's ops are attributed


# --------------------------------------------------------------------------------------------
# grad modes and autocast
# --------------------------------------------------------------------------------------------


def test_no_grad_inference_mode_and_enable_grad_inside_no_grad():
    def fn():
        model = MLP()
        x = torch.randn(3, 4)
        with torch.no_grad():
            a = model(x)
            with torch.enable_grad():
                b = model(x).sum()
                b.backward()
        with torch.inference_mode():
            c = model(x) * 2
        with torch.set_grad_enabled(False):
            d = model(x)
        return a, b, c, d, model.fc1.weight.grad, c.is_inference()

    got, w = assert_transparent(fn)
    assert got[-1] is True
    phases = [r.phase for r in w.records]
    assert phases.count("backward") > 0
    # Ops run under no_grad / inference_mode are forward ops of the model's modules.
    assert {r.module for r in w.records if r.op == "aten.addmm.default" and r.phase == "forward"} == {"fc1", "fc2"}


def test_autocast_cpu_bfloat16_forward_and_backward():
    def fn():
        model = MLP()
        x = torch.randn(3, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = out.float().pow(2).mean()
        loss.backward()
        return out, loss, model.fc1.weight.grad, model.fc2.bias.grad

    got, w = assert_transparent(fn)
    assert got[0].dtype == torch.bfloat16
    forward_addmm = [r for r in w.records if r.op == "aten.addmm.default" and r.phase == "forward"]
    # autocast's casts happen below the autocast key: the watch sees bfloat16 operands.
    assert [{m.dtype for m in r.inputs} for r in forward_addmm] == [{torch.bfloat16}, {torch.bfloat16}]
    assert [r.module for r in forward_addmm] == ["fc1", "fc2"]
    backward_mm = [r for r in w.records if r.op == "aten.mm.default" and r.phase == "backward"]
    assert backward_mm and {r.module for r in backward_mm} <= {"fc1", "fc2"}
    assert all(r.filename == MLP_FILE for r in backward_mm)  # the forward line, in MLP.forward


# --------------------------------------------------------------------------------------------
# activation checkpointing
# --------------------------------------------------------------------------------------------


def checkpointed_block(x):
    h = x.sin()  # @ckpt-sin
    return h.cos()  # @ckpt-cos


def _checkpoint_run(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(4, requires_grad=True)
    out = checkpoint(checkpointed_block, x, use_reentrant=use_reentrant)
    loss = out.sum()  # @ckpt-loss
    if use_reentrant:  # reentrant checkpointing does not support autograd.grad
        loss.backward()  # @ckpt-backward
        return out, loss, x.grad
    (grad,) = torch.autograd.grad(loss, x)  # @ckpt-grad
    return out, loss, grad


def test_checkpoint_non_reentrant_recomputed_forward_points_at_its_own_line():
    got, w = assert_transparent(lambda: _checkpoint_run(False))
    sin_line, cos_line = line_of("# @ckpt-sin", HERE), line_of("# @ckpt-cos", HERE)
    forward_sin = [r for r in w.records if r.op == "aten.sin.default" and r.phase == "forward"]
    assert [r.lineno for r in forward_sin] == [sin_line]
    # The recomputation runs during backward; its ops point at the block's own line.
    recomputed = [r for r in w.records if r.op == "aten.sin.default" and r.phase == "backward" and r.lineno == sin_line]
    assert len(recomputed) == 1, [(r.op, r.where, r.phase) for r in w.records]
    assert recomputed[0].filename == HERE
    # No backward op is attributed to the line that started the backward pass.
    grad_line = line_of("# @ckpt-grad", HERE)
    assert [r for r in w.records if r.phase == "backward" and r.lineno == grad_line] == []
    # cos's backward (-sin(h) * grad) points at the cos line.
    backward_lines = {r.lineno for r in w.records if r.phase == "backward"}
    assert cos_line in backward_lines


def test_checkpoint_reentrant_recomputed_forward_points_at_its_own_line():
    got, w = assert_transparent(lambda: _checkpoint_run(True))
    sin_line, cos_line = line_of("# @ckpt-sin", HERE), line_of("# @ckpt-cos", HERE)
    recomputed = [(r.op, r.lineno) for r in w.records if r.phase == "backward" and r.op in ("aten.sin.default", "aten.cos.default")]
    assert ("aten.sin.default", sin_line) in recomputed
    assert ("aten.cos.default", cos_line) in recomputed
    backward_line = line_of("# @ckpt-backward", HERE)
    assert [r for r in w.records if r.phase == "backward" and r.lineno == backward_line] == []


def test_checkpoint_reentrant_backward_of_the_recomputed_graph_points_at_the_block():
    """The inner backward that reentrant checkpointing runs over the recomputed graph consists
    of backward ops like any other: they carry the forward line that created them."""
    got, w = assert_transparent(lambda: _checkpoint_run(True))
    sin_line, cos_line = line_of("# @ckpt-sin", HERE), line_of("# @ckpt-cos", HERE)
    loss_line = line_of("# @ckpt-loss", HERE)
    # AccumulateGrad detaching the gradients it stores (of x, and of the detached input of the
    # inner backward) belongs to no forward op: leave those out.
    backward = [r for r in w.records if r.phase == "backward" and r.op != "aten.detach.default"]
    unattributed = [(r.index, r.op, r.where) for r in backward if r.filename is None]
    assert unattributed == [], f"backward ops without a line: {unattributed}"
    assert {r.lineno for r in backward} <= {sin_line, cos_line, loss_line}


def test_checkpoint_of_a_submodule_keeps_module_paths():
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            h = checkpoint(self.block, x, use_reentrant=False)  # @ckpt-module
            return self.head(h)

    def fn():
        net = Net()
        loss = net(torch.randn(2, 4)).sum()
        loss.backward()
        return loss, net.block[0].weight.grad, net.head.weight.grad

    got, w = assert_transparent(fn)
    line = line_of("# @ckpt-module", HERE)
    addmm = [(r.module, r.module_class, r.lineno, r.phase) for r in w.records if r.op == "aten.addmm.default"]
    # forward: block.0 and head; recomputation in backward: block.0 again, same line and path.
    assert addmm == [("block.0", "Linear", line, "forward"), ("head", "Linear", line + 1, "forward"), ("block.0", "Linear", line, "backward")]
    tanh = [(r.module, r.module_class, r.phase) for r in w.records if r.op == "aten.tanh.default"]
    assert tanh == [("block.1", "Tanh", "forward"), ("block.1", "Tanh", "backward")]


# --------------------------------------------------------------------------------------------
# double backward
# --------------------------------------------------------------------------------------------


def _double_backward():
    x = torch.randn(4, requires_grad=True)
    y = (x**3).sum()  # @double-pow
    (g,) = torch.autograd.grad(y, x, create_graph=True)  # @double-first
    gsum = g.sum()  # @double-gsum
    (gg,) = torch.autograd.grad(gsum, x)
    return y, g, gg


def test_double_backward_is_transparent():
    got, w = assert_transparent(_double_backward)
    torch.testing.assert_close(got[2], 6 * run_reference(lambda: torch.randn(4), plain=True))


def test_double_backward_ops_point_at_the_forward_line():
    """The graph built by the first backward (create_graph=True) is differentiated by the
    second; its nodes were made by the backward of ``x ** 3``, so their backward ops belong to
    that line, not to no line at all."""
    got, w = assert_transparent(_double_backward)
    pow_line, gsum_line = line_of("# @double-pow", HERE), line_of("# @double-gsum", HERE)
    second = [r for r in w.records if r.phase == "backward" and r.index > next(q.index for q in w.records if q.lineno == gsum_line)]
    assert second, ops(w.records)
    unattributed = [(r.index, r.op, r.where) for r in second if r.filename is None]
    assert unattributed == [], f"double-backward ops without a line: {unattributed}"
    assert {r.lineno for r in second} <= {pow_line, gsum_line}


# --------------------------------------------------------------------------------------------
# a custom autograd.Function's backward: its ops run on its own lines
# --------------------------------------------------------------------------------------------


class SqrtWithItsOwnGradient(torch.autograd.Function):
    """``sqrt`` of the clamped input, with a backward written by hand (as research code does)."""

    @staticmethod
    def forward(ctx, x):
        y = x.clamp_min(0).sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad / (2 * y)  # @custom-backward: y is 0 where the input was not positive


def _train_with_a_custom_backward(clamp_from: float):
    torch.manual_seed(0)
    first, second = nn.Linear(8, 16), nn.Linear(16, 1)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=1e-2)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(2):
            loss = second(SqrtWithItsOwnGradient.apply(first(torch.randn(16, 8)) + clamp_from)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return w


def test_a_custom_backward_s_op_is_told_as_run_by_its_own_line_not_as_a_forward_op_s_gradient():
    (found, *_) = [a for a in _train_with_a_custom_backward(clamp_from=0.0).anomalies if a.kind in ("nan", "inf")]
    assert (found.op, found.lineno, found.phase) == ("aten.div.Tensor", line_of("# @custom-backward", HERE), "backward")
    assert "(a backward op your own code ran: a custom autograd.Function's backward, a hook, or a checkpoint recomputing its forward)" in found.message
    assert "whose gradient it computes" not in found.message, found.message


def test_the_same_custom_backward_on_positive_inputs_reports_nothing():
    assert _train_with_a_custom_backward(clamp_from=10.0).anomalies == []
