"""Which indexing/scatter writes take a source of another dtype than the tensor they write, with
the installed torch as the judge: for each op and each pair (dtype of ``self``, dtype of the
source) among f32, f64, bf16, f16, i64, i32 and bool, does the kernel raise, silently cast the
source into ``self``'s dtype, or is the pair the same dtype?

Method. Each op is called as a user calls it (``buf.index_add_(0, idx, src)``,
``buf[mask] = src``, ``buf.copy_(src)``) on small CPU tensors, under a ``TorchDispatchMode``
that records the ATen op the call reaches (its schema name) and whether that op's kernel
raised: a raise outside every dispatched op would be a pre-dispatch check (none is found here).
The source is full-sized and, where the op takes a tensor value (``masked_fill_``,
``index_fill_``, ``index_put_``), also 0-dim (a scalar made with ``torch.tensor(x)``).
For a silent cast the script also says whether it *narrows* (a floating source into a less
precise floating or an integer buffer, i64 into i32, anything but bool into bool).

Run: ``python tools/find_accumulation_dtypes.py [--op NAME] [--messages]``; it prints one
table per call (rows: ``self``'s dtype; columns: the source's; ``=`` same dtype, ``R`` the
kernel raises, ``n`` a narrowing silent cast, ``c`` a silent cast that keeps every value, ``?``
anything else) and, with ``--messages``, torch's first error message for each call. The
``opwatch.checks.accumulation`` table is this result; ``tests/unit/test_accumulation_unit.py``
runs :func:`classify` again on every call and fails when torch disagrees with it.

Result on torch 2.13.0 (CPU build):

- raise on every dtype mismatch between ``self`` and the source (all 42 mismatched pairs):
  ``index_add_``, ``index_copy_``, ``index_reduce_``, ``scatter_``/``scatter_add_``/
  ``scatter_reduce_`` with a tensor ``src`` (and ``reduce=``), ``masked_scatter_``, ``put_``
  (with and without accumulate), ``index_put_`` with and without accumulate, full or 0-dim
  values (``buf[idx] = v``, ``buf[mask] = v``), ``lerp_`` (``end`` and ``weight``), and the
  functional forms;
- the one exception in that family: ``index_put_`` without accumulate of a one-element CPU
  value under a single bool mask (``buf[mask] = torch.tensor(x)``) runs as ``masked_fill_`` and
  casts;
- silently cast the source into ``self``'s dtype: ``copy_`` (and ``buf[:n] = v``),
  ``slice_scatter``/``select_scatter``, ``masked_fill_``/``index_fill_``/``fill_`` with a 0-dim
  tensor value (a value of more dims raises, a shape rule);
- in-place pointwise ops (``add_``, ``sub_``, ``addcmul_``, ``mul_``, ``add(out=)``) compute in the
  promoted dtype and round into ``self`` silently, raising only where a float result meets an
  integer or bool ``self``.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DTYPES = {
    "f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16,
    "i64": torch.int64, "i32": torch.int32, "b8": torch.bool,
}
_FLOAT_RANK = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


class _Recorder(TorchDispatchMode):
    """Records the ATen ops a call reaches, and the first whose kernel raised."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.raised_in = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.raised_in is None:
                self.raised_in = func._schema.name
            raise


def _index():
    return torch.tensor([0, 2, 0])


def _mask():
    return torch.tensor([[True, False, True], [False, True, False], [True, True, False], [False, False, True]])


