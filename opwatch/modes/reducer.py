"""Named sites for the DDP reducer's ops in a distributed watch.

The reducer's ops run in autograd hooks and in the engine's final callback, with no user frame
and no forward op behind them. In a distributed watch they get a *labelled site* instead of a
source line: ``DDP gradient of fc1.weight`` where a parameter's gradient is copied into its
bucket, ``DDP bucket [fc2.bias, fc2.weight, ...]`` for the bucket's all-reduce, ``DDP end of
backward`` where the reduced buckets are copied into ``.grad``. Their phase is ``backward``.
"""

from __future__ import annotations

import weakref

from ..core.notation import format_meta

__all__ = ["ReducerSites"]


class ReducerSites:
    """Site labels for ops the autograd engine runs without a forward line in a distributed
    watch: a parameter's gradient hook (``DDP gradient of fc1.weight``), a collective launched
    from one (``DDP bucket [fc2.bias, fc2.weight, +2]``: the parameters whose hooks ran since
    the previous collective), and the engine's final callback (``DDP end of backward``).
    "DDP" only when the outermost module called is a ``DistributedDataParallel``."""

    _MAX_NAMES = 3

    def __init__(self, log, modules):
        self._log = log
        self._modules = modules  # ModuleStack: its last root names the parameters
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> {id(param): name}
        self._ready: list[str] = []  # parameters whose gradient hooks ran since the last collective

    def site(self, node, is_collective: bool) -> int:
        """The labelled site id of an engine-run op without a forward line; 0 when unknown."""
        root = self._root()
        prefix = "DDP " if type(root).__name__ == "DistributedDataParallel" else ""
        if node is None:
            return self._log.label_site(f"{prefix}end of backward")
        if type(node).__name__ != "AccumulateGrad":
            return 0
        if is_collective:
            names, self._ready = self._ready, []
            shown = ", ".join(names[: self._MAX_NAMES])
            if len(names) > self._MAX_NAMES:
                shown += f", +{len(names) - self._MAX_NAMES}"
            return self._log.label_site(f"{prefix}bucket [{shown}]")
        name = self._name(root, node)
        if not self._ready or self._ready[-1] != name:
            self._ready.append(name)
            if len(self._ready) > 4096:
                del self._ready[:2048]
        return self._log.label_site(f"{prefix}gradient of {name}")

    def _root(self):
        """The outermost module called, through ``torch.compile``'s wrapper (``torch.compile(ddp)``
        names the parameters as DDP does, not ``_orig_mod.module.fc.weight``)."""
        return self._modules.model()

    def _name(self, root, node) -> str:
        try:
            param = node.variable  # AccumulateGrad's parameter (a public attribute of the node)
        except Exception:
            return "a parameter"
        if root is not None:
            names = self._names.get(root)
            if names is None:
                names = self._names[root] = _parameter_names(root)
            name = names.get(id(param))
            if name is not None:
                return name
        return f"a {format_meta((tuple(param.shape), param.dtype, param.device))} parameter"


def _parameter_names(root) -> dict:
    strip = "module." if type(root).__name__ == "DistributedDataParallel" else ""
    names = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name.removeprefix(strip))
    return names
