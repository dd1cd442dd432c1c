"""Every Python block of README.md and docs/**/*.md runs as written, or says it is an excerpt.

A block is an excerpt when its first line is a comment ``# excerpt: <what is left out>``
(CONTRIBUTING.md, "Docs"); every other block is pasted into a file and run with a fresh Python
in an empty folder, as a reader would run it. A block that imports lightning, transformers or
tensorboard is skipped where that package is not installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import needs

REPO = Path(__file__).resolve().parent.parent.parent
PAGES = [REPO / "README.md"] + sorted(page for page in (REPO / "docs").rglob("*.md") if "_build" not in page.parts)
EXCERPT = "# excerpt:"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_OPTIONAL = ("lightning", "transformers", "tensorboard")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each ```` ```python ```` block of a Markdown text (line: the fence's)."""
    return [(text.count("\n", 0, match.start()) + 1, match.group(1)) for match in _FENCE.finditer(text)]


def _blocks():
    for page in PAGES:
        for line, code in python_blocks(page.read_text(encoding="utf-8")):
            yield pytest.param(page, code, id=f"{page.relative_to(REPO).as_posix()}:{line}")


BLOCKS = list(_blocks())
RUN = [block for block in BLOCKS if not block.values[1].startswith(EXCERPT)]


def run_block(code: str, folder: Path) -> subprocess.CompletedProcess:
    """Run ``code`` as a script in ``folder`` (empty), with this checkout's opwatch."""
    (folder / "snippet.py").write_text(code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OPWATCH_DISABLE", None)
    return subprocess.run([sys.executable, "snippet.py"], capture_output=True, text=True, cwd=folder, env=env, timeout=120)


def test_a_block_that_uses_what_it_does_not_define_fails(tmp_path):
    # The TensorBoard page's block as it once was: no `import opwatch`, no data.
    result = run_block("with opwatch.watch() as w:\n    for step, (x, y) in enumerate(data):\n        pass\n", tmp_path)
    assert result.returncode == 1 and "NameError: name 'opwatch' is not defined" in result.stderr


def test_the_blocks_are_found_and_most_run():
    # The extraction itself: a page with a block of each kind, and the real pages' counts.
    page = "text\n\n```python\nprint(1)\n```\n\n```bash\nls\n```\n\n```python\n# excerpt: x is yours\nx\n```\n"
    assert python_blocks(page) == [(3, "print(1)\n"), (11, "# excerpt: x is yours\nx\n")]
    assert any(block.id.startswith("README.md:") for block in RUN)
    assert len(BLOCKS) >= 15 and len(RUN) >= len(BLOCKS) // 3


def test_an_excerpt_says_what_it_leaves_out():
    for block in BLOCKS:
        first = block.values[1].partition("\n")[0]
        if first.lower().startswith("# excerpt"):
            assert first.startswith(EXCERPT) and len(first) > len(EXCERPT) + 3, (block.id, first)


@pytest.mark.parametrize("page, code", RUN)
def test_the_block_runs_as_written(page, code, tmp_path):
    for name in _OPTIONAL:
        if re.search(rf"^\s*(?:from|import) {name}\b|^\s*from \S*\.{name} import|torch\.utils\.{name}", code, re.MULTILINE):
            needs(name)
    result = run_block(code, tmp_path)
    assert result.returncode == 0, (
        f"{page.relative_to(REPO)}: this block fails when run as written; fix it, or make its first line "
        f"'{EXCERPT} <what is left out>'\n{result.stderr[-3000:]}"
    )
