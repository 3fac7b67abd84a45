"""The admin page's operator actions over real HTTP (httpx) against a real appliance: the per-row Load / Unload /
Unregister buttons (refused without the CSRF token; each changes the daemon and answers its table's fragment with
the result out of band), the model pickers (models, aliases, unconfigured GGUF files), the memory bar's name by
device kind, and the live log tail (new lines followed, nothing resent while nothing is new, secrets redacted,
HTML escaped); and :class:`~appliance.supervisor.logtail.LogTail` itself."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import httpx
import pytest
from harness import running

from appliance.config.secrets import REDACTED
from appliance.supervisor.logtail import LogTail

TOKEN = "admin-actions-token-0123456789"
HUGE_BYTES = 64 * 1024**3  # over any cap on the fake 8 GiB device


@pytest.fixture
def app(model_dir: Path):  # type: ignore[no-untyped-def]
    specs = {"tiny": {"path": str(model_dir / "tiny.gguf"), "aliases": ["gpt-4.1"]},
             "huge": {"path": str(model_dir / "tiny.gguf"), "vram_bytes": HUGE_BYTES}}
    with running(specs, model_dirs=[model_dir]) as running_app:
        yield running_app


def post(app, path: str, data: dict[str, str], csrf: bool = True) -> httpx.Response:  # type: ignore[no-untyped-def]
    url = app.appliance.http_url
    headers = {"Origin": url, "HX-Request": "true"}
    if csrf:
        headers["X-CSRF-Token"] = app.appliance.csrf_token
    return httpx.post(url + path, data=data, headers=headers, timeout=120)


def row(html: str, attribute: str, key: str) -> str:
    """The table row ``<tr data-ATTRIBUTE="KEY">`` of ``html``."""
    start = html.index(f'<tr data-{attribute}="{key}">')
    return html[start:html.index("</tr>", start)]


def test_a_row_button_needs_the_csrf_token(app) -> None:  # type: ignore[no-untyped-def]
    for path in ("/admin/_dashboard/load", "/admin/registry/_tables/load"):
        refused = post(app, path, {"model": "tiny"}, csrf=False)
        assert refused.status_code == 403 and "CSRF" in refused.json()["error"]["message"]
    assert app.daemon.model_state("tiny") == "available"


def test_the_dashboard_rows_load_unload_and_unregister(app) -> None:  # type: ignore[no-untyped-def]
    url = app.appliance.http_url
    html = httpx.get(url + "/admin/").text
    assert 'data-action="load" hx-post="/admin/_dashboard/load"' in row(html, "model", "tiny")
    assert '<div id="row-result" class="result-area"' in html

    loaded = post(app, "/admin/_dashboard/load", {"model": "tiny"})
    assert loaded.status_code == 200 and loaded.headers["x-appliance-outcome"] == "ok"
    assert app.daemon.model_state("tiny") == "loaded"
    fragment = loaded.text
    assert fragment.startswith('<div id="dashboard"') and "<html" not in fragment  # the table's fragment
    assert 'data-action="unload"' in row(fragment, "model", "tiny")
    assert '<div id="row-result" class="result-area" aria-live="polite" hx-swap-oob="true">' in fragment
    assert "Model tiny loaded" in fragment

    denied = post(app, "/admin/_dashboard/load", {"model": "huge"})
    assert denied.headers["x-appliance-outcome"] == "VRAM_LEDGER_DENY"
    assert '<dd data-figure="requested"><strong>68719476736</strong> bytes' in denied.text
    assert app.daemon.model_state("huge") == "available" and 'id="dashboard"' in denied.text

    app.call(app.daemon.register("agent-1", "tiny"))
    busy = post(app, "/admin/_dashboard/unload", {"model": "tiny"})
    assert busy.headers["x-appliance-outcome"] == "MODEL_BUSY" and "agent-1" in busy.text
    assert app.daemon.model_state("tiny") == "loaded"
    assert 'data-action="unregister"' in row(busy.text, "agent", "agent-1")

    gone = post(app, "/admin/_dashboard/unregister", {"agent": "agent-1"})
    assert gone.headers["x-appliance-outcome"] == "ok" and "Agent agent-1 unregistered." in gone.text
    assert "agent-1" not in app.daemon.agents and app.daemon.model_state("tiny") == "available"  # its last agent
    assert "No agents are registered." in gone.text
    assert post(app, "/admin/_dashboard/unregister", {"agent": "agent-1"}).headers[
        "x-appliance-outcome"] == "UNKNOWN_AGENT"
    assert post(app, "/admin/_dashboard/unregister", {"agent": "bad id!"}).headers[
        "x-appliance-outcome"] == "BAD_REQUEST"

    post(app, "/admin/_dashboard/load", {"model": "tiny"})
    unloaded = post(app, "/admin/_dashboard/unload", {"model": "tiny"})
    assert unloaded.headers["x-appliance-outcome"] == "ok" and "Model tiny unloaded." in unloaded.text
    assert app.daemon.model_state("tiny") == "available" and app.daemon.ledger.allocated == 0
    assert 'data-action="load"' in row(unloaded.text, "model", "tiny")


def test_the_registry_rows_answer_the_registry_tables(app) -> None:  # type: ignore[no-untyped-def]
    url = app.appliance.http_url
    app.call(app.daemon.register("agent-1", "tiny"))
    html = httpx.get(url + "/admin/registry").text
    assert 'hx-post="/admin/registry/_tables/unregister"' in row(html, "agent", "agent-1")
    gone = post(app, "/admin/registry/_tables/unregister", {"agent": "agent-1"})
    assert gone.headers["x-appliance-outcome"] == "ok" and gone.text.startswith('<div id="registry-tables"')
    assert "agent-1" not in app.daemon.agents
    loaded = post(app, "/admin/registry/_tables/load", {"model": "gpt-4.1"})  # an alias names its model
    assert loaded.headers["x-appliance-outcome"] == "ok" and app.daemon.model_state("tiny") == "loaded"
    assert 'hx-post="/admin/registry/_tables/unload"' in row(loaded.text, "model", "tiny")


def test_the_pickers_offer_models_aliases_and_unconfigured_files(app, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    url = app.appliance.http_url
    shutil.copy(model_dir / "tiny_b.gguf", model_dir / "spare.gguf")
    (model_dir / "notes.txt").write_text("not a model")
    registry = httpx.get(url + "/admin/registry").text
    picker = registry[registry.index('<select name="model" id="register-model" required>'):]
    picker = picker[:picker.index("</select>")]
    assert re.findall(r'<optgroup label="([^"]+)">', picker) == ["Models", "Aliases", "GGUF files in model_dirs"]
    values = re.findall(r'<option value="([^"]+)"', picker)
    assert values == ["tiny", "huge", "gpt-4.1", str(model_dir / "spare.gguf"), str(model_dir / "tiny_b.gguf")]
    assert "gpt-4.1 \u2192 tiny" in picker  # an alias shows its model
    assert 'id="load-model"' in registry and 'id="unload-model"' in registry
    registered = post(app, "/admin/registry/register", {"agent": "by-file", "model": str(model_dir / "spare.gguf")})
    assert registered.headers["x-appliance-outcome"] == "ok"
    chat = httpx.get(url + "/admin/chat").text
    chat_picker = chat[chat.index('id="chat-model"'):chat.index("</select>", chat.index('id="chat-model"'))]
    assert re.findall(r'<option value="([^"]+)"', chat_picker) == ["tiny", "huge", "gpt-4.1"]  # no files


def test_the_memory_bar_is_named_by_the_device(tiny_model: Path) -> None:
    for device, heading, memory in (("fake:8GiB", "VRAM ledger", "device memory"), ("host", "Ledger", "host RAM")):
        with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], device=device) as app:
            html = httpx.get(app.appliance.http_url + "/admin/_dashboard").text
            assert f'<h2 id="ledger-heading">{heading}</h2>' in html, device
            assert f"% of the {memory}, less other processes' use" in html
            assert f'aria-label="{memory}: ' in html


def test_the_log_tail_follows_new_lines_escaped_and_without_secrets(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"api_token": TOKEN}) as app:
        url = app.appliance.http_url
        auth = {"Authorization": f"Bearer {TOKEN}"}
        page = httpx.get(url + "/admin/", headers=auth).text
        assert '<section id="log-tail"' in page and "appliance 0." in page  # its start-up line
        first = httpx.get(url + "/admin/_log", headers=auth)
        newest = int(re.findall(r'data-seq="(\d+)"', first.text)[-1])
        assert f'hx-get="/admin/_log?seen={newest}"' in first.text
        assert httpx.get(url + f"/admin/_log?seen={newest}", headers=auth).status_code == 204  # nothing new
        logging.getLogger("appliance.test").warning("token %s in <script>alert(1)</script>", TOKEN)
        followed = httpx.get(url + f"/admin/_log?seen={newest}", headers=auth)
        assert followed.status_code == 200
        last = followed.text[followed.text.rindex('<li class="log-line'):]
        assert "log-warning" in last and "appliance.test" in last
        assert f"token {REDACTED} in &lt;script&gt;alert(1)&lt;/script&gt;" in last
        assert TOKEN not in followed.text and "<script>alert" not in followed.text
        assert httpx.get(url + "/admin/_log").status_code == 401  # the token guards it like every page


def test_the_tail_keeps_the_newest_lines_numbered_and_stops_at_detach() -> None:
    tail = LogTail(capacity=3)
    logger = logging.getLogger("appliance.tail-test")
    logger.setLevel(logging.INFO)
    tail.attach("appliance.tail-test")
    try:
        for n in range(5):
            logger.info("line %d", n)
        assert [(line.seq, line.message) for line in tail.lines()] == [(3, "line 2"), (4, "line 3"), (5, "line 4")]
        assert [line.seq for line in tail.lines(after=4)] == [5] and tail.last_seq == 5
        logger.info("x" * 5000)
        assert len(tail.lines()[-1].message) == 2000 and tail.lines()[-1].message.endswith("\u2026")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
        assert "ValueError: boom" in tail.lines()[-1].message and tail.lines()[-1].level == "ERROR"
    finally:
        tail.detach()
    logger.info("after")
    assert tail.last_seq == 7 and tail.lines()[-1].message.startswith("failed")


def test_the_add_model_form_adds_a_file_of_model_dirs_to_the_config_and_reloads(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir], watch=True) as app:
        url = app.appliance.http_url
        registry = httpx.get(url + "/admin/registry").text
        picker = registry[registry.index('id="add-model-file"'):]
        assert re.findall(r'<option value="([^"]+)"', picker[:picker.index("</select>")]) == \
            [str(model_dir / "tiny_b.gguf")]  # the one file no model is configured with
        before = app.config_file.read_text()
        assert post(app, "/admin/registry/add-model", {"file": str(model_dir / "tiny_b.gguf")}, csrf=False) \
            .status_code == 403
        refusals = [
            ({"file": str(model_dir.parent / "elsewhere.gguf")}, "FORBIDDEN", "inside a model_dirs folder"),
            ({"file": str(model_dir / "tiny_b.gguf"), "name": "tiny"}, "MODEL_EXISTS", "already configured"),
            ({"file": str(model_dir / "tiny_b.gguf"), "n_ctx": "lots"}, "BAD_REQUEST", "n_ctx must be an integer"),
            ({"file": str(model_dir / "tiny_b.gguf"), "n_ctx": "8"}, "BAD_REQUEST", "n_ctx must be an integer"),
            ({"file": str(model_dir / "tiny_b.gguf"), "name": "bad name!"}, "BAD_REQUEST", "model name"),
            ({"name": "b"}, "BAD_REQUEST", "file is required"),
        ]
        for fields, code, message in refusals:
            refused = post(app, "/admin/registry/add-model", fields)
            assert refused.headers["x-appliance-outcome"] == code and message in refused.text, (fields, refused.text)
        assert app.config_file.read_text() == before  # nothing written

        added = post(app, "/admin/registry/add-model", {"file": str(model_dir / "tiny_b.gguf"), "name": "second",
                                                        "n_ctx": "512"})
        assert added.headers["x-appliance-outcome"] == "ok", added.text
        assert "Model second added to" in added.text and "the config was reloaded" in added.text
        assert added.headers["hx-trigger"] == "appliance-changed"
        text = app.config_file.read_text()
        assert text.startswith(before.rstrip("\n")) and "name: second" in text and "n_ctx: 512" in text
        spec = app.appliance.config.model("second")
        assert spec is not None and spec.n_ctx == 512 and spec.path == model_dir / "tiny_b.gguf"
        assert post(app, "/admin/registry/register", {"agent": "on-second", "model": "second"}).headers[
            "x-appliance-outcome"] == "ok"
        reloads = [(record["trigger"], record["result"]) for record in app.appliance.reloader.history.to_list()]
        assert ("api", "applied") in reloads or ("file", "applied") in reloads, reloads  # before the answer
        again = httpx.get(url + "/admin/registry").text
        assert 'id="add-model-none"' in again  # no unconfigured file is left


def test_without_a_config_file_the_add_model_form_says_why(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        assert "there is no file to add a model to" in httpx.get(app.appliance.http_url + "/admin/registry").text
        refused = post(app, "/admin/registry/add-model", {"file": str(model_dir / "tiny_b.gguf")})
        assert refused.headers["x-appliance-outcome"] == "BAD_REQUEST" and "without a config file" in refused.text
