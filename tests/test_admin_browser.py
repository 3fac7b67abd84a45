"""The admin page (SPEC W4) in a real headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright's
sync API; ``scripts/setup.sh test`` installs it, never ``playwright install``) against a real appliance: the dashboard
shows an agent registered through the form by polling, without a reload; a ledger denial is rendered inline with
its figures; resync shows the reading before and after; a chat message streams its tokens; every page fits a
375 px phone screen; and no page logs a JavaScript error or a failed request. Screenshots go to the test's
``tmp_path``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import running

HUGE_BYTES = 64 * 1024**3  # over any cap on the fake 8 GiB device
PHONE = {"width": 375, "height": 740}
DESKTOP = {"width": 1280, "height": 900}
PAGES = ("/admin/", "/admin/registry", "/admin/device", "/admin/config", "/admin/benchmarks", "/admin/chat")
WAIT_MS = 30_000  # a bound for a slow, shared 2-core machine; the polling itself is every 2 s


@pytest.fixture
def app(tiny_model: Path):  # type: ignore[no-untyped-def]
    spec = {"tiny": {"path": str(tiny_model)}, "huge": {"path": str(tiny_model), "vram_bytes": HUGE_BYTES}}
    with running(spec, model_dirs=[tiny_model.parent], watch=True) as running_app:
        yield running_app


class Problems:
    """What a page logged that it should not: console errors, uncaught exceptions, failed requests and HTTP
    error responses."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.stopped = False

    def stop(self) -> None:
        """Stop listening: closing a page aborts whatever it still polls, which is no fault of the page."""
        self.stopped = True

    def add(self, problem: str) -> None:
        if not self.stopped:
            self.seen.append(problem)

    def watch(self, page: Any) -> Any:
        page.on("console", self.console)
        page.on("pageerror", self.page_error)
        page.on("requestfailed", self.request_failed)
        page.on("response", self.response)
        return page

    def console(self, message: Any) -> None:
        if message.type == "error":
            self.add(f"console error: {message.text}")

    def page_error(self, error: Any) -> None:
        self.add(f"page error: {error}")

    def request_failed(self, request: Any) -> None:
        self.add(f"request failed: {request.method} {request.url}: {request.failure}")

    def response(self, response: Any) -> None:
        if response.status >= 400:
            self.add(f"HTTP {response.status}: {response.request.method} {response.url}")


@pytest.fixture
def problems() -> Problems:
    return Problems()


def test_register_through_the_form_and_see_it_appear_on_the_dashboard(app, browser, problems: Problems,
                                                                      tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url = app.appliance.http_url
    context = browser.new_context(viewport=DESKTOP)
    try:
        dashboard = problems.watch(context.new_page())
        dashboard.goto(url + "/")  # redirects to /admin/
        assert dashboard.url == url + "/admin/"
        assert dashboard.locator('#agents tr[data-agent]').count() == 0
        dashboard.evaluate("window.sameDocument = true")  # gone if the page reloads

        registry = problems.watch(context.new_page())
        registry.goto(url + "/admin/registry")
        registry.fill("#register-form input[name=agent]", "browser-agent")
        registry.select_option("#register-model", "tiny")
        registry.click("#register-form button[type=submit]")
        registry.locator('#register-result [data-outcome="ok"]').wait_for(timeout=WAIT_MS)
        assert "browser-agent registered on model tiny" in registry.inner_text("#register-result")
        registry.locator('#registered-agents tr[data-agent="browser-agent"]').wait_for(timeout=WAIT_MS)
        assert "browser-agent" in app.daemon.agents

        row = dashboard.locator('#agents tr[data-agent="browser-agent"]')
        row.wait_for(timeout=WAIT_MS)  # the dashboard's polling brought it in
        assert dashboard.evaluate("window.sameDocument === true")  # without a reload
        assert "tiny" in row.inner_text()
        assert dashboard.locator('#models tr[data-model="tiny"] .state').inner_text() == "loaded"
        dashboard.screenshot(path=str(tmp_path / "dashboard-desktop.png"), full_page=True)
        dashboard.set_viewport_size(PHONE)
        dashboard.screenshot(path=str(tmp_path / "dashboard-375px.png"), full_page=True)
        assert (tmp_path / "dashboard-desktop.png").stat().st_size > 0
        assert (tmp_path / "dashboard-375px.png").stat().st_size > 0
    finally:
        problems.stop()
        context.close()
    assert problems.seen == []


def test_a_ledger_denial_is_rendered_inline(app, browser, problems: Problems) -> None:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport=DESKTOP)
    try:
        page = problems.watch(context.new_page())
        page.goto(app.appliance.http_url + "/admin/registry")
        page.fill("#register-form input[name=agent]", "too-big")
        page.select_option("#register-model", "huge")
        page.click("#register-form button[type=submit]")
        result = page.locator('#register-result [data-outcome="VRAM_LEDGER_DENY"]')
        result.wait_for(timeout=WAIT_MS)
        ledger = app.daemon.ledger
        assert page.inner_text('[data-figure="requested"] strong') == str(HUGE_BYTES)
        assert page.inner_text('[data-figure="allocated"] strong') == str(ledger.allocated)
        assert page.inner_text('[data-figure="cap"] strong') == str(ledger.cap)
        assert "VRAM_LEDGER_DENY" in result.inner_text() and "too-big" not in app.daemon.agents
    finally:
        problems.stop()
        context.close()
    assert problems.seen == []


