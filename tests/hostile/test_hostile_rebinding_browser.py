"""DNS rebinding in a real headless Chromium (Debian's ``/usr/bin/chromium`` driven by Playwright, as
tests/test_admin_browser.py does): the attacker's page is served from ``http://evil.test:PORT`` on the appliance's
own port, and Chromium resolves ``evil.test`` to 127.0.0.1 (``--host-resolver-rules``), so the page's requests
are same-origin for the browser and reach the appliance. Chromium's own Private Network Access checks are turned
off: they exist only in recent Chromium, and the appliance must refuse on its own (Firefox and Safari have none).

What was seen before the fix: the page read the admin page and ``/v1/models`` and its POSTs (with the CSRF token)
registered an agent, loaded a model and ran a chat completion. The last case logs in and out under the login page's
Content Security Policy (no logout existed before)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import running

CHROMIUM = Path("/usr/bin/chromium")
REBOUND = "evil.test"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1",
                 "--disable-features=LocalNetworkAccessChecks,PrivateNetworkAccessSendPreflights,"
                 "PrivateNetworkAccessRespectPreflightResults,BlockInsecurePrivateNetworkRequests"]
WAIT_MS = 30_000
ATTACKER_PAGE = "<!doctype html><html><head><title>cute cats</title></head><body>cats</body></html>"

READ_MODELS = "async () => { const r = await fetch('/v1/models'); return [r.status, await r.json()]; }"
ATTACK = """async ({csrf}) => {
  const form = {"Content-Type": "application/x-www-form-urlencoded", "X-CSRF-Token": csrf};
  const chat = JSON.stringify({model: "demo", messages: [{role: "user", content: "hi"}], max_tokens: 2});
  const attempts = {
    admin: ["/admin/", {}],
    models: ["/v1/models", {}],
    register: ["/admin/registry/register", {method: "POST", headers: form, body: "agent=rebound&model=demo"}],
    load: ["/admin/registry/load", {method: "POST", headers: form, body: "model=demo-b"}],
    reload: ["/admin/config/reload", {method: "POST", headers: form, body: ""}],
    chat: ["/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"}, body: chat}],
  };
  const seen = {};
  for (const [name, [path, init]] of Object.entries(attempts)) {
    try {
      const response = await fetch(path, init);
      seen[name] = {status: response.status, body: (await response.text()).slice(0, 4000)};
    } catch (error) {
      seen[name] = {status: 0, body: String(error)};
    }
  }
  return seen;
}"""


@pytest.fixture(scope="module")
def rebinding_browser() -> Iterator[Any]:
    """Chromium resolving :data:`REBOUND` to 127.0.0.1; one per module (Playwright's sync API holds an event loop)."""
    if not CHROMIUM.exists():
        pytest.fail(f"Debian's chromium is missing ({CHROMIUM}): run scripts/setup.sh test")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def browser_page(rebinding_browser: Any) -> Iterator[Any]:
    """A page in a fresh browser context. A case asks for it before ``hostile``, so that the renderer starts before
    the prober times health (on a 2-core box it competes with the appliance for the CPU while it starts)."""
    context = rebinding_browser.new_context()
    try:
        page = context.new_page()
        page.goto("about:blank")
        yield page
    finally:
        context.close()


def serve_attacker_page(route: Any) -> None:
    """The attacker's own server answering for its page before the name is rebound."""
    route.fulfill(status=200, content_type="text/html", body=ATTACKER_PAGE)


def console_errors(page: Any) -> list[str]:
    """The console errors ``page`` logs from now on (a Content Security Policy violation is one)."""
    seen: list[str] = []

    def record(message: Any) -> None:
        if message.type == "error":
            seen.append(message.text)

    page.on("console", record)
    return seen


def server_side(hostile: Any) -> dict[str, Any]:
    appliance = hostile.app.appliance
    daemon = hostile.app.daemon
    return {"agents": sorted(daemon.agents), "models": {name: daemon.model_state(name) for name in ("demo", "demo-b")},
            "config_file": appliance.config_path.read_bytes(), "config": id(appliance.config),
            "benchmark": appliance.benchmark_job.state,
            "openai_requests": sum(record.surface == "openai" for record in daemon.requests.recent(200))}


@pytest.mark.hostile_config(watch=True)  # a config file on disk, so that a reload or applied advice would show
def test_a_page_on_a_rebound_name_can_neither_read_nor_change_the_appliance(browser_page, hostile) -> None:
    url = hostile.http
    port = int(url.rsplit(":", 1)[1])
    csrf = hostile.app.appliance.csrf_token
    before = server_side(hostile)
    browser_page.route(f"http://{REBOUND}:{port}/cats", serve_attacker_page)
    browser_page.goto(f"http://{REBOUND}:{port}/cats")
    assert browser_page.evaluate("location.origin") == f"http://{REBOUND}:{port}"
    seen = browser_page.evaluate(ATTACK, {"csrf": csrf})  # the worst case: the attacker even knows the CSRF token
    for name, answer in seen.items():
        assert answer["status"] == 403, (name, answer)
        error = json.loads(answer["body"])["error"]
        assert error["code"] == "FORBIDDEN" and error["details"] == {"host": REBOUND}, (name, error)
        assert csrf not in answer["body"]
    assert server_side(hostile) == before


@pytest.mark.hostile_config(watch=True)
def test_the_admin_page_on_its_own_address_still_works(browser_page, hostile) -> None:
    browser_page.goto(hostile.http + "/admin/registry")
    browser_page.fill("#register-form input[name=agent]", "legit")
    browser_page.select_option("#register-model", "demo")
    browser_page.click("#register-form button[type=submit]")
    browser_page.locator('#register-result [data-outcome="ok"]').wait_for(timeout=WAIT_MS)
    models = browser_page.evaluate(READ_MODELS)
    assert "legit" in hostile.app.daemon.agents
    assert models[0] == 200 and "demo" in [model["id"] for model in models[1]["data"]]


def test_the_login_page_works_under_its_policy_and_logout_ends_the_session(record_case, rebinding_browser,
                                                                           tiny_model: Path) -> None:
    token = "browser-login-token"
    with running({"demo": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"host": "127.0.0.1", "port": 0, "api_token": token}) as app:
        url = app.appliance.http_url
        context = rebinding_browser.new_context()
        try:
            page = context.new_page()
            violations = console_errors(page)
            page.goto(url + "/admin/")
            assert page.url == url + "/admin/login"
            assert page.evaluate("getComputedStyle(document.body).maxWidth") == "384px"  # its style ran (24rem)
            page.fill("input[name=token]", token)
            page.click("button[type=submit]")
            page.wait_for_url(url + "/admin/", timeout=WAIT_MS)
            page.click("#logout-button")
            page.wait_for_url(url + "/admin/login", timeout=WAIT_MS)
            assert [cookie["name"] for cookie in context.cookies()] == []
            page.goto(url + "/admin/")
            assert page.url == url + "/admin/login"  # the session is gone
        finally:
            context.close()
        record_case()
    assert violations == []
