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
import re
import threading
import warnings
from typing import NamedTuple

import torch

from ..core.compat import count_compiled_calls, dynamo_loaded, force_eager_stance
from ..core.fact_tuples import fact_tuple
from ..core.sites import display_path

__all__ = ["EagerCompiled", "hold", "release", "eager_calls"]


@fact_tuple("eager_compiled")
class EagerCompiled(NamedTuple):
    """One compiled callable that ran eagerly under a watch: its name (a module's class, or a
    function's qualified name), whether it is a ``"module"`` or a ``"function"``, its
    ``file:line`` and how many calls ran eagerly."""

    name: str
    kind: str
    where: str
    calls: int


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
                calls[fn] = calls.get(fn, 0) + 1


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
    for fn, count in calls.items():
        key = _described(fn)
        merged[key] = merged.get(key, 0) + count
    facts = [EagerCompiled(name, kind, where, count) for (name, kind, where), count in merged.items()]
    return sorted(facts, key=lambda fact: -fact.calls)


def _described(fn) -> tuple[str, str, str]:
    for _ in range(8):  # Dynamo's own wrappers keep the function in __wrapped__
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        cls = type(owner)
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        return cls.__name__, "module", _where(code)
    _, _, name = (getattr(fn, "__qualname__", None) or type(fn).__name__).rpartition("<locals>.")
    return name, "function", _where(getattr(fn, "__code__", None))


def _where(code) -> str:
    if code is None:
        return "?"
    return f"{display_path(code.co_filename)}:{code.co_firstlineno}"
