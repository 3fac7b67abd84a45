"""The admin page (SPEC W4) over real HTTP with httpx against a real appliance: every page renders with its figures,
the registry's forms act and show a structured error inline (a ledger denial's exact figures), the device resync
shows before and after, the config page shows the file (never the API token) and its reload record; and the
W5 guards: no CSRF header or a cross-origin POST -> 403, with ``api_token`` no token -> 401, login -> pages work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from harness import running

from appliance.http.admin import figures

TOKEN = "admin-page-test-token-0123456789"
HUGE_BYTES = 64 * 1024**3  # over any cap on the fake 8 GiB device


def models(tiny_model: Path) -> dict[str, dict]:
    return {"tiny": {"path": str(tiny_model)}, "huge": {"path": str(tiny_model), "vram_bytes": HUGE_BYTES}}


@pytest.fixture
def app(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running(models(tiny_model), model_dirs=[tiny_model.parent], watch=True) as running_app:
        yield running_app


def post(app, path: str, data: dict[str, str] | None = None) -> httpx.Response:  # type: ignore[no-untyped-def]
    """A same-origin admin POST with the page's CSRF header, as htmx sends it."""
    url = app.appliance.http_url
    headers = {"Origin": url, "X-CSRF-Token": app.appliance.csrf_token, "HX-Request": "true"}
    return httpx.post(url + path, data=data, headers=headers, timeout=60)


def test_every_page_renders_with_its_figures(app) -> None:  # type: ignore[no-untyped-def]
    url = app.appliance.http_url
    app.call(app.daemon.register("agent-1", "tiny"))
    daemon = app.daemon
    root = httpx.get(url + "/")
    assert root.status_code == 307 and root.headers["location"] == "/admin/"

    dashboard = httpx.get(url + "/admin/")
    assert dashboard.status_code == 200
    html = dashboard.text
    assert f'hx-headers=\'{{"X-CSRF-Token": "{app.appliance.csrf_token}"}}\'' in html
    assert '<script src="/static/htmx.min.js"' in html and "default-src 'self'" in dashboard.headers[
        "content-security-policy"]
    assert figures.format_bytes(daemon.ledger.cap) in html and figures.format_bytes(daemon.reading.total) in html
    tiny = daemon.models["tiny"]
    first = next(iter(daemon.ledger.reservations().values()))  # the model's context, then its weights
    assert f'<rect class="seg-model-0" x="0.0" y="0" width="{round(100 * first / daemon.reading.total, 3)}"' \
        in html  # the ledger bar: each reservation as a share of the device
    assert '<tr data-model="tiny">' in html and figures.format_bytes(tiny.estimate) in html
    assert '<tr data-agent="agent-1">' in html and "none yet" in html
    assert 'hx-get="/admin/_dashboard" hx-trigger="every 2s"' in html

    partial = httpx.get(url + "/admin/_dashboard")
    assert partial.status_code == 200 and "<html" not in partial.text and '<tr data-agent="agent-1">' in partial.text

    pages = {"/admin/registry": ['<form id="register-form" hx-post="/admin/registry/register"',
                                 '<tr data-agent="agent-1"><td>agent-1</td><td>tiny</td>',
                                 '<optgroup label="Models">', '<option value="tiny">tiny</option>'],
             "/admin/device": ['id="resync-button"', figures.format_bytes(daemon.reading.total)],
             "/admin/config": ["The file is valid", "No reloads yet.", "vram_bytes: 68719476736"],
             "/admin/benchmarks": ["No benchmark results are saved yet."],
             "/admin/chat": ['<option value="tiny">tiny</option>', '<script src="/static/chat.js"']}
    for path, expected in pages.items():
        response = httpx.get(url + path)
        assert response.status_code == 200, path
        for text in expected:
            assert text in response.text, (path, text)
    for asset in ("/static/htmx.min.js", "/static/admin.css", "/static/chat.js"):
        assert httpx.get(url + asset).status_code == 200, asset


