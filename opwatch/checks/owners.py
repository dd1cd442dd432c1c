"""Who holds a tensor: the modules running now and the parameters and buffers of the models a
watch saw called. Asked by :mod:`opwatch.checks.provenance` when a finding's odd operand may be
a module's (slow: never on a healthy op).

:class:`~opwatch.modes.modules.ModuleStack` keeps the calls running in the watched thread in a
list whose entries start with ``(path, class name)`` and the frame of the module's
``__call__`` (``RUNNING_NAME``, ``RUNNING_FRAME``); it hands that list to its
:class:`ModuleOwners` and tells it of each model it lists (``seen``) and each outermost call
(``forwards``). Nothing here keeps a module alive: models are held weakly, running modules are
read from the frames of their calls, which are executing.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

from torch import nn

from ..core.compat import module_class_name

__all__ = ["ModuleOwners", "RUNNING_NAME", "RUNNING_FRAME"]

# In an entry of the running calls (ModuleStack's): the module's (path, class name), the frame
# of its __call__ (whose ``self`` is the module).
RUNNING_NAME = 0
RUNNING_FRAME = 1


class ModuleOwners:
    """The owners of one watch's thread: ``running`` is the list of running calls (see the
    module's doc), innermost last."""

    def __init__(self, running: list):
        self._running = running
        self.forwards = 0  # outermost module calls so far: a table is rebuilt once per call at most
        self._roots: weakref.WeakSet = weakref.WeakSet()  # the models seen called
        # model -> (forwards when built, {id of a parameter or buffer -> _Owned})
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def seen(self, root: nn.Module) -> None:
        """``root`` was called as the outermost module: its parameters and buffers may be asked for."""
        self._roots.add(root)

    def running(self) -> list[tuple[str, nn.Module]]:
        """The modules running now, innermost first, as ``(path, module)`` (read from the
        frames of their calls)."""
        found = []
        for entry in reversed(self._running):
            module = entry[RUNNING_FRAME].f_locals.get("self")
            if isinstance(module, nn.Module):
                path, _ = entry[RUNNING_NAME]
                found.append((path, module))
        return found

    def owner_of(self, ident: int) -> tuple | None:
        """``("parameter" | "buffer", class name of the module that holds it, its name there,
        module path)`` of the live tensor ``ident`` when a model seen called holds it as a
        parameter or buffer; ``None`` otherwise. A model's table is built on first use and
        rebuilt at most once per call of the model (a buffer replaced since is found then)."""
        for root in list(self._roots):
            built = self._tables.get(root)
            if built is None or (built.forwards != self.forwards and ident not in built.table):
                built = self._tables[root] = _Owners(self.forwards, _owners_table(root))
            found = built.table.get(ident)
            if found is not None and id(found.tensor()) == ident:
                return found.owner
        return None


class _Owners(NamedTuple):
    """A model's table of owners (see :meth:`ModuleOwners.owner_of`), built during its call
    number ``forwards``."""

    forwards: int
    table: dict  # id of a parameter or buffer -> _Owned


class _Owned(NamedTuple):
    """A parameter or buffer (weakly) and its owner facts (see :meth:`ModuleOwners.owner_of`)."""

    tensor: weakref.ref
    owner: tuple


def _owners_table(root: nn.Module) -> dict:
    """``{id of a parameter or buffer of root's modules -> _Owned}``; paths as
    :class:`~opwatch.modes.modules.ModuleStack` names modules (the outermost by its class)."""
    table = {}
    for name, module in root.named_modules(remove_duplicate=False):
        path = name or type(root).__name__
        for kind, held in (("parameter", module.named_parameters(recurse=False)), ("buffer", module.named_buffers(recurse=False))):
            for attribute, tensor in held:
                if id(tensor) not in table:
                    table[id(tensor)] = _Owned(weakref.ref(tensor), (kind, module_class_name(module), attribute, path))
    return table
