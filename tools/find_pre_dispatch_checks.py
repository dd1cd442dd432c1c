"""Find the torch functions that reject a device or dtype BEFORE any ATen op reaches a dispatch
mode (or outside every dispatched op), so that opwatch's per-op checks never see the call.

Method. For every OpInfo in torch's own test database (``op_db``: about 600 functions of
``torch``, ``torch.nn.functional``, ``torch.linalg``, ``torch.fft``, ``torch.special`` with
realistic sample inputs), plus a few hand-written calls the database lacks
(``pack_padded_sequence``), take float32 CPU samples and perturb ONE tensor argument at a time
(every tensor but the first, the one a user makes separately: a weight, a window, an index, a
target, lengths) in three ways: moved to ``meta`` (a stand-in for another device), cast to
float64, cast to int64. Each call runs under a ``TorchDispatchMode`` that records every op that
reaches it and whether that op's kernel raised. A call is kept when

- the healthy sample runs, and
- the perturbed one raises ``RuntimeError``/``ValueError``/``TypeError`` whose message speaks of
  a device or a dtype (device, dtype, type, cpu, meta, cuda, Double, Float, Long, same, ...),
- and NO dispatched op's kernel raised: the check is torch's own code around the ops (C++
  composite or Python), which opwatch's dispatch mode cannot see.

Run: ``python tools/find_pre_dispatch_checks.py [--limit N]``; it prints one line per
(function, perturbed argument, perturbation) and a summary per function.

Result on torch 2.13.0 (CPU build), summarised (what ``opwatch/checks/pre_dispatch.py`` covers):
see ``RESULT`` below, filled in from a run of this script.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_WORDS = re.compile(r"device|dtype|type|cpu|meta|cuda|double|float|long|int64|same|scalar", re.I)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
        self.raised_inside = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.raised_inside is None:
                self.raised_inside = str(func)
            raise


def _perturbations(tensor):
    if tensor.is_floating_point():
        yield "meta", tensor.to("meta")
        yield "float64", tensor.double()
        yield "int64", tensor.long()
    elif tensor.dtype in (torch.int64, torch.int32):
        yield "meta", tensor.to("meta")
        yield "float32", tensor.float()
        yield "int32" if tensor.dtype == torch.int64 else "int64", tensor.int() if tensor.dtype == torch.int64 else tensor.long()


def _slots(sample):
    """(label, getter, setter) for each tensor of a sample but its first input."""
    slots = []
    for i, arg in enumerate(sample.args):
        if isinstance(arg, torch.Tensor):
            slots.append((f"args[{i}]", i, None))
    for name, value in sample.kwargs.items():
        if isinstance(value, torch.Tensor):
            slots.append((name, None, name))
    return slots


def _call(op, inp, args, kwargs):
    recorder = _Recorder()
    try:
        with recorder:
            op(inp, *args, **kwargs)
    except Exception as error:  # AssertionError too: jiterator ops without a GPU
        return recorder, error
    return recorder, None


def _extra_cases():
    """Calls the OpInfo database lacks: (name, function, input, args, kwargs)."""
    from torch.nn.utils.rnn import pack_padded_sequence

    x = torch.randn(3, 5, 4)
    yield "nn.utils.rnn.pack_padded_sequence", pack_padded_sequence, x, (torch.tensor([5, 4, 2]),), {"batch_first": True}
    yield "torch.stft", torch.stft, torch.randn(400), (), {"n_fft": 64, "window": torch.hann_window(64), "return_complex": True}
    yield "torch.istft", torch.istft, torch.stft(torch.randn(400), 64, window=torch.hann_window(64), return_complex=True), (), {"n_fft": 64, "window": torch.hann_window(64)}


def _cases(limit):
    from torch.testing._internal.common_methods_invocations import op_db

    for info in op_db[:limit]:
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        try:
            samples = list(info.sample_inputs("cpu", torch.float32, requires_grad=False))[:2]
        except Exception:
            continue
        for sample in samples:
            yield info.name, info.op, sample.input, tuple(sample.args), dict(sample.kwargs)
    yield from _extra_cases()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="only the first N OpInfos")
    options = parser.parse_args(argv)
    found = {True: defaultdict(set), False: defaultdict(set)}
    for name, op, inp, args, kwargs in _cases(options.limit):
        if not isinstance(inp, torch.Tensor):
            continue
        if _call(op, inp, args, kwargs)[1] is not None:
            continue  # the healthy sample itself fails
        for label, index, key in _slots_of(args, kwargs, with_input=True):
            original = inp if index == -1 else args[index] if key is None else kwargs[key]
            for how, changed in _perturbations(original):
                new_inp = changed if index == -1 else inp
                new_args = args[:index] + (changed,) + args[index + 1 :] if key is None and index >= 0 else args
                new_kwargs = kwargs if key is None else {**kwargs, key: changed}
                recorder, error = _call(op, new_inp, new_args, new_kwargs)
                if not isinstance(error, (RuntimeError, ValueError, TypeError)) or not _WORDS.search(str(error)):
                    continue
                where = "outside" if recorder.raised_inside is None else f"in {recorder.raised_inside}"
                first = str(error).strip().splitlines()[0][:100]
                print(f"{name:36s} {label:10s} {how:8s} ops before: {len(recorder.ops):2d} {where:40s} {type(error).__name__}: {first}", flush=True)
                found[where == "outside"][name].add(f"{label}:{how}" + ("" if where == "outside" else f" ({where[3:]})"))
    for outside, title in ((True, "outside every dispatched op"), (False, "inside the kernel of an op (the dispatch mode sees it)")):
        print(f"\nfunctions that reject a device/dtype {title}:")
        for name in sorted(found[outside]):
            print(f"  {name}: {', '.join(sorted(found[outside][name]))}")
    return 0


def _slots_of(args, kwargs, with_input=False):
    if with_input:
        yield "input", -1, None
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            yield f"args[{i}]", i, None
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            yield key, None, key


if __name__ == "__main__":
    sys.exit(main())
