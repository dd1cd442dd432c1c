"""``opwatch.diff`` of a compiled run (``watch(fingerprints=True, compiled=BACKEND)``) against an
eager run, at the level both can see.

Real ``torch.compile`` on the CPU: a custom AOT backend whose pass changes one node's math (gelu's
exact form swapped for its tanh approximation: an honest miscompile) is named at that node's
line in a training step; the same backend without the pass, ``aot_eager`` and inductor agree
with eager within the compiled default tolerance; inductor's graph outputs name the first output
that differs when the compiled run's model differs; logs round-trip through the CLI.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opwatch
from opwatch.runners.cli_diff import run_diff
from support.helpers import line_of

pytest.importorskip("torch._dynamo")
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402

HERE = __file__


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc1(x)
        h = F.gelu(h)  # the gelu line
        h = torch.tanh(self.fc2(h))  # the tanh line
        return self.fc3(h)


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)  # the loss line
    loss.backward()
    optimizer.step()
    return loss.detach()


def _gelu_tanh_pass(gm, example_inputs):
    """The miscompile: every exact gelu computed with the tanh approximation instead."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.gelu.default:
            node.kwargs = {**node.kwargs, "approximate": "tanh"}
    gm.recompile()
    return make_boxed_func(gm.forward)


def _nop(gm, example_inputs):
    return make_boxed_func(gm.forward)


MISCOMPILE = aot_autograd(fw_compiler=_gelu_tanh_pass, bw_compiler=_nop)
CLEAN = aot_autograd(fw_compiler=_nop)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _setup(seed=0):
    torch.manual_seed(seed)
    model = Net()
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    return model, x, y


def _eager(model, x, y, steps=2):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with opwatch.watch(fingerprints=True) as w:
        for _ in range(steps):
            train_step(model, optimizer, x, y)
    return w


def _compiled(model, x, y, backend, steps=2):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(train_step)
    with opwatch.watch(fingerprints=True, compiled=backend) as w:
        losses = [step(model, optimizer, x, y) for _ in range(steps)]
    return w, losses, model


def test_a_miscompiled_node_is_named_at_its_line():
    model, x, y = _setup()
    compiled, _, _ = _compiled(model, x, y, MISCOMPILE)
    result = opwatch.diff(compiled, _eager(model, x, y))
    assert not result.agree
    first = result.first
    assert first.a.op == "aten.gelu.default" and first.b.op == "aten.gelu.default"
    assert first.a.lineno == first.b.lineno == line_of("# the gelu line", HERE)
    assert first.a.phase == "forward" and first.reason == "values"
    text = str(result)
    assert "The runs first differ at aten.gelu" in text
    assert "h = F.gelu(h)" in text
    assert "computes this node differently from eager" in text
    # Its input (fc1's addmm, in the same graph) was compared and agreed.
    states = {state for _, state, _, _ in first.inputs}
    assert "agreed" in states and "differed" not in states


@pytest.mark.parametrize("backend", [CLEAN, "aot_eager"], ids=["custom_aot", "aot_eager"])
def test_an_honest_aot_backend_agrees_node_by_node(backend):
    model, x, y = _setup()
    compiled, losses, trained = _compiled(model, x, y, backend)
    eager = _eager(model, x, y)
    result = opwatch.diff(compiled, eager)
    assert result.agree, str(result)
    assert result.compiled == "a" and result.tolerance.reason == "compiled"
    # Every node: the forward's gelu and tanh, the backward's mm, both steps, and the optimizer's updates.
    ops = {record.op for record, other in result.pairs if other is not None}
    assert {"aten.gelu.default", "aten.tanh.default", "aten.gelu_backward.default", "aten.mm.default"} <= ops
    assert result.compared >= 40
    # Compiled for real: the watch ran nothing eagerly, and the loss went down as eager's did.
    assert compiled.compiled_eagerly == []
    assert losses[1] < losses[0]
    # Both sides swapped: the same verdict.
    assert opwatch.diff(eager, compiled).agree


