"""The pytest plugin, run the way users run it: pytest in a subprocess on a generated test file,
its outcomes read from the JUnit XML report."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from opwatch.runners import pytest_plugin
from opwatch.runners.pytest_plugin import Settings, layered_settings

TESTS = textwrap.dedent(
    """
    import os

    import pytest
    import torch

    import opwatch


    def broadcast_loss():
        y = torch.arange(4.0)
        pred = torch.arange(4.0).reshape(4, 1)
        return ((y - pred) ** 2).mean()


    def test_anomalous():
        broadcast_loss()


    def test_clean():
        assert torch.ones(3).sum().item() == 3.0


    @pytest.mark.opwatch(False)
    def test_opted_out():
        broadcast_loss()


    @pytest.mark.opwatch(strict=True)
    def test_strict_marker():
        broadcast_loss()


    @pytest.mark.opwatch(checks=["nonfinite"])
    def test_checks_from_marker():
        broadcast_loss()


    @pytest.mark.opwatch(allow=[opwatch.Allow(kind="broadcast")])
    def test_allowed_by_marker(opwatch_watch):
        broadcast_loss()
        assert [a.kind for a in opwatch_watch.allowed] == ["broadcast"]


    def test_fixture(opwatch_watch):
        torch.ones(2) + 1
        assert [record.op for record in opwatch_watch.records] == ["aten.ones.default", "aten.add.Tensor"]
        assert opwatch_watch.strict == (os.environ["EXPECT_STRICT"] == "1")


    def test_fails_by_itself():
        broadcast_loss()
        assert False, "the test's own failure"
    """
)

TIMEOUT = 120


def run_pytest(tmp_path: Path, *args: str, env: dict | None = None, ini: str | None = None, files: dict | None = None):
    """Run pytest on the generated tests in ``tmp_path``; returns (outcomes, stdout), where
    outcomes maps each test's name to ``(outcome, message)``."""
    (tmp_path / "test_generated.py").write_text(TESTS)
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    if ini is not None:
        (tmp_path / "pytest.ini").write_text("[pytest]\n" + textwrap.dedent(ini))
    environment = {key: value for key, value in os.environ.items() if not key.startswith("OPWATCH_")}
    environment.update(env or {})
    report = tmp_path / "report.xml"
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}", *args],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert report.exists(), process.stdout + process.stderr
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, child.get("message", "")
        outcomes[case.get("name")] = (outcome, message)
    return outcomes, process.stdout + process.stderr


def expect_under_watch(outcomes: dict, *, strict: bool) -> None:
    anomalous = outcomes.pop("test_anomalous")
    if strict:
        assert anomalous[0] == "failure" and anomalous[1].startswith("opwatch.findings.anomaly.AnomalyError: broadcast in aten.sub.Tensor")
    else:
        assert anomalous == ("failure", "Failed: opwatch: 1 anomaly at 1 place in this test (see 'Captured opwatch call' below)")
    strict_marker = outcomes.pop("test_strict_marker")
    assert strict_marker[0] == "failure" and "AnomalyError: broadcast in aten.sub.Tensor" in strict_marker[1]
    own = outcomes.pop("test_fails_by_itself")
    assert own[0] == "failure" and ("the test's own failure" in own[1] or "AnomalyError" in own[1])
    passing = ("test_clean", "test_opted_out", "test_checks_from_marker", "test_allowed_by_marker", "test_fixture")
    assert outcomes == dict.fromkeys(passing, ("passed", ""))


def test_a_test_that_leaves_anomalies_fails_with_the_summary(tmp_path):
    # The command line beats the environment and the ini file; a marker beats the command line.
    outcomes, output = run_pytest(
        tmp_path,
        "--opwatch",  # before the path: a bare --opwatch must not swallow it
        "test_generated.py",
        "--opwatch-last=2",
        env={"OPWATCH_PYTEST": "off", "EXPECT_STRICT": "0"},
        ini="opwatch = strict\n",
    )
    expect_under_watch(outcomes, strict=False)
    section = output.split("Captured opwatch call", 1)[1]
    assert "opwatch: 1 anomaly at 1 place:\n\nbroadcast in aten.sub.Tensor at test_generated.py:13 (forward)" in section
    carets = "             ^^^^^^^^\n" if sys.version_info >= (3, 11) else ""  # column positions: 3.11+
    assert f"    return ((y - pred) ** 2).mean()\n{carets}  problem:  both operands were expanded" in section
    # --opwatch-last: the dump of the test that raised shows 2 ops.
    assert "opwatch: the watched block raised AnomalyError; the last 2 ops:" in output


def test_the_environment_beats_the_ini_file_in_xdist_workers(tmp_path):
    pytest.importorskip("xdist")
    outcomes, output = run_pytest(tmp_path, "-n", "1", env={"OPWATCH_PYTEST": "strict", "EXPECT_STRICT": "1"}, ini="opwatch = on\n")
    assert "1 worker" in output
    expect_under_watch(outcomes, strict=True)


@pytest.fixture(scope="module")
def run_without_opwatch(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("plain")
    conftest = """
        import sys

        def pytest_configure(config):
            # The plugin has been imported by now: did that import torch?
            open("torch_at_configure.txt", "w").write(str("torch" in sys.modules))
        """
    outcomes, output = run_pytest(tmp_path, env={"EXPECT_STRICT": "0"}, files={"conftest.py": conftest})
    return tmp_path, outcomes, output


def test_without_opwatch_only_marked_tests_are_watched(run_without_opwatch):
    _, outcomes, output = run_without_opwatch
    assert outcomes.pop("test_strict_marker")[0] == "failure"
    assert outcomes.pop("test_fails_by_itself") == ("failure", "AssertionError: the test's own failure\nassert False")
    assert outcomes.pop("test_checks_from_marker") == ("passed", "")  # watched, but only for nan/inf
    passing = ("test_anomalous", "test_clean", "test_opted_out", "test_allowed_by_marker", "test_fixture")
    assert outcomes == dict.fromkeys(passing, ("passed", ""))


def test_loading_the_plugin_does_not_import_torch(run_without_opwatch):
    tmp_path, _, _ = run_without_opwatch
    assert (tmp_path / "torch_at_configure.txt").read_text() == "False"


def test_the_plugin_module_itself_imports_no_torch():
    # Loaded alone (without the opwatch package's __init__), the plugin imports pytest only.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('plugin_alone', {pytest_plugin.__file__!r})\n"
        "module = sys.modules['plugin_alone'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print('torch' in sys.modules, 'opwatch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert result.stdout.split() == ["False", "False"], result.stderr


def test_settings_precedence_and_values():
    ini = ("ini", "strict", ["broadcast"], "5")
    env = ("env", "on", None, "")
    cli = ("cli", None, "nonfinite, dtype_mismatch", None)
    assert layered_settings([ini]) == Settings(mode="strict", checks=("broadcast",), last=5)
    assert layered_settings([ini, env]) == Settings(mode="on", checks=("broadcast",), last=5)
    assert layered_settings([ini, env, cli]) == Settings(mode="on", checks=("nonfinite", "dtype_mismatch"), last=5)
    assert layered_settings([ini, ("cli", "off", "all", "0")]) == Settings(mode="off", checks=None, last=0)
    assert layered_settings([("env", "TRUE", None, None)]).mode == "on"
    with pytest.raises(ValueError, match=r"opwatch mode 'loud' is not understood; use on, strict or off \(from env\)"):
        layered_settings([("env", "loud", None, None)])
    with pytest.raises(ValueError, match=r"last must be a whole number, 0 or more, got '-3' \(from cli\)"):
        layered_settings([("cli", None, None, "-3")])
