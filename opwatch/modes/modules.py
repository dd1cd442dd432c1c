"""Which ``nn.Module`` is running: a stack of module paths kept by global module hooks.

Like ``torch.utils.module_tracker``, names are looked up through weak references, so tracking
never keeps a module alive. Unlike it, paths are relative to the outermost module called (the
way ``state_dict`` keys read) and only the thread that entered the watch is tracked.

Ops run by a module's hooks belong to that module: its forward pre-hooks and forward hooks, its
own and the global ones (``register_module_forward_pre_hook`` / ``register_module_forward_hook``).
So the entering hook is put first among the global pre-hooks when the watch starts, and when a
module has forward hooks that run after the exiting global hook (its own, or global ones
registered after it), the path is kept through them by a one-shot forward hook added last to
that module for the length of the call (``always_call``, so it runs when forward raises too) and
removed when it has run.

Limits: modules called from other threads are ignored; a module called inside another one
without being registered as its child is named ``<parent path>.<ClassName>``; global
pre-hooks registered while the watch runs come after the entering hook (they get the module's
path anyway).
"""

from __future__ import annotations

# pytest leaves this module's frames out of a failing test's traceback (it reads
# __tracebackhide__ in each frame's globals): opwatch's frames are not the user's story.
__tracebackhide__ = True

import sys
import threading
import weakref

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..checks.owners import RUNNING_NAME, ModuleOwners
from ..core.compat import compiled_module_inner, current_autograd_node, hooks_dict_of, module_class_name
from ..core.records import MODULE_PATH
from ..core.sites import user_frame

__all__ = ["ModuleStack"]

# A stack entry: ((path, class), call frame, user frame answer, held hook handle); the first two
# as checks.owners reads them (RUNNING_NAME, RUNNING_FRAME).
_NAME, _HELD = RUNNING_NAME, 3


