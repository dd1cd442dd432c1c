"""A check point that reads many outputs at once: a deep network's training step queues hundreds
of (min, max) pairs between two optimizer steps, in buffers of
``NonFiniteTracker._CHUNK // 2`` pairs per device and dtype, read back with one host read per
device. The op named must be the op that made the nan wherever its pair sits: in the first
buffer, past it, and where two dtypes take turns (a float64 head on a float32 body, whose pairs
fill two buffers in alternation). Each case has a healthy twin that reports nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opwatch
from opwatch.checks.nonfinite.tracker import NonFiniteTracker
from support.helpers import line_of

HERE = __file__
DEPTH = 150  # two checked forward outputs a layer (addmm, gelu), about four more in backward


class Deep(nn.Module):
    """A deep, narrow GELU MLP; ``poison_at``: the layer after which a log of the activations
    (shifted by 0.1, below the smallest GELU value) makes nan; ``head_log``: the float64 head's
    output goes through such a log instead."""

    def __init__(self, head_dtype=torch.float32, poison_at=None, head_log=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(DEPTH))
        self.head = nn.Linear(8, 1).to(head_dtype)
        self.poison_at = poison_at
        self.head_log = head_log

    def forward(self, x):
        for number, layer in enumerate(self.layers):
            x = F.gelu(layer(x))
            if number == self.poison_at:
                x = torch.log(x + 0.1)  # the body's log
        out = self.head(x.to(self.head.weight.dtype))
        if self.head_log:
            out = torch.log(out - out.max() - 0.5) + out  # the head's log
        return out


def train(model, steps=2):
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()


def nonfinite_found(model):
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        train(model)
    return [a for a in w.anomalies if a.kind in ("nan", "inf")]


def deep(**options):
    torch.manual_seed(0)
    return Deep(**options)


def test_the_step_queues_more_pairs_than_one_buffer_holds():
    # Otherwise the cases below would read one buffer only.
    pairs_per_buffer = NonFiniteTracker._CHUNK // 2
    assert 2 * 140 > pairs_per_buffer and 6 * DEPTH > 2 * pairs_per_buffer


@pytest.mark.parametrize("layer", [1, 140], ids=["first buffer", "a later buffer"])
def test_a_nan_made_by_a_log_deep_in_the_network_names_that_log(layer):
    (anomaly,) = nonfinite_found(deep(poison_at=layer))
    assert (anomaly.op, anomaly.lineno, anomaly.kind) == ("aten.log.default", line_of("# the body's log", HERE), "nan")
    assert anomaly.module == "Deep"  # the log runs in Deep.forward, between two layers


def test_a_nan_made_in_a_float64_head_names_the_head_log_where_two_dtypes_take_turns():
    (anomaly,) = nonfinite_found(deep(head_dtype=torch.float64, head_log=True))
    assert (anomaly.op, anomaly.lineno, anomaly.kind) == ("aten.log.default", line_of("# the head's log", HERE), "nan")


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.float64])
def test_healthy_deep_steps_report_nothing(head_dtype):
    assert nonfinite_found(deep(head_dtype=head_dtype)) == []
