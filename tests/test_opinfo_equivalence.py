"""opwatch is transparent on PyTorch's OpInfo database.

For every OpInfo in ``torch.testing._internal.common_methods_invocations.op_db``
that supports CPU, sample inputs are run forward (and backward, where the op
supports autograd for that dtype) twice: under the reference
:class:`equivalence.PassthroughMode` and under :func:`equivalence.watching`
(``opwatch.watch()``).  The two runs must agree bitwise on

* the op's output (nested; dtype, shape, strides, storage offset, conj/neg/
  zero-tensor bits, requires_grad, grad_fn type, raw bits incl. NaN payloads),
* the inputs after the call (in-place ops),
* the gradients w.r.t. every input that requires grad,
* the exception type and the stage (forward / backward) if either run raises.

Passes (one pytest test per OpInfo; all passes for an op run in that test):

* float32:  the first ``FLOAT32_SAMPLES`` (= 4) samples.
* second pass: float64, complex64, bfloat16 and int64, the first
  ``OTHER_SAMPLES`` (= 2) samples each.
* float32 in-place variant (``op.inplace_variant``), forward only, the first
  ``INPLACE_SAMPLES`` (= 1) sample with ``requires_grad=False`` -- this
  exercises views whose base is modified in place.

Samples are generated once (seeded) and deep-cloned for every run with
:func:`equivalence.clone_inputs` (layout, aliasing, conj/neg bits preserved);
the global RNGs are reseeded before every run, so random ops (dropout,
bernoulli, randn_like, ...) must give identical results too.  Gradient
outputs are drawn from a private, fixed-seed generator.

Skips (counted and printed in the summary at the end of the module):

* "nondeterministic": the watched run differs from the reference, and a
  second reference run also differs from the first -> the sample is
  nondeterministic by nature and is skipped.
* "sample-generation": the OpInfo's sample generator itself raised.
* Ops whose outputs are uninitialized memory (``UNINITIALIZED_OUTPUT_OPS``:
  empty, empty_like, new_empty, ...) are not skipped: their outputs are
  compared on metadata only (dtype/shape/strides/...), not on values.

Crashes: a segfault kills the pytest process.  Run with ``-v`` to see the
op's test id before it runs, and ``pytest -p faulthandler`` (default on)
dumps the Python stack.  Before each run the op / dtype / sample index /
mode is also written to ``BREADCRUMB`` (``$TMPDIR/opwatch_opinfo_breadcrumb.txt``)
so a crash can be attributed to a sample.  To reproduce one op verbosely in
a fresh process::

    .venv/bin/python tests/test_opinfo_equivalence.py OPNAME [OPNAME ...]

(``--all`` runs the whole sweep with a timing summary).  Set
``OPWATCH_EQUIV_TARGET=standin`` to run the harness against a second
passthrough mode instead of opwatch.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice

import pytest
import torch

pytest.importorskip("expecttest")

if __package__ in (None, ""):
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, _HERE)
    if __name__ == "__main__":  # make the repo's opwatch importable
        sys.path.insert(1, os.path.dirname(_HERE))
    import equivalence as eq  # type: ignore[no-redef]
else:
    try:
        from . import equivalence as eq
    except ImportError:
        import equivalence as eq  # type: ignore[no-redef]

from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

DEVICE = "cpu"
# Samples per (op, dtype); override with OPWATCH_OPINFO_SAMPLES="f32,other,inplace".
FLOAT32_SAMPLES, OTHER_SAMPLES, INPLACE_SAMPLES = (
    int(n) for n in os.environ.get("OPWATCH_OPINFO_SAMPLES", "4,2,1").split(",")
)
SECOND_PASS_DTYPES = (torch.float64, torch.complex64, torch.bfloat16, torch.int64)

# Ops whose results are (partly) uninitialized memory: compare metadata only.
UNINITIALIZED_OUTPUT_OPS = frozenset(
    {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
     "new_empty_strided", "resize_", "resize_as_"}
)

BREADCRUMB = os.path.join(tempfile.gettempdir(), "opwatch_opinfo_breadcrumb.txt")


def op_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _supported(op, dtype) -> bool:
    try:
        return dtype in op.supported_dtypes(DEVICE)
    except Exception:  # noqa: BLE001
        return False


OPS = [op for op in op_db if any(_supported(op, d) for d in (torch.float32, *SECOND_PASS_DTYPES))]


# --------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------


@dataclass
class OpReport:
    op: str
    samples: int = 0
    runs: int = 0
    skipped: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)
    seconds: float = 0.0


class _Breadcrumb:
    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))


_breadcrumb: _Breadcrumb | None = None


def _crumb(text: str) -> None:
    global _breadcrumb
    if _breadcrumb is None:
        try:
            _breadcrumb = _Breadcrumb(BREADCRUMB)
        except OSError:
            return
    _breadcrumb.write(text + "\n")


def _sample_repr(sample, limit: int = 600) -> str:
    try:
        text = sample.summary() if hasattr(sample, "summary") else repr(sample)
    except Exception:  # noqa: BLE001
        text = repr(sample)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _make_body(fn, sample, inputs, grad: bool):
    """The thunk run under each mode; ``inputs`` = cloned (input, args, kwargs)."""

    def body(state):
        inp, args, kwargs = inputs
        state["stage"] = "forward"
        out = fn(inp, *args, **kwargs)
        state["partial"] = {"out": out, "inputs": inputs}
        grads = None
        if grad:
            state["stage"] = "backward-prep"
            g_out = sample.output_process_fn_grad(out)
            outs = [
                t for t in tree_flatten(g_out)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
                and t.layout == torch.strided and (t.is_floating_point() or t.is_complex())
            ]
            ins = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs and ins:
                gen = torch.Generator().manual_seed(1234)
                grad_outputs = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
                state["stage"] = "backward"
                grads = torch.autograd.grad(outs, ins, grad_outputs, allow_unused=True)
        return {"out": out, "inputs": inputs, "grads": grads}

    return body


def _check_sample(report: OpReport, op, fn, variant: str, dtype, idx: int, sample, grad: bool,
                  verbose: bool = False) -> None:
    where = f"{report.op} [{variant}, {str(dtype).replace('torch.', '')}, sample {idx}{', +grad' if grad else ''}]"
    values = op.name not in UNINITIALIZED_OUTPUT_OPS
    original = (sample.input, sample.args, sample.kwargs)

    def run(factory, label):
        _crumb(f"{where} under {label}\n{_sample_repr(sample)}")
        if verbose:
            print(f"  {where} under {label}", flush=True)
        inputs = eq.clone_inputs(original)
        report.runs += 1
        return eq.capture(factory, _make_body(fn, sample, inputs, grad))

    report.samples += 1
    ref = run(eq.PassthroughMode, "PassthroughMode")
    got = run(eq.watching, eq.target_name())
    d = eq.outcome_diff(ref, got, values=values)
    if d is None:
        return
    ref2 = run(eq.PassthroughMode, "PassthroughMode (again)")
    if eq.outcome_diff(ref, ref2, values=values) is not None:
        report.skipped["nondeterministic"] += 1
        return
    report.failures.append(f"{where}: {d}\n    sample: {_sample_repr(sample)}")


def _samples(op, dtype, requires_grad: bool, n: int, report: OpReport, variant: str):
    eq.seed_everything(0)
    try:
        return list(islice(op.sample_inputs(DEVICE, dtype, requires_grad=requires_grad), n))
    except Exception as e:  # noqa: BLE001
        report.skipped["sample-generation"] += 1
        report.failures_ignored = getattr(report, "failures_ignored", [])
        report.failures_ignored.append(f"{variant} {dtype}: {type(e).__name__}: {e}")
        return []


def check_op(op, verbose: bool = False) -> OpReport:
    report = OpReport(op_id(op))
    t0 = time.perf_counter()
    passes = [(torch.float32, FLOAT32_SAMPLES)] + [(d, OTHER_SAMPLES) for d in SECOND_PASS_DTYPES]
    for dtype, n in passes:
        if not _supported(op, dtype):
            continue
        grad = bool(op.supports_autograd) and dtype in op.supported_backward_dtypes(DEVICE)
        for i, s in enumerate(_samples(op, dtype, grad, n, report, "op")):
            _check_sample(report, op, op.op, "op", dtype, i, s, grad, verbose)
    inplace = op.inplace_variant
    if inplace is not None and _supported(op, torch.float32):
        for i, s in enumerate(_samples(op, torch.float32, False, INPLACE_SAMPLES, report, "inplace")):
            _check_sample(report, op, inplace, "inplace", torch.float32, i, s, False, verbose)
    report.seconds = time.perf_counter() - t0
    return report


# --------------------------------------------------------------------------
# pytest
# --------------------------------------------------------------------------

_REPORTS: dict[str, OpReport] = {}


@pytest.fixture(scope="module", autouse=True)
def _sweep_summary(pytestconfig):
    yield
    if not _REPORTS:
        return
    reports = list(_REPORTS.values())
    skipped = sum((r.skipped for r in reports), Counter())
    lines = [
        f"OpInfo equivalence sweep against {eq.target_name()}: "
        f"{len(reports)} ops, {sum(r.samples for r in reports)} samples, "
        f"{sum(r.runs for r in reports)} runs, "
        f"{sum(len(r.failures) for r in reports)} failing samples, "
        f"skipped: {dict(skipped) or 'none'}, "
        f"{sum(r.seconds for r in reports):.1f}s",
    ]
    slow = sorted(reports, key=lambda r: -r.seconds)[:5]
    lines.append("slowest: " + ", ".join(f"{r.op} {r.seconds:.2f}s" for r in slow))
    tr = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line("")
        for line in lines:
            tr.write_line(line)
    else:
        print("\n".join(lines))


@pytest.mark.parametrize("op", OPS, ids=op_id)
def test_opinfo_equivalence(op):
    report = check_op(op)
    _REPORTS[report.op] = report
    if report.failures:
        pytest.fail(
            f"{len(report.failures)} sample(s) of {report.op} differ between "
            f"PassthroughMode and {eq.target_name()}:\n" + "\n".join(report.failures),
            pytrace=False,
        )


# --------------------------------------------------------------------------
# explicit hazards seen in earlier probes (cheap, named, isolated)
# --------------------------------------------------------------------------


def _equivalent(body, values: bool = True):
    ref = eq.capture(eq.PassthroughMode, body)
    got = eq.capture(eq.watching, body)
    d = eq.outcome_diff(ref, got, values=values)
    assert d is None, d
    return ref, got


def test_hazard_reduce_efficient_zerotensor():
    def body(state):
        z = torch._efficientzerotensor((3, 4), dtype=torch.float32)
        state["stage"] = "sum"
        a = z.sum()
        state["stage"] = "sum_dim"
        b = z.sum(dim=0)
        state["stage"] = "amax/mean"
        c = z.mean()
        return a, b, c, z.add(1)

    _equivalent(body)


def test_hazard_zerotensor_in_backward():
    # torch.where / mul backward may hand zero tensors to later nodes; a
    # complex -> real op (abs, angle) with a real grad exercises conj paths.
    def body(state):
        x = torch.randn(5, dtype=torch.complex64, requires_grad=True)
        y = torch.randn(5, requires_grad=True)
        out = (x.abs() * y).sum() + torch.where(y > 0, y, torch.zeros(())).sum() + x.angle().sum()
        state["stage"] = "backward"
        return out, torch.autograd.grad(out, (x, y))

    _equivalent(body)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=str)
def test_hazard_sgn_backward(dtype):
    def body(state):
        x = torch.tensor([-1.5, 0.0, 2.0, float("nan")], dtype=dtype, requires_grad=True)
        y = x.sgn() * x
        state["stage"] = "backward"
        (g,) = torch.autograd.grad(y.abs().sum(), x)
        y2 = torch.sgn(x * 2)
        (g2,) = torch.autograd.grad(y2, x, torch.ones_like(y2))
        return y, g, y2, g2

    _equivalent(body)


def test_hazard_grad_fn_of_nograd_view_of_inplace_modified_base():
    def body(state):
        base = torch.randn(4, 4, requires_grad=True).clone()
        with torch.no_grad():
            v = base[0]
        base.mul_(2)
        state["stage"] = "grad_fn"
        try:
            gf = type(v.grad_fn).__name__
        except Exception as e:  # noqa: BLE001
            gf = type(e).__name__
        state["stage"] = "use-view"
        try:
            w = v * 3
            res = (w, None)
        except Exception as e:  # noqa: BLE001
            res = (None, type(e).__name__)
        return gf, res, base

    _equivalent(body)


def test_hazard_empty_outputs_garbage():
    # Uninitialized memory may be NaN/inf; opwatch must not crash on it and
    # metadata must match.  Values are not compared (garbage by nature).
    def body(state):
        outs = [torch.empty(64), torch.empty_like(torch.ones(3, 5)), torch.ones(2).new_empty((7,)),
                torch.empty_strided((2, 3), (1, 2)), torch.empty(4, dtype=torch.bfloat16)]
        outs.append(outs[0] + 1)
        outs.append(outs[1].sum())
        return outs

    _equivalent(body, values=False)


# --------------------------------------------------------------------------
# command line: verbose per-op repro / whole sweep timing
# --------------------------------------------------------------------------


def _main(argv: list[str]) -> int:
    by_name = {op_id(o): o for o in OPS}
    if not argv:
        print(__doc__)
        return 2
    selected = OPS if argv == ["--all"] else [by_name.get(a) or by_name[a] for a in argv]
    verbose = argv != ["--all"]
    print(f"target: {eq.target_name()}", flush=True)
    t0 = time.perf_counter()
    reports = []
    for op in selected:
        if verbose:
            print(op_id(op), flush=True)
        r = check_op(op, verbose=verbose)
        reports.append(r)
        for f in r.failures:
            print("FAIL", f, flush=True)
    total = time.perf_counter() - t0
    skipped = sum((r.skipped for r in reports), Counter())
    print(f"{len(reports)} ops, {sum(r.samples for r in reports)} samples, {sum(r.runs for r in reports)} runs, "
          f"{sum(len(r.failures) for r in reports)} failures in {sum(bool(r.failures) for r in reports)} ops, "
          f"skipped {dict(skipped)}, {total:.1f}s")
    for r in sorted(reports, key=lambda r: -r.seconds)[:15]:
        print(f"  {r.op:40s} {r.seconds:6.2f}s {r.samples} samples")
    return 1 if any(r.failures for r in reports) else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
