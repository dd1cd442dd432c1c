"""torch's own warnings under a watch are shown at the program's line, as without it: before,
each carried the watch's frame (``opwatch/modes/functions.py:128``), and Python's default
filter showed a message once for all the program's lines."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import opwatch
from opwatch import OpwatchWarning
from support.helpers import line_of


class Attention(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = F.softmax(q @ k.transpose(-2, -1) / 4.0)  # IMPLICIT DIM: torch warns
        return self.out((weights @ v).mean(1))


def train(*, epochs=2):
    """A training loop over 17 sequences in batches of 8 (its last batch is one), each batch
    standardised, its loss read for a log: three of torch's warnings, at three lines."""
    torch.manual_seed(0)
    model = Attention()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(torch.randn(17, 5, 16), torch.randn(17, 1)), batch_size=8)
    logged = []
    for _ in range(epochs):
        for x, y in loader:
            x = (x - x.mean(0)) / (x.std(0) + 1e-5)  # STANDARDISE: a batch of one warns
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            logged.append(float(loss))  # LOGGED: a tensor that requires grad, to a float
    return logged


@pytest.fixture(autouse=True)
def warn_always():
    """torch warns some messages once per process (``TORCH_WARN_ONCE``): every time, here."""
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    yield
    torch.set_warn_always(was)


def torch_warnings(action, *, watched):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        if watched:
            with opwatch.watch(warn=False):
                train()
        else:
            train()
    return [(w.category, str(w.message)[:50], w.filename, w.lineno) for w in caught if not issubclass(w.category, OpwatchWarning)]


@pytest.mark.parametrize("action", ["default", "once", "always"])
def test_torch_warnings_in_a_watched_training_loop_are_shown_at_the_programs_lines_as_without_it(action):
    plain = torch_warnings(action, watched=False)
    watched = torch_warnings(action, watched=True)
    here = __file__
    places = {(filename, lineno) for _, _, filename, lineno in plain}
    every = {(here, line_of(marker, here)) for marker in ("IMPLICIT DIM", "STANDARDISE", "LOGGED")}
    # float() of a tensor that requires grad warns on newer torch (not on 2.6): the other two on every version.
    assert {(here, line_of("IMPLICIT DIM", here)), (here, line_of("STANDARDISE", here))} <= places <= every, plain
    assert watched == plain


def test_a_module_filter_sees_the_programs_module():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=UserWarning, module=__name__)
        with opwatch.watch(warn=False):
            train(epochs=1)
    assert [w for w in caught if not issubclass(w.category, OpwatchWarning)] == []


def test_the_programs_own_warnings_keep_their_place_and_the_watch_puts_showwarning_back():
    before = warnings.showwarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch(warn=False):
            with opwatch.watch(warn=False):
                warnings.warn("the program's own")  # OWN WARNING
            assert warnings.showwarning is not before  # the outer watch keeps it wrapped
    assert warnings.showwarning is before
    (own,) = caught
    assert (own.filename, own.lineno) == (__file__, line_of("OWN WARNING", __file__))


def test_an_error_filter_at_the_programs_module_raises_there_as_without_the_watch():
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Implicit dimension choice", module=__name__)
        with pytest.raises(UserWarning, match="Implicit dimension choice"):
            F.softmax(x)  # no watch
        with pytest.raises(UserWarning, match="Implicit dimension choice"):
            with opwatch.watch(warn=False):
                F.softmax(x)


def test_a_failure_of_the_wrap_shows_the_warning_where_python_placed_it(monkeypatch):
    from opwatch.modes import torch_warnings as module

    def broken(*args, **kwargs):
        raise RuntimeError("opwatch's own bug")

    monkeypatch.setattr(module, "attributed_line", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opwatch.watch(warn=False):
            F.softmax(torch.randn(3, 4))
    (shown,) = [w for w in caught if not issubclass(w.category, OpwatchWarning)]
    assert "Implicit dimension choice" in str(shown.message) and "opwatch" in shown.filename
