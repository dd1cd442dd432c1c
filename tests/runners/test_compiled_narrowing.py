"""A compiled-only nan/inf narrowed down (issue 28): the first graph node the failing backend
gets wrong and its source line, inductor's settings closer to eager, a one-file repro of the
graph on its saved inputs; and no narrowing where the step is healthy or eager fails too.

The honest miscompile here is a backend that computes softmax without subtracting the row's
maximum (exp(x) / sum(exp(x))), a real class of fused-kernel bug: finite on ordinary logits,
inf/inf = nan once a logit passes ~88, where eager's softmax stays finite."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import opwatch
from opwatch.render import guard as words
from opwatch.runners.guarded.compiled import CompiledVerdict, narrow
from opwatch.runners.guarded.narrow import Capture, NodeFact, Value, first_wrong_node
from opwatch.modes.compiled import EagerCompiled
from support.helpers import line_of

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run_repro(repro, backend=None):
    """A one-file repro, alone in a fresh process (the backend by its import path, or
    ``backend`` through ``TORCH_COMPILE_BACKEND``)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OPWATCH_", "TORCH_COMPILE"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), HERE])
    if backend is not None:
        env["TORCH_COMPILE_BACKEND"] = backend
    return subprocess.run([sys.executable, repro], capture_output=True, text=True, cwd=HERE, env=env, timeout=300)


def naive_softmax(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim, keepdim=True)


class Softmaxless:
    """A torch.compile backend that runs Dynamo's graph with each softmax computed without
    subtracting the maximum."""

    def __call__(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target == "softmax" and node.op == "call_method" or node.target is torch.softmax:
                dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else -1)
                node.op, node.target, node.args, node.kwargs = "call_function", naive_softmax, (node.args[0],), {"dim": dim}
        gm.recompile()
        return gm.forward


