"""Which guarded calls are audited: run under a full watch with every check.

Shape, dtype and device bugs are properties of the code path and of the arguments' signature,
not of their values: one fully watched call per distinct signature sees them. The signature of
a call is the nesting structure of its arguments (types, lengths, dict keys, a few levels deep)
with each tensor's shape, dtype and device; any other value counts by its type only (a step
counter does not make every call new). It is computed on every call: plain tuples, no tensor
work.
"""

from __future__ import annotations

import torch

_Tensor = torch.Tensor
_DEPTH = 4  # levels of lists, tuples and dicts looked into
MODES = ('"new"', '"never"', "an int >= 1")


def signature(value, depth: int = _DEPTH):
    """A hashable signature of ``value``'s structure and tensors' metadata."""
    if isinstance(value, _Tensor):
        return (value.shape, value.dtype, value.device)
    if depth and isinstance(value, (tuple, list)):
        return (type(value), tuple([signature(item, depth - 1) for item in value]))
    if depth and isinstance(value, dict):
        return (type(value), tuple([(key, signature(item, depth - 1)) for key, item in value.items()]))
    return type(value)


def call_signature(args, kwargs):
    """``signature((args, kwargs))``, with the common call (positional tensors, no keywords)
    read in one pass: it runs before every guarded step."""
    if not kwargs:
        return tuple([(value.shape, value.dtype, value.device) if isinstance(value, _Tensor) else signature(value, _DEPTH - 2) for value in args])
    return signature((args, kwargs))


def check_mode(audit, max_audits) -> None:
    """Refuses ``audit`` and ``max_audits`` values other than those documented."""
    if isinstance(audit, bool) or not isinstance(audit, (str, int)):
        raise TypeError(f"audit must be \"new\", \"never\" or an int >= 1, got {type(audit).__name__}")
    if isinstance(audit, str) and audit not in ("new", "never"):
        raise ValueError(f"audit must be \"new\", \"never\" or an int >= 1, got {audit!r}")
    if isinstance(audit, int) and audit < 1:
        raise ValueError(f"audit must be \"new\", \"never\" or an int >= 1, got {audit}")
    if isinstance(max_audits, bool) or not isinstance(max_audits, int):
        raise TypeError(f"max_audits must be an int >= 0, got {type(max_audits).__name__}")
    if max_audits < 0:
        raise ValueError(f"max_audits must be an int >= 0, got {max_audits}")


class Audits:
    """Decides, call by call, whether to audit. ``audit``: ``"new"`` (the first call and every
    call of a new signature, at most ``max_audits`` signatures), ``"never"``, or ``N``: every
    ``N``-th call as well as new signatures."""

    def __init__(self, audit, max_audits: int):
        check_mode(audit, max_audits)
        self._by_signature = audit != "never"
        self._every = audit if isinstance(audit, int) else 0
        self._max = max_audits
        self._seen: set = set()
        self.count = 0  # calls audited

    def wanted(self, call: int, args, kwargs) -> bool:
        """Whether call number ``call`` (from 1) is audited."""
        due = bool(self._every) and call % self._every == 0
        if self._by_signature and len(self._seen) < self._max:
            key = call_signature(args, kwargs)
            if key not in self._seen:
                self._seen.add(key)
                due = True
        if due:
            self.count += 1
        return due