def test_inductor_agrees_with_eager_within_the_compiled_default():
    model, x, y = _setup()
    compiled, _, _ = _compiled(model, x, y, "inductor")
    result = opwatch.diff(compiled, _eager(model, x, y))
    assert result.agree, str(result)
    assert result.tolerance.reason == "compiled" and (result.tolerance.rtol, result.tolerance.atol) == (1.3e-6, 1e-5)
    paired = [(record, other) for record, other in result.pairs if other is not None]
    # The graphs' outputs: the loss (inductor's aten.mean paired with eager's aten.mse_loss), the
    # activations saved for backward, each weight's and bias's gradient, and the updates.
    assert any(record.op == "aten.mean.default" and other.op == "aten.mse_loss.default" for record, other in paired)
    assert sum(record.phase == "backward" for record, _ in paired) >= 12
    # Eager ops inside the fused kernels (no graph output shows them) are counted, not compared.
    assert result.not_visible >= 6
    assert "The runs agree at the level both can see" in str(result)


def test_inductor_names_the_first_graph_output_that_differs():
    model, x, y = _setup()
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.fc2.weight[0, 0] += 0.05  # the compiled run's model differs in one weight
    compiled, _, _ = _compiled(changed, x, y, "inductor")
    result = opwatch.diff(compiled, _eager(model, x, y))
    assert not result.agree
    first = result.first
    # The first graph output past fc2 in the forward graph: the tanh saved for backward.
    assert first.a.op == "aten.tanh.default" and first.a.lineno == line_of("# the tanh line", HERE)
    assert "A compiled graph's output" in str(result)


def test_saved_logs_and_the_command_line(tmp_path, capsys):
    model, x, y = _setup()
    compiled, _, _ = _compiled(model, x, y, MISCOMPILE)
    compiled.export_jsonl(tmp_path / "compiled.jsonl")
    _eager(model, x, y).export_jsonl(tmp_path / "eager.jsonl")
    status = run_diff([str(tmp_path / "compiled.jsonl"), str(tmp_path / "eager.jsonl"), "--context", "1"])
    out = capsys.readouterr().out
    assert status == 1
    assert "Run a ran compiled" in out and "The runs first differ at aten.gelu" in out
    assert opwatch.diff(opwatch.load(tmp_path / "compiled.jsonl"), str(tmp_path / "eager.jsonl")).first.a.op == "aten.gelu.default"


def test_after_the_watch_compiled_code_and_plain_watches_are_as_before():
    model, x, y = _setup()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(train_step)
    with opwatch.watch(fingerprints=True, compiled="aot_eager") as w:
        step(model, optimizer, x, y)
    recorded = len(w.records)
    step(model, optimizer, x, y)  # outside: runs compiled, records nothing
    assert len(w.records) == recorded
    with opwatch.watch() as plain:  # a plain watch runs it eagerly again, op by op
        step(model, optimizer, x, y)
    assert plain.compiled_eagerly and any(record.op == "aten.gelu.default" for record in plain.records)


@pytest.mark.parametrize(
    "value, error",
    [("eager", ValueError), ("inductr", ValueError), (42, TypeError), (lambda gm, inputs: gm, TypeError)],
)
def test_compiled_rejects_what_it_cannot_record(value, error):
    with pytest.raises(error, match="compiled must be one of 'inductor', 'aot_eager' or a backend made with"):
        opwatch.watch(fingerprints=True, compiled=value)


def test_a_fault_while_logging_a_graph_leaves_the_step_to_run(monkeypatch):
    from opwatch.modes import compiled_graphs

    def broken(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(compiled_graphs._Recording, "_record", staticmethod(broken))
    model, x, y = _setup()
    eager_model = copy.deepcopy(model)
    expected = train_step(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.1), x, y)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(opwatch.OpwatchWarning, match="injected"):
        with opwatch.watch(fingerprints=True, compiled="aot_eager") as w:
            loss = torch.compile(train_step)(model, optimizer, x, y)
    assert torch.equal(loss, expected)  # the graph ran on, as eager computes it
    assert not any(compiled_graphs.is_graph_record(record) for record in w.records)
