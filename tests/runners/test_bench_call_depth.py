"""``bench.call_depth``: the training step called from more Python frames, to time the watch
against ``detect_anomaly`` as a framework's loop runs it. No timing here: that the depth asked
for is the depth the step runs at."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.call_depth import at_depth  # noqa: E402


def _frames_below(frame) -> int:
    count = 0
    while frame is not None:
        count += 1
        frame = frame.f_back
    return count


@pytest.mark.parametrize("depth", [1, 10, 30])
def test_the_step_runs_as_many_frames_deeper_as_asked(depth):
    seen = []

    def step():
        seen.append(_frames_below(sys._getframe()))

    at_depth(step, 0)()
    at_depth(step, depth)()
    shallow, deep = seen
    assert deep - shallow == depth


def test_a_negative_depth_is_refused():
    with pytest.raises(ValueError, match="depth must be 0 or more, got -1"):
        at_depth(lambda: None, -1)
