"""``BoundedCache``: the one way opwatch keeps a cache that must not grow without end.

Caches that outlive an op (interned shapes and arguments, per-class or per-op answers) are
keyed by what a program meets: a few hundred distinct keys in practice, but without bound when
a program varies them (sequence lengths that change every step, a decaying learning rate). A
``BoundedCache`` starts afresh when it is full: cheaper than LRU bookkeeping on a hot path, and
a cleared cache only costs recomputing what is still in use. This module imports nothing from
opwatch, so every layer may use it.
"""

from __future__ import annotations

__all__ = ["BoundedCache"]

_ABSENT = object()


class BoundedCache(dict):
    """A dict that holds at most ``limit`` keys: storing one more through :meth:`put` or
    :meth:`keep` clears it first. Reads are plain dict reads (``cache.get(key)``,
    ``cache[key]``), as fast as a dict's; :meth:`lookup` memoizes a function. A subclass may define ``__missing__`` and call
    :meth:`put` from it (a table that fills itself on a miss)."""

    __slots__ = ("limit",)

    def __init__(self, limit: int):
        super().__init__()
        if limit < 1:
            raise ValueError(f"BoundedCache limit must be 1 or more, got {limit}")
        self.limit = limit

    def put(self, key, value):
        """Store ``value`` under ``key`` (clearing a full cache first); returns ``value``."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value

    def keep(self, key, value):
        """The value already stored under ``key``, else ``value``, stored (``dict.setdefault``
        with the bound). Raises ``TypeError`` for an unhashable key, as a dict does."""
        known = self.get(key, _ABSENT)
        if known is _ABSENT:
            return self.put(key, value)
        return known

    def lookup(self, key, make):
        """The value stored under ``key``, else ``make(key)``, stored (a memo of ``make``)."""
        known = self.get(key, _ABSENT)
        if known is _ABSENT:
            return self.put(key, make(key))
        return known