class ModuleStack:
    """The modules currently running in one thread; ``current`` is the innermost one's
    ``(path, class name)`` (:data:`~opwatch.core.records.MODULE_PATH`), ``None`` outside modules.

    It also remembers, for the innermost module, the frame that called it and the user frame
    above that call, so that the interceptor's frame walk can stop there (see
    :func:`opwatch.core.sites.user_frame`). That frame is executing while remembered: holding it
    keeps nothing alive that would not be alive anyway.
    """

    def __init__(self, on_call=None) -> None:
        """``on_call(module, args)``, when given, is called on every module call of the watched
        thread, before the module's own forward pre-hooks and its forward, with the module's
        path already current (``current``, ``call_answer`` name the module and the user's line
        that called it). What it raises reaches the program from the module call."""
        self.current: tuple | None = None
        self.call_frame = None
        self.call_answer = None
        self.on_call = on_call
        self._stack: list[tuple] = []  # ((path, class), call frame, user frame answer, one-shot hook handle or None)
        self._stale: list = []  # one-shot hooks that ran while an exception was handled: removed later
        self._exit_hooks: dict = {}  # the global forward hooks (torch's dict), once installed
        self._exit_id = None
        self._exit_hooks_len = 0  # their number when ``_exit_is_last`` was worked out
        self._exit_is_last = True
        self._thread = threading.get_ident()
        # root module -> {descendant module -> (its path relative to that root, its class)}
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._root_names: weakref.WeakKeyDictionary | None = None
        self._root = None  # weakref to the outermost module of the current (or last) forward
        self._strangers: weakref.WeakSet = weakref.WeakSet()  # called inside it, but not its descendants
        self._handles: list = []
        # Who holds a tensor (the running modules, the models' parameters and buffers), for
        # where a finding's odd operand was made: reads this stack, told of each model called.
        self.owners = ModuleOwners(self._stack)

    def install(self) -> None:
        enter = register_module_forward_pre_hook(self._enter)
        exit_ = register_module_forward_hook(self._exit, always_call=True)
        self._handles = [enter, exit_]
        # Global pre-hooks registered before the watch run after the entering hook, so that their
        # ops get the module's path. Only opwatch's own entry moves.
        pre_hooks = hooks_dict_of(enter)
        if pre_hooks is not None and hasattr(pre_hooks, "move_to_end"):
            pre_hooks.move_to_end(enter.id, last=False)
        hooks = hooks_dict_of(exit_)
        self._exit_hooks = hooks if hooks is not None else {}  # {}: never re-checked
        self._exit_id = exit_.id
        self._exit_hooks_len = len(self._exit_hooks)
        self._exit_is_last = True

    def uninstall(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        for entry in self._stack:
            if entry[_HELD] is not None:
                entry[_HELD].remove()
        self._stack.clear()
        self._remove_stale()
        self._exit_hooks = {}
        self.current = self.call_frame = self.call_answer = None

    def _enter(self, module: nn.Module, args) -> None:
        if threading.get_ident() != self._thread:
            return
        if not self._stack:
            self.owners.forwards += 1
            if self._stale and sys.exc_info()[0] is None:
                self._remove_stale()  # a new forward, outside any exception handling
            if current_autograd_node() is not None and self._root_names is not None and module in self._root_names:
                # A checkpoint recomputing part of the last forward: keep that forward's paths.
                name = self._root_names[module]
            else:
                self._root = weakref.ref(module)
                self._root_names = self._names_for_root(module)
                cls = module_class_name(compiled_module_inner(module) or module)
                name = (cls, cls)
        else:
            name = self._root_names.get(module) if self._root_names is not None else None
            root = self._root() if self._root is not None else None
            if name is None and root is not None and module not in self._strangers:
                # A module added since the names were listed: list them again, once.
                self._names.pop(root, None)
                self._root_names = self._names_for_root(root)
                name = self._root_names.get(module)
                if name is None:
                    self._strangers.add(module)  # not a descendant: do not list again for it
            if name is None:
                cls = module_class_name(module)
                name = (f"{self._stack[-1][_NAME][MODULE_PATH]}.{cls}", cls)
        call_frame = sys._getframe(1)  # the module's __call__, an ancestor of all its ops' frames
        answer = user_frame(call_frame.f_back, self.call_frame, self.call_answer)
        held = None
        if module._forward_hooks or len(self._exit_hooks) != self._exit_hooks_len or not self._exit_is_last:
            if module._forward_hooks or not self._exit_last():
                held = self._hold_through_hooks(module)
        self._stack.append((name, call_frame, answer, held))
        self.current, self.call_frame, self.call_answer = name, call_frame, answer
        if self.on_call is not None:
            self.on_call(module, args)

    @property
    def path(self) -> str | None:
        """The innermost running module's dotted path, ``None`` outside modules."""
        return None if self.current is None else self.current[MODULE_PATH]

    def _exit(self, module: nn.Module, args, output) -> None:
        if threading.get_ident() != self._thread or not self._stack:
            return
        if self._stack[-1][_HELD] is not None:
            return  # forward hooks of this call run after this one: the one-shot hook pops
        self._pop()

    def _pop(self) -> None:
        self._stack.pop()
        if self._stack:
            self.current, self.call_frame, self.call_answer, _ = self._stack[-1]
        else:
            self.current = self.call_frame = self.call_answer = None

    def _exit_last(self) -> bool:
        """Whether no global forward hook but another watch's exiting hook runs after this
        one's (re-checked only when their number changed)."""
        hooks = self._exit_hooks
        if len(hooks) == self._exit_hooks_len:
            return self._exit_is_last
        self._exit_hooks_len = len(hooks)
        after = False
        last = True
        for key, hook in list(hooks.items()):
            if after and getattr(hook, "__func__", None) is not ModuleStack._exit:
                last = False
                break
            after = after or key == self._exit_id
        self._exit_is_last = last
        return last

    def _hold_through_hooks(self, module: nn.Module):
        """Keep ``module``'s path current until its last forward hook of this call has run: a
        one-shot forward hook added after the others, which pops the path and removes itself.
        A plain function (not a bound method), so that deep-copying the module meanwhile copies
        no ModuleStack."""
        stack = weakref.ref(self)
        handle = None

        def release(module, args, output):
            owner = stack()
            if owner is not None:
                owner._release(handle)
            return None

        try:
            handle = module.register_forward_hook(release, always_call=True)
        except Exception:
            return None  # a module that takes no hooks: its forward hooks get the parent's path
        return handle

    def _release(self, handle) -> None:
        if threading.get_ident() != self._thread or not self._stack or self._stack[-1][_HELD] is not handle:
            # Another thread, or not this call's hook: a recursive call of the same module runs
            # the outer call's hook too (it is popped when the outer call's hooks run).
            return
        self._pop()
        if sys.exc_info()[0] is None:
            handle.remove()  # the hooks of this call run from a snapshot: removing is safe
        else:
            # Run from _call_impl's exception path, which iterates the module's hooks live.
            self._stale.append(handle)

    def _remove_stale(self) -> None:
        for handle in self._stale:
            handle.remove()
        self._stale.clear()

    def model(self) -> nn.Module | None:
        """The outermost module of the current (or last) forward as the program wrote it:
        ``torch.compile``'s wrapper looked through (``torch.compile(ddp)`` is the DDP module)."""
        root = self._root() if self._root is not None else None
        while (inner := compiled_module_inner(root)) is not None:
            root = inner
        return root

    def _names_for_root(self, root: nn.Module) -> weakref.WeakKeyDictionary:
        names = self._names.get(root)
        if names is None:
            names = weakref.WeakKeyDictionary()
            inner = compiled_module_inner(root)
            if inner is not None:  # torch.compile(model): paths as the model's own ("Net", "fc1")
                names[inner] = (module_class_name(inner), module_class_name(inner))
            for path, child in (root if inner is None else inner).named_modules(remove_duplicate=False):
                if path and child not in names:
                    names[child] = (path, module_class_name(child))
            self._names[root] = names
            self.owners.seen(root)
        return names
