"""The sequence alignment of :func:`opwatch.diff`: two lists of op keys matched by their
common start and end and a shortest edit script (Myers) between them."""

from __future__ import annotations

from difflib import SequenceMatcher

__all__ = ["matches"]


def matches(a: list, b: list) -> list[tuple[int, int]]:
    """The aligned ``(i, j)`` of two key lists, increasing: the common start and end, and a
    shortest edit script (Myers) between them. A training loop repeats its ops every step, and
    longest-block matching (difflib) pairs a step with the wrong one after an insertion; a
    shortest edit script does not, and takes O((n + m) d) for d edits."""
    ids: dict = {}
    a = [ids.setdefault(key, len(ids)) for key in a]
    b = [ids.setdefault(key, len(ids)) for key in b]
    start = 0
    while start < len(a) and start < len(b) and a[start] == b[start]:
        start += 1
    end = 0
    while end < len(a) - start and end < len(b) - start and a[-1 - end] == b[-1 - end]:
        end += 1
    middle_a, middle_b = a[start : len(a) - end], b[start : len(b) - end]
    found = _shortest_edit(middle_a, middle_b, _MAX_EDITS) if middle_a and middle_b else []
    if found is None:  # too different for a shortest edit script: difflib's longest blocks
        blocks = SequenceMatcher(None, middle_a, middle_b, autojunk=False).get_matching_blocks()
        found = [(x + k, y + k) for x, y, size in blocks for k in range(size)]
    middle = [(start + x, start + y) for x, y in found]
    tail = [(len(a) - end + k, len(b) - end + k) for k in range(end)]
    return [(k, k) for k in range(start)] + middle + tail


_MAX_EDITS = 1000  # beyond this many insertions and deletions, fall back to difflib


def _shortest_edit(a: list, b: list, max_edits: int) -> list[tuple[int, int]] | None:
    """Myers' greedy shortest edit script: the matched ``(i, j)``, or ``None`` past ``max_edits``."""
    n, m = len(a), len(b)
    frontier = {1: 0}  # diagonal k = x - y -> furthest x reached
    trace = []
    for edits in range(min(max_edits, n + m) + 1):
        trace.append(dict(frontier))
        for k in range(-edits, edits + 1, 2):
            down = k == -edits or (k != edits and frontier[k - 1] < frontier[k + 1])
            x = frontier[k + 1] if down else frontier[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            frontier[k] = x
            if x >= n and y >= m:
                return _walk_back(trace, n, m)
    return None


def _walk_back(trace: list, x: int, y: int) -> list[tuple[int, int]]:
    matched = []
    for edits in range(len(trace) - 1, 0, -1):
        frontier, k = trace[edits], x - y
        down = k == -edits or (k != edits and frontier[k - 1] < frontier[k + 1])
        before = k + 1 if down else k - 1
        before_x = frontier[before]
        before_y = before_x - before
        while x > before_x and y > before_y:
            x, y = x - 1, y - 1
            matched.append((x, y))
        x, y = before_x, before_y
    while x > 0 and y > 0:
        x, y = x - 1, y - 1
        matched.append((x, y))
    matched.reverse()
    return matched
