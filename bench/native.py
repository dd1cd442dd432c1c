"""Build and load :file:`bench/native_floor.cpp`: the floors of :mod:`bench.floor` in native
code, to measure what the same per-op work costs where the hot path is native.

    python -m bench.ablate --native          # prints them beside the Python floors

Two builds of the one source, each compiled on first use into a cache folder keyed by the
source, the Python version and the platform (and torch's version, for the second):

- ``native_floor``: only the CPython headers (the compiler Python was built with, from
  ``sysconfig``); torch is reached through its Python objects. An extension built this way
  works with any torch.
- ``native_floor_torch``: against the installed torch's C++ headers and libraries
  (``torch.utils.cpp_extension``), using torch's C++ API for tensor metadata, the autograd
  node and the reductions. An extension built this way works with that torch version only.

The torch build also holds three parts of the real watch's per-op work, which
:func:`native_parts` swaps in, to measure what porting them would buy: ``watch_metas``, opwatch's
``tensor_metas`` (every op's tensor metadata); ``watch_reduce``, the nan/inf tracker's queue of
(min, max) reductions; ``watch_head``, the start of each op's entry.

Where a build cannot be made (no compiler, no Python headers), :func:`load` raises
:class:`NativeUnavailable` saying why.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.floor import _FLOAT32, _READ_DTYPES, _SLOTS, _read_by_the_check
from opwatch.core.compat import current_autograd_node, get_sequence_nr, op_kernel

__all__ = ["NativeRecordsFloor", "NativeReadsFloor", "TorchApiRecordsFloor", "TorchApiReadsFloor", "NativeUnavailable", "load", "native_parts"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_floor.cpp")


class NativeUnavailable(RuntimeError):
    """The native floor could not be built here (no C compiler, no Python headers)."""


_loaded: dict = {}
_set_up: set = set()  # the native parts told opwatch's constants (once a process: they hold them)


def load(torch_api: bool = False):
    """The compiled module (``native_floor``, or ``native_floor_torch`` with ``torch_api``),
    built on first use."""
    if torch_api in _loaded:
        return _loaded[torch_api]
    with open(_SOURCE, "rb") as source:
        key = source.read() + sys.version.encode() + sysconfig.get_platform().encode()
    if torch_api:
        key += torch.__version__.encode()
    folder = os.path.join(tempfile.gettempdir(), f"opwatch-bench-native-{hashlib.sha1(key).hexdigest()[:16]}")
    os.makedirs(folder, exist_ok=True)
    module = _build_with_torch(folder) if torch_api else _load_file("native_floor", _build_plain(folder))
    _loaded[torch_api] = module
    return module


def _load_file(name: str, path: str):
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def _build_with_torch(folder: str):
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            "native_floor_torch", [_SOURCE], extra_cflags=["-O2", "-DOPWATCH_TORCH_API"], build_directory=folder, verbose=False,
        )
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        raise NativeUnavailable(f"building {_SOURCE} against torch {torch.__version__} failed: {error}") from None


def _build_plain(folder: str) -> str:
    """The CPython-only build's path, compiled unless it is there."""
    target = os.path.join(folder, "native_floor" + importlib.machinery.EXTENSION_SUFFIXES[0])
    if os.path.exists(target):
        return target
    compiler = shlex.split(sysconfig.get_config_var("CXX") or "c++")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise NativeUnavailable(f"no Python.h in {include}: the Python headers are not installed")
    partial = target + f".{os.getpid()}.tmp"
    command = [*compiler, "-O2", "-shared", "-fPIC", "-fno-exceptions", "-I", include, _SOURCE, "-o", partial]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except FileNotFoundError as error:
        raise NativeUnavailable(f"no C compiler ({compiler[0]}): {error}") from None
    if done.returncode != 0:
        raise NativeUnavailable(f"building {_SOURCE} failed:\n{done.stderr[-3000:]}")
    os.replace(partial, target)
    return target