# name -> (call(buf, src), source shape: "rows" (3 rows of buf), "full" (buf's shape),
# "scalar" (0-dim), "flat3" (3 values)); buf is always 4x3.
CALLS = {
    "index_add_": (lambda b, s: b.index_add_(0, _index(), s), "rows"),
    "index_add": (lambda b, s: b.index_add(0, _index(), s), "rows"),
    "index_copy_": (lambda b, s: b.index_copy_(0, _index(), s), "rows"),
    "index_copy": (lambda b, s: b.index_copy(0, _index(), s), "rows"),
    "index_reduce_(amax)": (lambda b, s: b.index_reduce_(0, _index(), s, "amax"), "rows"),
    "scatter_(src)": (lambda b, s: b.scatter_(0, _index()[:, None].expand(3, 3), s), "rows"),
    "scatter(src)": (lambda b, s: b.scatter(0, _index()[:, None].expand(3, 3), s), "rows"),
    "scatter_(src, reduce=add)": (lambda b, s: b.scatter_(0, _index()[:, None].expand(3, 3), s, reduce="add"), "rows"),
    "scatter_add_": (lambda b, s: b.scatter_add_(0, _index()[:, None].expand(3, 3), s), "rows"),
    "scatter_add": (lambda b, s: b.scatter_add(0, _index()[:, None].expand(3, 3), s), "rows"),
    "scatter_reduce_(sum)": (lambda b, s: b.scatter_reduce_(0, _index()[:, None].expand(3, 3), s, "sum"), "rows"),
    "scatter_reduce_(amax)": (lambda b, s: b.scatter_reduce_(0, _index()[:, None].expand(3, 3), s, "amax"), "rows"),
    "masked_scatter_": (lambda b, s: b.masked_scatter_(_mask(), s), "full"),
    "masked_scatter": (lambda b, s: b.masked_scatter(_mask(), s), "full"),
    "put_": (lambda b, s: b.put_(_index(), s), "flat3"),
    "put_(accumulate)": (lambda b, s: b.put_(_index(), s, accumulate=True), "flat3"),
    "index_put_(accumulate)": (lambda b, s: b.index_put_((_index(),), s, accumulate=True), "rows"),
    "index_put_(accumulate, 0-dim)": (lambda b, s: b.index_put_((_index(),), s, accumulate=True), "scalar"),
    "index_put_": (lambda b, s: b.index_put_((_index(),), s), "rows"),
    "index_put_(0-dim)": (lambda b, s: b.index_put_((_index(),), s), "scalar"),
    "buf[mask] = v": (lambda b, s: b.__setitem__(_mask(), s), "six"),
    "buf[mask] = 0-dim (masked_fill path)": (lambda b, s: b.__setitem__(_mask(), s), "scalar"),
    "buf[idx] = 0-dim": (lambda b, s: b.__setitem__(_index(), s), "scalar"),
    "buf[:3] = v": (lambda b, s: b.__setitem__(slice(0, 3), s), "rows"),
    "copy_": (lambda b, s: b.copy_(s), "full"),
    "masked_fill_(0-dim)": (lambda b, s: b.masked_fill_(_mask(), s), "scalar"),
    "masked_fill_(full)": (lambda b, s: b.masked_fill_(_mask(), s), "full"),
    "index_fill_(0-dim)": (lambda b, s: b.index_fill_(0, _index(), s), "scalar"),
    "fill_(0-dim)": (lambda b, s: b.fill_(s), "scalar"),
    "slice_scatter": (lambda b, s: b.slice_scatter(s, 0, 0, 3), "rows"),
    "select_scatter": (lambda b, s: b.select_scatter(s[0], 0, 1), "rows"),
    # In-place pointwise ops, for comparison: torch computes in the promoted dtype and casts
    # the result into self (raising only where the category narrows: float into an integer).
    "add_ (buf += v)": (lambda b, s: b.add_(s), "full"),
    "sub_": (lambda b, s: b.sub_(s), "full"),
    "addcmul_": (lambda b, s: b.addcmul_(s, s), "full"),
    "lerp_ (EMA)": (lambda b, s: b.lerp_(s, 0.5), "full"),
    "mul_": (lambda b, s: b.mul_(s), "full"),
    "add(out=buf)": (lambda b, s: torch.add(s, s, out=b), "full"),
}


def _source(shape_kind: str, dtype: torch.dtype) -> torch.Tensor:
    shape = {"rows": (3, 3), "full": (4, 3), "scalar": (), "flat3": (3,), "six": (6,)}[shape_kind]
    return torch.ones(shape).to(dtype)


def narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` values into ``target`` can lose something: a floating source
    into a less precise floating dtype (f16 and bf16 lose to each other) or into an integer or
    bool; i64 into i32; any non-bool into bool."""
    if source == target:
        return False
    if target == torch.bool:
        return True
    if source.is_floating_point:
        if not target.is_floating_point:
            return True
        return _FLOAT_RANK[source] >= _FLOAT_RANK[target]
    if source == torch.int64 and target == torch.int32:
        return True
    return False


def classify(name: str, target: torch.dtype, source: torch.dtype) -> tuple[str, str | None, str]:
    """``(mark, the ATen op reached, torch's message or "")`` for one call and dtype pair."""
    call, shape_kind = CALLS[name]
    buf = torch.zeros(4, 3, dtype=target)
    src = _source(shape_kind, source)
    recorder = _Recorder()
    try:
        with recorder:
            call(buf, src)
    except Exception as error:  # noqa: BLE001 - the kernel's error is the datum
        reached = recorder.raised_in
        if reached is None:
            return "P", None, str(error).splitlines()[0]  # raised before any dispatched op
        return "R", reached, str(error).splitlines()[0]
    writer = next((op for op in reversed(recorder.ops) if op.endswith("_") or op.endswith("index_put")), None)
    if target == source:
        return "=", writer, ""
    return ("n" if narrows(source, target) else "c"), writer, ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", help="only the calls whose name contains this")
    parser.add_argument("--messages", action="store_true", help="print torch's first message per call")
    options = parser.parse_args(argv)
    names = list(DTYPES)
    for name in CALLS:
        if options.op and options.op not in name:
            continue
        rows, messages, reached = [], set(), set()
        for target_name, target in DTYPES.items():
            cells = []
            for source in DTYPES.values():
                mark, op, message = classify(name, target, source)
                cells.append(mark)
                if op:
                    reached.add(op)
                if message:
                    messages.add(message)
            rows.append(f"  {target_name:>5} " + " ".join(f"{c:>4}" for c in cells))
        print(f"{name}  (reaches {', '.join(sorted(reached)) or '-'})")
        print("  self\\src" + "".join(f"{n:>5}" for n in names))
        print("\n".join(rows))
        if options.messages:
            for message in sorted(messages)[:3]:
                print(f"    torch: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