def test_resync_shows_the_reading_before_and_after(app, browser, problems: Problems) -> None:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport=DESKTOP)
    try:
        page = problems.watch(context.new_page())
        page.goto(app.appliance.http_url + "/admin/device")
        app.daemon.device.set_used(1024**3)  # another process took 1 GiB
        page.click("#resync-button")
        page.locator("#resync-table").wait_for(timeout=WAIT_MS)
        cells = page.locator('#resync-table tr[data-figure="used"] td').all_inner_texts()
        assert cells == ["Used", "0 bytes", "1.0 GiB", "+1.0 GiB"]
        external = page.locator('#resync-table tr[data-figure="external"] td').all_inner_texts()
        assert external[1:3] == ["0 bytes", "1.0 GiB"]
    finally:
        problems.stop()
        context.close()
    assert problems.seen == []


def test_a_stale_csrf_token_is_refused_and_said_so(app, browser, problems: Problems) -> None:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport=DESKTOP)
    try:
        page = problems.watch(context.new_page())
        page.goto(app.appliance.http_url + "/admin/registry")
        page.evaluate("""document.body.setAttribute("hx-headers", '{"X-CSRF-Token": "from-before-a-restart"}')""")
        page.fill("#register-form input[name=agent]", "stale")
        page.select_option("#register-model", "tiny")
        page.click("#register-form button[type=submit]")
        page.locator('#register-result [data-outcome="refused"]').wait_for(timeout=WAIT_MS)
        text = page.inner_text("#register-result")
        assert "FORBIDDEN" in text and "CSRF" in text and "reload the page" in text
        assert "stale" not in app.daemon.agents
    finally:
        problems.stop()
        context.close()
    refused = [seen for seen in problems.seen if "HTTP 403" in seen]
    assert len(refused) == 1 and refused[0].endswith("/admin/registry/register"), problems.seen


RECORD_STREAM = """() => {
    window.streamed = [];
    const log = document.getElementById("chat-log");
    new MutationObserver(() => {
        const reply = log.querySelector(".message-assistant");
        if (reply && reply.dataset.state === "streaming") {
            const text = reply.querySelector(".text").textContent;
            if (text && window.streamed[window.streamed.length - 1] !== text) {
                window.streamed.push(text);
            }
        }
    }).observe(log, {subtree: true, childList: true, characterData: true, attributes: true});
}"""
"""Records each distinct text of the assistant's reply while it is still streaming (its DOM updates)."""


def test_a_chat_message_streams_its_tokens(app, browser, problems: Problems) -> None:  # type: ignore[no-untyped-def]
    app.engine.delay_s = 0.1  # each token waits: the stream takes about 2 s
    context = browser.new_context(viewport=DESKTOP)
    try:
        page = problems.watch(context.new_page())
        page.goto(app.appliance.http_url + "/admin/chat")
        page.evaluate(RECORD_STREAM)
        page.select_option("#chat-model", "tiny")
        page.fill("#chat-max-tokens", "16")
        page.fill("#chat-temperature", "0")
        page.fill("#chat-message", "Say something")
        page.click("#chat-send")
        page.locator('#chat-status[data-state="done"], #chat-status[data-state="error"]').wait_for(timeout=60_000)
        status = page.inner_text("#chat-status")
        assert page.get_attribute("#chat-status", "data-state") == "done", status
        reply = page.inner_text(".message-assistant .text")
        streamed = page.evaluate("window.streamed")
        assert len(streamed) >= 2, streamed  # at least two DOM updates before the end
        assert reply.startswith(streamed[0]) and len(reply) >= len(streamed[-1]) > len(streamed[0])
        assert "generated" in status
    finally:
        problems.stop()
        context.close()
    assert problems.seen == []


def test_every_page_fits_a_phone_screen(app, browser, problems: Problems) -> None:  # type: ignore[no-untyped-def]
    app.call(app.daemon.register("a-rather-long-agent-identifier-0123456789", "tiny"))
    context = browser.new_context(viewport=PHONE)
    try:
        page = problems.watch(context.new_page())
        for path in PAGES:
            page.goto(app.appliance.http_url + path)
            widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert widths[0] <= widths[1], (path, widths)  # no horizontal scroll
    finally:
        problems.stop()
        context.close()
    assert problems.seen == []
