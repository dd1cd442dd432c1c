"""pytest plugin: run tests under an opwatch watch (registered as ``opwatch`` through the
``pytest11`` entry point; ``-p no:opwatch`` turns it off).

    pytest --opwatch                  # each test's body runs under opwatch.watch(); a test
                                      # that leaves anomalies fails, the summary in its report
    pytest --opwatch=strict           # opwatch.strict(): AnomalyError at the first anomaly
    pytest --opwatch --opwatch-checks=broadcast,nonfinite --opwatch-last=50

Settings, from weakest to strongest: the ini options ``opwatch = off|on|strict``,
``opwatch_checks``, ``opwatch_last``; the environment variables ``OPWATCH_PYTEST``,
``OPWATCH_PYTEST_CHECKS``, ``OPWATCH_PYTEST_LAST``; the command line; the ``opwatch`` marker::

    @pytest.mark.opwatch                        # watch this test even without --opwatch
    @pytest.mark.opwatch(strict=True, checks=["broadcast"], last=50)
    @pytest.mark.opwatch(False)                 # never watch this test

Any other keyword of :func:`opwatch.watch` may be given to the marker (``allow``,
``max_records``, ``warn``, ``dump_on_error``). The ``opwatch_watch`` fixture gives the test
the :class:`opwatch.Watch` that runs around its body (and watches the test when nothing else
asked for it).

Only the test function's body is watched, not its fixtures' setup and teardown. This module
imports only pytest and the standard library: opwatch's watch, and torch with it, is imported
for the first watched test.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import pytest

# The accepted spellings of the three modes: off, on, strict.
_MODE_WORDS = {"off": "off", "0": "off", "false": "off", "no": "off", "on": "on", "1": "on", "true": "on", "yes": "on", "strict": "strict"}
ENV_MODE = "OPWATCH_PYTEST"
ENV_CHECKS = "OPWATCH_PYTEST_CHECKS"
ENV_LAST = "OPWATCH_PYTEST_LAST"

_SETTINGS = pytest.StashKey["Settings"]()
_WATCH = pytest.StashKey[object]()


@dataclass(frozen=True)
class Settings:
    """What one test runs under."""

    mode: str = "off"
    checks: tuple[str, ...] | None = None  # None: every check
    last: int = 20
    options: tuple = ()  # more keyword arguments of opwatch.watch(), from a marker

    def watch_kwargs(self) -> dict:
        # warn=False: a failing test already shows each anomaly; a warning per line would repeat it.
        return {"checks": self.checks, "last": self.last, "warn": False, **dict(self.options)}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("opwatch", "opwatch: watch every PyTorch op of each test")
    group.addoption(
        "--opwatch",
        action="store",
        nargs="?",
        const="on",
        default=None,
        metavar="on|strict|off",
        help="run each test under opwatch.watch() and fail tests that leave anomalies; "
        "'strict': opwatch.strict(), raise at the first anomaly; 'off': not at all",
    )
    group.addoption(
        "--opwatch-checks",
        action="store",
        default=None,
        metavar="NAMES",
        help="comma-separated checks to run: device_mismatch, dtype_mismatch, broadcast, nonfinite, collective_mismatch, pre_dispatch (default: all but collective_mismatch)",
    )
    group.addoption("--opwatch-last", action="store", default=None, metavar="N", help="ops shown when a watched test raises (default 20)")
    parser.addini("opwatch", "watch each test: off (default), on or strict", default="")
    parser.addini("opwatch_checks", "checks opwatch runs (default: the four default checks)", type="args", default=[])
    parser.addini("opwatch_last", "ops shown when a watched test raises (default 20)", default="")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args: list[str]) -> None:
    # ``--opwatch`` takes an optional value, so argparse would read ``pytest --opwatch tests/``
    # as --opwatch=tests/. Give a bare --opwatch its default before the command line is parsed.
    for position, arg in enumerate(args):
        if arg == "--opwatch" and (position + 1 == len(args) or args[position + 1].lower() not in _MODE_WORDS):
            args[position] = "--opwatch=on"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "opwatch(enabled=True, *, strict=False, checks=None, last=20, allow=(), ...): run this test "
        "under an opwatch watch (opwatch(False): never)",
    )
    sources = (
        ("the ini file", config.getini("opwatch"), config.getini("opwatch_checks"), config.getini("opwatch_last")),
        (f"the environment ({ENV_MODE}, {ENV_CHECKS}, {ENV_LAST})", os.environ.get(ENV_MODE), os.environ.get(ENV_CHECKS), os.environ.get(ENV_LAST)),
        ("the command line", config.getoption("opwatch"), config.getoption("opwatch_checks"), config.getoption("opwatch_last")),
    )
    try:
        settings = layered_settings(sources)
    except ValueError as error:
        raise pytest.UsageError(f"opwatch: {error}") from None
    if settings.checks is not None:
        _validate_checks(settings.checks)
    config.stash[_SETTINGS] = settings


def layered_settings(sources) -> Settings:
    """The session's settings from ``(source, mode, checks, last)`` tuples, weakest first:
    each source overrides what it sets (empty values set nothing)."""
    settings = Settings()
    for source, mode, checks, last in sources:
        try:
            settings = _layer(settings, mode, checks, last)
        except ValueError as error:
            raise ValueError(f"{error} (from {source})") from None
    return settings


def _layer(settings: Settings, mode, checks, last) -> Settings:
    """``settings`` with the options one source gives (empty values give nothing)."""
    if mode is not None and str(mode).strip():
        word = str(mode).strip().lower()
        if word not in _MODE_WORDS:
            raise ValueError(f"opwatch mode {mode!r} is not understood; use on, strict or off")
        settings = replace(settings, mode=_MODE_WORDS[word])
    if checks:
        names = checks if isinstance(checks, (list, tuple)) else [checks]
        names = tuple(name for item in names for name in item.replace(",", " ").split())
        if names:
            settings = replace(settings, checks=None if names == ("all",) else names)
    if last is not None and str(last).strip():
        try:
            value = int(str(last).strip())
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"last must be a whole number, 0 or more, got {last!r}")
        settings = replace(settings, last=value)
    return settings


def _validate_checks(names) -> None:
    from opwatch.checks import CHECK_NAMES  # imports torch: only when checks were named

    unknown = [name for name in names if name not in CHECK_NAMES]
    if unknown:
        raise pytest.UsageError(f"opwatch: unknown check name(s) {', '.join(map(repr, unknown))}; valid names are {', '.join(CHECK_NAMES)} (or all)")


def settings_for(item: pytest.Item) -> Settings:
    """The settings of one test: the session's, then its ``opwatch`` markers, the farthest
    (module, class) first and the test's own last."""
    settings = item.config.stash[_SETTINGS]
    for marker in reversed(list(item.iter_markers("opwatch"))):
        settings = _apply_marker(settings, marker, item)
    return settings


