"""The docs site as readers see it: built with Sphinx (the `docs` extra) and opened in a real
browser at 1280 px, each guide page in the Furo theme with no code block cut off at its edge."""

from __future__ import annotations

import pathlib

import pytest

from support.browser import browser, launch

DOCS = pathlib.Path(__file__).resolve().parent.parent.parent / "docs"
# The guides: what a reader follows step by step (the reference pages are checked by the build).
GUIDES = ["index", "getting-started", "modes", "guard", "leave-on", "report", "runners/script", "runners/lightning"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    sphinx = pytest.importorskip("sphinx.cmd.build", reason="the docs site test needs the docs extra (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    assert sphinx.build_main(["-q", "-b", "html", str(DOCS), str(out)]) == 0
    return out


def test_guides_render_in_furo_with_no_code_cut_off(site, tmp_path):
    sync_playwright = browser()
    cut_off = {}
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        page = chromium.new_page(viewport={"width": 1280, "height": 900})
        for guide in GUIDES:
            page.goto((site / f"{guide}.html").as_uri())
            assert page.locator("link[href*='furo']").count() > 0, f"{guide}: not in the Furo theme"
            assert page.locator("h1").count() == 1, f"{guide}: no title"
            # A code block wider than its box must scroll (overflow auto/scroll), not be clipped.
            cut_off[guide] = page.evaluate(
                """() => [...document.querySelectorAll('pre')].filter(pre => {
                    if (pre.scrollWidth <= pre.clientWidth) return false;
                    const scrolls = el => el && ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
                    return !scrolls(pre) && !scrolls(pre.closest('.highlight'));
                }).length"""
            )
            page.screenshot(path=str(tmp_path / f"{guide.replace('/', '_')}.png"))
        chromium.close()
    assert not any(cut_off.values()), cut_off
