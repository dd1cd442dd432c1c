"""The command line as a tool: ``--version``, ``--checks``, the usage when called bare, the
``opwatch`` console script, and the kill switch (``OPWATCH_DISABLE``) said rather than hidden.
Each runs the CLI in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import opwatch
from opwatch.checks import CHECK_NAMES

REPO = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO))
ENV.pop("OPWATCH_DISABLE", None)

# A training step with a broadcast (line 8) and a -inf kept alive (line 9).
SCRIPT = """\
import torch
from torch import nn

model = nn.Linear(3, 1)
x, y = torch.randn(8, 3), torch.randn(8)
for _ in range(2):
    prediction = model(x)
    loss = ((y - prediction) ** 2).mean()
    bad = torch.zeros(2).log()
    loss.backward()
print("done")
"""


def cli(*args, cwd, env=None, command=(sys.executable, "-m", "opwatch")):
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd, env=env or ENV, timeout=300)


@pytest.fixture
def train(tmp_path) -> Path:
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    return tmp_path


def test_version(tmp_path):
    result = cli("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == f"opwatch {opwatch.__version__}\n"


def test_called_bare_it_prints_the_usage_with_examples(tmp_path):
    result = cli(cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    err = result.stderr
    assert err.startswith("usage: python -m opwatch [-h] [--version]")
    assert "the following arguments are required" not in err
    for example in ("python -m opwatch train.py", "python -m opwatch --strict train.py", "python -m opwatch --checks ", "python -m opwatch show run.jsonl",
                    "python -m opwatch diff a.jsonl b.jsonl", "python -m opwatch demo", "python -m opwatch --help"):
        assert example in err, example
    assert "examples:" in cli("--help", cwd=tmp_path).stdout


def test_checks_choose_what_runs(train):
    everything = cli("train.py", cwd=train)
    assert everything.returncode == 0 and everything.stdout == "done\n"
    assert "broadcast in aten.sub.Tensor at train.py:8" in everything.stderr
    assert "inf in aten.log.default at train.py:9" in everything.stderr
    broadcast = cli("--checks", "broadcast", "train.py", cwd=train)
    assert broadcast.returncode == 0 and broadcast.stdout == "done\n"
    assert "broadcast in aten.sub.Tensor at train.py:8" in broadcast.stderr and "inf in aten" not in broadcast.stderr
    both = cli("--checks", "nonfinite, broadcast", "train.py", cwd=train)
    assert "broadcast in" in both.stderr and "inf in aten.log.default" in both.stderr
    none = cli("--checks", "none", "--strict", "train.py", cwd=train)
    assert none.returncode == 0 and none.stderr == (
        "opwatch: no check ran (off: device_mismatch, dtype_mismatch, broadcast, nonfinite, pre_dispatch), so no anomaly could be found: the ops were only recorded.\n"
        "opwatch: to run every check: python -m opwatch --strict train.py\n"
    )
    # Every check ran: nothing is said to be off.
    assert "off" not in everything.stderr and "to run every check" not in everything.stderr


def test_with_checks_off_the_summary_names_them_and_the_command_that_runs_them(train):
    # The broadcast and the inf are there; the one check that ran sees neither.
    device = cli("--checks", "device_mismatch", "train.py", "--epochs", "1", cwd=train)
    assert device.returncode == 0, device.stderr
    assert device.stderr == (
        "opwatch: no anomalies among the checks that ran (device_mismatch); off: dtype_mismatch, broadcast, nonfinite, pre_dispatch.\n"
        "opwatch: to run every check: python -m opwatch train.py --epochs 1\n"
    )
    # What it finds is shown, and what it did not look for is named after it.
    nonfinite = cli("--checks", "nonfinite", "train.py", cwd=train)
    assert nonfinite.stderr.startswith("opwatch: 1 anomaly at 1 place:\n\ninf in aten.log.default at train.py:9")
    assert nonfinite.stderr.endswith(
        "\n(checks off: device_mismatch, dtype_mismatch, broadcast, pre_dispatch; anomalies of their kinds were not looked for)\n"
        "opwatch: to run every check: python -m opwatch train.py\n"
    )
    assert "broadcast in" not in nonfinite.stderr


@pytest.mark.parametrize("value", ["device,dtype", "", "broadcast,,bogus"])
def test_unknown_checks_are_a_usage_error_naming_the_real_ones(train, value):
    result = cli("--checks", value, "train.py", cwd=train)
    assert result.returncode == 2 and result.stdout == ""
    last = result.stderr.splitlines()[-1]
    assert last.startswith("python -m opwatch: error: --checks: unknown check name(s)")
    assert f"the checks are {', '.join(CHECK_NAMES)} (or none)" in last


def test_checks_reach_the_guard_runner(train):
    result = cli("--guard", "--checks", "broadcast", "train.py", cwd=train)
    assert result.returncode == 0, result.stderr
    assert "broadcast in aten.sub.Tensor at train.py:8" in result.stderr and "inf in aten" not in result.stderr


def test_the_console_script_runs_main(train):
    """``opwatch`` (pyproject's [project.scripts]) calls ``opwatch.runners.cli:main`` and exits
    with its status, naming itself ``opwatch`` in its usage."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"opwatch": "opwatch.runners.cli:main"}
    # The console script's wrapper, as pip writes it, run with this tree on the path.
    wrapper = "import sys; sys.argv[0] = 'opwatch'; from opwatch.runners.cli import main; sys.exit(main())"
    command = (sys.executable, "-c", wrapper)
    result = cli("--checks", "broadcast", "train.py", cwd=train, command=command)
    assert result.returncode == 0 and result.stdout == "done\n"
    assert "broadcast in aten.sub.Tensor at train.py:8" in result.stderr
    bare = cli(cwd=train, command=command)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: opwatch [-h]") and "opwatch --strict train.py" in bare.stderr
    assert cli("--version", cwd=train, command=command).stdout == f"opwatch {opwatch.__version__}\n"


def test_a_disabled_watch_says_it_watched_nothing(train):
    result = cli("--strict", "train.py", cwd=train, env=dict(ENV, OPWATCH_DISABLE="1"))
    assert result.returncode == 0 and result.stdout == "done\n"
    assert result.stderr == "opwatch: nothing was watched (OPWATCH_DISABLE=1 turned opwatch off), so no anomalies could be found.\n"


def test_a_bad_opwatch_disable_is_one_line_naming_the_accepted_values(train):
    result = cli("train.py", cwd=train, env=dict(ENV, OPWATCH_DISABLE="maybe"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "python -m opwatch: error: OPWATCH_DISABLE='maybe' is not understood; use '1', 'true', 'yes' to turn opwatch off, "
        "'0', 'false', 'no' (or leave it unset) to watch\n"
    )
