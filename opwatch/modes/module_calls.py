"""Module calls judged before their forward runs (:mod:`opwatch.checks.module_calls`: torch's
own modules that check their arguments in Python, before any op reaches the dispatch mode).

:class:`~opwatch.modes.modules.ModuleStack` calls a :class:`ModuleCalls` on every module call of
the watched thread, with the module's path already current. A finding is logged as an entry of
its own (its op a :class:`~opwatch.core.records.ModuleCall`, ``LSTM.forward``) at the user's line
that called the module, numbered by the log like every op, and handed to the exit of findings;
in strict mode the error is raised from the module call, before its forward runs.
"""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (it reads
# __tracebackhide__ in each frame's globals): opwatch's frames are not the user's story.
__tracebackhide__ = True

from time import perf_counter_ns

import torch

from ..core.compat import current_autograd_node
from ..core.records import BACKWARD, FORWARD, ModuleCall, tensor_metas

__all__ = ["ModuleCalls"]

_Tensor = torch.Tensor


class ModuleCalls:
    """``ModuleStack.on_call`` of one watch: ``checks`` (the watch's
    :class:`~opwatch.checks.ActiveChecks`) judge the call; ``interceptor`` is the watch's dispatch
    mode, whose ``inert`` switch, exit of findings (``findings``) and ``internal_error`` this
    shares."""

    __slots__ = ("_checks", "_modules", "_interceptor")

    def __init__(self, *, checks, modules, interceptor):
        self._checks = checks
        self._modules = modules
        self._interceptor = interceptor

    def __call__(self, module, args) -> None:
        interceptor = self._interceptor
        if interceptor.inert:
            return
        try:
            finding = self._checks.module_call(module, args)
            if finding is None:
                return
            error = interceptor.findings.deliver(finding, self._log_call(module, args))
        except Exception as internal:
            interceptor.internal_error(internal)
            return
        if error is not None:
            raise error  # strict: before the module's forward runs

    def _log_call(self, module, args):
        """Log the call at the user's line that called the module; return its record."""
        log = self._interceptor.log
        modules = self._modules
        code, lasti, _ = modules.call_answer or (None, 0, False)
        phase = FORWARD if current_autograd_node() is None else BACKWARD
        tensors = []
        for value in args:
            if isinstance(value, _Tensor):
                tensors.append(value)
            elif type(value) is tuple or type(value) is list:
                tensors.extend(item for item in value if isinstance(item, _Tensor))
        entry = log.log_call(ModuleCall.of(type(module)), log.site_id(code, lasti), modules.current, phase, tensor_metas(tensors, log), start_ns=perf_counter_ns())
        return log.view(entry)