class ScaleAndSoftmax(Softmaxless):
    """Softmaxless, and the logits multiplied by the scale instead of divided."""

    def __call__(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and getattr(node.target, "__name__", "") == "truediv":
                node.target = torch.mul
        return super().__call__(gm, example_inputs)


class Block(nn.Module):
    """Self-attention and an MLP, pre-norm on the MLP only (the attention sees raw inputs)."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # SCALE
        attn = scores.softmax(dim=-1)  # SOFTMAX
        x = x + self.proj(attn @ v)
        x = x + self.mlp(self.norm(x))
        return self.head(x).mean(1)


def attention_batches(count, outlier_at=None):
    torch.manual_seed(0)
    batches = [torch.randn(4, 8, 16) for _ in range(count)]
    if outlier_at is not None:
        batches[outlier_at] = batches[outlier_at] * 60  # an outlier batch: logits in the thousands
    return batches


def train(model, compiled, batches, **options):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x):
        loss = ((compiled(x) - x.mean((1, 2)).unsqueeze(-1)) ** 2).mean()
        loss.backward()
        return loss

    guarded = opwatch.guard(step, model, **options)
    for x in batches:
        optimizer.zero_grad()
        guarded(x)
        optimizer.step()
    return guarded


def test_a_miscompiled_softmax_is_narrowed_to_its_node_and_line_with_a_repro_that_reproduces(tmp_path):
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, backend=Softmaxless())
    batches = attention_batches(4, outlier_at=3)
    with pytest.raises(RuntimeError) as raised:
        train(model, compiled, batches, repro_dir=tmp_path)
    text = str(raised.value)
    line = line_of("# SOFTMAX", __file__)
    assert "only the compiled step makes nan/inf" in text, text
    assert "the step's own backend (test_compiled_narrowing:Softmaxless) is the first stage that makes it" in text, text
    assert ("The first node of the forward graph whose output test_compiled_narrowing:Softmaxless gets wrong: Tensor.softmax "
            "(node attn, graph 1 of 1) at ") in text, text
    assert (f"test_compiled_narrowing.py:{line}: attn = scores.softmax(dim=-1)  # {'SOFTMAX'}; "
            "its output is not finite where eager is (eager: finite, max |x| ") in text, text
    assert "; compiled: nan in " in text
    assert "Inductor's settings" not in text  # the failing backend is no inductor
    repro = text.split("One-file repro (the graph on its saved inputs, eager and compiled): python ")[1].split()[0]
    assert os.path.dirname(os.path.dirname(repro)) == str(tmp_path)
    assert len(os.listdir(tmp_path)) == 1  # one repro: the graph's (the healthy steps made none)

    # the repro, alone in a fresh process: the backend by its import path, eager finite, compiled nan
    result = run_repro(repro)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "eager:    outputs finite; input gradients finite" in result.stdout, result.stdout
    assert "compiled (test_compiled_narrowing:Softmaxless): outputs nan/inf in 0" in result.stdout, result.stdout
    assert "reproduced: the compiled graph makes nan/inf where eager does not" in result.stdout
    # the same graph through Dynamo's eager backend: not reproduced
    result = run_repro(repro, "eager")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not reproduced" in result.stdout


def test_the_verdict_holds_the_node_the_step_is_put_back_and_the_compiled_code_runs_again(tmp_path):
    torch.manual_seed(0)
    model = Block()
    backend = Softmaxless()
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x):
        loss = ((compiled(x) - x.mean((1, 2)).unsqueeze(-1)) ** 2).mean()
        loss.backward()
        return loss

    guarded = opwatch.guard(step, model, repro=False, repro_dir=tmp_path)
    healthy, outlier = attention_batches(2, outlier_at=1)
    guarded(healthy)  # the audit, eager
    optimizer.step()
    optimizer.zero_grad()
    weights = model.qkv.weight.detach().clone()
    with pytest.raises(RuntimeError):
        guarded(outlier)
    verdict = guarded.last_verdict
    assert not verdict.eager_fails and verdict.own == "nan/inf" and verdict.backend == "test_compiled_narrowing:Softmaxless"
    node = verdict.node
    assert (node.op, node.name, node.why, node.graph, node.graphs) == ("Tensor.softmax", "attn", "nan/inf", 1, 1)
    assert node.where.endswith(f"test_compiled_narrowing.py:{line_of('# SOFTMAX', __file__)}")
    assert node.eager.kind == "finite" and node.compiled.kind == "nan" and node.compiled.nonfinite > 0
    assert verdict.narrowed == "found" and verdict.settings == () and verdict.repro is None
    assert all(parameter.grad is None for parameter in model.parameters()) and torch.equal(model.qkv.weight, weights)
    assert not list(glob.glob(os.path.join(str(tmp_path), "*")))
    # the program's own compiled code is still the one that runs
    out = compiled(healthy)
    assert torch.isfinite(out).all() and not torch.isfinite(compiled(outlier)).all()


def test_a_wrong_node_before_the_one_that_makes_the_nan_is_blamed_under_the_dtype_tolerance(tmp_path):
    """The bisection walks back to the first wrong node: here the backend also multiplies the
    logits by the scale instead of dividing (16x too large, finite), and the naive softmax
    then overflows. The first wrong node is the scaling, outside float32's tolerance."""

    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, backend=ScaleAndSoftmax())
    batches = attention_batches(2)
    batches[1] = batches[1] * 3  # logits of a few tens: finite for the naive softmax, not once 16x larger
    with pytest.raises(RuntimeError) as raised:
        train(model, compiled, batches, repro=False)
    text = str(raised.value)
    line = line_of("# SCALE", __file__)
    assert "gets wrong: operator.truediv (node scores, graph 1 of 1) at " in text, text
    assert f"test_compiled_narrowing.py:{line}: scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # {'SCALE'}; " in text
    assert "its output differs from eager by up to " in text and "outside the tolerance of its dtype (rtol 1.3e-06, atol 1e-05)" in text
    assert "(eager: finite, max |x| " in text and "compiled: finite, max |x| " in text


def test_inputs_over_repro_max_bytes_are_not_kept_and_no_node_is_named(tmp_path):
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, backend=Softmaxless())
    with pytest.raises(RuntimeError) as raised:
        train(model, compiled, attention_batches(2, outlier_at=1), repro_dir=tmp_path, repro_max_bytes=1024)
    text = str(raised.value)
    assert "the step's own backend (test_compiled_narrowing:Softmaxless) is the first stage that makes it" in text
    assert "The graphs' inputs were over repro_max_bytes, so none was kept and no node was narrowed." in text, text
    assert "The first node" not in text and "One-file repro" not in text
    assert not glob.glob(os.path.join(str(tmp_path), "opwatch-compiled-repro-*"))


