"""The HTML report (``Watch.report_html``, ``python -m opwatch report``): one self-contained
page built from a real training loop's records and findings, then opened in a real browser
(Debian's chromium driven by playwright, offline)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html import escape

import pytest

import opwatch
from opwatch.runners.cli import main
from opwatch.render.html import render_report, training_steps
from opwatch.storage.jsonl import load

import report_training  # noqa: E402  (tests/scenarios)
from support.browser import browser, launch
from support.helpers import line_of

# Code objects have column positions from Python 3.11 (co_positions): the op's sub-expression is
# marked in its line there; on 3.10 the line is shown whole.
HAS_COLUMNS = sys.version_info >= (3, 11)


def watched(steps=3, buggy=True, **options) -> opwatch.Watch:
    with opwatch.watch(warn=False, **options) as w:
        report_training.train(steps=steps, buggy=buggy)
    return w


@pytest.fixture(scope="module")
def buggy_run(tmp_path_factory):
    """A buggy run's report, written from the watch, and its log."""
    folder = tmp_path_factory.mktemp("report")
    old = os.getcwd()
    os.chdir(os.path.dirname(report_training.__file__))  # paths as the tests show them
    try:
        w = watched()
        w.report_html(folder / "report.html")
        w.export_jsonl(folder / "run.jsonl")
    finally:
        os.chdir(old)
    return w, folder


def test_a_buggy_run_has_its_findings_first_with_their_words(buggy_run):
    w, folder = buggy_run
    page = (folder / "report.html").read_text(encoding="utf-8")
    kinds = {a.kind for a in w.anomalies}
    assert kinds == {"broadcast", "nan"}
    findings = page[page.index('id="findings"') : page.index('id="pictures"')]
    assert findings.count('<article class="finding"') == 2  # 6 anomalies at 2 places
    assert "6 anomalies at 2 places" in findings
    assert findings.count('<span class="count">x3</span>') == 2
    firsts = [next(a for a in w.anomalies if a.kind == kind) for kind in ("broadcast", "nan")]  # each place's first
    for anomaly in firsts:
        problem = anomaly.message.partition("  problem:  ")[2].partition("\n")[0]
        fix = anomaly.message.partition("  fix:      ")[2].partition("\n")[0]
        assert problem and escape(problem) in findings
        assert escape(fix) in findings
        assert f"report_training.py:{anomaly.lineno}" in findings
    # The nan's cause (sqrt of a negative shift: undefined math) is shown between its problem
    # and what was expected, as the text puts it; the broadcast has none.
    cause = firsts[1].message.partition("  cause:    ")[2].partition("\n")[0]
    assert cause.startswith("undefined math: ") and "  cause:    " not in firsts[0].message
    assert findings.count("<dt>cause</dt>") == 1
    assert f"<dt>cause</dt><dd>{escape(cause)}</dd><dt>expected</dt>" in findings
    card = firsts[1]._repr_html_()
    assert escape(cause) in card and card.index(">problem<") < card.index(">cause<") < card.index(">expected<")
    assert ">cause<" not in firsts[0]._repr_html_()
    # The sub-expression is marked in the line's text, which is escaped.
    if HAS_COLUMNS:
        assert "loss = ((<mark>y - pred</mark>) ** 2).mean()" in findings
        assert "spread = <mark>(pred.var() - 1.0).sqrt()</mark>" in findings
    else:  # Python 3.10 code has no column positions: the whole line, nothing marked
        assert "loss = ((y - pred) ** 2).mean()" in findings and "<mark>" not in findings
    assert "&lt;/script&gt;&lt;b&gt;not markup&lt;/b&gt; &amp; co" in findings
    assert "<b>not markup</b>" not in page
    # A nan's way from the op that made it to the last op it reached (the message names both).
    nan = firsts[1]
    way = findings.partition('<div class="way">')[2].partition("</div>")[0]
    steps = re.findall(r"<code>#(\d+) ([\w.]+)</code>", way)
    assert steps[0] == (str(nan.index), "aten.sqrt") and steps[-1][1] == "aten.add.Tensor"
    assert len(steps) == nan.finding.facts["spread"] + 1
    assert findings.count('<div class="way">') == 1  # a broadcast has no way
    # The findings come before the pictures and the op table.
    assert page.index('id="findings"') < page.index('id="pictures"') < page.index('id="ops"')


