"""0-dim CPU tensors where torch does not take them as scalars (opwatch.checks.device, rules
``device.joined`` and ``device.scalar_written``), and where it does (no finding).

``meta`` stands in for a GPU: torch raises on CUDA for every must-flag case here; on ``meta``
``total += x.sum()`` with a CPU ``total`` passes silently, which is why opwatch must say it.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opwatch
from opwatch.render.messages import explain
from support.helpers import line_of

HERE = os.path.abspath(__file__)


def _watched(call):
    error = None
    try:
        with opwatch.watch(warn=False, dump_on_error=False) as w:
            call()
    except Exception as raised:
        error = raised
    return w, error


class TwoHeadModel(nn.Module):
    """A classifier with an optional auxiliary loss, as multi-task code writes it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.main = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 1)

    def losses(self, x, y, use_aux: bool):
        hidden = self.body(x).relu()
        main = F.cross_entropy(self.main(hidden), y)
        aux = self.aux(hidden).pow(2).mean() if use_aux else torch.tensor(0.0)  # aux default
        return torch.stack([main, aux])  # stack losses


def test_a_cpu_zero_stacked_with_a_device_loss_flags_at_the_stack():
    model = TwoHeadModel().to("meta")
    x, y = torch.randn(4, 8, device="meta"), torch.randint(0, 3, (4,), device="meta")
    w, error = _watched(lambda: model.losses(x, y, use_aux=False))
    assert isinstance(error, RuntimeError)  # torch refuses it too, without saying where
    [anomaly] = w.anomalies
    assert anomaly.finding.rule == "device.joined" and anomaly.record.op == "aten.stack.default"
    assert anomaly.record.lineno == line_of("# stack losses", HERE)
    problem, _, fix = explain(anomaly.finding)
    assert "cat and stack take no CPU scalars" in problem
    assert f"f32[] cpu: made by torch.tensor(0.0) at {HERE}:{line_of('# aux default', HERE)} (Python or NumPy data entering torch)" in anomaly.message
    assert ".to('meta')" in fix


def test_a_cpu_zero_concatenated_flags_and_one_device_does_not():
    features = torch.randn(3, device="meta")
    w, error = _watched(lambda: torch.cat([features, torch.tensor(1.0)]))
    assert isinstance(error, RuntimeError)
    assert [a.finding.rule for a in w.anomalies] == ["device.joined"]
    with opwatch.strict():
        torch.cat([features, torch.ones(1, device="meta")])
        torch.stack([torch.tensor(1.0), torch.tensor(2.0)])  # CPU scalars among themselves


def test_an_evaluation_total_on_the_cpu_fed_from_the_device_flags_at_the_accumulation():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to("meta")
    batches = [(torch.randn(4, 8, device="meta"), torch.randint(0, 3, (4,), device="meta")) for _ in range(3)]

    def evaluate():
        total = torch.tensor(0.0)
        with torch.no_grad():
            for x, y in batches:
                total += F.cross_entropy(model(x), y)  # accumulate
        return total

    w, error = _watched(evaluate)
    assert error is None  # on meta torch lets it pass; on CUDA it raises
    rules = [(a.finding.rule, a.record.op, a.record.lineno) for a in w.anomalies]
    assert rules == [("device.scalar_written", "aten.add_.Tensor", line_of("# accumulate", HERE))] * 3
    finding = w.anomalies[0].finding
    assert finding.facts["written"] == "self" and finding.facts["device"] == "meta"
    problem, _, fix = explain(finding)
    assert "a 0-dim CPU tensor (self) is written in place from an operand on meta" in problem
    assert "torch.zeros((), device=x.device)" in fix
    with pytest.raises(opwatch.AnomalyError):
        with opwatch.strict(dump_on_error=False):
            evaluate()


def test_an_out_tensor_on_the_cpu_flags():
    a, b = torch.randn((), device="meta"), torch.randn((), device="meta")
    w, error = _watched(lambda: torch.add(a, b, out=torch.tensor(0.0)))
    assert isinstance(error, RuntimeError)
    [anomaly] = w.anomalies
    assert anomaly.finding.rule == "device.scalar_written" and anomaly.finding.facts["written"] == "out"
    assert "out= tensor on meta" in explain(anomaly.finding)[2]


def test_cpu_scalars_read_by_device_ops_in_a_training_loop_do_not_flag():
    torch.manual_seed(0)
    model = TwoHeadModel().to("meta")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # its step counts are 0-dim CPU tensors
    with opwatch.strict() as w:
        total = torch.zeros((), device="meta")
        for step in range(3):
            x, y = torch.randn(4, 8, device="meta"), torch.randint(0, 3, (4,), device="meta")
            hidden = model.body(x).relu()
            main = F.cross_entropy(model.main(hidden), y)
            aux = model.aux(hidden).pow(2).mean() if step else torch.zeros((), device=x.device)
            loss = torch.stack([main, aux]) @ torch.tensor([1.0, 0.1], device=x.device)
            loss = loss * torch.tensor(0.5)  # a CPU scalar read by a device op
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(torch.tensor(0.999))  # written on the device, the CPU scalar read
            hidden.clamp_(min=torch.tensor(0.0))
            total += loss.detach()
            torch.where(hidden > 0, hidden, torch.tensor(0.0))
            torch.tensor(0.0).fill_(loss.detach())  # fill_ reads its value on the host
    assert not w.anomalies, [str(a) for a in w.anomalies]


def test_cpu_accumulators_of_cpu_values_do_not_flag():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with opwatch.strict() as w:
        total, count = torch.tensor(0.0), torch.tensor(0)
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.detach()
            count += 1
        torch.stack([total, count.float()])
    assert not w.anomalies
