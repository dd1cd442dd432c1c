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
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # tomllib is 3.11+; pytest itself needs tomli on 3.10
        import tomli as tomllib

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


# -- a module, as python -m runs it ----------------------------------------------------------------


@pytest.fixture
def package(tmp_path) -> Path:
    """``trainpkg.train`` (the training step above, saying how Python ran it) and a package
    ``trainpkg.app`` that runs with -m through its ``__main__``."""
    root = tmp_path / "trainpkg"
    (root / "app").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    saying = "import sys\nprint('ran', __name__, __spec__.name, sys.argv[1:], sys.argv[0].endswith('.py'), sys.path[0])\n"
    (root / "train.py").write_text(saying + textwrap.dedent(SCRIPT))
    (root / "app" / "__init__.py").write_text("")
    (root / "app" / "__main__.py").write_text(saying + textwrap.dedent(SCRIPT))
    return tmp_path


def test_a_module_runs_as_python_dash_m_runs_it_and_its_anomalies_are_at_its_lines(package):
    plain = subprocess.run([sys.executable, "-m", "trainpkg.train", "--epochs", "1"], capture_output=True, text=True, cwd=package, env=ENV, timeout=300)
    watched = cli("-m", "trainpkg.train", "--epochs", "1", cwd=package)
    assert watched.returncode == plain.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout == f"ran __main__ trainpkg.train ['--epochs', '1'] True {package}\ndone\n"
    assert "broadcast in aten.sub.Tensor at trainpkg/train.py:10 (forward)" in watched.stderr, watched.stderr
    # a package runs its __main__
    app = cli("-m", "trainpkg.app", cwd=package)
    assert app.returncode == 0 and app.stdout.startswith("ran __main__ trainpkg.app.__main__ [] True"), app.stderr
    assert "broadcast in aten.sub.Tensor at trainpkg/app/__main__.py:10 (forward)" in app.stderr


LOOP = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = (model(torch.randn(5, 4)).squeeze(-1) - torch.randn(5)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("eval", tuple(model(torch.randn(2, 4)).shape))
"""


def test_a_module_under_guard_runs_left_on_and_the_commands_that_check_the_rest_name_it(package):
    (package / "trainpkg" / "loop.py").write_text(LOOP)
    guarded = cli("--guard", "-m", "trainpkg.loop", cwd=package)
    assert guarded.returncode == 0 and guarded.stdout == "eval (2, 1)\n", guarded.stderr
    assert "opwatch guard: 3 optimizer steps ran, 1 audited under a full watch, 0 failed" in guarded.stderr, guarded.stderr
    # the evaluation after the last step ran unjudged: the full watch it names runs the module again
    assert guarded.stderr.rstrip().endswith("a full watch checks every op: python -m opwatch --strict -m trainpkg.loop"), guarded.stderr
    some = cli("--checks", "nonfinite", "-m", "trainpkg.loop", cwd=package)
    assert some.stderr.rstrip().endswith("opwatch: to run every check: python -m opwatch -m trainpkg.loop"), some.stderr


@pytest.mark.parametrize("name, said", [
    ("trainpkg.nosuch", "no module named 'trainpkg.nosuch' (looked for from "),
    ("trainpkg", "'trainpkg' is a package without a __main__ module: it cannot be run with -m"),
    ("trainpkg/train.py", "-m takes a module's name (package.module, as for python -m), got 'trainpkg/train.py'"),
])
def test_a_module_that_cannot_run_is_named_why(package, name, said, monkeypatch):
    from opwatch.runners.cli import _module_problem

    monkeypatch.chdir(package)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert _module_problem(name).startswith(said)
        assert _module_problem("trainpkg.train") is None
    finally:  # finding a module imports its package, as python -m does
        for imported in [key for key in sys.modules if key == "trainpkg" or key.startswith("trainpkg.")]:
            del sys.modules[imported]


def test_a_module_that_cannot_run_is_a_usage_error_even_with_a_sub_commands_name(package):
    result = cli("-m", "show", cwd=package)  # with -m a sub-command's name is a module's
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert "python -m opwatch: error: no module named 'show'" in result.stderr, result.stderr
