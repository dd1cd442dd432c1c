"""The compatibility subset (``pytest -m compat``, tests/support/compat_subset.py) keeps its
promise: every check, mode and runner has a test in it, and every entry names tests that exist."""

from __future__ import annotations

import ast

from support import compat_subset
from support.compat_subset import COMPAT, TESTS


def uncovered(compat: dict, parts: list[str]) -> list[str]:
    return [part for part in parts if not compat.get(part)]


def unknown_entries(compat: dict) -> list[str]:
    """Entries naming a file that is not there, or a test function that file does not define."""
    wrong = []
    for entries in compat.values():
        for entry in entries:
            path, _, name = entry.partition("::")
            file = TESTS / path
            if not file.is_file():
                wrong.append(entry)
            elif name:
                defined = {node.name for node in ast.walk(ast.parse(file.read_text())) if isinstance(node, ast.FunctionDef)}
                if name not in defined:
                    wrong.append(entry)
    return wrong


def test_every_check_mode_and_runner_has_a_compat_test():
    parts = compat_subset.parts()
    # The parts are found in the package itself: a few that must be there.
    assert {"checks/nonfinite", "checks/dtype", "modes/compiled", "runners/cli", "runners/guarded/replay"} <= set(parts)
    assert uncovered(COMPAT, parts) == []
    # A new check with no entry is named.
    assert uncovered(COMPAT, [*parts, "checks/new_rule"]) == ["checks/new_rule"]


def test_every_entry_names_tests_that_exist():
    assert unknown_entries(COMPAT) == []
    assert unknown_entries({"x": ("e2e/test_gone.py", "unit/test_rules.py::test_not_there", "unit/test_rules.py")}) == [
        "e2e/test_gone.py", "unit/test_rules.py::test_not_there"]


def test_a_test_is_selected_by_its_file_or_its_name():
    chosen = {"tests/e2e/test_a.py", "tests/e2e/test_b.py::test_one"}
    assert compat_subset.is_compat("tests/e2e/test_a.py::test_any[param]", chosen)
    assert compat_subset.is_compat("tests/e2e/test_b.py::test_one[x-y]", chosen)
    assert not compat_subset.is_compat("tests/e2e/test_b.py::test_one_more", chosen)
    assert not compat_subset.is_compat("tests/e2e/test_c.py::test_one", chosen)
