"""Which ``nn.Module`` is running: a stack of module paths kept by global module hooks.

Like ``torch.utils.module_tracker``, names are looked up through weak references, so tracking
never keeps a module alive. Unlike it, paths are relative to the outermost module called (the
way ``state_dict`` keys read) and only the thread that entered the watch is tracked.

Limits: modules called from other threads are ignored; a module called inside another one
without being registered as its child is named ``<parent path>.<ClassName>``.
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..sites import user_frame

__all__ = ["ModuleStack"]


class ModuleStack:
    """The module paths currently running in one thread; ``current`` is the innermost.

    It also remembers, for the innermost module, the frame that called it and the user frame
    above that call, so that the interceptor's frame walk can stop there (see
    :func:`opwatch.sites.user_frame`). That frame is executing while remembered: holding it
    keeps nothing alive that would not be alive anyway.
    """

    def __init__(self) -> None:
        self.current: str | None = None
        self.call_frame = None
        self.call_answer = None
        self._stack: list[tuple] = []  # (path, call frame, user frame answer)
        self._thread = threading.get_ident()
        # root module -> {descendant module -> path relative to that root}
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._root_names: weakref.WeakKeyDictionary | None = None
        self._root = None  # weakref to the outermost module of the current (or last) forward
        self._strangers: weakref.WeakSet = weakref.WeakSet()  # called inside it, but not its descendants
        self._handles: list = []

    def install(self) -> None:
        self._handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._exit, always_call=True),
        ]

    def uninstall(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        self._stack.clear()
        self.current = self.call_frame = self.call_answer = None

    def _enter(self, module: nn.Module, args) -> None:
        if threading.get_ident() != self._thread:
            return
        if not self._stack:
            if torch._C._current_autograd_node() is not None and self._root_names is not None and module in self._root_names:
                # A checkpoint recomputing part of the last forward: keep that forward's paths.
                path = self._root_names[module]
            else:
                self._root = weakref.ref(module)
                self._root_names = self._names_for_root(module)
                path = type(module).__name__
        else:
            path = self._root_names.get(module) if self._root_names is not None else None
            root = self._root() if self._root is not None else None
            if path is None and root is not None and module not in self._strangers:
                # A module added since the names were listed: list them again, once.
                self._names.pop(root, None)
                self._root_names = self._names_for_root(root)
                path = self._root_names.get(module)
                if path is None:
                    self._strangers.add(module)  # not a descendant: do not list again for it
            if path is None:
                path = f"{self._stack[-1][0]}.{type(module).__name__}"
        call_frame = sys._getframe(1)  # the module's __call__, an ancestor of all its ops' frames
        answer = user_frame(call_frame.f_back, self.call_frame, self.call_answer)
        self._stack.append((path, call_frame, answer))
        self.current, self.call_frame, self.call_answer = path, call_frame, answer

    def _exit(self, module: nn.Module, args, output) -> None:
        if threading.get_ident() != self._thread or not self._stack:
            return
        self._stack.pop()
        if self._stack:
            self.current, self.call_frame, self.call_answer = self._stack[-1]
        else:
            self.current = self.call_frame = self.call_answer = None

    def _names_for_root(self, root: nn.Module) -> weakref.WeakKeyDictionary:
        names = self._names.get(root)
        if names is None:
            names = weakref.WeakKeyDictionary()
            for name, child in root.named_modules(remove_duplicate=False):
                if name and child not in names:
                    names[child] = name
            self._names[root] = names
        return names
