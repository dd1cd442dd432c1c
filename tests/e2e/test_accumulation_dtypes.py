"""Writes into a tensor judged by the source's dtype (opwatch.checks.accumulation), live.

Must flag: a mixture-of-experts layer writing float32 weighted expert outputs into its bf16
output buffer (``index_add_``, ``out[idx] += y``), in a bf16 model and under bf16 autocast;
graph message passing scattering float64 edge weights into a float32 node buffer; a bf16
exponential moving average of float32 weights. Must not: the same programs with their dtypes
right, trained a few steps (fp32, bf16 autocast), scalars and deliberate casts (``copy_``,
``load_state_dict`` into a bf16 model, master weights), optimizers, GradScaler.

The rules agree with torch: every call of ``tools/find_accumulation_dtypes.py`` on every pair
of dtypes is flagged exactly where torch raises (or, for the adding ops, rounds silently).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opwatch
from support.helpers import line_of

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
BF16, F32 = torch.bfloat16, torch.float32


def _watched(call, **options):
    error = None
    try:
        with opwatch.watch(warn=False, dump_on_error=False, **options) as w:
            call()
    except Exception as raised:
        error = raised
    return w, error


def rules(w):
    return [(a.finding.rule, a.record.op, a.record.lineno) for a in w.anomalies]


# -- a mixture of experts ----------------------------------------------------------------------


class MoE(nn.Module):
    """Top-2 routing with float32 routing weights (a float32 softmax, as Mixtral computes them),
    experts written into one output buffer. ``write`` picks how: ``"index_add"`` (the weights
    cast to the activations' dtype first, as Mixtral does), ``"index_add_bug"`` (that cast
    forgotten: float32 weighted outputs written into the buffer), ``"accumulate_bug"`` (the
    same with ``out[idx] += y``)."""

    def __init__(self, dim=16, experts=4, write="index_add"):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim)) for _ in range(experts))
        self.write = write

    def forward(self, h):
        weights = F.softmax(self.router(h), dim=-1, dtype=torch.float32)  # routing weights
        top, chosen = weights.topk(2, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        if self.write == "index_add":
            top = top.to(h.dtype)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel() == 0:
                continue
            y = expert(h[rows]) * top[rows, slot, None]  # weighted expert output
            if self.write != "accumulate_bug":
                out.index_add_(0, rows, y)  # moe write
            else:
                out[rows] += y  # moe accumulate
        return out


class MoEModel(nn.Module):
    def __init__(self, write="index_add"):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.inp = nn.Linear(16, 16)
        self.moe = MoE(write=write)
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        h = self.inp(self.embed(ids))
        return self.head(h + self.moe(h))


def train_moe(write="index_add", dtype=F32, autocast=False, steps=3):
    torch.manual_seed(0)
    model = MoEModel(write).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 32, (12,))
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = F.cross_entropy(model(ids).float(), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype, autocast", [(F32, False), (F32, True), (BF16, False)], ids=["fp32", "bf16-autocast", "bf16-model"])
def test_a_moe_with_its_dtypes_right_trains_under_strict(dtype, autocast):
    reference = train_moe(dtype=dtype, autocast=autocast)
    with warnings.catch_warnings():
        warnings.simplefilter("error", opwatch.OpwatchWarning)
        with opwatch.strict() as w:
            losses = train_moe(dtype=dtype, autocast=autocast)
    assert w.anomalies == [] and losses == reference
    written = [r for r in w.records if r.op == "aten.index_add_.default"]
    low = BF16 if dtype == BF16 or autocast else F32
    assert written and {m.dtype for m in written[0].inputs} == {low, torch.int64}
    assert any(r.op == "aten._softmax.default" and r.outputs[0].dtype == F32 for r in w.records)


def test_the_fp32_moe_with_the_bug_in_its_code_does_not_flag():
    """In float32 the product is float32 like the buffer: the missing cast is harmless there."""
    with opwatch.strict() as w:
        train_moe("index_add_bug")
    assert w.anomalies == []


def test_float32_weighted_outputs_written_into_a_bf16_buffer_under_autocast_raise_before_the_kernel():
    """Autocast allows the bf16 * f32 product (its own mix); writing it into the bf16 buffer is
    the program's."""
    with pytest.raises(opwatch.AnomalyError) as raised:
        with opwatch.strict(warn=False, dump_on_error=False):
            train_moe("index_add_bug", autocast=True)
    anomaly = raised.value.anomaly
    assert (anomaly.finding.rule, anomaly.op, anomaly.lineno, anomaly.phase) == (
        "dtype.write_source", "aten.index_add_.default", line_of("# moe write", HERE), "forward")
    assert f"made by aten.mul.Tensor at {HERE}:{line_of('# weighted expert output', HERE)}" in anomaly.message
    assert "writes source f32[" in anomaly.message and "(out * weight).to(buf.dtype)" in anomaly.message


