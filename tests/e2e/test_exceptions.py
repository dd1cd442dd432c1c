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


# -- notes opwatch adds: part of an AnomalyError's message; the program's own exception keeps its own


def _strict_error(stream) -> opwatch.AnomalyError:
    model = MLP()
    with pytest.raises(opwatch.AnomalyError) as caught:
        with opwatch.strict(file=stream):
            (torch.randn(4) - model(torch.randn(4, 4))[:, :1]).pow(2).mean()  # (4,) - (4, 1)
    return caught.value


def test_a_note_on_an_anomaly_error_is_part_of_its_message_once():
    error = _strict_error(io.StringIO())
    before = str(error)
    error.add_note("opwatch.guard: a replay note")
    error.add_note("compiled: a verdict")
    assert str(error) == f"{before}\nopwatch.guard: a replay note\ncompiled: a verdict"
    assert error.notes == ("opwatch.guard: a replay note", "compiled: a verdict")
    assert error.anomaly.message == before  # the anomaly's own message is unchanged
    assert not getattr(error, "__notes__", None)  # a traceback prints the message: the notes once
    with pytest.raises(TypeError, match="must be a str"):
        error.add_note(3)


def test_a_note_on_the_programs_own_exception_without_add_note():
    """Python 3.10 has no BaseException.add_note: the note goes to __notes__ (PEP 678), the
    exception's type, message and arguments stay as they were."""
    from opwatch.findings.anomaly import add_note

    class OldPythonError(ValueError):
        @property
        def add_note(self):  # what Python 3.10 looks like to hasattr()
            raise AttributeError("add_note")

    error = OldPythonError("the program's words")
    add_note(error, "first")
    add_note(error, "second")
    assert error.__notes__ == ["first", "second"]
    assert str(error) == "the program's words" and error.args == ("the program's words",)
    mine = UserError("mine")
    add_note(mine, "a note")
    assert mine.__notes__ == ["a note"] and str(mine) == "mine"
