"""The Benchmarks tab in a real headless Chromium (Debian's ``/usr/bin/chromium`` driven by Playwright, as in
tests/test_admin_browser.py) against a real appliance: start a quick ``appliance benchmark`` from the page (the real
CLI on the appliance's own config file, a tiny model), see the progress bar move without a reload, follow the
link to the result page (the table and the SVG charts, the quick run's caveats), click "Apply advice", confirm
(the run has caveats), and see the diff and the reload record, which says ``benchmark``. No page logs a
JavaScript error or a failed request, and the result page fits a 375 px phone screen. Screenshots go to the
test's ``tmp_path``."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import running
from test_admin_browser import DESKTOP, PHONE, Problems

RUN_MS = 300_000  # a quick run takes about 20-90 s on a slow, shared 2-core box
WAIT_MS = 30_000

RECORD_PROGRESS = """() => {
    window.progressSeen = [];
    const note = () => {
        const bar = document.getElementById("benchmark-progress");
        const value = bar && bar.hasAttribute("value") ? bar.getAttribute("value") : null;
        if (value !== null && window.progressSeen[window.progressSeen.length - 1] !== value) {
            window.progressSeen.push(value);
        }
    };
    new MutationObserver(note).observe(document.querySelector("main"), {subtree: true, childList: true});
    window.samePage = true;
}"""
"""Records each value the progress bar shows (the polled fragment replaces it), and marks the document so that a
reload would be noticed."""


@pytest.fixture
def app(tiny_model: Path):  # type: ignore[no-untyped-def]
    # The device-class preset is never 7 / 3, so the advice changes these two keys at least.
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], watch=True,
                 engine={"adaptive_window_size": 7, "adaptive_sample_rate": 3}) as running_app:
        yield running_app


@pytest.mark.slow
def test_a_quick_benchmark_from_the_page_then_apply_its_advice(app, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    problems = Problems()
    config = app.config_file
    config.write_text("# the operator's notes: keep me\n" + config.read_text())  # the reload sees no change
    context = browser.new_context(viewport=DESKTOP)
    try:
        page = problems.watch(context.new_page())
        page.goto(app.appliance.http_url + "/admin/benchmarks")
        assert page.locator("#no-benchmarks").is_visible()
        assert page.is_checked("#benchmark-form input[name=quick]")
        page.evaluate(RECORD_PROGRESS)
        page.click("#benchmark-start")
        page.locator('#benchmark-start-result [data-outcome="ok"]').wait_for(timeout=WAIT_MS)
        page.locator('#benchmark-run[data-state="running"]').wait_for(timeout=WAIT_MS)
        page.screenshot(path=str(tmp_path / "benchmarks-running.png"), full_page=True)
        page.locator('#benchmark-run[data-state="finished"], #benchmark-run[data-state="failed"]').wait_for(
            timeout=RUN_MS)
        assert page.get_attribute("#benchmark-run", "data-state") == "finished", page.inner_text("#benchmark-run")
        seen = [int(value) for value in page.evaluate("window.progressSeen")]
        assert len(seen) >= 2 and seen == sorted(seen) and seen[-1] > seen[0], seen  # the bar moved forward
        name = page.inner_text("#benchmark-result-link")
        page.locator(f'#benchmark-results a[href="/admin/benchmarks/result/{name}"]').wait_for(timeout=WAIT_MS)
        assert page.evaluate("window.samePage === true")  # the progress and the list came without a reload
        page.screenshot(path=str(tmp_path / "benchmarks-finished.png"), full_page=True)

        page.click("#benchmark-result-link")
        page.wait_for_url(f"**/admin/benchmarks/result/{name}")
        assert "HEADLINE: appliance benchmark" in page.inner_text("#benchmark-headline")
        figures = page.locator("#benchmark-table tbody tr").count()
        assert figures == 5
        assert page.locator("svg.chart").count() >= 2 and page.locator("svg.chart circle.point").count() >= 2
        page.screenshot(path=str(tmp_path / "benchmark-result.png"), full_page=True)

        assert page.locator("#benchmark-caveats").is_visible()  # a quick run of one repeat is marked
        page.click("#apply-advice")
        page.locator('#apply-result [data-outcome="confirm"]').wait_for(timeout=WAIT_MS)
        assert "a quick run (--quick)" in page.inner_text("#apply-confirmation")
        assert config.read_text().startswith("# the operator's notes") and "adaptive_window_size: 7\n" in \
            config.read_text()  # asked, nothing written yet
        page.click("#apply-confirm")
        page.locator('#apply-result [data-outcome="ok"]').wait_for(timeout=WAIT_MS)
        diff = page.inner_text("#apply-diff")
        assert "-  adaptive_window_size: 7" in diff and "+  adaptive_window_size:" in diff
        assert page.get_attribute("#apply-reload", "data-trigger") == "benchmark"
        assert page.get_attribute("#apply-reload", "data-result") == "applied"
        text = config.read_text()
        assert text.startswith("# the operator's notes: keep me\n") and "adaptive_window_size: 7\n" not in text
        last = app.appliance.reloader.history.last
        assert last.trigger == "benchmark" and last.result == "applied"
        assert app.appliance.config.engine.adaptive_window_size != 7

        page.set_viewport_size(PHONE)
        widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], widths  # no horizontal scroll on a phone
        page.screenshot(path=str(tmp_path / "benchmark-result-375px.png"), full_page=True)
    finally:
        problems.stop()
        context.close()
    assert problems.seen == []
