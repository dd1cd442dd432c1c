"""What ``python -m opwatch`` prints first when a script fails: the finding, once; then the
last ops as a compact table (repeats folded, fitted to a width); then Python's traceback
without opwatch's frames. Pinned by goldens of a real run (tests/scenarios/device_mix_cli.py)
and by pytest runs in a subprocess (``pytest --opwatch=strict``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import SCENARIOS, assert_golden, needs_columns

REPO = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO))
ENV.pop("OPWATCH_DISABLE", None)
TRACEBACK = "Traceback (most recent call last):\n"


def cli(*args, cwd=SCENARIOS):
    return subprocess.run([sys.executable, "-m", "opwatch", *args], capture_output=True, text=True, cwd=cwd, env=ENV, timeout=300)


def opwatch_part(stderr: str) -> str:
    """What opwatch prints (before the traceback), then the traceback's own last lines: the
    exception and opwatch's note (the frames between are Python's and torch's)."""
    before, _, traceback = stderr.partition(TRACEBACK)
    tail = traceback[traceback.index("\n", traceback.rindex('  File "')) + 1 :].splitlines(keepends=True)
    while tail and tail[0].startswith("    "):  # the last frame's source line and carets
        tail.pop(0)
    return before + TRACEBACK + "  ...\n" + "".join(tail)


@needs_columns
@pytest.mark.parametrize("mode", ["watch", "strict", "guard"])
def test_a_device_mix_prints_the_finding_first_and_once(mode):
    """The finding first, then the dump, then the traceback: in every mode (``--guard`` too)."""
    result = cli(*({"strict": ["--strict"], "guard": ["--guard"]}.get(mode, [])), "device_mix_cli.py")
    assert result.returncode == 1 and result.stdout == ""
    err = result.stderr
    header = "device_mismatch in aten.addmm.default at device_mix_cli.py:14, module 0 (Linear) (forward)"
    # The finding comes first, in full once.
    assert err.startswith("opwatch: 1 anomaly at 1 place:\n\n" + header + "\n")
    assert err.count("  problem:  tensor arguments on different devices") == 1
    assert err.count(header) == (2 if mode == "strict" else 1)  # strict: the AnomalyError's line names it
    if mode == "strict":
        assert err.rstrip("\n").endswith(f"opwatch.findings.anomaly.AnomalyError: {header} (in full in opwatch's report above)")
    # The dump: the 4 parameter copies of model.to() folded into one row; every line fits.
    assert err.index(header) < err.index("opwatch: the watched block raised") < err.index(TRACEBACK)
    dump = err[err.index("opwatch: the watched block raised") : err.index(TRACEBACK)]
    assert "aten._to_copy x6" in dump and dump.count("aten._to_copy") == 1
    assert ">> " in dump and "device_mismatch" in dump
    assert max(map(len, dump.splitlines())) <= 120
    # No opwatch frame in the traceback.
    assert "opwatch/" not in err[err.index(TRACEBACK) :].replace("opwatch/examples", "")
    assert_golden(f"cli_device_mix_{mode}.txt", opwatch_part(err))


def test_the_folded_dump_keeps_the_failing_op_and_its_neighbours(tmp_path):
    (tmp_path / "loop.py").write_text(
        textwrap.dedent(
            """\
            import torch

            x = torch.ones(3)
            for _ in range(30):
                x = x + 1
            y = x.double() @ torch.ones(3, 2)
            """
        )
    )
    result = cli("--last", "12", "loop.py", cwd=tmp_path)
    assert result.returncode == 1
    rows = result.stderr[result.stderr.index("the last 12 ops:") :].split(TRACEBACK)[0].strip().splitlines()[3:]
    numbers = [row.split()[1] if row.startswith(">>") else row.split()[0] for row in rows]
    # The adds fold into one row with their count; the failing op and its two neighbours
    # (x.double()'s copy and torch.ones) stay rows of their own.
    assert "aten.add.Tensor x" in rows[0] and numbers[0].count("-") == 1
    assert rows[-1].startswith(">> ") and "aten.mm" in rows[-1]
    assert all("-" not in number for number in numbers[-3:]) and len(rows) < 12
    first, last = map(int, numbers[0].split("-"))
    assert f"aten.add.Tensor x{last - first + 1}" in rows[0]


def test_a_script_that_raises_no_op_error_prints_no_dump(tmp_path):
    (tmp_path / "boom.py").write_text("import torch\ntorch.ones(2)\nraise ValueError('boom')\n")
    result = cli("boom.py", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("opwatch: no anomalies.\n\nopwatch: the watched block raised ValueError; the last 1 ops:")
    assert result.stderr.endswith("ValueError: boom\n")


PYTEST_TEST = """\
import torch
from torch import nn


def test_mix():
    model = nn.Linear(8, 4).to("meta")
    x = torch.randn(2, 8)
    model(x).sum()
"""


@pytest.mark.parametrize("showlocals", [False, True])
def test_under_pytest_strict_no_opwatch_frame_or_local_shows_and_the_finding_is_once(tmp_path, showlocals):
    (tmp_path / "test_mix.py").write_text(PYTEST_TEST)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--opwatch=strict", *(["-l"] if showlocals else []), "test_mix.py"],
        capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=300,
    )
    out = result.stdout
    assert result.returncode == 1, out
    failure = out[out.index("test_mix ___") : out.index("Captured opwatch call")]
    assert "opwatch/" not in failure and "interceptor" not in failure and "OpInterceptor" not in failure
    assert "finding = " not in failure and "record = " not in failure
    assert "E       opwatch.findings.anomaly.AnomalyError: device_mismatch in aten.addmm.default at test_mix.py:8" in failure
    # pytest's own short summary repeats the message (in full where CI is set): count before it
    report = out.split("short test summary info")[0]
    assert report.count("problem:  tensor arguments on different devices") == 1
    section = out[out.index("Captured opwatch call") :].split("Captured stderr call")[0]
    assert "device_mismatch in aten.addmm.default at test_mix.py:8, module Linear (forward) (the AnomalyError above)" in section


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
@pytest.mark.parametrize("columns", [130, 220])
def test_on_a_terminal_the_dump_fits_its_width(columns):
    import fcntl
    import struct
    import termios

    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {key: value for key, value in ENV.items() if key not in ("COLUMNS", "LINES")}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "opwatch", "device_mix_cli.py"], stdout=subprocess.PIPE, stderr=secondary, cwd=SCENARIOS, env=env, timeout=300
        )
    finally:
        os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the terminal's other end is closed: all read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    err = b"".join(chunks).decode().replace("\r\n", "\n")
    assert result.returncode == 1
    dump = err[err.index("opwatch: the watched block raised") : err.index(TRACEBACK)]
    widest = max(map(len, dump.splitlines()))
    assert widest <= columns
    # Not the fixed 120 of a file or pipe: a wide terminal gets the whole table, code included.
    assert widest > 120
    assert ("model(batch)" in dump) == (columns == 220)
