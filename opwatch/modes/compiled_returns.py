"""Pushing and popping the watch's dispatch mode inside a ``torch.compile``d call.

Dynamo's wrapper around a compiled call saves the thread's dispatch keys when it is called and
puts them back when it returns (:func:`~opwatch.core.compat.compiled_call_frame`). A watch that
ends inside one (leave-on's audit ends in the optimizer step's post-hook, and
``torch.compile(optimizer.step)`` or a compiled training step runs that hook) would leave the
Python dispatch key on with no mode on the stack: torch's next factory op then fails an
internal assert. A watch that starts inside one would be switched off where it returns. So a
push or pop inside such a call waits for the outermost one to return: a profile function
(``sys.setprofile``, the thread's own, chained to any it had) sees that frame's ``return``
event, after the wrapper put the keys back, and does the waiting pushes and pops in order.
"""

from __future__ import annotations

import sys
import threading

from ..core.compat import compiled_call_frame

__all__ = ["when_compiled_call_returns"]

_thread = threading.local()


class _Waiting:
    """The actions waiting for ``frame`` (the outermost compiled call) to return, and the
    thread's profile function before this one."""

    def __init__(self, frame, previous):
        self.frame = frame
        self.previous = previous
        self.actions: list = []

    def event(self, frame, kind, arg):
        previous = self.previous
        if previous is not None:
            previous(frame, kind, arg)
        if kind != "return" or frame is not self.frame:
            return
        sys.setprofile(previous)
        _thread.waiting = None
        for action in self.actions:
            action()


def when_compiled_call_returns(action, caller) -> bool:
    """Run ``action`` (a dispatch mode's push or pop) where the compiled call running above
    ``caller`` returns; returns ``False`` where none runs (the caller runs it now)."""
    frame = compiled_call_frame(caller)
    if frame is None:
        return False
    waiting = getattr(_thread, "waiting", None)
    if waiting is None or waiting.frame is not frame:
        waiting = _thread.waiting = _Waiting(frame, sys.getprofile())
        sys.setprofile(waiting.event)
    waiting.actions.append(action)
    return True