def test_the_same_bug_in_a_bf16_model_flags_the_write_as_well_as_the_promotion():
    w, error = _watched(lambda: train_moe("index_add_bug", dtype=BF16, steps=1))
    assert isinstance(error, RuntimeError)  # torch's own error, without saying where
    found = rules(w)
    assert ("dtype.write_source", "aten.index_add_.default", line_of("# moe write", HERE)) in found
    # (the bf16 * f32 product is a promotion outside autocast, judged by the promotion rule)
    assert {rule for rule, _, _ in found} <= {"dtype.write_source", "dtype.silent_upcast"}


def test_out_idx_plus_equals_float32_under_autocast_rounds_silently_and_flags_at_the_line():
    """``out[rows] += y`` is ``tmp = out[rows]; tmp += y; out[rows] = tmp``: the f32 sum is
    rounded into the bf16 copy by ``add_``, and torch says nothing."""
    w, error = _watched(lambda: train_moe("accumulate_bug", autocast=True, steps=1))
    assert error is None
    assert set(rules(w)) == {("dtype.narrowing_write", "aten.add_.Tensor", line_of("# moe accumulate", HERE))}
    assert f"made by aten.mul.Tensor at {HERE}:{line_of('# weighted expert output', HERE)}" in w.anomalies[0].message


# -- graph message passing ---------------------------------------------------------------------


class GraphConv(nn.Module):
    """Weighted mean aggregation of neighbour messages (scatter_add_ into node buffers)."""

    def __init__(self, dim=8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, edges, weight):
        src, dst = edges
        messages = self.lin(x)[src] * weight[:, None].to(x.dtype)
        total = torch.zeros_like(x).scatter_add_(0, dst[:, None].expand_as(messages), messages)
        degree = torch.zeros(x.shape[0], dtype=x.dtype).scatter_add_(0, dst, weight)  # degree
        return torch.relu(total / degree.clamp(min=1e-6)[:, None])


def train_graph(edge_weights: np.ndarray, steps=3):
    torch.manual_seed(0)
    conv, head = GraphConv(), nn.Linear(8, 2)
    opt = torch.optim.Adam([*conv.parameters(), *head.parameters()], lr=1e-2)
    x, y = torch.randn(6, 8), torch.randint(0, 2, (6,))
    edges = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 3], [1, 2, 3, 4, 5, 0, 0, 2]])
    weight = torch.from_numpy(edge_weights)  # edge weights
    for _ in range(steps):
        loss = F.cross_entropy(head(conv(x, edges, weight)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def test_float64_edge_weights_scattered_into_a_float32_node_buffer_flag():
    weights = np.linspace(0.5, 1.5, 8)  # float64, as numpy makes them
    w, error = _watched(lambda: train_graph(weights))
    assert isinstance(error, RuntimeError)  # torch refuses it, without saying where the f64 came from
    [anomaly] = w.anomalies
    assert (anomaly.finding.rule, anomaly.record.op, anomaly.record.lineno) == (
        "dtype.write_source", "aten.scatter_add_.default", line_of("# degree", HERE))
    assert "writes src f64[8] cpu into self f32[6] cpu" in anomaly.message
    assert "torch.from_numpy(a).float()" in anomaly.message


def test_graph_message_passing_with_matching_dtypes_trains_under_strict():
    weights = np.linspace(0.5, 1.5, 8).astype(np.float32)
    reference = train_graph(weights)
    with opwatch.strict() as w:
        assert train_graph(weights) == reference
    assert w.anomalies == []
    assert sum(r.op == "aten.scatter_add_.default" for r in w.records) >= 6  # forward, every step


# -- accumulating in place: an EMA of the weights ----------------------------------------------


def train_with_ema(ema_dtype, model_dtype=F32, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(model_dtype)
    ema = [p.detach().to(ema_dtype) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    x, y = torch.randn(16, 8, dtype=model_dtype), torch.randn(16, 1, dtype=model_dtype)
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for average, p in zip(ema, model.parameters()):
                average.mul_(0.999).add_(p, alpha=0.001)  # ema update
    return ema


def test_a_bf16_average_of_float32_weights_is_a_narrowing_write():
    w, error = _watched(lambda: train_with_ema(BF16))
    assert error is None  # torch rounds silently: 0.1% updates vanish in bf16
    assert {rule for rule, _, _ in rules(w)} == {"dtype.narrowing_write"}
    assert {(op, line) for _, op, line in rules(w)} == {("aten.add_.Tensor", line_of("# ema update", HERE))}
    anomaly = w.anomalies[0]
    assert "add_ computes in f32" in anomaly.message and "rounds the result into self bf16[" in anomaly.message


@pytest.mark.parametrize("ema_dtype, model_dtype", [(F32, F32), (F32, BF16)], ids=["fp32", "f32-average-of-bf16-model"])
def test_an_average_as_precise_as_the_weights_does_not_flag(ema_dtype, model_dtype):
    with opwatch.strict() as w:
        train_with_ema(ema_dtype, model_dtype)
    assert w.anomalies == []


def test_strict_raises_before_the_rounding_add_runs():
    acc, update = torch.zeros(4, dtype=BF16), torch.full((4,), 1.0)
    with pytest.raises(opwatch.AnomalyError):
        with opwatch.strict(warn=False, dump_on_error=False):
            acc += update  # residual into bf16
    assert acc.tolist() == [0.0] * 4


def test_a_float32_residual_added_in_place_into_a_bf16_output_under_autocast_flags():
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)

    def block():
        with torch.autocast("cpu", dtype=BF16):
            h = lin(x)
            h += x  # residual in place
            return h

    w, error = _watched(block)
    assert error is None
    assert rules(w) == [("dtype.narrowing_write", "aten.add_.Tensor", line_of("# residual in place", HERE))]


# -- healthy writes ----------------------------------------------------------------------------


def test_scalars_and_deliberate_casts_do_not_flag():
    def run():
        buf = torch.zeros(4, 3, dtype=BF16)
        mask = buf == 0
        buf[mask] = torch.tensor(1.5)  # a 0-dim value under a mask: torch runs masked_fill_
        buf[mask] = 2.5
        buf.masked_fill_(mask, torch.tensor(-1e4))
        buf.index_fill_(0, torch.tensor([1]), torch.tensor(0.25))
        buf.copy_(torch.randn(4, 3))  # the way to write into a preallocated buffer
        buf[:2] = torch.randn(2, 3)
        buf.mul_(torch.rand(4, 3))  # a scaling computed in f32, rounded once
        buf += torch.tensor(1.0, dtype=torch.float64)  # a 0-dim scalar
        counts = torch.zeros(5)
        counts.index_add_(0, torch.tensor([0, 1, 1]), torch.ones(3))
        total = torch.zeros(())
        total += counts.sum()

    w, error = _watched(run)
    assert error is None and w.anomalies == []


def test_a_float32_checkpoint_loaded_into_a_bf16_model_and_master_weights_do_not_flag():
    def run():
        torch.manual_seed(0)
        fp32 = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
        model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4)).to(BF16)
        model.load_state_dict(fp32.state_dict())
        master = [p.detach().float().requires_grad_() for p in model.parameters()]
        opt = torch.optim.AdamW(master, lr=1e-3, foreach=False)
        for _ in range(2):
            loss = model(torch.tensor([[1, 2, 3]])).float().pow(2).mean()
            loss.backward()
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, model.parameters()):
                    p.copy_(m)

    w, error = _watched(run)
    assert error is None and w.anomalies == []


