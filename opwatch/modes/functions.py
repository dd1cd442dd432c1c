"""The private ``TorchFunctionMode`` that sees the calls of a small table of torch functions:
those that reject a device or a dtype before any ATen op reaches the dispatch mode
(:mod:`opwatch.checks.pre_dispatch` holds the table and the judges).

Every torch function call, tensor method and tensor attribute read of the watched thread passes
through ``__torch_function__`` while the mode is active; a call of a function outside the table
costs one dict lookup and goes on unchanged. A call of a table function is judged from its
Python arguments, as metadata; a finding is logged as a small entry (its op a
:class:`~opwatch.core.records.ModuleCall` named after the function, ``torch.stft``) at the user's
line that called it, and reported as the module-call checks are: in strict mode the
:class:`~opwatch.AnomalyError` is raised before torch runs the function (and raises its own
error); in ``watch()`` the anomaly is kept and torch's error reaches the program unchanged.

torch runs ``__torch_function__`` with the mode taken off its stack, so the function itself and
opwatch's own work inside the handler do not come back to it. The mode logs into the
interceptor's log, which numbers its calls among the ops, and shares the interceptor's ``inert``
switch (an internal error, a forked child).

The mode stands aside (off the thread's stack) while one of torch's own optimizers runs its
step (:meth:`FunctionWatch.stand_aside`): the step reads and writes tensor attributes (``.grad``)
that would each cost a call here, and calls no function of the table. It steps back in where
the step's profiler region ends (the dispatch mode sees that op, also where the step raised),
or when the watch ends. It stands aside in torch's own ``Optimizer.zero_grad`` and
``Module.zero_grad`` too (:class:`_GradientResets`): they read and write ``.grad`` of every
parameter (two thirds of the mode's calls on a small training step) and call no function of the
table; torch tells of no hook there, so for as long as a watch has the mode entered those two
methods are wrapped, and each call takes the mode off for its length.
"""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (it reads
# __tracebackhide__ in each frame's globals): opwatch's frames are not the user's story.
__tracebackhide__ = True

import functools
import sys
import threading
import traceback
from time import perf_counter_ns

import torch
from torch.overrides import TorchFunctionMode

from ..checks import pre_dispatch
from ..core.compat import (
    MODIFIED_SAVED_TENSOR, current_autograd_node, function_mode_alone, put_function_mode_back, run_uncompiled, skip_dynamo_for_code, sole_function_mode,
    take_function_mode_off,
)
from ..core.records import BACKWARD, FORWARD, ModuleCall
from ..core.sites import user_frame
from ..findings.anomaly import add_note
from ..render import overwritten_save_note
from .saved_tensors import overwritten_save

__all__ = ["FunctionWatch"]

_TENSOR_BACKWARD = torch.Tensor.backward
_BACKWARD = ("backward", None)  # the table value of the calls that start a backward pass


def _backward_calls() -> tuple:
    """The calls that start a backward pass from the tensors they are given (the loss): the
    nan/inf check counts a tensor backward() ran on as a sink. ``Tensor.backward`` as it is now
    too: a wrapper of it (leave-on keeps each loss) is what Tensor.backward hands to the mode.
    Tensor.backward and autograd.grad hand themselves to a function mode; autograd.backward on
    the torch versions whose code does."""
    return (_TENSOR_BACKWARD, torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)

_Tensor = torch.Tensor
# The name torch gives an optimizer step's profiler region: "Optimizer.step#SGD.step".
_STEP_REGION = "Optimizer.step#"


class FunctionWatch(TorchFunctionMode):
    """Judges the calls of :func:`opwatch.checks.pre_dispatch.table`'s functions, and tells the
    watch's ``checks`` (:class:`~opwatch.checks.ActiveChecks`) the tensors each ``backward()``
    runs on. ``interceptor`` is the watch's :class:`~opwatch.modes.interceptor.OpInterceptor`
    (its log, ``inert`` and the exit of findings, ``findings``); ``kinds``: the anomaly kinds
    enabled."""

    def __init__(self, *, modules, interceptor, checks, kinds: frozenset, on_internal_error):
        super().__init__()
        # One lookup a call: the judged functions and the backward calls share the table.
        self._table = {**pre_dispatch.table(), **dict.fromkeys(_backward_calls(), _BACKWARD)}
        self._checks = checks
        self._log = interceptor.log
        self._modules = modules
        self._interceptor = interceptor
        self._kinds = kinds
        self._on_internal_error = on_internal_error
        self._callees: dict = {}  # function -> its ModuleCall stand-in in the log
        self.inert = False
        # Names of the profiler regions open on the thread (record_function: an optimizer step
        # is one), as the interceptor sees them start and end.
        self._regions: list[str] = []
        self._aside_below = 0  # standing aside: back on the stack when fewer regions are open

    def __enter__(self):
        skip_dynamo_for_code(FunctionWatch.__torch_function__.__code__)
        self._interceptor.on_region = self._region
        gradient_resets.enter()
        return super().__enter__()

    def __exit__(self, exc_type, exc, traceback_):
        self._interceptor.on_region = None
        gradient_resets.exit()
        if self._aside_below:  # off the stack already (the interceptor went inert in the step)
            self._aside_below = 0
            return None
        return super().__exit__(exc_type, exc, traceback_)

    def stand_aside(self) -> None:
        """Leave the thread's stack for the optimizer step about to run, until its profiler
        region ends: torch's own optimizer with no closure and no step hook but the watch's (the
        caller checked), so nothing but torch's optimizer code runs until then. Only inside the
        step's region, and where this is the one function mode on the stack: putting it back is
        then putting it on top."""
        regions = self._regions
        if self._aside_below or not regions or not function_mode_alone(self):
            return
        *_, innermost = regions
        if innermost.startswith(_STEP_REGION):
            take_function_mode_off()
            self._aside_below = len(regions)

    def _region(self, opened: bool, args) -> None:
        """A profiler region opened (``args``: its op's arguments, the name first) or ended
        (the interceptor's call)."""
        regions = self._regions
        if opened:
            name = next(iter(args), None)
            regions.append(name if type(name) is str else "")
        elif regions:
            regions.pop()
            if len(regions) < self._aside_below:
                self._aside_below = 0
                put_function_mode_back(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call and tensor attribute read of the thread comes here: one dict lookup.
        entry = self._table.get(func)
        if entry is not None and not (self.inert or self._interceptor.inert):
            if entry is _BACKWARD:
                return self._backward(func, args, kwargs or {})
            self._judge(func, entry, args, kwargs or {}, sys._getframe(1))  # strict: raises here
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)

    def _judge(self, func, entry, args, kwargs, caller) -> None:
        try:
            finding = pre_dispatch.judge(entry, args, kwargs, caller.f_code.co_name)
            if finding is None or finding.kind not in self._kinds:
                return
            name, _ = entry  # (public name, judge): see pre_dispatch.table
            record = self._log_call(func, name, finding, caller)
            error = self._interceptor.findings.deliver(finding, record)  # where its odd tensor was made added
        except Exception as internal:
            self.inert = True
            self._on_internal_error(internal, traceback.format_exc())
            return
        if error is not None:
            raise error

    def _backward(self, func, args, kwargs):
        """``Tensor.backward(loss)``, ``autograd.backward(tensors)``, ``autograd.grad(outputs,
        ...)``: the tensors the engine starts from, told to the checks; then the call, whose
        "modified by an inplace operation" error gets a note naming the op whose backward needed
        the tensor and the op that wrote into it (:mod:`opwatch.modes.saved_tensors`)."""
        roots = []
        try:
            first = next(iter(args), None)
            if first is None:
                first = kwargs.get("tensors", kwargs.get("outputs"))
            roots = [first] if isinstance(first, torch.Tensor) else [root for root in first or () if isinstance(root, torch.Tensor)]
            self._checks.backward_from(roots)
        except Exception as internal:
            self.inert = True
            self._on_internal_error(internal, traceback.format_exc())
        started = self._log.next_index
        try:
            return func(*args, **kwargs)
        except RuntimeError as error:
            if MODIFIED_SAVED_TENSOR in str(error):
                self._explain_overwritten(error, roots, started)
            raise

    def _explain_overwritten(self, error, roots, started) -> None:
        try:
            facts = overwritten_save(error, roots, self._log, self._interceptor.forward_sites, started)
        except Exception as internal:
            self._on_internal_error(internal, traceback.format_exc())
            return
        if facts is not None:
            add_note(error, overwritten_save_note(facts))

    def _log_call(self, func, name, finding, caller):
        """Log the call as an entry of its own, at the user's line, and return its record."""
        log, modules = self._log, self._modules
        code, lasti, _ = user_frame(caller, modules.call_frame, modules.call_answer)
        callee = self._callees.get(func)
        if callee is None:
            callee = self._callees[func] = ModuleCall(name)
        phase = FORWARD if current_autograd_node() is None else BACKWARD
        entry = log.log_call(callee, log.site_id(code, lasti), modules.current, phase, finding.operands, start_ns=perf_counter_ns())
        return log.view(entry)


class _GradientResets:
    """torch's own ``Optimizer.zero_grad`` and ``Module.zero_grad``, wrapped while a
    :class:`FunctionWatch` is entered (on any thread; counted, the last exit puts torch's methods
    back) so that each call runs with the thread's function mode off its stack when that mode is
    a watch's and the only one. Both only read and write ``.grad`` (and zero it through ATen ops,
    which the dispatch mode sees as ever); a subclass's own ``zero_grad`` runs as it is, with the
    mode on."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entered = 0
        self._wrapped: list = []  # (class, its method as it was, the wrapper)

    def enter(self) -> None:
        with self._lock:
            self._entered += 1
            if self._entered > 1:
                return
            for owner in (torch.optim.Optimizer, torch.nn.Module):
                original = owner.__dict__["zero_grad"]
                wrapper = run_uncompiled(_without_the_watch(original))
                self._wrapped.append((owner, original, wrapper))
                owner.zero_grad = wrapper

    def exit(self) -> None:
        with self._lock:
            self._entered -= 1
            if self._entered > 0:
                return
            for owner, original, wrapper in self._wrapped:
                if owner.__dict__.get("zero_grad") is wrapper:  # a wrap put on top of it since stays
                    owner.zero_grad = original
            self._wrapped = []


def _without_the_watch(method):
    """``method``, run with a watch's function mode off the thread's stack for its length."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        mode = sole_function_mode()
        if type(mode) is not FunctionWatch:
            return method(self, *args, **kwargs)
        take_function_mode_off()
        try:
            return method(self, *args, **kwargs)
        finally:
            put_function_mode_back(mode)

    return run


gradient_resets = _GradientResets()