def test_the_dashboard_shows_where_kv_lives_the_requests_and_an_idle_countdown(tiny_model: Path) -> None:
    spec = {"tiny": {"path": str(tiny_model), "idle_ttl_s": 600}}
    with running(spec, model_dirs=[tiny_model.parent], engine={"live_slots": 1}) as app:
        url = app.appliance.http_url
        app.call(app.daemon.register("agent-1", "tiny"))
        app.call(app.daemon.register("agent-2", "tiny"))
        assert "<td>held</td>" in httpx.get(url + "/admin/_dashboard").text
        app.line("DECODE agent-1 4 hello there")
        app.line("DECODE agent-2 4 good morning")  # agent-1's KV is parked in host RAM
        parked = app.daemon.agents["agent-1"].conversation
        assert parked.where == "host" and parked.nbytes > 0
        html = httpx.get(url + "/admin/_dashboard").text
        row = html[html.index('<tr data-agent="agent-1">'):]
        row = row[:row.index("</tr>")]
        assert "<td>in host RAM</td>" in row and f"<td>{figures.format_bytes(parked.nbytes)}</td>" in row
        assert "on device" in html[html.index('<tr data-agent="agent-2">'):]
        app.call(app.daemon.unregister("agent-1"))
        app.call(app.daemon.unregister("agent-2"))
        html = httpx.get(url + "/admin/_dashboard").text
        assert "No agents are registered." in html and "No requests yet." not in html
        assert "<td>lines</td><td>tiny</td><td>agent-1</td>" in html  # the request's record
        assert post(app, "/admin/registry/load", {"model": "tiny"}).headers["x-appliance-outcome"] == "ok"
        html = httpx.get(url + "/admin/_dashboard").text  # loaded without agents: the idle TTL runs
        assert re.search(r"<td>(9 min [0-5]?[0-9] s|10 min 0 s)</td>", html), html


def test_the_registry_forms_act_and_show_errors_inline(app) -> None:  # type: ignore[no-untyped-def]
    daemon = app.daemon
    registered = post(app, "/admin/registry/register", {"agent": "agent-1", "model": "tiny"})
    assert registered.status_code == 200 and registered.headers["x-appliance-outcome"] == "ok"
    assert "Agent agent-1 registered on model tiny." in registered.text
    assert registered.headers["hx-trigger"] == "appliance-changed"  # the page's tables refresh
    assert "agent-1" in daemon.agents

    allocated, cap = daemon.ledger.allocated, daemon.ledger.cap
    denied = post(app, "/admin/registry/register", {"agent": "agent-2", "model": "huge"})
    assert denied.status_code == 200 and denied.headers["x-appliance-outcome"] == "VRAM_LEDGER_DENY"
    for name, value in (("requested", HUGE_BYTES), ("allocated", allocated), ("cap", cap)):
        assert f'<dd data-figure="{name}"><strong>{value}</strong> bytes' in denied.text, name
    assert "agent-2" not in daemon.agents and "hx-trigger" not in denied.headers

    busy = post(app, "/admin/registry/unload", {"model": "tiny"})
    assert busy.headers["x-appliance-outcome"] == "MODEL_BUSY" and "agent-1" in busy.text
    assert daemon.model_state("tiny") == "loaded"
    exists = post(app, "/admin/registry/register", {"agent": "agent-1", "model": "tiny"})
    assert exists.headers["x-appliance-outcome"] == "AGENT_EXISTS"
    for fields in ({"agent": "bad id!", "model": "tiny"}, {"agent": "", "model": "tiny"}, {"agent": "x" * 65}):
        bad = post(app, "/admin/registry/register", fields)
        assert bad.status_code == 200 and bad.headers["x-appliance-outcome"] == "BAD_REQUEST", fields
    unknown = post(app, "/admin/registry/register", {"agent": "agent-3", "model": "nope"})
    assert unknown.headers["x-appliance-outcome"] == "UNKNOWN_MODEL" and "nope" in unknown.text
    huge_form = post(app, "/admin/registry/register", {"agent": "a", "model": "m" * 10_000})
    assert huge_form.headers["x-appliance-outcome"] == "BAD_REQUEST" and "8192" in huge_form.text

    unregistered = post(app, "/admin/registry/unregister", {"agent": "agent-1"})
    assert unregistered.headers["x-appliance-outcome"] == "ok" and not daemon.agents
    assert daemon.model_state("tiny") == "available"  # its last agent left (L4)
    assert post(app, "/admin/registry/unregister", {"agent": "agent-1"}).headers[
        "x-appliance-outcome"] == "UNKNOWN_AGENT"

    loaded = post(app, "/admin/registry/load", {"model": "tiny"})
    assert loaded.headers["x-appliance-outcome"] == "ok" and daemon.model_state("tiny") == "loaded"
    assert post(app, "/admin/registry/load", {"model": "huge"}).headers["x-appliance-outcome"] == "VRAM_LEDGER_DENY"
    unloaded = post(app, "/admin/registry/unload", {"model": "tiny"})
    assert unloaded.headers["x-appliance-outcome"] == "ok" and daemon.model_state("tiny") == "available"
    assert daemon.ledger.allocated == 0
    tables = httpx.get(app.appliance.http_url + "/admin/registry/_tables")
    assert "No agents are registered." in tables.text and 'hx-trigger="appliance-changed from:body"' in tables.text


