"""Sphinx extension of opwatch's docs: the CLI reference from argparse, and a check that the
API reference documents every public name.

- ``_generated/cli-*.txt``: the ``--help`` of ``python -m opwatch`` and its sub-commands,
  written at each build from the parsers themselves, so the CLI page cannot fall behind them.
- After reading the sources, every name in ``PUBLIC_MODULES``' ``__all__`` and in ``RETURNED``
  must be documented in the API reference as ``module.name`` (an ``auto*`` directive); a missing
  one is a warning, which ``-W`` makes an error. ``tests/unit/test_docs.py`` asks the same of the
  ``.rst`` sources without building.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re

# The modules whose ``__all__`` is the public API; each name is documented as ``module.name``.
PUBLIC_MODULES = (
    "opwatch",
    "opwatch.runners.lightning",
    "opwatch.runners.transformers",
    "opwatch.runners.tensorboard",
)
# What those names return or raise, documented where it is defined.
RETURNED = (
    "opwatch.runners.guarded.Guarded",
    "opwatch.runners.leave_on.GradientsNotFinite",
    "opwatch.runners.divergence.Diff",
    "opwatch.runners.divergence.Divergence",
    "opwatch.runners.divergence.Tolerance",
    "opwatch.storage.jsonl.SavedLog",
    "opwatch.storage.jsonl.SavedRecord",
    "opwatch.storage.jsonl.SavedAnomaly",
    "opwatch.findings.ranks.AllAnomalies",
    "opwatch.runners.trainers.metrics",
)
# The ``--help`` pages of the command line: file stem -> argv.
CLI_PAGES = {
    "cli-main": ["--help"],
    "cli-show": ["show", "--help"],
    "cli-diff": ["diff", "--help"],
    "cli-report": ["report", "--help"],
    "cli-merge-traces": ["merge-traces", "--help"],
}
_AUTO = re.compile(r"^\.\. auto(?:function|class|exception|data|attribute|module)::\s*(\S+)", re.M)


def public_names() -> list[str]:
    """``module.name`` for every name a public module exports, and the types they return."""
    names = list(RETURNED)
    for module in PUBLIC_MODULES:
        for name in importlib.import_module(module).__all__:
            names.append(f"{module}.{name}")
    return names


def documented_in_sources(folder: str) -> set[str]:
    """The names given to ``auto*`` directives in the ``.rst`` files under ``folder``."""
    found = set()
    for root, _, files in os.walk(folder):
        for file in files:
            if file.endswith(".rst"):
                with open(os.path.join(root, file), encoding="utf-8") as handle:
                    found.update(_AUTO.findall(handle.read()))
    return found


def cli_help(argv: list[str]) -> str:
    """What ``python -m opwatch ARGV`` prints for ``--help``, at a fixed width."""
    from opwatch.runners.cli import main

    out = io.StringIO()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(argv)
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return out.getvalue()


def _write_cli_pages(app) -> None:
    folder = os.path.join(app.srcdir, "_generated")
    os.makedirs(folder, exist_ok=True)
    for stem, argv in CLI_PAGES.items():
        text = cli_help(argv)
        if not text.strip():
            from sphinx.util import logging

            logging.getLogger(__name__).warning("python -m opwatch %s printed no help", " ".join(argv))
        path = os.path.join(folder, stem + ".txt")
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if old != text:  # unchanged files keep their time stamp: no needless rebuild
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)


def _check_api_coverage(app, env) -> None:
    from sphinx.util import logging

    documented = set(env.get_domain("py").objects)
    missing = [name for name in public_names() if name not in documented]
    for name in missing:
        logging.getLogger(__name__).warning(
            "public name %s is not in the API reference (docs/api.rst): add an auto* directive for it", name
        )


def setup(app):
    app.connect("builder-inited", _write_cli_pages)
    app.connect("env-check-consistency", _check_api_coverage)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