def test_real_inductor_on_a_healthy_step_narrows_nothing_and_names_no_node():
    """Real inductor on CPU, every graph node compared with eager under the dtype's tolerance:
    no node of a healthy attention step is found wrong (no false narrowing)."""
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model)
    x = attention_batches(1)[0]

    def step():
        loss = ((compiled(x) - x.mean((1, 2)).unsqueeze(-1)) ** 2).mean()
        loss.backward()
        return loss

    from opwatch.core.compat import registered_backend

    capture = Capture(registered_backend("inductor"), max_bytes=2**26)
    with torch.compiler.set_stance("default", force_backend=capture):
        loss = step()
    assert torch.isfinite(loss)
    narrowed = first_wrong_node(capture.graphs)
    assert narrowed.node is None and narrowed.reason == "outputs_agree", narrowed
    assert len(capture.graphs) == 1


def test_real_inductor_where_eager_fails_too_gets_the_eager_origin_and_no_narrowing(tmp_path):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(6, 8)
            self.fc2 = nn.Linear(8, 1)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x))) * x[:, :1].sqrt()  # EAGER-NAN

    model = Scaled()
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x):
        loss = ((compiled(x) - 1) ** 2).mean()
        loss.backward()
        return loss

    guarded = opwatch.guard(step, model, repro_dir=tmp_path)
    torch.manual_seed(0)
    x = torch.rand(16, 6)
    guarded(x)
    optimizer.step()
    optimizer.zero_grad()
    bad = x.clone()
    bad[2, 0] = -1.0
    with pytest.raises(opwatch.AnomalyError) as raised:
        guarded(bad)
    notes = str(raised.value)  # the verdict is part of the message
    assert "eager also fails: aten.sqrt.default at " in notes and f"test_compiled_narrowing.py:{line_of('# EAGER-NAN', __file__)}" in notes
    verdict = guarded.last_verdict
    assert verdict.eager_fails and verdict.stages == () and verdict.node is None and verdict.repro is None
    assert not glob.glob(os.path.join(str(tmp_path), "opwatch-compiled-repro-*"))


