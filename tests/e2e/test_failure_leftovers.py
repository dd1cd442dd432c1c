"""Left on, what a told failure leaves behind is not a new failure.

After a failed optimizer step, the leave-on runner watches the next step fully to find the op
that makes the nan/inf (the re-check). That watch starts right after the failed step, so the
rest of the failed step's loop body runs under it: a loop that sums its losses into a running
total (``running += loss.detach()``), takes a metric of its outputs, or clones its loss for
the log read the failed step's nan there. Those ops were named as the failure's origin:
``the failure of step 4 recurred at step 5: nan first made by aten.add_.Tensor`` at the running
sum's line, and the summary listed it as an anomaly, though step 5 was healthy. Now nan/inf
found in tensors made before such a watch are the told failure's leftovers: named only once
they reach the gradients or a parameter (a bad batch of the re-checked step does).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import opwatch
from opwatch.runners.leave_on import LeaveOn
from support.helpers import line_of


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.body(x))


def left_on(*, tail: str, bad_batches=(), made_at=(), steps: int = 7):
    """The leave-on runner over a loop on a dataset made up front (AdamW, ``clip_grad_norm_``);
    the batches of the optimizer steps in ``bad_batches`` (counted from 1) hold a nan (a
    corrupted record); at the steps in ``made_at`` the loss takes the square root of a negative
    (torch makes the nan). After each optimizer step the loop's ``tail`` reads the step's loss
    or outputs: ``sum`` (a running total), ``metric`` (a metric of the outputs, kept),
    ``clone`` (the loss cloned and scaled for the log), ``log_zero`` (after the first failed
    step only, under the re-check's watch, the log of a zero of its own read on the host: an
    inf the tail makes itself)."""
    torch.manual_seed(0)
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(steps)]
    for step in bad_batches:
        data[step - 1][0][3, 5] = float("nan")
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = LeaveOn(on_failure="skip", max_failed_in_a_row=None)
    running, kept = torch.zeros(()), []
    with warnings.catch_warnings(record=True) as told, runner:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(data, 1):
            out = model(x)  # THE MODEL'S CALL
            shift = 1e3 if step in made_at else 0.0
            loss = (out - y).pow(2).mean() + (out.mean().abs() + 1 - shift).sqrt()  # TORCH MAKES IT
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if tail == "sum":
                running += loss.detach()  # THE RUNNING SUM
            elif tail == "metric":
                kept.append((out.detach() - y).abs().mean())  # THE METRIC
            elif tail == "clone":
                logged = loss.detach().clone()
                kept.append(logged.mul_(0.5))  # THE LOGGED LOSS
            elif tail == "log_zero" and runner.failures and step == runner.failures[0].step:
                kept.append(torch.log(torch.zeros(4)).min().item())  # THE TAIL'S OWN INF
    messages = [str(warning.message) for warning in told if issubclass(warning.category, opwatch.OpwatchWarning)]
    return runner, model, messages


@pytest.mark.parametrize("tail", ["sum", "metric", "clone"])
def test_a_bad_batch_s_leftovers_in_the_loop_s_tail_are_not_a_recurrence(tail):
    runner, model, told = left_on(tail=tail, bad_batches=[4])
    (failure,) = runner.failures
    assert (failure.step, failure.cause) == (4, "input")
    assert [line for line in told if "recurred" in line or "did not recur" in line] == [], told
    assert runner.watch.anomalies == [], runner.watch_summary()
    assert "no op was named in the fully watched steps, but 1 optimizer step failed" in runner.watch_summary()
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_a_nan_torch_made_once_is_told_as_not_recurring_despite_the_running_sum():
    runner, _, told = left_on(tail="sum", made_at=[4])
    (failure,) = runner.failures
    assert (failure.step, failure.cause) == (4, "gradients")
    assert "opwatch: the failure of step 4 did not recur: step 5 ran under a full watch and its gradients were finite." in told, told
    assert runner.watch.anomalies == [], runner.watch_summary()


def test_a_nan_torch_makes_again_is_named_at_its_op_not_at_the_running_sum():
    runner, _, told = left_on(tail="sum", made_at=[4, 5])
    line = line_of("# TORCH MAKES IT", __file__)
    recurred = [text for text in told if "the failure of step 4 recurred at step 5" in text]
    assert recurred and f"nan first made by aten.sqrt.default at {__file__}:{line} (forward)" in recurred[0], told
    assert all(anomaly.lineno != line_of("# THE RUNNING SUM", __file__) for anomaly in runner.watch.anomalies)


def test_a_bad_batch_in_the_rechecked_step_is_still_named():
    """The re-checked step's own batch was made before its watch too, but it reaches the
    gradients: named as the input it came in with."""
    runner, _, told = left_on(tail="sum", bad_batches=[4, 5])
    assert [failure.step for failure in runner.failures] == [4, 5]
    (recurred,) = [text for text in told if "the failure of step 4 recurred at step 5" in text]
    assert ("nan came in with an input made before the step (its batch, or a tensor the program kept), not made by any op of it: "
            f"the first op to read it was aten.addmm.default at ") in recurred, recurred
    assert [anomaly.op for anomaly in runner.watch.anomalies] == ["aten.addmm.default"], runner.watch_summary()


def test_a_nan_or_inf_the_tail_makes_itself_after_a_failure_is_still_named():
    runner, _, told = left_on(tail="log_zero", bad_batches=[4])
    assert [anomaly.lineno for anomaly in runner.watch.anomalies] == [line_of("# THE TAIL'S OWN INF", __file__)], runner.watch_summary()
    assert runner.watch.anomalies[0].op == "aten.log.default"