@contextlib.contextmanager
def native_parts(*, metadata: bool = True, reductions: bool = False, head: bool = False, checks=None):
    """``opwatch.watch()`` with parts of its per-op work in native code (the torch build), the
    rest of the watch as it is: ``metadata``, every op's tensor metadata (``watch_metas``, for
    ops with no tensor subclass of their own); ``reductions``, the nan/inf tracker's queue of
    (min, max) reductions (``watch_reduce``: ``NonFiniteTracker._reduce``, its kernels called
    through torch's C++ API); ``head``, the start of each op's entry (``watch_head``:
    ``OpInterceptor._head``, the user's frame, the autograd node and the sequence number read
    natively; a watch that names DDP's reducer ops keeps the Python one). ``checks``: the
    watch's ``checks`` (its default when ``None``). Patches opwatch's internals for the block,
    as ``bench.ablate``'s stubs do."""
    import opwatch
    from opwatch.checks.nonfinite import rules, tracker
    from opwatch.core import records, sites
    from opwatch.core.compat import dispatch_modes_outside
    from opwatch.modes import interceptor

    module = load(torch_api=True)
    saved = [
        (interceptor, "_metas", interceptor._metas), (tracker.NonFiniteTracker, "_observe_all", tracker.NonFiniteTracker._observe_all),
        (interceptor.OpInterceptor, "_head", interceptor.OpInterceptor._head),
    ]
    if metadata:
        watch_metas, python_metas = module.watch_metas, interceptor._metas

        def metas(tensors, log, types=()):
            if not types:
                found = watch_metas(tensors, log.shapes)
                if found is not None:
                    return found
            return python_metas(tensors, log, types)

        interceptor._metas = metas
    if reductions:
        if "reductions" not in _set_up:
            module.watch_reduce_setup(
                set(rules.CHECKED_DTYPES), set(rules.PLAIN_TYPES), set(tracker._CONVERTED), set(tracker._SPLIT_DTYPES), rules.FLOAT16,
                tracker.NonFiniteTracker._CHUNK, tracker._SPLIT_FROM, tracker._SPLIT_STRIDED_FROM,
            )
            _set_up.add("reductions")
        watch_reduce, python_observe_all = module.watch_reduce, tracker.NonFiniteTracker._observe_all

        def observe_all(self, entry, inputs, outputs, metas):
            if type(outputs) is not tuple or type(metas) is not list or dispatch_modes_outside():
                return python_observe_all(self, entry, inputs, outputs, metas)
            watch_reduce(self, entry[records.E_INDEX], outputs, metas)

        tracker.NonFiniteTracker._observe_all = observe_all
    if head:
        if "head" not in _set_up:
            module.watch_head_setup(sites.USER, sites.ENGINE, sites.classify_code, records.FORWARD, records.BACKWARD, interceptor._NO_SITE, interceptor._drop_oldest_half)
            _set_up.add("head")
        watch_head, python_head = module.watch_head, interceptor.OpInterceptor._head

        def native_head(self, plan, others):
            if self._reducer_sites is not None:
                return python_head(self, plan, others)
            return watch_head(self, plan, others)  # the op's caller: two frames up, as for _head

        interceptor.OpInterceptor._head = native_head
    try:
        with (opwatch.watch() if checks is None else opwatch.watch(checks=checks)) as watch:
            yield watch
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _plan(func) -> tuple:
    """(the C++ op, whether the nan/inf check reads its results): bench.floor's plan."""
    return op_kernel(func), _read_by_the_check(func)


class NativeRecordsFloor(TorchDispatchMode):
    """:class:`bench.floor.RecordsFloor`'s per-op work in native code, through the CPython API."""

    reads = False  # NativeReadsFloor: one reduction per floating result
    torch_api = False  # the TorchApi floors: torch's C++ API for tensors, nodes and reductions

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no Python frame of its own per op: nothing for Dynamo to trace

    def __init__(self, max_records: int = 10_000):
        super().__init__()
        native = load(self.torch_api)
        self.slots = torch.empty(2 * _SLOTS).unbind()  # the (min, max) pairs of float32 outputs
        self._native_state, dispatch = native.bind(
            self, self.reads, torch.Tensor, _plan, current_autograd_node, get_sequence_nr, torch.aminmax,
            tuple(_READ_DTYPES), _FLOAT32, self.slots, max_records,
        )
        self._native = native
        # What torch calls per op: it looks the name up on the mode, and requires the bound
        # callable's __self__ to be the mode.
        self.__torch_dispatch__ = dispatch

    @property
    def entries(self) -> list:
        """The ring of entries (``None`` where none was written yet), as RecordsFloor's."""
        return self._native.entries(self._native_state)

    @property
    def refs(self) -> list:
        """The ring of weak references to the outputs read (``None`` where none was written yet)."""
        return self._native.refs(self._native_state)


class NativeReadsFloor(NativeRecordsFloor):
    """:class:`bench.floor.ReadsFloor`'s per-op work in native code, through the CPython API."""

    reads = True


class TorchApiRecordsFloor(NativeRecordsFloor):
    """:class:`bench.floor.RecordsFloor`'s per-op work in native code, through torch's C++ API."""

    torch_api = True


class TorchApiReadsFloor(NativeReadsFloor):
    """:class:`bench.floor.ReadsFloor`'s per-op work in native code, through torch's C++ API."""

    torch_api = True
