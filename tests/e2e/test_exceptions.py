"""The program's own exceptions pass through a watch unchanged: the same object, type, message
and arguments, whether raised in the block, by an op, or inside a backward hook; and the module
stack recovers after an exception inside a module."""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch
from torch import nn

import opwatch

from support.equivalence import ops  # noqa: E402
from support.helpers import MLP  # noqa: E402


class UserError(Exception):
    pass


@pytest.mark.parametrize(
    "make", [lambda: UserError("mine"), lambda: KeyboardInterrupt(), lambda: SystemExit(3), lambda: GeneratorExit()],
    ids=["Exception", "KeyboardInterrupt", "SystemExit", "GeneratorExit"],
)
@pytest.mark.parametrize("strict", [False, True])
def test_user_exceptions_pass_through_as_the_same_object(make, strict):
    error = make()
    args_before = error.args
    stream = io.StringIO()
    with pytest.raises(BaseException) as caught:
        with (opwatch.strict if strict else opwatch.watch)(file=stream) as w:
            torch.ones(2).sin()
            raise error
    assert caught.value is error
    assert type(caught.value) is type(error)
    assert caught.value.args == args_before
    assert not getattr(error, "__notes__", None)  # not raised by an op: nothing added
    assert ops(w.records) == ["aten.ones.default", "aten.sin.default"]


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit, UserError])
def test_exceptions_raised_inside_a_backward_hook_pass_through(kind):
    def fn():
        x = torch.randn(3, requires_grad=True)
        y = x * 2

        def hook(grad):
            raise kind("from the hook")

        y.register_hook(hook)
        y.sum().backward()

    with pytest.raises(BaseException) as unwatched:
        fn()
    with pytest.raises(BaseException) as watched:
        with opwatch.watch(file=io.StringIO()):
            fn()
    assert type(watched.value) is type(unwatched.value) is kind
    assert str(watched.value) == str(unwatched.value)


def test_an_op_error_keeps_its_type_and_message():
    def fn():
        return torch.ones(2, 3) @ torch.ones(2, 3)

    with pytest.raises(RuntimeError) as unwatched:
        fn()
    with pytest.raises(RuntimeError) as watched:
        with opwatch.watch(file=io.StringIO()):
            fn()
    assert type(watched.value) is type(unwatched.value)
    assert str(watched.value) == str(unwatched.value)
    assert watched.value.args == unwatched.value.args


def test_module_paths_recover_after_an_exception_inside_a_module():
    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def forward(self, x):
            self.inner(x)
            raise UserError("boom")

    with pytest.raises(UserError):
        with opwatch.watch(file=io.StringIO()):
            Exploding()(torch.ones(1, 2))
    model = MLP()
    with opwatch.watch() as w:
        torch.ones(2).sin()
        model(torch.ones(1, 4))
    # Nothing is left on the module stack by the exception: ops outside modules have no path.
    assert [(r.op, r.module) for r in w.records[:3]] == [
        ("aten.ones.default", None), ("aten.sin.default", None), ("aten.ones.default", None)
    ]
    assert {r.module for r in w.records[3:]} <= {"MLP", "fc1", "fc2"}
    assert [r.module for r in w.records if r.op == "aten.addmm.default"] == ["fc1", "fc2"]
