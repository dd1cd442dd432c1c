"""Pieces of the interceptor's hot path, as plain functions."""

from __future__ import annotations

import contextlib
import json
import sys

import torch

from opwatch.checks import ActiveChecks
from opwatch.modes.interceptor import _OpPlan, _reads_to_host
from opwatch.core.records import OpLog
from opwatch.core.sites import INTERNAL, USER, classify_code, user_frame

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def meta(device):
    return ((2,), torch.float32, device, 0)


def plan(func):
    return _OpPlan(func, 0, ActiveChecks(frozenset(), OpLog(10), table_limit=100))


def test_item_and_bool_are_host_reads():
    for func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
        assert plan(func).may_read_to_host and _reads_to_host(plan(func), (meta(CUDA),), {})


def test_a_copy_is_a_host_read_only_from_a_device_to_the_cpu():
    to_copy = plan(torch.ops.aten._to_copy.default)
    assert _reads_to_host(to_copy, (meta(CUDA),), {"device": CPU})
    assert not _reads_to_host(to_copy, (meta(CUDA),), {"dtype": torch.float16})  # stays on the GPU
    assert not _reads_to_host(to_copy, (meta(CPU),), {"device": CPU})
    copy_ = plan(torch.ops.aten.copy_.default)
    assert _reads_to_host(copy_, (meta(CPU), meta(CUDA)), {})
    assert not _reads_to_host(copy_, (meta(CUDA), meta(CUDA)), {})
    assert not _reads_to_host(copy_, (meta(CUDA), meta(CPU)), {})  # host to device


def test_standard_library_and_torch_frames_are_not_user_code():
    assert classify_code(json.dumps.__code__) == INTERNAL
    assert classify_code(contextlib.contextmanager.__code__) == INTERNAL
    assert classify_code(torch.nn.Linear.forward.__code__) == INTERNAL
    assert classify_code(test_standard_library_and_torch_frames_are_not_user_code.__code__) == USER


def test_frame_walk_stops_at_the_innermost_module_call():
    def torch_like_inner():
        return user_frame(sys._getframe(0), stop_frame=marker[0], stop_answer=("answer",))

    marker = [sys._getframe(0)]
    # The walk from here meets this test's frame, a user frame, before the stop frame.
    code, _, reached_engine = torch_like_inner()
    assert code is torch_like_inner.__code__ and not reached_engine
    assert user_frame(marker[0], stop_frame=marker[0], stop_answer=("answer",)) == ("answer",)
