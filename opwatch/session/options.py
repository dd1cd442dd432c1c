"""The options of ``watch()`` and ``strict()`` checked: each bad one a ``TypeError`` or
``ValueError`` naming what is accepted; and the ``OPWATCH_DISABLE`` kill switch read."""

from __future__ import annotations

import os

from .. import checks as _checks
from ..findings.allow import Allow

__all__ = [
    "DISABLE_VARIABLE", "disabled_by_environment", "checks_off", "check_names", "allow_entries",
    "positive_int", "non_negative_int", "flag", "text_stream",
]

DISABLE_VARIABLE = "OPWATCH_DISABLE"
_DISABLE_VALUES = {"": False, "0": False, "false": False, "no": False, "1": True, "true": True, "yes": True}


def disabled_by_environment() -> bool:
    value = os.environ.get(DISABLE_VARIABLE, "")
    key = value.strip().lower()
    if key not in _DISABLE_VALUES:
        off = ", ".join(repr(v) for v, disabled in _DISABLE_VALUES.items() if disabled)
        on = ", ".join(repr(v) for v, disabled in _DISABLE_VALUES.items() if v and not disabled)
        raise ValueError(f"{DISABLE_VARIABLE}={value!r} is not understood; use {off} to turn opwatch off, {on} (or leave it unset) to watch")
    return _DISABLE_VALUES[key]


def checks_off(checks) -> tuple[str, ...]:
    """The default checks that ``checks`` (names) leaves out: a summary names them, as
    anomalies of their kinds were not looked for."""
    return tuple(name for name in _checks.DEFAULT_CHECK_NAMES if name not in checks)


def check_names(checks) -> frozenset[str]:
    if checks is None:
        return frozenset(_checks.DEFAULT_CHECK_NAMES)
    if isinstance(checks, str):
        raise TypeError(f"checks must be a collection of check names, e.g. checks=[{checks!r}], not a string")
    try:
        names = list(checks)
    except TypeError:
        raise TypeError(f"checks must be a collection of check names, got {type(checks).__name__}") from None
    unknown = [name for name in names if name not in _checks.CHECK_NAMES]
    if unknown:
        raise ValueError(f"unknown check name(s) {', '.join(map(repr, unknown))}; valid names are {', '.join(map(repr, _checks.CHECK_NAMES))}")
    return frozenset(names)


def allow_entries(allow) -> tuple[Allow, ...]:
    if isinstance(allow, Allow):
        return (allow,)
    if isinstance(allow, (str, bytes)):
        raise TypeError(f"allow must be a list of opwatch.Allow entries, e.g. allow=[opwatch.Allow(kind='broadcast')], not a string")
    try:
        entries = tuple(allow)
    except TypeError:
        raise TypeError(f"allow must be a list of opwatch.Allow entries, got {type(allow).__name__}") from None
    for entry in entries:
        if not isinstance(entry, Allow):
            raise TypeError(f"allow must hold opwatch.Allow entries, got {type(entry).__name__}: {entry!r}")
    return entries


def _int_at_least(name, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be {'at least 1' if least == 1 else '0 or more'}, got {value}")
    return value


def positive_int(name, value) -> int:
    return _int_at_least(name, value, 1)


def non_negative_int(name, value) -> int:
    return _int_at_least(name, value, 0)


def flag(name, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def text_stream(name, value):
    """``value`` when it is ``None`` or has a ``write()`` method."""
    if value is not None and not callable(getattr(value, "write", None)):
        raise TypeError(f"{name} must be a text stream with a write() method, got {type(value).__name__}")
    return value
