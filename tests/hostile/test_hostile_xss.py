"""XSS probes: markup through every way a value reaches the admin page (issue: "the rest of this round's cases").

The values a client, an operator or a file controls are shown on the admin pages: agent ids (the id rule allows no
markup characters: the refusal is what gets shown), model files' paths (any file name a model folder holds), the
config file's text (comments, values) and its validation reason, benchmark result files (every string field), and a
model's output in the chat box (a real model that writes markup, in a real browser). Each probe's markup must reach
the HTML escaped (``&lt;script&gt;``), never as a tag; the chat box must insert it as text.
"""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path

import gguf
import httpx
import numpy as np
from harness import running
from hostile_checks import HUNG_S
from markupsafe import escape

from appliance.engine import tinymodel

REPO = Path(__file__).resolve().parents[2]
PAGES = ("/admin/", "/admin/_dashboard", "/admin/registry", "/admin/registry/_tables", "/admin/device",
         "/admin/config", "/admin/config/_status", "/admin/benchmarks", "/admin/chat")
TAG_OPENINGS = re.compile(r"<(?:img src=x onerror|script>(?:alert|window)|svg onload)", re.IGNORECASE)
"""The opening of a tag a probe wrote (no page writes one of its own like these)."""


def probe(label: str) -> str:
    """Markup that would run if inserted raw, named by where it was put."""
    return f'"><img src=x onerror=alert("{label}")><script>alert("{label}")</script>'


def escaped_forms(text: str) -> tuple[str, ...]:
    """``text`` as an HTML page may show it: Jinja2's escape, or the standard library's."""
    return str(escape(text)), html.escape(text), html.escape(text, quote=False)


def reflections(page: str, text: str) -> tuple[bool, bool]:
    """(raw, escaped): whether ``text`` is in ``page`` as it is, and whether it is there escaped."""
    return text in page, any(form in page for form in escaped_forms(text))


def assert_escaped(page: str, text: str, where: str) -> None:
    raw, shown = reflections(page, text)
    assert not raw, f"{where}: raw markup {text!r}"
    assert shown, f"{where}: {text!r} is not shown (escaped) at all: the probe proves nothing"


def assert_no_probe_tags(page: str, where: str) -> None:
    found = TAG_OPENINGS.findall(page)
    assert not found, f"{where}: tags opened by a probe: {found[:3]}"


def admin_pages(client: httpx.Client) -> dict[str, str]:
    pages = {}
    for path in PAGES:
        response = client.get(path)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])
        pages[path] = response.text
    return pages


def test_the_escape_check_tells_raw_from_escaped():
    text = probe("x")
    assert reflections(f"<p>{text}</p>", text) == (True, False)
    assert reflections(f"<p>{escape(text)}</p>", text) == (False, True)
    assert TAG_OPENINGS.findall(f"<p>{text}</p>") and not TAG_OPENINGS.findall(f"<p>{escape(text)}</p>")
    assert not TAG_OPENINGS.findall('<script src="/static/chat.js" defer></script><img src="data:x">')


def test_markup_in_agent_ids_is_refused_and_never_reflected_raw(hostile):
    """Agent ids from the admin form, the OpenAI ``user`` field and ``X-Agent-Id``: the id rule refuses markup; the
    form's refusal (an HTML fragment) does not reflect it raw, the API's is JSON naming the field; an id with every
    character the rule allows beyond letters and digits is shown on the pages, and no page holds a probe's tag."""
    csrf = {"X-CSRF-Token": hostile.app.appliance.csrf_token}
    allowed = "ok.id:with@every+char-1_2"
    with httpx.Client(base_url=hostile.http, timeout=HUNG_S) as client:
        for label in ("form", "user", "header"):
            text = probe(label)
            if label == "form":
                response = client.post("/admin/registry/register", data={"agent": text, "model": "demo-b"},
                                       headers=csrf)
                assert response.status_code == 200 and response.headers["x-appliance-outcome"] == "BAD_REQUEST"
                assert response.headers["content-type"].startswith("text/html")
                assert not reflections(response.text, text)[0], response.text
                assert_no_probe_tags(response.text, "the register form's refusal")
                continue
            body = {"model": "demo-b", "prompt": "hi", "max_tokens": 1, **({"user": text} if label == "user" else {})}
            headers = {"X-Agent-Id": text} if label == "header" else {}
            response = client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 400, response.text
            assert response.headers["content-type"] == "application/json"  # a browser never renders it as HTML
            assert response.json()["error"]["param"] == ("user" if label == "user" else "X-Agent-Id")
        reply = client.post("/v1/completions", json={"model": "demo-b", "prompt": "hi", "max_tokens": 1,
                                                     "user": allowed})
        assert reply.status_code == 200, reply.text
        pages = admin_pages(client)
    assert any(allowed in page for page in pages.values()), "the pages show agent ids"
    assert not [agent for agent in list(hostile.app.daemon.agents) if "<" in agent or '"' in agent]
    for path, page in pages.items():
        assert_no_probe_tags(page, path)


