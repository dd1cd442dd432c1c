"""Which tensors share storage, as the op log shows it: a view op's outputs join the group of
its input (``v = h.view(-1)``: ``v`` and ``h``). A write in place into one of a group changes
the values of all of them: the replay forgets the ranges it knew for the others
(:mod:`.replay`), and the causes do not read them as they were when the origin's op ran
(:mod:`.cause`).

By ident only, outside the hot path (the replay and the causes' walk of the log). An id reused
by a new tensor (an op that makes new data, not a view or a write in place) leaves its old group
(:meth:`Aliases.forget`), and so does an id a view op hands out while it still sits in another
group (its old tensor died unseen): else a later write into the new tensor would count as a
write into the old group, a parameter that a dead ``w.t()`` viewed included. Bounded: past ``_MAX``
members the groups are dropped (the views made before then are not known as views any more: a
rare step of that many views may show a stale range).
"""

from __future__ import annotations

__all__ = ["Aliases"]


class Aliases:
    """Groups of tensor idents that share storage: ``root ident -> {idents}``."""

    __slots__ = ("_root", "_members", "_count")

    _MAX = 1 << 16

    def __init__(self) -> None:
        self._root: dict = {}  # ident -> the root of its group
        self._members: dict = {}  # root -> set of idents (the root included)
        self._count = 0

    def __bool__(self) -> bool:
        return bool(self._root)

    def view(self, source, outputs) -> None:
        """The tensors ``outputs`` (idents) view ``source``'s storage."""
        if self._count >= self._MAX:
            self.clear()
        root = self._root.get(source, source)
        members = self._members.get(root)
        if members is None:
            members = self._members[root] = {root}
            self._root[root] = root
            self._count += 1
        for ident in outputs:
            if ident != root and self._root.get(ident) != root:
                # an id in another group is a new tensor's now (its old one died): it leaves
                # that group first, else the other group's bookkeeping keeps naming it
                self.forget(ident)
                self._root[ident] = root
                members.add(ident)
                self._count += 1

    def forget(self, ident) -> None:
        """``ident`` is a new tensor's now: it leaves the group its old tensor was in."""
        root = self._root.pop(ident, None)
        if root is None:
            return
        members = self._members.pop(root)
        members.discard(ident)
        if len(members) > 1:
            if root == ident:  # the group's other members keep sharing their storage
                root = next(iter(members))
                for member in members:
                    self._root[member] = root
            self._members[root] = members
        else:
            for member in members:
                self._root.pop(member, None)

    def sharing(self, ident) -> set | tuple:
        """The idents that share ``ident``'s storage, ``ident`` included."""
        root = self._root.get(ident)
        return (ident,) if root is None else self._members[root]

    def clear(self) -> None:
        self._root = {}
        self._members = {}
        self._count = 0
