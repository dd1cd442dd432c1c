"""A real browser for the tests that look at pages: Debian's chromium driven by playwright
(never `playwright install`: no browser is downloaded; everything is read offline)."""

from __future__ import annotations

import os

import pytest

CHROMIUM = "/usr/bin/chromium"


def browser():
    """playwright's sync API, chromium at :data:`CHROMIUM`; a skip without them (a failure where
    CI is set: .ci/run installs both, so there the test must run)."""
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        missing.append("playwright (pip install playwright)")
    if not os.path.exists(CHROMIUM):
        missing.append(f"chromium at {CHROMIUM} (apt-get install chromium)")
    if missing:
        reason = "the browser test needs " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI is set, so it must run")
        pytest.skip(reason)
    return sync_playwright


def launch(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