def _apply_marker(settings: Settings, marker, item) -> Settings:
    where = f"@pytest.mark.opwatch on {item.nodeid}"
    if len(marker.args) > 1 or (marker.args and not isinstance(marker.args[0], bool)):
        raise pytest.UsageError(f"{where}: the one positional argument is True or False (opwatch(False) turns watching off), got {marker.args!r}")
    enabled = marker.args[0] if marker.args else True
    if not enabled:
        return replace(settings, mode="off")
    kwargs = dict(marker.kwargs)
    strict = kwargs.pop("strict", None)
    if strict is None:
        mode = settings.mode if settings.mode != "off" else "on"
    elif isinstance(strict, bool):
        mode = "strict" if strict else "on"
    else:
        raise pytest.UsageError(f"{where}: strict must be True or False, got {strict!r}")
    checks = kwargs.pop("checks", settings.checks)
    if isinstance(checks, str):
        raise pytest.UsageError(f"{where}: checks must be a list of check names, e.g. checks=[{checks!r}]")
    last = kwargs.pop("last", settings.last)
    options = dict(settings.options)
    options.update(kwargs)
    return Settings(mode=mode, checks=None if checks is None else tuple(checks), last=last, options=tuple(options.items()))


def _make_watch(settings: Settings, item: pytest.Item):
    import opwatch

    make = opwatch.strict if settings.mode == "strict" else opwatch.watch
    try:
        return make(**settings.watch_kwargs())
    except (TypeError, ValueError) as error:  # an option of the marker that watch() refuses
        pytest.fail(f"@pytest.mark.opwatch on {item.nodeid}: {error}", pytrace=False)


@pytest.fixture
def opwatch_watch(request: pytest.FixtureRequest):
    """The :class:`opwatch.Watch` that runs around this test's body: read its ``records`` and
    ``anomalies`` in the test. Asking for it watches the test (with the session's settings, or
    ``on``) unless a marker says ``opwatch(False)``."""
    item = request.node
    settings = settings_for(item)
    if settings.mode == "off":
        if any(marker.args == (False,) for marker in item.iter_markers("opwatch")):
            pytest.fail("the opwatch_watch fixture asks for a watch, but @pytest.mark.opwatch(False) turns watching off for this test", pytrace=False)
        settings = replace(settings, mode="on")
    watch = item.stash.get(_WATCH, None)
    if watch is None:
        watch = item.stash[_WATCH] = _make_watch(settings, item)
    return watch


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    watch = item.stash.get(_WATCH, None)  # made by the fixture
    if watch is None:
        if item.config.stash[_SETTINGS].mode == "off" and item.get_closest_marker("opwatch") is None:
            return (yield)  # the common case without --opwatch: nothing imported, nothing done
        settings = settings_for(item)
        if settings.mode == "off":
            return (yield)
        watch = item.stash[_WATCH] = _make_watch(settings, item)
    summary = raised = None
    try:
        with watch:
            result = yield
    except BaseException as error:
        # A strict watch's AnomalyError: its message is in the test's traceback already, so
        # the opwatch section names that anomaly in one line.
        from ..findings.anomaly import AnomalyError

        raised = error if isinstance(error, AnomalyError) else None
        raise
    finally:
        if watch.anomalies or watch.contained or watch.allowed:
            summary = watch.summary(raised=raised)
            item.add_report_section("call", "opwatch", summary)
    if watch.anomalies:
        # The summary's first line: "opwatch: 2 anomalies at 1 place:".
        headline = summary.partition("\n")[0].rstrip(":")
        from ..render.notices import test_failed

        pytest.fail(test_failed(headline), pytrace=False)
    return result
