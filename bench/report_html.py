"""The HTML report of a large log: how long it takes to write, how big it is, and how long
Chromium takes to open it (issue 31: a 14,000-record log opens in under 3 s, the file stays
under 25 MB).

    python -m bench.report_html                  # 14,000 records, 5 page loads
    python -m bench.report_html --records 2000   # a smoke run

The log: a 2-layer transformer's training steps and a small regression with a broadcast and a
nan in its loss, interleaved, until the watch holds ``--records`` ops; exported to JSON Lines,
then reported as ``python -m opwatch report`` does (load, render, write). The page is opened
in Debian's chromium through playwright, offline; the time is the navigation's
``loadEventEnd`` (the page's script has drawn the first page of ops by then), median of the
loads, and the time until the ops around the first finding are shown after a click.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

CHROMIUM = "/usr/bin/chromium"


def buggy_regression() -> callable:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 2), torch.randn(16)

    def step():
        optimizer.zero_grad()
        pred = model(x)
        loss = ((y - pred) ** 2).mean()  # (16,) - (16, 1): a broadcast
        spread = (pred.var() - 1.0).sqrt()  # a nan
        (loss + 0 * spread.detach()).backward()
        optimizer.step()

    return step


def record_log(records: int, path: str) -> tuple[int, int]:
    import opwatch

    from .workloads import transformer32_step

    transformer, buggy = transformer32_step(), buggy_regression()
    with opwatch.watch(warn=False, max_records=records) as w:
        op_count = 0
        while op_count < records:
            transformer()
            buggy()
            op_count = len(w.records)
    w.export_jsonl(path)
    return len(w.records), len(w.anomalies)


def open_in_chromium(path: str, loads: int) -> tuple[list[float], float]:
    from playwright.sync_api import sync_playwright

    times = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(offline=True)
        for _ in range(loads):
            page = context.new_page()
            errors = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto("file://" + os.path.abspath(path))
            page.wait_for_function("performance.getEntriesByType('navigation')[0].loadEventEnd > 0")
            times.append(page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd") / 1000)
            if errors:
                raise RuntimeError(f"the page raised: {errors}")
            page.close()
        page = context.new_page()
        page.goto("file://" + os.path.abspath(path))
        start = time.perf_counter()
        page.click("button.around >> nth=0")
        page.wait_for_selector(".around-ops tr.this")
        click = time.perf_counter() - start
        browser.close()
    return times, click


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report_html", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=14_000)
    parser.add_argument("--loads", type=int, default=5)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    from opwatch.runners.cli import main as cli

    with tempfile.TemporaryDirectory() as folder:
        log, report = os.path.join(folder, "run.jsonl"), os.path.join(folder, "run.html")
        records, anomalies = record_log(options.records, log)
        start = time.perf_counter()
        cli(["report", log, "-o", report])
        written = time.perf_counter() - start
        size = os.path.getsize(report)
        print(f"torch {torch.__version__}; {records} records, {anomalies} anomalies; log {os.path.getsize(log) / 1e6:.1f} MB")
        print(f"report written in {written:.2f} s (load + render + write), {size / 1e6:.2f} MB")
        if not os.path.exists(CHROMIUM):
            print(f"no chromium at {CHROMIUM}: page load not measured", file=sys.stderr)
            return 0
        times, click = open_in_chromium(report, options.loads)
        shown = ", ".join(f"{t:.3f}" for t in times)
        print(f"chromium opens it in {statistics.median(times):.3f} s (median of {len(times)} loads: {shown})")
        print(f"the ops around the first finding shown {click * 1000:.0f} ms after the click (playwright's round trips included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