class Gated(nn.Module):
    """An MLP whose hidden units are scaled by a random gate, sqrt(u - floor), u uniform: finite
    while every u is at least the floor (a buffer)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 1)
        self.register_buffer("floor", torch.zeros(()))

    def forward(self, x):
        gate = torch.sqrt(torch.rand(x.shape[0], 16) - self.floor)  # GATE
        return self.fc2(torch.relu(self.fc1(x)) * gate)


def test_real_inductor_drawing_other_random_numbers_than_eager_is_told_by_fallback_random(tmp_path):
    """Inductor on CPU draws its own random numbers (not eager's, unless fallback_random): with
    the floor set to the smallest of eager's draws, eager is finite and inductor's draws go below
    it for some seeds. fallback_random=True makes the step finite, emulate_precision_casts=True
    does not."""
    model = Gated()
    compiled = torch.compile(model)
    x = torch.rand(64, 6)

    def step(batch):
        loss = compiled(batch).pow(2).mean()
        loss.backward()
        return loss

    for seed in range(20):  # a seed whose inductor draws go below eager's smallest
        torch.manual_seed(seed)
        model.floor.fill_(float(torch.rand(64, 16).min()))
        torch.manual_seed(seed)
        finite = bool(torch.isfinite(step(x)))
        model.zero_grad()
        if not finite:
            break
    else:
        pytest.fail("inductor drew eager's random numbers for 20 seeds")
    guarded = opwatch.guard(step, model, audit="never", repro_dir=tmp_path)
    before = dynamo_cache()
    torch.manual_seed(seed)
    with pytest.raises(RuntimeError) as raised:
        guarded(x)
    text = str(raised.value)
    verdict = guarded.last_verdict
    assert verdict.backend == "inductor" and verdict.own == "nan/inf", verdict
    # six runs compiled for the verdict (three stages, inductor, its two settings), none kept
    assert dynamo_cache() == before and len(before[Gated.forward.__code__]) == 1
    graphs = counters["stats"]["unique_graphs"]
    model.floor.zero_()
    assert type(compiled(x).grad_fn).__name__ == "CompiledFunctionBackward"
    assert counters["stats"]["unique_graphs"] == graphs
    assert verdict.settings == (("emulate_precision_casts", "nan/inf"), ("fallback_random", "finite")), verdict.settings
    assert "fallback_random makes the step finite: random numbers that differ from eager's." in text, text
    assert "the step's own backend (inductor) is the first stage that makes it" in text
    assert verdict.repro is not None and os.path.exists(verdict.repro)
    assert verdict.node.op == "torch.sqrt" and verdict.node.where.endswith(f"test_compiled_narrowing.py:{line_of('# GATE', __file__)}")
    assert verdict.node.eager.kind == "finite" and verdict.node.compiled.kind == "nan"


# -- the words, piece by piece -----------------------------------------------------------------


def _verdict(**changes):
    node = NodeFact(1, 2, "attn", "Tensor.softmax", "model.py:12", "attn = scores.softmax(dim=-1)", Value("finite", 0, 256, 0.93),
                    Value("nan", 64, 256, 0.5), "nan/inf", None, 1.3e-06, 1e-05)
    base = CompiledVerdict((EagerCompiled("Block", "module", "model.py:5", 1),), False, None,
                           (("eager", "finite"), ("aot_eager", "finite"), ("aot_eager_decomp_partition", "finite")),
                           backend="inductor", own="nan/inf", node=node, narrowed="found", settings=(), repro=None)
    return base._replace(**changes)


def _failure():
    from opwatch.render.guard_facts import NotFinite, Returned

    return NotFinite("not_finite", (Returned("nan", "returned", "tensor"),), ())


def test_the_message_names_the_node_its_line_and_both_values():
    text = words.only_compiled(3, "step", _failure(), 0, _verdict())
    assert "the step's own backend (inductor) is the first stage that makes it (run again with it: nan/inf)." in text
    assert ("The first node of the forward graph whose output inductor gets wrong: Tensor.softmax (node attn, graph 1 of 2) at "
            "model.py:12: attn = scores.softmax(dim=-1); its output is not finite where eager is "
            "(eager: finite, max |x| 0.93; compiled: nan in 64 of 256 values, max finite |x| 0.5).") in text, text


def test_the_message_of_a_node_outside_the_tolerance_gives_the_difference_and_the_tolerance():
    node = _verdict().node._replace(why="tolerance", compiled=Value("finite", 0, 256, 0.95), difference=0.02)
    text = words.only_compiled(3, "step", _failure(), 0, _verdict(node=node))
    assert "its output differs from eager by up to 0.02, outside the tolerance of its dtype (rtol 1.3e-06, atol 1e-05)" in text


@pytest.mark.parametrize("reason, said", [
    ("outputs_agree", "the difference needs the step's own output gradients"),
    ("no_graph", "No graph was captured"),
    ("too_large", "over repro_max_bytes"),
    ("raised KeyError", "Narrowing it to a graph node failed (raised KeyError)."),
])
def test_the_message_says_why_no_node_was_named(reason, said):
    text = words.only_compiled(3, "step", _failure(), 0, _verdict(node=None, narrowed=reason))
    assert said in text and "The first node" not in text


@pytest.mark.parametrize("settings, said", [
    ((("emulate_precision_casts", "nan/inf"), ("fallback_random", "finite")),
     "(emulate_precision_casts=True: nan/inf; fallback_random=True: finite): fallback_random makes the step finite: random numbers that differ from eager's."),
    ((("emulate_precision_casts", "finite"), ("fallback_random", "nan/inf")),
     "emulate_precision_casts makes the step finite: a fused kernel's precision"),
    ((("emulate_precision_casts", "nan/inf"), ("fallback_random", "nan/inf")),
     "neither makes the step finite"),
])
def test_the_message_says_what_inductors_settings_did(settings, said):
    text = words.only_compiled(3, "step", _failure(), 0, _verdict(settings=settings, repro="/tmp/r/repro.py"))
    assert "Inductor's settings, each for one run from the same start " in text and said in text, text
    assert text.endswith("One-file repro (the graph on its saved inputs, eager and compiled): python /tmp/r/repro.py")


def test_a_stage_that_fails_first_is_the_one_narrowed():
    stages = (("eager", "finite"), ("aot_eager", "nan/inf"))
    text = words.only_compiled(3, "step", _failure(), 0, _verdict(stages=stages, own=None, backend="aot_eager"))
    assert "aot_eager is the first stage that makes it" in text
    assert "whose output aot_eager gets wrong: Tensor.softmax" in text


# -- leave-on: a trainer's guard mode replays the batch, and gives the same verdict ------------


def _lightning_fit(tmp_path, batches, on_failure):
    lightning = pytest.importorskip("lightning")
    import io
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from opwatch.runners.lightning import OpwatchCallback

    class Attention(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.block = Block()
            self.net = torch.compile(self.block, backend=Softmaxless())

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return ((self.net(x) - x.mean((1, 2)).unsqueeze(-1)) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = lightning.Trainer(
        max_steps=len(batches), accelerator="cpu", logger=False, default_root_dir=tmp_path,
        callbacks=[OpwatchCallback(mode="guard", on_failure=on_failure, warn=False, file=io.StringIO())],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module = Attention()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(TensorDataset(torch.cat(batches)), batch_size=len(batches[0])))
    return [str(warning.message) for warning in caught if "optimizer step" in str(warning.message)]


def test_lightning_guard_mode_gives_the_compiled_verdict_of_a_replayed_batch(tmp_path):
    from opwatch.runners.leave_on import GradientsNotFinite

    with pytest.raises(GradientsNotFinite) as raised:
        _lightning_fit(tmp_path, attention_batches(3, outlier_at=2), "raise")
    text = str(raised.value)
    assert text.startswith("opwatch: optimizer step 3: the gradients about to be applied hold nan/inf: "), text
    assert "its replay ran it eagerly from the same start under a full watch and found no nan/inf: eager is finite on the same inputs" in text
    assert "the step's own backend (test_compiled_narrowing:Softmaxless) is the first stage that makes it" in text
    assert "Tensor.softmax (node attn, graph 1 of 1) at " in text and f"test_compiled_narrowing.py:{line_of('# SOFTMAX', __file__)}: " in text
    assert "no op of this fully watched step made them" not in text


def test_lightning_guard_mode_skipping_warns_the_verdict_and_healthy_batches_warn_nothing(tmp_path):
    (warned,) = _lightning_fit(tmp_path, attention_batches(3, outlier_at=1), "skip")
    assert "optimizer step 2" in warned and "only the compiled step makes nan/inf" in warned, warned
    assert "Tensor.softmax (node attn, graph 1 of 1) at " in warned
    assert _lightning_fit(tmp_path, attention_batches(3), "skip") == []


# -- a miscompiled backward ------------------------------------------------------------------------


def naive_sigmoid_backward(grad, y):
    """sigmoid's derivative from the logit recovered from its output: exp(-x) / (1 + exp(-x))**2.
    Equal to y * (1 - y) on ordinary logits; inf/inf = nan once a logit is below about -88."""
    e = torch.exp(-torch.log(y / (1 - y)))
    return grad * e / (1 + e) ** 2


class LogitSigmoidBackward:
    """A torch.compile backend (AOTAutograd's forward and backward graphs) whose backward
    computes sigmoid's derivative from the logit (naive_sigmoid_backward): the forward is
    AOTAutograd's own, so every forward output agrees with eager."""

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=self.forward, bw_compiler=self.backward)(gm, example_inputs)

    def forward(self, gm, example_inputs):
        return gm

    def backward(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.sigmoid_backward.default:
                node.target = naive_sigmoid_backward
        gm.recompile()
        return gm


class GatedMLP(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.gate = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, 1)

    def forward(self, x):
        h = self.up(x) * torch.sigmoid(self.gate(x))  # SIGMOID GATE
        return self.down(h)


def _gated_training(batches, kept=None, **options):
    torch.manual_seed(0)
    model = GatedMLP()
    compiled = torch.compile(model, backend=LogitSigmoidBackward())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        loss = ((compiled(x) - y) ** 2).mean()
        loss.backward()
        return loss

    guarded = opwatch.guard(step, model, **options)
    if kept is not None:
        kept.append(guarded)
    for x, y in batches:
        optimizer.zero_grad()
        guarded(x, y)
        optimizer.step()
    return guarded, model


def _regression_batches(count, outlier_at=None):
    torch.manual_seed(1)
    batches = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(count)]
    if outlier_at is not None:
        x, y = batches[outlier_at]
        batches[outlier_at] = (x * 400, y)  # gate logits in the hundreds: sigmoid saturates
    return batches


@pytest.mark.thorough
def test_a_miscompiled_backward_is_narrowed_to_the_node_whose_gradient_is_wrong(tmp_path):
    with pytest.raises(RuntimeError) as raised:
        _gated_training(_regression_batches(4, outlier_at=2), repro_dir=tmp_path)
    text = str(raised.value)
    line = line_of("# SIGMOID GATE", __file__)
    assert "only the compiled step makes nan/inf" in text, text
    assert "the step's own backend (test_compiled_narrowing:LogitSigmoidBackward) is the first stage that makes it" in text, text
    assert ("Each captured graph's outputs agree with eager; its backward does not. The first node whose backward "
            "test_compiled_narrowing:LogitSigmoidBackward gets wrong: torch.sigmoid (node sigmoid, graph 1 of 1) at ") in text, text
    assert f"test_compiled_narrowing.py:{line}: h = self.up(x) * torch.sigmoid(self.gate(x))  # {'SIGMOID GATE'}; " in text, text
    assert "with a gradient of ones on the node's output, the gradient of gate." in text, text
    assert " is not finite where eager is (eager: finite" in text and "; compiled: nan in " in text, text

    # the repro (its backward of ones) reproduces it alone; Dynamo's aot_eager does not
    repro = text.split("One-file repro (the graph on its saved inputs, eager and compiled): python ")[1].split()[0]
    result = run_repro(repro)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "compiled (test_compiled_narrowing:LogitSigmoidBackward): outputs finite; input gradients nan/inf in" in result.stdout
    with open(repro) as script:
        assert "node:     torch.sigmoid (node sigmoid, graph 1 of 1) at " in script.read()
    result = run_repro(repro, "aot_eager")
    assert result.returncode == 0 and "not reproduced" in result.stdout, result.stdout + result.stderr


def test_the_backward_verdict_names_the_parameter_and_healthy_steps_say_nothing(tmp_path):
    guarded, model = _gated_training(_regression_batches(3), repro=False)  # the same backend, no outlier
    assert guarded.last_verdict is None and not guarded.anomalies and not guarded.failures
    kept: list = []
    with pytest.raises(RuntimeError):
        _gated_training(_regression_batches(2, outlier_at=1), kept, repro=False)
    node = kept[0].last_verdict.node
    assert (node.phase, node.op, node.name, node.why) == ("backward", "torch.sigmoid", "sigmoid", "nan/inf")
    assert node.gradient in ("gate.weight", "gate.bias"), node.gradient
    assert node.eager.kind == "finite" and node.compiled.kind == "nan"


# -- a verdict leaves the program's compiled code as it was (issue 36) ---------------------------


def cache_entries(function) -> list:
    """Dynamo's cache entries of a function's code object, most recently used first."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return _debug_get_cache_entry_list(function.__code__)


class DynamoLog(logging.Handler):
    """Keeps the warnings Dynamo logs (``torch._dynamo hit config.recompile_limit``)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def limits_hit(self) -> list:
        """``torch._dynamo hit config.recompile_limit (8)`` (``cache_size_limit`` before torch 2.7)."""
        return [message for message in self.messages if re.search(r"hit config\.(recompile|cache_size)_limit", message)]


def without_set_aside(monkeypatch, replacement):
    """The verdict's runs with ``replacement`` for compat.compiled_code_set_aside."""
    from opwatch.runners.guarded import compiled as verdicts
    from opwatch.runners.guarded import narrow as narrowing

    for module in (verdicts, narrowing):
        monkeypatch.setattr(module, "compiled_code_set_aside", replacement)


@pytest.fixture
def dynamo_log():
    handler = DynamoLog()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _gated_models_failing(count, *, warned):
    """``count`` GatedMLPs (one forward code object, one recompile budget), each compiled with
    its own LogitSigmoidBackward, each trained under a guard that skips a failing step: an
    outlier batch at step 2 of 5 fails only compiled, the verdict narrows it. Returns, per
    model: the steps skipped, the grad_fn of each healthy step's forward output after the
    outlier's, the graphs Dynamo compiled during those steps (``unique_graphs``) and the verdict."""
    models = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = GatedMLP()
        compiled = torch.compile(model, backend=LogitSigmoidBackward())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        grad_fns: list = []

        def step(x, y, compiled=compiled, grad_fns=grad_fns):
            out = compiled(x)
            grad_fns.append(type(out.grad_fn).__name__)
            loss = ((out - y) ** 2).mean()
            loss.backward()
            return loss

        guarded = opwatch.guard(step, model, audit="never", on_failure="skip", repro=False)
        after = []
        for index, (x, y) in enumerate(_regression_batches(5, outlier_at=1)):
            grad_fns.clear()
            optimizer.zero_grad()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                guarded(x, y)
            warned.extend(str(warning.message) for warning in caught)
            optimizer.step()
            if index == 1:
                graphs = counters["stats"]["unique_graphs"]
            if index > 1:
                after.extend(grad_fns)
        models.append((guarded.skipped, after, counters["stats"]["unique_graphs"] - graphs, guarded.last_verdict))
    return models


def test_three_compiled_only_failures_leave_the_programs_compiled_code_running_compiled(dynamo_log):
    """Three compile-only failures narrowed in one process: each verdict names the node, the
    failing models' later healthy steps run their compiled code (CompiledFunctionBackward) with
    no compile, the shared forward holds the program's entries only, and a new
    inductor-compiled model of the same class runs compiled. Before, each verdict left 4 cache
    entries on the forward's code object: the second hit Dynamo's recompile_limit (8)."""
    warned: list = []
    models = _gated_models_failing(3, warned=warned)
    for skipped, after, compiled_after, verdict in models:
        assert skipped == 1
        assert verdict is not None and verdict.own == "nan/inf" and verdict.node is not None, verdict
        assert (verdict.node.phase, verdict.node.op) == ("backward", "torch.sigmoid"), verdict.node
        assert after == ["CompiledFunctionBackward"] * 3, after  # the healthy steps after it: compiled
        assert compiled_after == 0  # and not compiled again
    told = [text for text in warned if "only the compiled step makes nan/inf" in text]
    assert len(told) == 3 and all("torch.sigmoid (node sigmoid, graph 1 of 1)" in text for text in told), warned
    assert len(cache_entries(GatedMLP.forward)) == 3  # one per program's backend, none of the verdicts'

    graphs = counters["stats"]["unique_graphs"]
    torch.manual_seed(5)
    model = GatedMLP()
    compiled = torch.compile(model)  # inductor
    outputs = [compiled(torch.randn(16, 8)) for _ in range(2)]
    assert [type(out.grad_fn).__name__ for out in outputs] == ["CompiledFunctionBackward"] * 2
    assert counters["stats"]["unique_graphs"] == graphs + 1  # compiled once, by the program
    assert len(cache_entries(GatedMLP.forward)) == 4
    assert not dynamo_log.limits_hit(), dynamo_log.messages


def test_without_setting_the_programs_code_aside_the_verdicts_spend_its_recompile_budget(dynamo_log, monkeypatch):
    """The twin of the test above, with the verdict's runs compiling into the program's code
    objects (as before issue 36): its checks see the loss of compiled code."""
    without_set_aside(monkeypatch, contextlib.nullcontext)
    warned: list = []
    models = _gated_models_failing(3, warned=warned)
    *_, second = models[1]
    assert second.own == "finite"  # its own backend's run hit the limit and ran eagerly: "did not reproduce"
    skipped, after, _, _ = models[-1]
    assert skipped == 0 and after == ["AddmmBackward0"] * 3  # the third model ran uncompiled: its outlier did not fail
    assert dynamo_log.limits_hit(), dynamo_log.messages
    assert len(cache_entries(GatedMLP.forward)) == 8
    compiled = torch.compile(GatedMLP())  # inductor: Dynamo no longer compiles this code object
    assert type(compiled(torch.randn(16, 8)).grad_fn).__name__ == "AddmmBackward0"


def test_a_torch_without_a_way_to_set_the_code_aside_runs_no_stage_and_says_so(monkeypatch):
    without_set_aside(monkeypatch, lambda: None)
    kept: list = []
    with pytest.raises(RuntimeError) as raised:
        _gated_training(_regression_batches(2, outlier_at=1), kept, repro=False)
    verdict = kept[0].last_verdict
    assert verdict.stages == (("eager", "not apart"),) and verdict.backend is None and verdict.node is None, verdict
    text = str(raised.value)
    assert ("(eager: not apart): this torch gives opwatch no way to compile the stages beside the program's compiled code, "
            "so they were not run: their compiles would have spent the recompile budget of the program's own frames.") in text, text
    assert len(cache_entries(GatedMLP.forward)) == 1


def test_code_set_aside_compiles_into_copies_and_drops_them_leaving_the_programs_entries_as_they_were():
    """compat.compiled_code_set_aside at work: a compiled module and a compiled function, each
    compiled by the program; in the block each compiles again for a forced backend, and a
    function compiled there first; after it, the program's entries are the same objects in the
    same order, the block's backend is freed, and the functions run their own code again."""
    import gc
    import weakref

    from opwatch.core.compat import compiled_code_set_aside

    class Doubler:
        def __call__(self, gm, example_inputs):
            return gm.forward

    def scaled(x):
        return torch.tanh(x) * 3

    def first_in_block(x):
        return torch.cos(x) - 1

    program = Doubler()
    model = GatedMLP()
    compiled_model = torch.compile(model, backend=program)
    compiled_scaled = torch.compile(scaled, backend=program)
    compiled_first = torch.compile(first_in_block, backend=program)
    x = torch.randn(4, 8)
    compiled_model(x), compiled_scaled(x)
    entries = {fn: [entry.guard_manager for entry in cache_entries(fn)] for fn in (GatedMLP.forward, scaled)}
    codes = {fn: fn.__code__ for fn in (GatedMLP.forward, scaled, first_in_block)}

    forced = Doubler()
    gone = weakref.ref(forced)
    with compiled_code_set_aside():
        assert GatedMLP.forward.__code__ is not codes[GatedMLP.forward] and scaled.__code__ is not codes[scaled]
        assert first_in_block.__code__ is codes[first_in_block]  # never compiled: left alone
        with torch.compiler.set_stance("default", force_backend=forced):
            compiled_model(x), compiled_scaled(x), compiled_first(x)
        assert len(cache_entries(GatedMLP.forward)) == 1 and len(cache_entries(scaled)) == 1  # the copies'
        assert len(cache_entries(first_in_block)) == 1
    assert all(fn.__code__ is code for fn, code in codes.items())
    for fn, kept in entries.items():
        assert [entry.guard_manager for entry in cache_entries(fn)] == kept  # the same entries, in order
    assert cache_entries(first_in_block) == []
    del forced
    gc.collect()
    assert gone() is None  # nothing of the block's compiles is held
    # the program's compiled code still runs, with no compile
    graphs = counters["stats"]["unique_graphs"]
    assert torch.allclose(compiled_scaled(x), scaled(x)) and torch.allclose(compiled_model(x), model(x))
    assert counters["stats"]["unique_graphs"] == graphs


def dynamo_cache() -> dict:
    """Every code object Dynamo holds compiled code for, with its cache entries' guard managers
    in order: ``{code: [guard manager, ...]}``."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo import convert_frame

    codes = [ref() for ref in convert_frame.input_codes.seen]
    return {code: [entry.guard_manager for entry in _debug_get_cache_entry_list(code)] for code in codes
            if code is not None and _debug_get_cache_entry_list(code)}


class BrokenBlock(Block):
    """Block with a graph break before its attention: the softmax lies in the graph of Dynamo's
    resume function, a code object Dynamo makes for the rest of the forward."""

    def forward(self, x):
        x = x + self.mlp(self.norm(x))
        torch._dynamo.graph_break()
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(dim=-1)  # ATTENTION AFTER THE BREAK
        return self.head(x + self.proj(attn @ v)).mean(1)


def test_a_verdict_across_a_graph_break_narrows_the_resume_graph_and_leaves_every_code_objects_entries():
    torch.manual_seed(0)
    model = BrokenBlock()
    compiled = torch.compile(model, backend=Softmaxless())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x):
        loss = ((compiled(x) - x.mean((1, 2)).unsqueeze(-1)) ** 2).mean()
        loss.backward()
        return loss

    guarded = opwatch.guard(step, model, audit="never", repro=False)
    healthy, outlier = attention_batches(2, outlier_at=1)
    guarded(healthy)
    optimizer.step()
    optimizer.zero_grad()
    before = dynamo_cache()
    assert len(before) == 2 and all(len(entries) == 1 for entries in before.values())  # forward, its resume function
    with pytest.raises(RuntimeError):
        guarded(outlier)
    verdict = guarded.last_verdict
    assert verdict.own == "nan/inf" and verdict.backend == "test_compiled_narrowing:Softmaxless", verdict
    assert (verdict.node.op, verdict.node.graph, verdict.node.graphs) == ("Tensor.softmax", 2, 2), verdict.node
    assert verdict.node.where.endswith(f"test_compiled_narrowing.py:{line_of('# ATTENTION AFTER THE BREAK', __file__)}")
    assert dynamo_cache() == before  # the same code objects, the same entries
    graphs = counters["stats"]["unique_graphs"]
    assert torch.isfinite(compiled(healthy)).all() and not torch.isfinite(compiled(outlier)).all()  # its own compiled code
    assert counters["stats"]["unique_graphs"] == graphs