def hostile_model_paths(folder: Path, source: Path) -> list[Path]:
    """Model files whose paths hold markup: a file name with a tag, and a folder and file name that together spell
    ``<script>…</script>`` (a file name cannot hold the slash)."""
    tag = folder / '"><img src=x onerror=alert(1)>.gguf'
    nested = folder / '<script>alert("path")<'
    nested.mkdir()
    script = nested / "script>.gguf"
    for path in (tag, script):
        os.link(source, path)
    return [tag, script]


def test_markup_in_model_paths_is_escaped_on_every_admin_page(hostile):
    """Agents registered (admin form and line protocol) on model files whose paths hold markup: every admin page
    that shows a path shows it escaped, and none holds a probe's tag."""
    paths = hostile_model_paths(hostile.model_dir, hostile.model_path("demo-b"))
    csrf = {"X-CSRF-Token": hostile.app.appliance.csrf_token}
    with httpx.Client(base_url=hostile.http, timeout=HUNG_S) as client:
        form = client.post("/admin/registry/register", data={"agent": "xss-form", "model": str(paths[0])},
                           headers=csrf)
        assert form.headers["x-appliance-outcome"] == "ok", form.text
        assert_no_probe_tags(form.text, "the register form's result")
        assert hostile.app.line(f"REGISTER xss-line {paths[1]}").startswith("OK")
        pages = admin_pages(client)
    for path in paths:
        raw = [where for where, page in pages.items() if str(path) in page]
        assert not raw, f"{path} raw on {raw}"
        assert any(reflections(page, str(path))[1] for page in pages.values()), f"{path} is shown nowhere"
    for where, page in pages.items():
        assert_no_probe_tags(page, where)
    for agent in ("xss-form", "xss-line"):
        assert hostile.app.line(f"UNREGISTER {agent}").startswith("OK")


def test_markup_in_the_config_file_is_escaped_on_the_config_page(record_case, tiny_model_b: Path, tmp_path: Path):
    """The config page shows the file's text and, when it is invalid, why: a comment closing a script and opening
    one, a model folder and a model path holding markup, then a key made of markup that makes the file invalid.
    The page shows each escaped, /v1/health's reason is JSON."""
    models = tmp_path / '<img src=x onerror=alert("dir")>'
    models.mkdir()
    model = models / '"><svg onload=alert("file")>.gguf'
    os.link(tiny_model_b, model)
    comment = '# </script><script>alert("comment")</script>'
    bad_key = '<svg onload=alert("key")>'
    crashed = True
    with running({"xss": {"path": str(model), "n_ctx": 256}}, model_dirs=[models], watch=True) as app:
        with httpx.Client(base_url=app.appliance.http_url or "", timeout=HUNG_S) as client:
            app.edit(comment + "\n" + app.config_file.read_text())
            assert app.reload().result in ("applied", "unchanged")
            valid = client.get("/admin/config").text
            app.edit(app.config_file.read_text() + f"{json.dumps(bad_key)}: 1\n")
            assert app.reload().result == "invalid"
            invalid = client.get("/admin/config").text
            partial = client.get("/admin/config/_status").text
            health = client.get("/v1/health")
            others = admin_pages(client)
        crashed = not app.line("STATUS").startswith("OK")
    record_case(crashed=crashed)
    for text in ('</script><script>alert("comment")</script>', str(models), str(model)):
        assert_escaped(valid, text, "the config page")
    assert_escaped(invalid, bad_key, "the config page of an invalid file")
    assert_escaped(partial, bad_key, "the config status fragment")
    assert health.headers["content-type"] == "application/json" and bad_key in strings(health.json())
    for where, page in {"config": valid, "invalid config": invalid, **others}.items():
        assert_no_probe_tags(page, where)


