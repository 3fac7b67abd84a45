"""The dashboard's row buttons and live log tail in a real headless Chromium (Debian's, driven by Playwright): the
operator clicks Unload on a loaded model's row and sees it unloaded, the result shown, and the daemon's log line
about it appear in the tail, all without a reload and without a JavaScript error or a failed request."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import running
from test_admin_browser import DESKTOP, WAIT_MS, Problems


@pytest.fixture
def app(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running({"tiny": {"path": str(tiny_model), "idle_ttl_s": 600}}, model_dirs=[tiny_model.parent]) as running_app:
        yield running_app


def test_unload_from_the_models_row_and_see_its_log_line_in_the_tail(app, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    problems = Problems()
    context = browser.new_context(viewport=DESKTOP)
    try:
        page = problems.watch(context.new_page())
        page.goto(app.appliance.http_url + "/admin/")
        page.evaluate("window.sameDocument = true")  # gone if the page reloads
        page.locator('#log-tail .log-message:has-text("started")').first.wait_for(timeout=WAIT_MS)
        model = page.locator('#models tr[data-model="tiny"]')
        model.locator('button[data-action="load"]').click()
        model.locator('.state:text-is("loaded")').wait_for(timeout=WAIT_MS)
        assert app.daemon.model_state("tiny") == "loaded"

        model.locator('button[data-action="unload"]').click()
        page.locator('#row-result [data-outcome="ok"]:has-text("Model tiny unloaded.")').wait_for(timeout=WAIT_MS)
        assert app.daemon.model_state("tiny") == "available"
        assert model.locator(".state").inner_text() == "available"
        line = page.locator('#log-tail .log-message:text-is("model tiny unloaded (admin page)")')
        line.wait_for(timeout=WAIT_MS)  # the tail's polling brought the daemon's line in
        assert page.evaluate("window.sameDocument === true")
        page.screenshot(path=str(tmp_path / "dashboard-rows-and-log.png"), full_page=True)
    finally:
        problems.stop()
        context.close()
    assert problems.seen == []
