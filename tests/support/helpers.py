"""Small helpers shared by test modules: ``from support.helpers import line_of, StubContext, MLP``."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from opwatch.checks.finding import Place

# What StubContext says made every tensor with a nonzero ident (rendered "aten.addmm at model.py:3").
PRODUCER = Place("aten.addmm.default", "model.py", 3, "forward")


def opwatch_frames(text: str) -> list[str]:
    """The places in ``text`` that lie in opwatch's own code (``opwatch/modes/interceptor.py``,
    ``opwatch/session/failure.py``, ...), the demo's scripts under ``opwatch/examples`` excepted: what a
    traceback or debugger shown to a user must not name. Found by the package's own folder and
    file names, so a clone's folder (``.../opwatch/.venv/...``) does not count."""
    import re
    from pathlib import Path

    import opwatch

    package = Path(opwatch.__file__).parent
    names = sorted(entry.name for entry in package.iterdir() if entry.name not in ("examples", "__pycache__"))
    pattern = r"opwatch[/\\](?:" + "|".join(map(re.escape, names)) + r")\b"
    return re.findall(r"[^\s\"']*" + pattern + r"[^\s\"':]*", text)


def two_steps_under(make_mode, step):
    """``step`` run twice inside a fresh ``make_mode()`` (a floor of ``bench.floor``, a watch);
    returns what the context gave, to read its records after."""
    with make_mode() as mode:
        step()
        step()
    return mode


def fp16_regression_script(optimizer: str, init_scale: str, steps: int) -> str:
    """A script for ``python -m opwatch``: a float16 autocast regression loop under GradScaler whose
    scale starts at ``init_scale``, too high (its first steps overflow), trained by ``optimizer``
    (an expression of ``model``) for ``steps`` steps; it prints the scale it ends with."""
    return f"""\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = {optimizer}
scaler = torch.amp.GradScaler("cpu", init_scale={init_scale})  # too high: its first steps overflow
for step in range({steps}):
    x = torch.randn(32, 16)
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).squeeze(-1), x.sum(-1))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print("scale", scaler.get_scale())
"""


def line_of(marker: str, path: str) -> int:
    """The line of the file ``path`` that holds ``marker`` (exactly one; the ``line_of(...)``
    calls that look it up do not count)."""
    with open(path) as source:
        lines = source.read().splitlines()
    found = [number for number, line in enumerate(lines, 1) if marker in line and "line_of(" not in line]
    assert len(found) == 1, (marker, found)
    return found[0]


class StubContext:
    """A check's context (see ``opwatch.checks.CheckContext``) answered from a table, so that a
    check runs on plain metadata with no mode and no op log.

    ``deliberate`` maps a tensor's ident to its size-1 dims made on purpose (negative, counted
    from the right); other tensors have none (the broadcast tracker ``shapes`` answers from
    it). A tensor with ident 0 has no producer; any other was made by :data:`PRODUCER`.
    """

    site = 0  # no source site: the same-call rules never apply
    phase = "forward"
    args = ()

    def __init__(self, deliberate: dict | None = None):
        self.shapes = StubShapes(deliberate or {})

    def producer(self, meta) -> Place | None:
        return PRODUCER if meta[3] else None


class StubShapes:
    """The broadcast check's tracker (``opwatch.checks.broadcast.ShapeProvenance``) answered
    from a table of deliberate dims; no expand was logged before."""

    def __init__(self, deliberate: dict):
        self.deliberate = deliberate

    def expand_before(self, site):
        return None

    def deliberate_dims(self, meta, site) -> frozenset[int]:
        return frozenset(self.deliberate.get(meta[3], ()))

    def kept(self, meta) -> bool:
        return False  # no keepdim reduction made it

    def same_source(self, first, second) -> bool:
        return first[3] == second[3]  # by ident: no op log to follow views through

    def defer(self, finding, result, tensors) -> None:
        self.deferred = finding


class MLP(nn.Module):
    """Two linear layers (``fc1``, ``fc2``) with a tanh between: 4 features in, 2 out. Its ops
    are attributed to this file, the line of ``forward``."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def watch_story(story, *args, expect_error=None, **options):
    """Run ``story(*args)`` under ``opwatch.watch(**options)`` (quiet by default) and return the
    watch; with ``expect_error``, the story must raise it."""
    import opwatch
    import pytest

    options.setdefault("warn", False)
    options.setdefault("dump_on_error", False)
    w = opwatch.watch(**options)
    if expect_error is None:
        with w:
            story(*args)
    else:
        with pytest.raises(expect_error):
            with w:
                story(*args)
    return w


def guard_in_process(tmp_path, capsys, script, *options):
    """``python -m opwatch --guard [options] train.py`` run in this process (``script`` written
    to ``tmp_path/train.py``; the test makes ``tmp_path`` the working directory): its status,
    stdout, and its warnings (as they would print) followed by its stderr."""
    import opwatch  # noqa: PLC0415
    from opwatch.runners.cli import main  # noqa: PLC0415

    (tmp_path / "train.py").write_text(script)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", opwatch.OpwatchWarning)
        status = main(["--guard", *options, "train.py"])
    out, err = capsys.readouterr()
    told = "".join(f"{warning.message}\n" for warning in caught if issubclass(warning.category, opwatch.OpwatchWarning))
    return status, out, told + err
