"""The docs keep up with the code: every public name in the API reference, every pytest option
and environment variable on its page, every relative link resolving, the README short, and no
page telling how or when it was written. The Sphinx build in .ci/run (``-W``) checks the same
and the references inside the docstrings; these run without Sphinx."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [REPO / "README.md"]
PAGES = [page for page in PAGES if "_build" not in page.parts and "_generated" not in page.parts]
# Phrases of a lab notebook, not of reference prose: the docs say what is, not what changed.
NOTEBOOK = re.compile(
    r"this round|previous round|this task|before this change|the final code|not measured on|"
    r"no gpu lent|this session|in this commit|we now|used to (?:report|flag|give)",
    re.IGNORECASE,
)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _extension():
    spec = importlib.util.spec_from_file_location("opwatch_docs", DOCS / "_ext" / "opwatch_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_is_in_the_api_reference():
    docs = _extension()
    names = docs.public_names()
    assert "opwatch.watch" in names and "opwatch.runners.lightning.OpwatchCallback" in names
    missing = [name for name in names if name not in docs.documented_in_sources(str(DOCS))]
    assert missing == [], f"add an auto* directive to docs/api.rst for: {missing}"


def test_the_build_warns_for_a_public_name_missing_from_the_reference(caplog):
    pytest.importorskip("sphinx")
    docs = _extension()
    documented = {name: None for name in docs.public_names() if name != "opwatch.diff"}

    class Env:
        def get_domain(self, name):
            assert name == "py"
            return type("Domain", (), {"objects": documented})()

    with caplog.at_level("WARNING"):
        docs._check_api_coverage(None, Env())
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "opwatch.diff" in warnings[0]


def test_every_pytest_option_is_on_the_pytest_page():
    from opwatch.runners import pytest_plugin

    names = []

    class Group:
        def addoption(self, name, **_):
            names.append(name)

    class Parser:
        def getgroup(self, *_):
            return Group()

        def addini(self, name, *_, **__):
            names.append(name)

    pytest_plugin.pytest_addoption(Parser())
    page = (DOCS / "runners" / "pytest.md").read_text()
    assert "--opwatch-checks" in names
    missing = [name for name in names if name not in page]
    assert missing == [], f"document these pytest options in docs/runners/pytest.md: {missing}"


def test_every_environment_variable_is_on_the_cli_page():
    used = set()
    for path in (REPO / "opwatch").rglob("*.py"):
        used.update(re.findall(r"\"(OPWATCH_[A-Z_]+)\"", path.read_text()))
    assert "OPWATCH_DISABLE" in used
    page = (DOCS / "cli.md").read_text()
    missing = sorted(name for name in used if name not in page)
    assert missing == [], f"document these variables in docs/cli.md: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert broken == [], f"{page.relative_to(REPO)} links to missing files: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_pages_do_not_tell_how_they_were_written(page):
    found = [match.group(0) for match in NOTEBOOK.finditer(page.read_text())]
    assert found == [], f"{page.relative_to(REPO)}: reword as reference prose: {found}"


def test_readme_is_what_a_newcomer_reads_in_five_minutes():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "move details into docs/ and link them"
    for section in ("## Install", "## Quick start", "## The demo, as it prints", "## Modes", "## Two commands", "## Documentation"):
        assert section in readme
    linked = set(_LINK.findall(readme))
    for guide in ("docs/modes.md", "docs/checks/nonfinite.md", "docs/runners/pytest.md", "docs/api.rst"):
        assert guide in linked