def test_fp16_training_with_grad_scaler_does_not_flag():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 20))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    ids = torch.randint(0, 20, (4, 6))
    with opwatch.strict(checks=["dtype_mismatch"]) as w:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert w.anomalies == []
    assert any(r.op == "aten.embedding_dense_backward.default" or r.op.startswith("aten.index_put") for r in w.records if r.phase == "backward")


# -- the rules agree with torch, call by call --------------------------------------------------


def _probe():
    spec = importlib.util.spec_from_file_location("find_accumulation_dtypes", os.path.join(ROOT, "tools", "find_accumulation_dtypes.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROBE = _probe()
# The calls whose source the kernel must take in self's dtype, and those that add into self.
SOURCE_CALLS = [name for name in PROBE.CALLS if name.split("(")[0].split(" ")[0].rstrip("_") in (
    "index_add", "index_copy", "index_reduce", "scatter", "scatter_add", "scatter_reduce", "masked_scatter",
    "put", "index_put", "buf[mask]", "buf[idx]", "lerp")]
ADDING_CALLS = ["add_ (buf += v)", "sub_", "addcmul_", "add(out=buf)"]


@pytest.mark.parametrize("name", list(PROBE.CALLS))
def test_every_call_is_flagged_exactly_where_torch_raises_or_rounds(name):
    for target in PROBE.DTYPES.values():
        for source in PROBE.DTYPES.values():
            mark, _, message = PROBE.classify(name, target, source)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # index_reduce is beta
                w, _ = _watched(lambda: PROBE.CALLS[name][0](torch.zeros(4, 3, dtype=target), PROBE._source(PROBE.CALLS[name][1], source)), checks=["dtype_mismatch"])
            found = {a.finding.rule for a in w.anomalies} & {"dtype.write_source", "dtype.narrowing_write"}
            if name in SOURCE_CALLS and mark == "R" and target != source:
                expected = {"dtype.write_source"}
            elif name in ADDING_CALLS and mark == "n" and target.is_floating_point and source.is_floating_point:
                expected = {"dtype.narrowing_write"}
            else:
                expected = set()
            assert found == expected, (name, target, source, mark, message)


def test_the_probe_found_both_families():
    assert len(SOURCE_CALLS) >= 20
    assert PROBE.classify("index_add_", BF16, F32)[0] == "R" and PROBE.classify("copy_", BF16, F32)[0] == "n"


# -- a saved run -------------------------------------------------------------------------------


def test_findings_survive_the_export_round_trip(tmp_path):
    def run():
        try:
            train_moe("index_add_bug", dtype=BF16, steps=1)
        except RuntimeError:
            pass
        train_with_ema(BF16, steps=1)

    w, error = _watched(run)
    assert error is None
    assert {"dtype.write_source", "dtype.narrowing_write"} <= {a.finding.rule for a in w.anomalies}
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    saved = opwatch.load(path)
    assert [str(s) for s in saved.anomalies] == [str(a) for a in w.anomalies]
