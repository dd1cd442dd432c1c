"""The explanations of every rule, one module each, registered with
:func:`opwatch.render.messages.explains` when imported here."""

from __future__ import annotations

from . import nonfinite  # noqa: F401
from . import text  # noqa: F401  TRANSITIONAL
