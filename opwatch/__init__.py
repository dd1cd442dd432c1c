"""opwatch: which op, on which line of your code, went wrong.

Watches every PyTorch op while a model runs and points at the op and the line that caused a
device mix, a silent float64 upcast, a broadcasting blowup, or the first nan/inf::

    import opwatch

    with opwatch.watch() as w:
        loss = model(x).sum()
        loss.backward()
    print(w.table(last=20))
    for anomaly in w.anomalies:
        print(anomaly)

The names below are imported on first use (PEP 562): ``import opwatch`` alone does not import
torch, so the pytest plugin costs nothing in a test run that does not ask for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "watch": ".session",
    "strict": ".session",
    "Watch": ".session",
    "guard": ".runners.guarded",
    "Allow": ".findings.allow",
    "KINDS": ".checks",
    "OpRecord": ".core.records",
    "TensorMeta": ".core.notation",
    "format_meta": ".core.notation",
    "Anomaly": ".findings.anomaly",
    "AnomalyError": ".findings.anomaly",
    "OpwatchWarning": ".findings.anomaly",
    "load": ".storage.jsonl",
    "diff": ".runners.divergence",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from .findings.allow import Allow
    from .findings.anomaly import Anomaly, AnomalyError, OpwatchWarning
    from .checks import KINDS
    from .runners.divergence import diff
    from .storage.jsonl import load
    from .runners.guarded import guard
    from .core.notation import TensorMeta, format_meta
    from .core.records import OpRecord
    from .session import Watch, strict, watch


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'opwatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