def strings(document: object) -> str:
    """Every string in a JSON document, joined by newlines."""
    if isinstance(document, str):
        return document
    if isinstance(document, dict):
        return "\n".join(strings(value) for value in document.values())
    if isinstance(document, list):
        return "\n".join(strings(value) for value in document)
    return ""


def crafted_result() -> dict[str, object]:
    """A benchmark result with markup in every string field the result page reads (each named by its field)."""
    return {
        "benchmark": probe("benchmark"), "headline": probe("headline"), "quick": True, "complete": False,
        "config_path": probe("config_path"), "finished_at": 1.7e9, "wall_s": 12.5,
        "model": {"name": probe("model.name"), "n_ctx": 512},
        "machine": {"cores": 2, "device_kind": probe("machine.device_kind"), "device_total_bytes": 1024},
        "workload": {"description": probe("workload.description")},
        "strategies": {"fixed": {"label": probe("fixed.label")}, "adaptive": {"label": probe("adaptive.label")}},
        "table": {"fixed": {"ttft_avg_ms": probe("table")}, "adaptive": {"ttft_avg_ms": 3.0}},
        "rounds": {"fixed": [{"round": 1, "ttft_avg_ms": 2.0}, {"round": probe("round"), "ttft_avg_ms": 1.0}]},
        "thread_curve": [{"threads": 1, "tokens_per_s": 10.0}, {"threads": probe("threads"), "tokens_per_s": 1}],
        "device_class": {"name": probe("device_class.name"), "reason": probe("device_class.reason")},
        "advice": [{"key": probe("advice.key"), "value": probe("advice.value"), "current": probe("advice.current"),
                    "reason": probe("advice.reason")},
                   {"key": None, "model": probe("advice.model"), "value": [probe("advice.list")],
                    "reason": probe("advice.reason2")}],
    }


SHOWN_FIELDS = ("benchmark", "headline", "config_path", "model.name", "machine.device_kind", "workload.description",
                "fixed.label", "adaptive.label", "device_class.name", "device_class.reason", "advice.key",
                "advice.value", "advice.current", "advice.reason", "advice.model", "advice.reason2")
"""The fields the result page shows as text (numbers given as markup are left out, never shown)."""


def test_markup_in_benchmark_result_files_is_escaped_on_the_benchmarks_tab(hostile):
    """A crafted result JSON with markup in every string field, and a result file whose name is markup: the list
    and the result page show every field escaped; fields that must be numbers are not shown at all."""
    folder = hostile.state / "benchmarks"
    folder.mkdir(exist_ok=True)
    (folder / "crafted.json").write_text(json.dumps(crafted_result()))
    odd_name = '"><img src=x onerror=alert("name")>.json'
    (folder / odd_name).write_text(json.dumps({"benchmark": probe("listed"), "headline": probe("listed headline")}))
    with httpx.Client(base_url=hostile.http, timeout=HUNG_S) as client:
        listing = client.get("/admin/benchmarks")
        result = client.get("/admin/benchmarks/result/crafted.json")
    assert listing.status_code == 200 and result.status_code == 200, (listing.text[:300], result.text[:300])
    for label in ("benchmark", "headline", "listed", "listed headline"):
        assert_escaped(listing.text, probe(label), f"the list's {label}")
    assert_escaped(listing.text, odd_name, "the list's file name")
    for label in SHOWN_FIELDS:
        assert_escaped(result.text, probe(label), f"the result page's {label}")
    for label in ("table", "round", "threads"):
        assert not any(reflections(result.text, probe(label))), f"{label} is a number field: not shown"
    assert_no_probe_tags(listing.text, "the list")
    assert_no_probe_tags(result.text, "the result page")


# -- a model that writes markup, in the chat box of a real browser --------------------------------------------------

