"""``watch(allow=[opwatch.Allow(...)])``: findings the user accepts go to ``w.allowed``; they
are no anomaly, no warning and no raise in ``strict()``."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import opwatch
from opwatch.findings.allow import parse_allow

from support.helpers import line_of

HERE = os.path.abspath(__file__)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.body(x))


def train(steps=4):
    """A training loop with the classic broadcasting loss, at one known line."""
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3), torch.randn(8)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((y - model(x)) ** 2).mean()  # the known broadcast
        loss.backward()
        optimizer.step()
    return loss


BROADCAST_LINE = line_of("# the known broadcast", HERE)


def test_without_an_allow_list_the_broadcast_is_an_anomaly():
    with opwatch.watch(warn=False) as w:
        train()
    assert {a.kind for a in w.anomalies} == {"broadcast"} and w.allowed == []


@pytest.mark.parametrize(
    "entry",
    [
        opwatch.Allow(kind="broadcast"),
        opwatch.Allow(where=f"test_allow.py:{BROADCAST_LINE}"),
        opwatch.Allow(where="test_allow.py:*", op="aten.sub"),
        opwatch.Allow(op="aten.sub.Tensor", kind="broad*"),
        opwatch.Allow(),
    ],
    ids=repr,
)
def test_a_matching_entry_allows_it_in_strict_mode_too(entry):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no OpwatchWarning either
        with opwatch.strict(allow=[entry]) as w:
            train()
    assert w.anomalies == []
    assert len(w.allowed) == 4 and {a.lineno for a in w.allowed} == {BROADCAST_LINE}
    assert "4 finding(s) matched an allow entry" in w.summary()


@pytest.mark.parametrize(
    "entry",
    [
        opwatch.Allow(kind="nan"),
        opwatch.Allow(where="test_allow.py:1"),
        opwatch.Allow(where="other.py:*"),
        opwatch.Allow(op="aten.add*"),
        opwatch.Allow(kind="broadcast", module="Regressor.head"),  # the sub runs outside modules
    ],
    ids=repr,
)
def test_an_entry_that_does_not_match_leaves_it_an_anomaly(entry):
    with pytest.raises(opwatch.AnomalyError):
        with opwatch.strict(allow=[entry]):
            train()


class ScaledLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 1)

    def forward(self, x, y):
        return ((y - self.inner(x)) ** 2).mean()  # broadcast inside a module


class WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.criterion = ScaledLoss()

    def forward(self, x, y):
        return self.criterion(x, y)


def test_module_patterns_match_module_paths():
    model = WithLoss()
    with opwatch.watch(warn=False, allow=[opwatch.Allow(module="crit*")]) as w:
        model(torch.randn(4, 3), torch.randn(4)).backward()
    assert [a.module for a in w.allowed] == ["criterion"] and w.anomalies == []
    with opwatch.watch(warn=False, allow=[opwatch.Allow(module="criterion.inner")]) as w:
        model(torch.randn(4, 3), torch.randn(4)).backward()
    assert w.allowed == [] and [a.module for a in w.anomalies] == ["criterion"]


def test_unknown_fields_and_kinds_are_value_errors_naming_the_accepted_ones():
    with pytest.raises(ValueError, match="'line'.*'kind', 'op', 'module', 'where'"):
        opwatch.Allow(line="train.py:3")
    with pytest.raises(ValueError, match="'nonsense'.*'device_mismatch'.*'broadcast'.*'nan'"):
        opwatch.Allow(kind="nonsense")
    with pytest.raises(TypeError, match="string pattern"):
        opwatch.Allow(kind=3)
    with pytest.raises(TypeError, match="opwatch.Allow entries"):
        opwatch.watch(allow="broadcast")
    with pytest.raises(TypeError, match="opwatch.Allow entries"):
        opwatch.watch(allow=[{"kind": "broadcast"}])


def test_cli_syntax():
    assert parse_allow("kind=broadcast,where=train.py:42") == opwatch.Allow(kind="broadcast", where="train.py:42")
    with pytest.raises(ValueError, match="FIELD=PATTERN"):
        parse_allow("broadcast")
    with pytest.raises(ValueError, match="unknown Allow field"):
        parse_allow("file=train.py")


# -- where: a location that does not depend on the working directory -------------------------

BROADCAST = """\
import torch
x, y = torch.randn(8, 1), torch.randn(8)
loss = ((y - x) ** 2).mean()
"""


def run_file(path):
    """Run the program at ``path`` as ``python path`` would: its code names that file."""
    exec(compile(path.read_text(), str(path), "exec"), {"__name__": "__main__"})


@pytest.fixture
def two_trains(tmp_path):
    """``a/train.py`` and ``b/train.py``: the same broadcast at line 3 of two files."""
    paths = []
    for folder in ("a", "b"):
        path = tmp_path / "proj" / folder / "train.py"
        path.parent.mkdir(parents=True)
        path.write_text(BROADCAST)
        paths.append(path)
    return paths


def allowed_files(entry, paths):
    with opwatch.watch(warn=False, allow=[entry]) as w:
        for path in paths:
            run_file(path)
    return sorted(a.filename for a in w.allowed), sorted(a.filename for a in w.anomalies)


@pytest.mark.parametrize("cwd", ["proj", "proj/a", "elsewhere", "/"])
def test_where_with_a_folder_matches_the_same_file_from_any_working_directory(two_trains, tmp_path, monkeypatch, cwd):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / cwd)
    a, b = map(str, two_trains)
    for pattern in ("a/train.py:3", "proj/a/train.py:3", "a/*.py:3", "a/train.py", f"{a}:3"):
        assert allowed_files(opwatch.Allow(where=pattern), two_trains) == ([a], [b]), pattern
    # Without a folder: the file's name, whichever folder it is in.
    assert allowed_files(opwatch.Allow(where="train.py:3"), two_trains) == ([a, b], [])
    assert allowed_files(opwatch.Allow(where="*.py:?"), two_trains) == ([a, b], [])
    # No false match: another line, another folder, a folder that is only a part of a name.
    for pattern in ("train.py:4", "c/train.py:3", "roj/a/train.py:3", "/a/train.py:3", "a/train.py:3?"):
        assert allowed_files(opwatch.Allow(where=pattern), two_trains) == ([], [a, b]), pattern


def test_where_matching_rule():
    from opwatch.findings.allow import where_matches

    file = "/home/me/proj/src/train.py"
    assert where_matches("src/train.py:42", file, 42, "elsewhere.py:1")
    assert where_matches("train.py:4?", file, 42, "?")
    assert where_matches("src/*:42", file, 42, "?") and where_matches("proj/*/train.py", file, 7, "?")
    assert where_matches(f"{file}:42", file, 42, "?") and where_matches("/home/*/proj/src/train.py:42", file, 42, "?")
    assert not where_matches("/proj/src/train.py:42", file, 42, "?")  # "/": the whole path
    assert not where_matches("tools/train.py:42", file, 42, "?") and not where_matches("rc/train.py:42", file, 42, "?")
    assert not where_matches("src/train.py:43", file, 42, "?") and not where_matches("train.py:42", None, None, "?")
    # The location as messages show it still matches: named places, and the old form.
    assert where_matches("DDP bucket [[]*", None, None, "DDP bucket [fc.weight]")
    assert where_matches("autograd", None, None, "autograd")
    assert where_matches("src/*.py:4?", "/elsewhere/x.py", 1, "src/deep/er/train.py:42")
