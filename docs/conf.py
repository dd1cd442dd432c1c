"""Sphinx configuration of opwatch's documentation.

Build it as CI does (warnings are errors, so a broken reference or a public name missing from
the API reference fails the build):

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the opwatch of this tree, not an installed one
sys.path.insert(0, os.path.join(HERE, "_ext"))

import opwatch  # noqa: E402

project = "opwatch"
author = "the opwatch authors"
release = version = opwatch.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "opwatch_docs",  # docs/_ext/opwatch_docs.py: the CLI's --help pages, the API coverage check
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # the options are documented in prose
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: the properties are documented as members

# Every reference to an opwatch object must resolve (nitpicky, with -W: an error); references
# to torch's and Python's objects are not resolved (no inventory is fetched) and not judged.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!opwatch\b).*")]

# Furo: the theme PyTorch-ecosystem readers know (a sidebar, light and dark); its code blocks
# scroll sideways inside their box instead of being cut at the page's edge.
html_theme = "furo"
html_title = f"opwatch {release}"
html_static_path: list = []