OUTPUT = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'
"""What the parrot model writes, once per token."""
MODEL_PROBE = '"><img src=x onerror="window.__xss=3">'
"""A model name of markup (no slash: a name with one is a path, refused without being echoed)."""
INSERTED_AS_HTML = re.compile(r"\.(?:innerHTML|outerHTML)\s*[+]?=|insertAdjacentHTML|document\.write|createContextual")


def write_parrot(path: Path, text: str) -> Path:
    """A real llama GGUF (1 layer, 64 wide, the tiny model's vocabulary; public writer calls only) whose greedy output
    is ``text`` over and over: token 0 of its vocabulary is that text and its output norm is zero, so every logit is
    0 and greedy sampling takes the first token."""
    hp = tinymodel.resolve_hyperparams(1, 64, None, None, None, 2048)
    base = tinymodel.build_vocabulary()
    tokens = [text, *base.tokens]
    writer = gguf.GGUFWriter(path, "llama")
    values = {"context_length": hp.n_ctx_train, "embedding_length": hp.dim, "block_count": hp.layers,
              "feed_forward_length": hp.ff, "attention.head_count": hp.heads, "attention.head_count_kv": hp.kv_heads,
              "rope.dimension_count": hp.head_dim}
    for key, value in values.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_layer_norm_rms_eps(tinymodel.RMS_EPS)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0, *base.scores])
    writer.add_token_types([int(gguf.TokenType.NORMAL), *base.types])
    writer.add_unk_token_id(tinymodel.UNK_ID + 1)  # every special one place up, behind the parrot's token
    writer.add_bos_token_id(tinymodel.BOS_ID + 1)
    writer.add_eos_token_id(tinymodel.EOS_ID + 1)
    rng = np.random.default_rng(0)
    for spec in tinymodel.tensor_specs(hp, len(tokens)):
        data = np.ones(spec.shape, np.float32) if spec.is_norm else rng.standard_normal(spec.shape, np.float32) * 0.02
        if spec.name == "output_norm.weight":
            data = np.zeros(spec.shape, dtype=np.float32)
        writer.add_tensor(spec.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


ADD_MODEL = "(select, value) => select.add(new Option(value, value, true, true))"
PROBE_ELEMENTS = "document.querySelectorAll('#chat-log img, #chat-log script, #chat-status *').length"


def chat_once(page, model: str) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """Send one message to ``model`` from the chat box; (its end state, the status line)."""
    page.eval_on_selector("#chat-model", ADD_MODEL, model)
    page.fill("#chat-max-tokens", "3")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-message", "Say something")
    page.click("#chat-send")
    page.locator('#chat-status[data-state="done"], #chat-status[data-state="error"]').wait_for(timeout=60_000)
    return page.get_attribute("#chat-status", "data-state") or "", page.inner_text("#chat-status")


def test_markup_a_model_writes_is_text_in_the_chat_box(hostile, browser):
    """A real model whose every token is markup, streamed into the chat box of headless Chromium: the reply shows
    the markup as text, no element is created from it and nothing of it runs; a model name made of markup fails
    with its refusal shown as text too. web/chat.js never inserts HTML."""
    script = (REPO / "web" / "chat.js").read_text()
    assert not INSERTED_AS_HTML.findall(script), INSERTED_AS_HTML.findall(script)
    parrot = write_parrot(hostile.model_dir / "parrot.gguf", OUTPUT)
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(hostile.http + "/admin/chat")
        state, status = chat_once(page, str(parrot))
        assert state == "done", status
        reply = page.inner_text(".message-assistant .text")
        elements = page.evaluate(PROBE_ELEMENTS)
        ran = page.evaluate("window.__xss")
        page.click("#chat-clear")
        refused_state, refused = chat_once(page, MODEL_PROBE)
        refused_elements = page.evaluate(PROBE_ELEMENTS)
        ran_after = page.evaluate("window.__xss")
    finally:
        context.close()
    assert reply == OUTPUT * 3, reply
    assert elements == 0 and ran is None, (elements, ran)
    assert refused_state == "error" and "UNKNOWN_MODEL" in refused and MODEL_PROBE in refused, refused
    assert refused_elements == 0 and ran_after is None
