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
that would each cost a call here, and calls no function of the table. It steps back in at the
step's post-hook, or, where the step raised, at the end of its profiler region, which the
dispatch mode sees (or when the watch ends).
"""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (it reads
# __tracebackhide__ in each frame's globals): opwatch's frames are not the user's story.
__tracebackhide__ = True

import sys
import traceback
from time import perf_counter_ns

import torch
from torch.overrides import TorchFunctionMode

from ..checks import pre_dispatch
from ..core.compat import current_autograd_node, function_mode_alone, put_function_mode_back, skip_dynamo_for_code, take_function_mode_off
from ..core.records import BACKWARD, FORWARD, ModuleCall
from ..core.sites import user_frame

__all__ = ["FunctionWatch"]

_Tensor = torch.Tensor


class FunctionWatch(TorchFunctionMode):
    """Judges the calls of :func:`opwatch.checks.pre_dispatch.table`'s functions. ``interceptor``
    is the watch's :class:`~opwatch.modes.interceptor.OpInterceptor` (its log, ``inert`` and the
    exit of findings, ``findings``); ``kinds``: the anomaly kinds enabled."""

    def __init__(self, *, modules, interceptor, kinds: frozenset, on_internal_error):
        super().__init__()
        self._table = pre_dispatch.table()
        self._log = interceptor.log
        self._modules = modules
        self._interceptor = interceptor
        self._kinds = kinds
        self._on_internal_error = on_internal_error
        self._callees: dict = {}  # function -> its ModuleCall stand-in in the log
        self.inert = False
        self._aside_for = None  # the optimizer whose step runs with this mode off the stack

    def __enter__(self):
        skip_dynamo_for_code(FunctionWatch.__torch_function__.__code__)
        return super().__enter__()

    def __exit__(self, exc_type, exc, traceback_):
        if self._aside_for is not None:  # off the stack already (a step raised, unseen)
            self._aside_for = self._interceptor.aside = None
            return None
        return super().__exit__(exc_type, exc, traceback_)

    def stand_aside(self, optimizer) -> None:
        """Leave the thread's stack for the step of ``optimizer`` about to run: torch's own
        optimizer with no closure and no step hooks but the watch's (the caller checked), so
        nothing but torch's optimizer code runs until the step's post-hook. Only where this is
        the one function mode on the stack: putting it back is then putting it on top."""
        if self._aside_for is None and function_mode_alone(self):
            take_function_mode_off()
            self._aside_for = optimizer
            self._interceptor.aside = self

    def step_back_in(self, optimizer=None) -> None:
        """Back on the stack after the step of ``optimizer`` (``None``: whichever step it
        stood aside for, which raised: the interceptor saw the end of its profiler region)."""
        if self._aside_for is not None and (optimizer is None or optimizer is self._aside_for):
            self._aside_for = self._interceptor.aside = None
            put_function_mode_back(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call and tensor attribute read of the thread comes here: one dict lookup.
        entry = self._table.get(func)
        if entry is not None and not (self.inert or self._interceptor.inert):
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