def test_resync_shows_the_reading_before_and_after(app) -> None:  # type: ignore[no-untyped-def]
    device = app.daemon.device
    cap_before = app.daemon.ledger.cap
    device.set_used(2 * 1024**3)  # another process took 2 GiB
    response = post(app, "/admin/device/resync")
    assert response.status_code == 200 and response.headers["x-appliance-outcome"] == "ok"
    html = response.text
    assert '<tr data-figure="used"><td>Used</td><td>0 bytes</td><td>2.0 GiB</td>' in html
    assert '<tr data-figure="external"><td>Other processes</td><td>0 bytes</td><td>2.0 GiB</td>' in html
    assert app.daemon.ledger.cap == cap_before - 2 * 1024**3
    assert (f"<td>{figures.format_bytes(cap_before)}</td><td>{figures.format_bytes(app.daemon.ledger.cap)}</td>"
            in html)


def test_the_config_page_shows_validity_and_the_reload_record(app) -> None:  # type: ignore[no-untyped-def]
    url = app.appliance.http_url
    original = app.config_file.read_text()
    reloaded = post(app, "/admin/config/reload")
    assert reloaded.headers["x-appliance-outcome"] == "ok" and "Reload (api) unchanged in" in reloaded.text
    app.edit(original.replace("vram_bytes: 68719476736", "vram_bytes: lots"))
    refused = post(app, "/admin/config/reload")
    assert refused.headers["x-appliance-outcome"] == "CONFIG_INVALID" and "vram_bytes" in refused.text
    page = httpx.get(url + "/admin/config").text
    assert "The file on disk is invalid" in page and "runs its last valid config" in page
    assert "vram_bytes: lots" in page  # the file on disk, said to be not what runs
    assert page.index("<strong>invalid</strong> (api)") < page.index("<strong>unchanged</strong> (api)")  # newest first


def test_the_config_page_never_shows_the_api_token(tiny_model: Path) -> None:
    with running(models(tiny_model), model_dirs=[tiny_model.parent], watch=True,
                 http_settings={"api_token": TOKEN}) as app:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        page = httpx.get(app.appliance.http_url + "/admin/config", headers=headers)
        assert page.status_code == 200 and "api_token:" in page.text
        assert TOKEN not in page.text and "(hidden)" in page.text


def test_saved_benchmark_results_are_listed(app) -> None:  # type: ignore[no-untyped-def]
    folder = app.appliance.config.data_dir / "benchmarks"
    folder.mkdir()
    (folder / "http.json").write_text(json.dumps({"benchmark": "http", "headline": "HEADLINE: <b>fast</b>"}))
    (folder / "broken.json").write_text("{not json")
    page = httpx.get(app.appliance.http_url + "/admin/benchmarks").text
    assert "<td>http</td>" in page and "HEADLINE: &lt;b&gt;fast&lt;/b&gt;" in page  # escaped
    assert "broken.json" in page and "not readable JSON" in page


def test_a_post_without_the_csrf_header_or_from_another_origin_is_refused(app) -> None:  # type: ignore[no-untyped-def]
    url = app.appliance.http_url
    form = {"agent": "agent-1", "model": "tiny"}
    for path in ("/admin/registry/register", "/admin/device/resync", "/admin/config/reload"):
        missing = httpx.post(url + path, data=form, headers={"Origin": url})
        assert missing.status_code == 403 and missing.json()["error"]["code"] == "FORBIDDEN", path
        other = httpx.post(url + path, data=form,
                           headers={"Origin": "http://evil.example", "X-CSRF-Token": app.appliance.csrf_token})
        assert other.status_code == 403 and other.json()["error"]["message"] == "cross-origin request refused"
    assert not app.daemon.agents


def test_with_an_api_token_the_pages_work_after_logging_in(tiny_model: Path) -> None:
    with running(models(tiny_model), model_dirs=[tiny_model.parent], http_settings={"api_token": TOKEN}) as app:
        url = app.appliance.http_url
        for path in ("/admin/", "/admin/_dashboard", "/admin/registry", "/admin/chat", "/static/htmx.min.js"):
            refused = httpx.get(url + path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "UNAUTHORIZED", path
        with httpx.Client(base_url=url, timeout=60) as browser:
            login = browser.post("/admin/login", data={"token": TOKEN}, headers={"Origin": url})
            assert login.status_code == 303 and login.headers["location"] == "/admin/"
            assert browser.get("/admin/").status_code == 200
            headers = {"Origin": url, "X-CSRF-Token": app.appliance.csrf_token}
            registered = browser.post("/admin/registry/register", data={"agent": "a1", "model": "tiny"},
                                      headers=headers)
            assert registered.headers["x-appliance-outcome"] == "ok" and "a1" in app.daemon.agents
            assert TOKEN not in browser.get("/admin/config").text
