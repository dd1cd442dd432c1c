"""Find the torch functions that promote between floating dtypes INSIDE their own composite
kernels, though every tensor the caller passed has one dtype: the ones a per-op dtype check
would blame on the caller (the math ``scaled_dot_product_attention`` upcasts float16 q, k, v to
float32 and adds the caller's float16 mask).

Method. For every OpInfo in torch's own test database (``op_db``) that supports the dtype on
the CPU, take up to ``--samples`` sample inputs in float16, bfloat16, float32 and float64
whose floating tensors (non-scalar) all have that one dtype, and run each forward under
``opwatch.watch(checks=["dtype_mismatch"])``, with the math SDPA backend forced as transformers'
tests do. Every ``dtype_mismatch`` the watch reports is printed: with one floating dtype passed,
each is a promotion (or a dtype rule) inside the function. Run it against two trees to compare::

    PYTHONPATH=/path/to/tree python tools/find_internal_promotions.py [--limit N] [--samples K]

Result on torch 2.13.0 (CPU build): see ``RESULT``. OpInfo's SDPA samples carry no float mask,
so the math SDPA's upcast (``aten.add`` of float32 scores and the caller's float16 mask) is
not among them; the tiny Hugging Face models in half precision (tests/equivalence) show it.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import defaultdict

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

RESULT = """
torch 2.13.0 CPU, every OpInfo, 4 samples per dtype, forward, math SDPA forced:
  before the composite-call rule (opwatch.checks.dtype):
    nn.functional.rms_norm  float16, bfloat16: aten.mul.Tensor silent_upcast (float32 normalised
                            input times the caller's weight)
    linalg.matrix_rank      float32: aten.mul.Tensor, aten.gt.Tensor silent_upcast (a float64
                            tolerance made inside)
    gather                  every dtype: aten.gather arg_dtype (an index sample torch rejects:
                            a real finding, not a promotion)
  after it: gather only
"""


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _one_dtype(sample) -> bool:
    tensors = [*_tensors(sample.input), *_tensors(list(sample.args)), *_tensors(sample.kwargs)]
    floating = {t.dtype for t in tensors if t.dim() and t.is_floating_point()}
    return len(floating) <= 1


def main(argv=None) -> int:
    import opwatch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.testing._internal.common_methods_invocations import op_db

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="only the first N OpInfos")
    parser.add_argument("--samples", type=int, default=4, help="samples per OpInfo and dtype")
    options = parser.parse_args(argv)
    found = defaultdict(set)
    warnings.simplefilter("ignore")
    for info in op_db[: options.limit]:
        for dtype in DTYPES:
            if dtype not in info.supported_dtypes("cpu"):
                continue
            try:
                samples = list(info.sample_inputs("cpu", dtype, requires_grad=False))[: options.samples]
            except Exception:
                continue
            for sample in samples:
                if not _one_dtype(sample):
                    continue
                w = opwatch.watch(checks=["dtype_mismatch"], warn=False, dump_on_error=False)
                try:
                    with sdpa_kernel(SDPBackend.MATH), w:
                        info.op(sample.input, *sample.args, **sample.kwargs)
                except Exception:
                    pass  # the sample's own error; what was reported before it still counts
                for anomaly in w.anomalies:
                    rule = anomaly.finding.rule
                    found[info.name].add(f"{str(dtype)[6:]} {anomaly.op} {rule}")
                    print(f"{info.name:40s} {str(dtype)[6:]:9s} {anomaly.op:40s} {rule}", flush=True)
    print("\nfunctions reporting a dtype anomaly with one floating dtype passed:")
    for name in sorted(found):
        print(f"  {name}: {'; '.join(sorted(found[name]))}")
    if not found:
        print("  none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
