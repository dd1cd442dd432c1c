"""torch's warnings under a watch, shown at the program's line.

A warning torch issues inside a function or op the program called (``Converting a tensor with
requires_grad=True to a scalar``, ``std(): degrees of freedom is <= 0``, ``Implicit dimension
choice for softmax``) takes a Python frame near the call as its place: under a watch that frame
is the watch's own mode calling the function for the program (``opwatch/modes/functions.py``,
``opwatch/modes/interceptor.py``), not the program's line. While a watch is entered,
``warnings.showwarning`` is wrapped: a warning placed on one of those frames is issued again at
the line its op is attributed to, through Python's filters there (the default filter shows it
once per line, as without the watch), and forgotten at the watch's frame, so that the same
warning from another line is not taken for a repeat.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

from ..core.sites import attributed_line, warn_at_user

__all__ = ["torch_warnings"]

# The modes' files, as their code objects name them: the modules of one package, loaded from
# this module's folder.
_WATCH_FILES = frozenset(os.path.join(os.path.dirname(__file__), name) for name in ("functions.py", "interceptor.py"))


class _TorchWarnings:
    """``warnings.showwarning`` wrapped while any watch is entered (on any thread; counted, the
    last exit puts back what was there, unless something wrapped it since)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entered = 0
        self._previous = None
        self._wrapper = self._show  # one bound method: what is put in, and looked for at the exit

    def enter(self) -> None:
        with self._lock:
            self._entered += 1
            if self._entered > 1:
                return
            self._previous = warnings.showwarning
            warnings.showwarning = self._wrapper

    def exit(self) -> None:
        with self._lock:
            self._entered -= 1
            if self._entered > 0:
                return
            if warnings.showwarning is self._wrapper:  # what was there stays in _previous for a late call
                warnings.showwarning = self._previous

    def _show(self, message, category, filename, lineno, file=None, line=None):
        previous = self._previous
        if filename not in _WATCH_FILES:
            return previous(message, category, filename, lineno, file, line)
        issued = sys._getframe(1)
        try:
            while issued is not None and issued.f_code.co_filename != filename:
                issued = issued.f_back  # out of the warnings machinery, to the mode's frame
            at = None if issued is None else attributed_line(issued.f_back)
            if at is None:  # no frame of the program's (a device's autograd thread): as Python placed it
                return previous(message, category, filename, lineno, file, line)
            _forget(message, category, lineno, issued.f_globals)
            warn_at_user(message if isinstance(message, Warning) else category(message), line=at)
        except Warning:
            raise  # the program's filter makes it an error at its line, as without the watch
        except Exception:  # never the program's failure: shown as Python placed it
            return previous(message, category, filename, lineno, file, line)
        finally:
            del issued


def _forget(message, category, lineno: int, module_globals: dict) -> None:
    """Take the warning out of what Python noted of it as shown at the watch's place: the
    registry of the watch's module that issued it (``module_globals``'; ``lineno`` for the
    default action, 0 for ``module``) and, for ``once``, the process's; the issue at the
    program's line notes it there."""
    text = str(message)
    warnings.onceregistry.pop((text, category), None)
    registry = module_globals.get("__warningregistry__")
    if registry:
        for place in (lineno, 0):
            registry.pop((text, category, place), None)


torch_warnings = _TorchWarnings()
