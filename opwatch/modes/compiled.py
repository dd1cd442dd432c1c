"""Compiled code under a watch: while any watch is active, TorchDynamo is in its ``"force_eager"``
stance, so a ``torch.compile``d function runs its Python code eagerly, op by op, where the watch
sees it, and keeps its compiled code and cache for after the watch; each watch counts the
compiled calls its thread made.

Without the stance a dispatch mode makes Dynamo's frame callback give up on the frame with its
default answer, "skip this code from now on": the compiled function would never run compiled
again in the process. The stance keeps Dynamo from looking at the frame at all.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import threading
import warnings
from typing import NamedTuple

import torch

from ..core.compat import count_compiled_calls, dynamo_loaded, force_eager_stance
from ..core.fact_tuples import fact_tuple
from ..core.sites import USER, classify_code, display_path, program_line

__all__ = ["EagerCompiled", "hold", "release", "eager_calls"]


@fact_tuple("eager_compiled")
class EagerCompiled(NamedTuple):
    """One compiled callable that ran eagerly under a watch: its name (a module's class, or a
    function's qualified name), whether it is a ``"module"`` or a ``"function"``, its
    ``file:line`` (where its ``forward`` or the function is defined in the program's code; for
    a module class of torch or of an installed package, ``nn.Sequential``, the program's line
    that first called it) and how many calls ran eagerly."""

    name: str
    kind: str
    where: str
    calls: int


class _Calls:
    """A compiled callable's calls under one watch, and the program's line of the first."""

    __slots__ = ("count", "first_line")

    def __init__(self, first_line):
        self.count = 1
        self.first_line = first_line


class _Stance:
    """The one stance and counting hook while any watch is active (set by the first watch
    entered, put back by the last one left, however they nest or interleave across threads)."""

    def __init__(self):
        self._held: list[tuple[int, dict]] = []  # (thread, that watch's callable -> calls)
        self._restore = None
        self._undo = None
        self._compile = None  # torch.compile while it is wrapped (Dynamo not imported yet)
        self._compile_wrapper = None
        self._quiet = None  # the warnings filter entry of _quiet_hooks_warning
        self._lock = threading.Lock()

    def hold(self, calls: dict) -> None:
        with self._lock:
            if not self._held:
                self._set()
                self._quiet = _quiet_hooks_warning()
            self._held.append((threading.get_ident(), calls))

    def release(self, calls: dict) -> None:
        with self._lock:
            held = [(thread, counted) for thread, counted in self._held if counted is not calls]
            if len(held) == len(self._held):
                return
            self._held = held
            if held:
                return
            undo, restore, self._undo, self._restore = self._undo, self._restore, None, None
            compile_, self._compile = self._compile, None
            quiet, self._quiet = self._quiet, None
        if quiet in warnings.filters:
            warnings.filters.remove(quiet)
        if compile_ is not None and torch.compile is self._compile_wrapper:
            torch.compile = compile_
        if undo is not None:
            undo()
        if restore is not None:
            restore()

    def _set(self) -> None:
        """The stance and the counting hook, or, while nothing is compiled yet (no Dynamo, and
        no ~1 s import of it for a program that never compiles), a wrapper on ``torch.compile``
        that sets them once a program compiles something under the watch (``nn.Module.compile``
        calls it too)."""
        if dynamo_loaded():
            self._restore = force_eager_stance()
            self._undo = count_compiled_calls(self._called) if self._restore is not None else None
            return
        original = self._compile = torch.compile

        @functools.wraps(original)
        def compile_(*args, **kwargs):
            compiled = original(*args, **kwargs)
            with self._lock:
                if self._held and self._restore is None and dynamo_loaded():
                    self._set()
            return compiled

        self._compile_wrapper = torch.compile = compile_

    def _called(self, fn) -> None:
        thread = threading.get_ident()
        for held_by, calls in self._held:
            if held_by == thread:
                counted = calls.get(fn)
                if counted is None:  # the first call: the program's line that made it
                    calls[fn] = _Calls(program_line(sys._getframe(1)))
                else:
                    counted.count += 1


def _quiet_hooks_warning():
    """Ignore, while watches are active, the warning torch gives at each call of a
    ``torch.compile``d module while global module hooks exist (the watch's module paths are
    such hooks; they name the compiled module's paths as the model's own). Returns the entry."""
    entry = ("ignore", re.compile(_HOOKS_WARNING), UserWarning, None, 0)  # as warnings.filterwarnings makes it
    warnings.filters.insert(0, entry)
    return entry


# The start of torch's warning (torch._dynamo.eval_frame.OptimizedModule.__call__), as a regex.
_HOOKS_WARNING = "Using `torch\\.compile\\(module\\)`"


_STANCE = _Stance()
hold = _STANCE.hold
release = _STANCE.release


def eager_calls(calls: dict) -> list[EagerCompiled]:
    """A watch's counts as facts, most calls first (callables of one name and place merged)."""
    merged: dict = {}
    for fn, counted in calls.items():
        key = _described(fn, counted.first_line)
        merged[key] = merged.get(key, 0) + counted.count
    facts = [EagerCompiled(name, kind, where, count) for (name, kind, where), count in merged.items()]
    return sorted(facts, key=lambda fact: -fact.calls)


def _described(fn, called_at=None) -> tuple[str, str, str]:
    for _ in range(8):  # Dynamo's own wrappers keep the function in __wrapped__
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        cls = type(owner)
        forward = getattr(cls, "forward", None)
        try:  # a decorated forward (transformers' @can_return_tuple): the function it wraps
            forward = inspect.unwrap(forward) if forward is not None else None
        except ValueError:  # a cycle of __wrapped__
            pass
        code = getattr(forward, "__code__", None)
        return cls.__name__, "module", _where(code, called_at)
    _, _, name = (getattr(fn, "__qualname__", None) or type(fn).__name__).rpartition("<locals>.")
    return name, "function", _where(getattr(fn, "__code__", None), called_at)


def _where(code, called_at=None) -> str:
    """Where a compiled callable is defined, or, when that is not the program's own code (a
    module class of torch's, an installed package's), where the program first called it."""
    if code is None:
        return called_at or "?"
    if called_at is not None and classify_code(code) != USER:
        return called_at
    return f"{display_path(code.co_filename)}:{code.co_firstlineno}"