def test_the_page_is_self_contained(buggy_run):
    _, folder = buggy_run
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert not re.search(r"https?://", page)
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|@import|url\(", page, re.I)
    assert page.count("<style>") == 1 and page.count("<script>") == 1


def test_every_op_travels_once_as_compact_data_that_cannot_close_its_script(buggy_run):
    w, folder = buggy_run
    page = (folder / "report.html").read_text(encoding="utf-8")
    text = page.partition('<script type="application/json" id="opwatch-data">')[2].partition("</script>")[0]
    assert "<" not in text
    data = json.loads(text)
    assert [row[0] for row in data["rows"]] == [r.index for r in w.records]
    assert data["headers"] == list(opwatch.render.TABLE_HEADERS)
    # Each cell text once: the rows are numbers into it.
    assert len(data["cells"]) == len(set(data["cells"])) < len(w.records)
    first_broadcast = next(a for a in w.anomalies if a.kind == "broadcast")
    row = next(row for row in data["rows"] if row[0] == first_broadcast.index)
    assert [data["cells"][n] for n in row[1:3]] == ["aten.sub.Tensor", "f32[16] cpu, f32[16, 1] cpu"]


def test_the_pictures_count_ops_per_module_and_anomalies_per_step(buggy_run):
    w, folder = buggy_run
    page = (folder / "report.html").read_text(encoding="utf-8")
    pictures = page[page.index('id="pictures"') : page.index('id="ops"')]
    body_ops = sum(1 for r in w.records if (r.module or "").startswith("body"))
    assert f"<title>body: {body_ops} ops, 0 anomalies</title>" in pictures
    outside = [r for r in w.records if not r.module]
    assert f"<title>(outside any module): {len(outside)} ops, 6 anomalies</title>" in pictures
    # Three training steps: two anomalies in each.
    assert len(training_steps(w.records)) == 3
    assert pictures.count("anomalies</title></rect>") == 3
    assert pictures.count(": 2 anomalies</title></rect>") == 3


def test_a_clean_run_says_so_and_draws_no_finding():
    w = watched(buggy=False)
    page = render_report(w)
    assert not w.anomalies
    assert "No anomalies" in page and '<article class="finding"' not in page
    assert "&lt;/script&gt;" not in page  # no finding shows the line


def test_one_forward_pass_has_no_steps_chart():
    import torch

    model = report_training.Regressor()
    with opwatch.watch(warn=False) as w:
        model(torch.randn(16, 2))
    assert len(training_steps(w.records)) == 1
    assert "Anomalies per training step" not in render_report(w)


def test_a_saved_log_reports_the_same_findings(buggy_run):
    w, folder = buggy_run
    live = (folder / "report.html").read_text(encoding="utf-8")
    old = os.getcwd()
    os.chdir(os.path.dirname(report_training.__file__))
    try:
        saved = render_report(load(folder / "run.jsonl"))
    finally:
        os.chdir(old)

    def findings(page):
        return page[page.index('id="findings"') :]

    assert findings(saved) == findings(live)


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(opwatch.__file__)), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "opwatch", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_the_command_line_writes_the_report_and_names_it(buggy_run, tmp_path):
    _, folder = buggy_run
    done = _cli("report", str(folder / "run.jsonl"), "-o", str(tmp_path / "out.html"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"opwatch: report written to {tmp_path / 'out.html'}\n"
    assert "6 anomalies at 2 places" in (tmp_path / "out.html").read_text(encoding="utf-8")


def test_without_o_the_report_is_named_after_the_log(buggy_run, tmp_path, monkeypatch, capsys):
    _, folder = buggy_run
    monkeypatch.chdir(tmp_path)
    shutil.copy(folder / "run.jsonl", "again.jsonl")
    assert main(["report", "again.jsonl"]) == 0
    assert capsys.readouterr().out == "opwatch: report written to again.html\n"
    assert "6 anomalies at 2 places" in (tmp_path / "again.html").read_text(encoding="utf-8")


def test_a_log_cut_short_is_refused_in_one_line(buggy_run, tmp_path, monkeypatch, capsys):
    _, folder = buggy_run
    monkeypatch.chdir(tmp_path)
    lines = (folder / "run.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "cut.jsonl").write_text("".join(lines[: len(lines) // 2]), encoding="utf-8")
    assert main(["report", "cut.jsonl"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m opwatch report: error: cut.jsonl: the log is cut short") and err.count("\n") == 1
    assert not (tmp_path / "cut.html").exists()
    assert main(["report", "cut.jsonl", "--partial"]) == 0
    assert (tmp_path / "cut.html").exists()


# -- in a real browser --------------------------------------------------------------------------


def test_the_report_in_chromium_offline(buggy_run, tmp_path):
    sync_playwright = browser()  # the skip (or CI failure) when chromium or playwright is missing
    w, folder = buggy_run
    with opwatch.watch(warn=False, max_records=3000) as big:  # several pages of ops
        report_training.train(steps=60)
    big.report_html(tmp_path / "big.html")
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        context = chromium.new_context(offline=True)
        fetched = []
        context.route("**/*", lambda route: (fetched.append(route.request.url), route.continue_()))
        page = context.new_page()
        errors = []
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto((folder / "report.html").as_uri())
        # The findings' words are on the page as a reader sees them.
        broadcast = page.locator("article.finding", has_text="broadcast").first
        problem = next(a for a in w.anomalies if a.kind == "broadcast").message.partition("  problem:  ")[2].partition("\n")[0]
        assert problem in broadcast.inner_text()
        if sys.version_info >= (3, 11):  # the sub-expression comes from column positions (3.11+)
            assert broadcast.locator("mark").inner_text() == "y - pred"
        # Clicking the button shows the ops around the finding, its own op marked.
        box = broadcast.locator(".around-ops")
        assert not box.is_visible()
        broadcast.locator("button.around").click()
        assert box.is_visible()
        marked = box.locator("tr.this")
        assert marked.count() == 1 and "aten.sub.Tensor" in marked.inner_text() and "f32[16, 16] cpu" in marked.inner_text()
        assert box.locator("tbody tr").count() == 13  # six either side
        # Another occurrence: its own op marked.
        third = next(a.index for a in w.anomalies if a.kind == "broadcast" and a.index > 100)
        box.locator("button", has_text=f"#{third}").click()
        assert box.locator("tr.this td").first.inner_text() == str(third)
        # The op table: newest first, filtered on demand.
        rows = page.locator("#all-ops tr")
        # One page of 200 rows at most: the run records 200 ops on torch 2.13, 294 on 2.6 (its
        # first optimizer step imports Dynamo, whose import runs ops; autograd's detaches differ).
        assert rows.count() == min(len(w.records), 200)
        page.fill("#filter", "aten.sqrt")
        page.wait_for_function("document.querySelectorAll('#all-ops tr').length === 3")
        page.check("#flagged")
        page.wait_for_function("document.querySelectorAll('#all-ops tr').length === 3")
        # A log of several pages draws one page of rows at first, and pages on.
        page.goto((tmp_path / "big.html").as_uri())
        assert rows.count() == 200 and rows.first.locator("td").first.inner_text() == str(big.records[-1].index)
        page.click("#next")
        assert rows.first.locator("td").first.inner_text() == str(big.records[-201].index)
        chromium.close()
    assert not errors
    assert all(url.startswith("file://") for url in fetched), fetched


# -- two runs side by side (opwatch.diff) --------------------------------------------------------


def fingerprinted(scale: float):
    """A clean run whose loss is scaled by ``scale``: two scales differ from the ``mul`` on."""
    import torch

    with opwatch.watch(warn=False, fingerprints=True) as w:
        torch.manual_seed(0)
        model = report_training.Regressor()
        x, y = torch.randn(16, 2), torch.randn(16)
        loss = ((y - model(x).squeeze(-1)) ** 2).mean() * scale
        loss.backward()
    return w


def test_two_runs_that_differ_side_by_side_the_first_difference_marked(tmp_path, capsys):
    a, b = fingerprinted(1.0), fingerprinted(2.0)
    result = opwatch.diff(a, b)
    assert result.first is not None and result.first.a.op == "aten.mul.Tensor"
    a.export_jsonl(tmp_path / "a.jsonl")
    b.export_jsonl(tmp_path / "b.jsonl")
    status = main(["diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--html", str(tmp_path / "diff.html")])
    assert status == 1
    assert capsys.readouterr().out.endswith(f"opwatch: report written to {tmp_path / 'diff.html'}\n")
    page = (tmp_path / "diff.html").read_text(encoding="utf-8")
    assert not re.search(r"https?://|<script[^>]*\bsrc=|<link\b", page, re.I)
    assert escape(str(opwatch.diff(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")))) in page  # the text report's words
    first = page.partition('<tr id="first" class="this">')[2].partition("</tr>")[0]
    assert first.count("aten.mul.Tensor") == 2 and "first difference" in first
    assert first.count(f"test_report_html.py:{result.first.a.lineno}</td>") == 2
    assert page.count('id="first"') == 1
    # The rows before it are the same in both runs; the ones after it are greyed.
    before = page.partition('<tr id="first"')[0].partition("<tbody>")[2]
    assert before.count("<tr>") >= 5 and 'class="differs"' not in before and "same" in before
    assert '<tr class="after">' in page


def test_two_runs_that_agree_mark_no_difference(tmp_path):
    result = opwatch.diff(fingerprinted(1.0), fingerprinted(1.0))
    assert result.agree
    result.report_html(tmp_path / "same.html")
    page = (tmp_path / "same.html").read_text(encoding="utf-8")
    assert "The runs agree" in page
    assert 'id="first"' not in page and 'class="differs"' not in page and 'class="after"' not in page


# -- in a notebook (_repr_html_) ------------------------------------------------------------------

NOTEBOOK_CELLS = [
    "import sys\nsys.path[:0] = [{repo!r}, {scenarios!r}]\nimport opwatch, report_training",
    "with opwatch.watch(warn=False) as w:\n    report_training.train(steps=2)\nw",
    "w.anomalies[0]",
    "with opwatch.watch(warn=False) as clean:\n    report_training.train(steps=2, buggy=False)\nclean",
    "from test_report_html import fingerprinted\nopwatch.diff(fingerprinted(1.0), fingerprinted(2.0))",
    "w.anomalies[0].index",  # the op index counts the ops torch runs (2.6 more: its first step imports TorchDynamo)
]


def test_a_notebook_shows_watches_anomalies_and_diffs_as_html_and_their_text_unchanged(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="the notebook test needs nbformat, nbclient and ipykernel (pip install -e '.[test]')")
    nbclient = pytest.importorskip("nbclient", reason="the notebook test needs nbclient (pip install -e '.[test]')")
    pytest.importorskip("ipykernel", reason="the notebook test needs ipykernel (pip install -e '.[test]')")
    scenarios = os.path.dirname(report_training.__file__)
    repo = os.path.dirname(os.path.dirname(opwatch.__file__))
    cells = [cell.format(repo=repo, scenarios=scenarios) for cell in NOTEBOOK_CELLS]
    # this module (fingerprinted) and the tests' support package it imports
    here = os.path.dirname(__file__)
    cells[4] = f"sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]\n" + cells[4]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": scenarios}}).execute()
    outputs = [cell.outputs for cell in notebook.cells]
    assert not any(output.output_type == "error" for cell in outputs for output in cell), outputs

    def shown(number):
        (output,) = [o for o in outputs[number] if o.output_type == "execute_result"]
        return output.data["text/html"], output.data["text/plain"]

    html, text = shown(1)
    assert "4 anomalies at 2 places" in html
    if HAS_COLUMNS:
        assert "<mark" in html and "y - pred</mark>" in html
    else:  # Python 3.10 code has no column positions: nothing marked
        assert "<mark" not in html and "y - pred" in html
    assert "the last 10 ops" in html and "aten.add_.Tensor" in html
    assert "<script" not in html and "&lt;/script&gt;&lt;b&gt;" in html
    assert text.startswith("<opwatch.session.Watch at ")  # the text repr is IPython's, as before
    html, text = shown(2)
    assert html.count("<span") == 1 and ">broadcast</span>" in html and "problem" in html and "fix" in html
    (index,) = [o.data["text/plain"] for o in outputs[5] if o.output_type == "execute_result"]
    broadcast_line = line_of("loss = ((y - pred) ** 2).mean()", report_training.__file__)
    assert text == f"<Anomaly broadcast aten.sub.Tensor at report_training.py:{broadcast_line} #{int(index)}>"
    html, _ = shown(3)
    assert "no anomalies" in html and ">nan</span>" not in html and ">broadcast</span>" not in html
    html, text = shown(4)
    assert "The runs first differ at aten.mul.Tensor" in html and html.count("first difference") == 1
    assert text.startswith("<Diff ") and "first at aten.mul.Tensor" in text
