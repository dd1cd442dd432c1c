"""``bench.ablate``'s stub that keeps no entry: what native records would save at most. It must
leave the watch at work on a window without a flag (else it would time a watch gone inert), and
end its block with an error where a check point replays the window, which reads the entries."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.ablate import VARIANTS  # noqa: E402
from bench.workloads import mlp_step  # noqa: E402

NO_ENTRIES = VARIANTS["watch(), no entries kept (windows without a flag)"]


def test_the_watch_keeps_no_entry_and_stays_at_work_on_healthy_steps():
    step = mlp_step()
    with NO_ENTRIES() as watch:
        for _ in range(3):
            step()
        assert not watch._interceptor.inert
        assert len(watch._log.entries) == 1
        assert watch._log.next_index > 150  # every op still numbered and checked


def test_a_window_with_a_flag_ends_the_block_with_an_error():
    with pytest.raises(RuntimeError, match="went inert"):
        with NO_ENTRIES():
            x = torch.zeros(4, requires_grad=True)
            y = torch.log(x) * 0  # -inf, then nan: the check point replays the window
            y.sum().backward()
