"""The access log: one ``appliance.access`` line per request on every surface (the request log's observer). The line's
fields from crafted records first (pure), then a real appliance asked once on each surface with the lines captured;
thread-count changes of the adaptive engine are DEBUG lines, not INFO."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import RawPeer, Running, running

from appliance.client import MagnClient
from appliance.config.validate import parse_config
from appliance.daemon import accesslog
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.daemon.requestlog import RequestRecord
from appliance.engine.adaptive import CpuShare
from appliance.engine.runtime import Engine
from appliance.engine.tinymodel import write_tiny_model
from appliance.errors import ApplianceError
from appliance.protocol import messages as m
from appliance.protocol.lines import parse_fields

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def record(**changes: object) -> RequestRecord:
    fields: dict[str, object] = {
        "at": 0.0, "surface": "lines", "model": "demo", "agent": "a", "prompt_tokens": 7, "generated_tokens": 11,
        "ttft_s": 0.25, "elapsed_s": 1.5, "outcome": "ok", "stop_reason": "length", "plan": "S",
        "prompt_evaluated": 3, "generation_s": 1.25}
    fields.update(changes)
    return RequestRecord(**fields)  # type: ignore[arg-type]


def test_the_line_has_every_field_in_order() -> None:
    line = accesslog.access_line(record())
    assert line == ("surface=lines task=generate model=demo agent=a prompt_tokens=7 prompt_evaluated=3 "
                    "generated_tokens=11 ttft_ms=250.000 tokens_per_s=10.000 elapsed_ms=1500.000 outcome=ok "
                    "error=none stop=length")


def test_tokens_per_second_is_the_speed_after_the_first_token() -> None:
    assert accesslog.tokens_per_second(record()) == pytest.approx(10 / 1.0)  # 10 tokens after the first, in 1 s
    assert accesslog.tokens_per_second(record(generated_tokens=1)) is None  # no decoding after the first
    assert accesslog.tokens_per_second(record(ttft_s=None, generated_tokens=0)) is None
    assert accesslog.tokens_per_second(record(generation_s=None, outcome="error")) is None  # it never ran
    assert accesslog.tokens_per_second(record(generation_s=0.25)) is None  # no time after the first token


def test_a_failed_request_and_embeddings() -> None:
    failed = accesslog.access_fields(record(outcome="error", error="UNKNOWN_MODEL", generated_tokens=0, ttft_s=None,
                                            prompt_evaluated=None, generation_s=None, stop_reason=None, agent=None))
    assert (failed["outcome"], failed["error"], failed["ttft_ms"], failed["tokens_per_s"]) == (
        "error", "UNKNOWN_MODEL", None, None)
    embed = parse_fields(accesslog.access_line(record(surface="openai", task="embed", agent=None, generated_tokens=0,
                                                      ttft_s=None, prompt_evaluated=None, generation_s=None,
                                                      stop_reason=None)))
    assert (embed["task"], embed["agent"], embed["generated_tokens"], embed["ttft_ms"]) == ("embed", "none", "0",
                                                                                            "none")


def test_a_name_a_client_sent_cannot_add_a_line() -> None:
    line = accesslog.access_line(record(model="evil\nsurface=forged ok", outcome="error", error="UNKNOWN_MODEL"))
    assert "\n" not in line
    assert parse_fields(line)["model"] == "evil\nsurface=forged ok"  # quoted and escaped as the line protocol does
    assert parse_fields(line)["surface"] == "lines"


def test_the_observer_logs_at_info_on_its_own_logger(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=accesslog.LOGGER):
        accesslog.log_request(record())
    (entry,) = [r for r in caplog.records if r.name == "appliance.access"]
    assert entry.levelno == logging.INFO and entry.getMessage() == accesslog.access_line(record())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=accesslog.LOGGER):  # filtered out with its logger's level
        accesslog.log_request(record())
    assert not [r for r in caplog.records if r.name == "appliance.access"]


# -- a real appliance, one request per surface -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("access") / "chat.gguf"
    return write_tiny_model(path, layers=2, dim=64, seed=5, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def app(chat_tiny: Path) -> Iterator[Running]:
    models = {"chat": {"path": str(chat_tiny), "n_ctx": 512},
              "embed": {"path": str(chat_tiny), "n_ctx": 512, "embeddings": True}}
    with running(models, model_dirs=[chat_tiny.parent], engine={"warmup_runs": 0}) as running_app:
        yield running_app


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    return [parse_fields(r.getMessage()) for r in caplog.records if r.name == "appliance.access"]


def test_every_surface_writes_one_access_line_per_request(app: Running, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="appliance.access")
    url = app.appliance.http_url
    assert app.line("REGISTER a chat").startswith("OK")
    assert app.line("DECODE a 4 Hello there").startswith("OK")
    with MagnClient(str(app.socket), timeout=120) as client:
        assert client.infer(model="chat", prompt="Hello", max_tokens=4).usage.completion_tokens == 4
    peer = RawPeer(app.socket, timeout=120)
    try:
        peer.send(m.EmbedRequest("e1", "embed", ("hello",)).to_payload())
        assert isinstance(peer.read(), m.Embeddings)
    finally:
        peer.close()
    messages = [{"role": "user", "content": "Hello"}]
    bodies = [("/v1/chat/completions", {"model": "chat", "messages": messages, "max_tokens": 4}),
              ("/v1/completions", {"model": "chat", "prompt": "Hello", "max_tokens": 4}),
              ("/v1/responses", {"model": "chat", "input": "Hello", "max_output_tokens": 4}),
              ("/v1/messages", {"model": "chat", "messages": messages, "max_tokens": 4}),
              ("/v1/embeddings", {"model": "embed", "input": ["hello", "world"]})]
    for path, body in bodies:
        answer = httpx.post(url + path, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
    too_long = " ".join(f"word{n}" for n in range(600))  # more tokens than the model's 512: refused while it runs
    assert app.line(f"DECODE a 4 {too_long}").startswith("ERR CONTEXT_OVERFLOW")

    lines = access_lines(caplog)
    records = list(reversed(app.daemon.requests.recent(len(lines) + 5)))
    assert len(lines) == len(records) == 9  # one line per request, no more, no less
    seen = [(line["surface"], line["task"], line["model"], line["outcome"]) for line in lines]
    assert seen == [("lines", "generate", "chat", "ok"), ("magn", "generate", "chat", "ok"),
                    ("magn", "embed", "embed", "ok"), ("openai", "generate", "chat", "ok"),
                    ("openai", "generate", "chat", "ok"), ("responses", "generate", "chat", "ok"),
                    ("anthropic", "generate", "chat", "ok"), ("openai", "embed", "embed", "ok"),
                    ("lines", "generate", "chat", "error")]
    assert (lines[8]["error"], lines[8]["ttft_ms"], lines[8]["generated_tokens"]) == ("CONTEXT_OVERFLOW", "none",
                                                                                      "0")
    agents = [line["agent"] for line in lines]
    assert agents[0] == agents[8] == "a" and agents[5].startswith("resp_")  # a stored Response's conversation
    assert agents[1:5] + agents[6:8] == ["none"] * 6
    for line, kept in zip(lines, records, strict=True):  # the figures are the request log's
        assert int(line["prompt_tokens"]) == kept.prompt_tokens
        assert int(line["generated_tokens"]) == kept.generated_tokens
        assert float(line["elapsed_ms"]) == pytest.approx(kept.elapsed_s * 1000, abs=0.001)
    for line in lines[:8]:
        if line["task"] == "generate":
            assert line["generated_tokens"] == "4" and line["stop"] == "length"
            assert 0 < int(line["prompt_evaluated"]) <= int(line["prompt_tokens"])
            assert float(line["ttft_ms"]) > 0 and float(line["tokens_per_s"]) > 0
        else:
            assert int(line["prompt_tokens"]) > 0 and line["generated_tokens"] == "0"
            assert line["ttft_ms"] == "none" and line["tokens_per_s"] == "none"


def test_an_agents_turn_counts_only_what_it_evaluated(app: Running, caplog: pytest.LogCaptureFixture) -> None:
    """The second turn of a conversation evaluates its new tokens only: its KV state was there."""
    caplog.set_level(logging.INFO, logger="appliance.access")
    assert app.line("REGISTER b chat").startswith("OK")
    first = "Once upon a time there was a model that read every story it was given"
    assert app.line(f"DECODE b 4 {first}").startswith("OK")
    assert app.line("DECODE b 4  and then").startswith("OK")
    one, two = access_lines(caplog)[-2:]
    assert (one["agent"], two["agent"]) == ("b", "b")
    assert int(one["prompt_evaluated"]) == int(one["prompt_tokens"]) > 10
    assert int(two["prompt_evaluated"]) <= int(two["prompt_tokens"]) + 4 < int(one["prompt_tokens"])


def test_thread_count_changes_are_debug_lines(tiny_model: Path, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    text = (f"data_dir: {tmp_path}\ndevice: fake:8GiB\nengine: {{warmup_runs: 0}}\n"
            f"models:\n  - name: m\n    path: {tiny_model}\n    n_ctx: 512\n")

    async def scenario() -> None:
        daemon = Daemon(parse_config(text, base_dir=tmp_path), FakeDevice(8 * 2**30), Engine(2))
        try:
            agent = await daemon.register("a", "m")
            model = agent.model
            daemon.adaptive.cores = 2
            model.tuner.usable_cores = 2
            daemon.adaptive.cpu = CpuShare(45.0, 2)  # another process takes one of two cores: one thread
            daemon.adaptive.schedule(model, threads_only=True)
            await model.retuning
            assert await daemon.engine.call(getattr, model.runtime, "threads") == 1
        finally:
            await daemon.close()

    caplog.set_level(logging.DEBUG, logger="appliance.daemon.adaptive")
    asyncio.run(scenario())
    # This daemon's model only: a daemon of an earlier test in this process may still log its own models' changes.
    changes = [r for r in caplog.records if r.name == "appliance.daemon.adaptive"
               and r.getMessage().startswith("model m: ") and " threads (CPU share " in r.getMessage()]
    assert [(r.levelname, r.getMessage().split(" (")[0]) for r in changes] == [("DEBUG", "model m: 1 threads")]


# -- HTTP requests refused before they run ---------------------------------------------------------------------------
TOKEN = "access-test-token-0123456789"
GUESS = "wrong-guess-9876543210"


def test_a_refused_line_has_its_status_and_code_and_a_cut_path() -> None:
    error = ApplianceError("UNAUTHORIZED", "no token")
    line = accesslog.refusal_line("GET", "/v1/" + "x" * 1000, 401, error, "10.0.0.7")
    fields = parse_fields(line)
    assert line.startswith("surface=http method=GET path=/v1/xxx")
    assert (fields["status"], fields["outcome"], fields["error"], fields["client"]) == ("401", "refused",
                                                                                        "UNAUTHORIZED", "10.0.0.7")
    assert len(fields["path"]) == accesslog.MAX_PATH_CHARS
    unread = parse_fields(accesslog.refusal_line(None, None, 400, ApplianceError("BAD_REQUEST", "m"), None))
    assert (unread["method"], unread["path"], unread["client"]) == ("none", "none", "none")
    forged = accesslog.refusal_line("GET", "/a\nsurface=forged", 404, ApplianceError("NOT_FOUND", "m"), None)
    assert "\n" not in forged and parse_fields(forged)["path"] == "/a\nsurface=forged"


def raw_request(url: str, data: bytes) -> bytes:
    """``data`` sent on a fresh connection; what comes back until the server closes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(data)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def test_every_request_refused_before_it_runs_has_one_line(tiny_model: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Each refusal (the guard's, the router's, a route's before its run, the connection's) writes one access line
    with its status and error code, never the token or the body; a request that ran has its record's line only."""
    caplog.set_level(logging.INFO, logger="appliance.access")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with running({"tiny": {"path": str(tiny_model), "n_ctx": 512}}, model_dirs=[tiny_model.parent],
                 http_settings={"api_token": TOKEN}, engine={"warmup_runs": 0}) as app:
        url = app.appliance.http_url
        assert url is not None
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        sent = [
            (httpx.get(url + "/v1/models"), "GET", "/v1/models", "UNAUTHORIZED"),
            (httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {GUESS}"}), "GET", "/v1/models",
             "UNAUTHORIZED"),
            (httpx.get(url + "/admin/", headers={"Accept": "text/html"}), "GET", "/admin/", "UNAUTHORIZED"),
            (httpx.get(url + "/v1/models", headers={**auth, "Host": "evil.example"}), "GET", "/v1/models",
             "FORBIDDEN"),
            (httpx.get(url + "/v1/models", headers={**auth, "Host": "no host!"}), "GET", "/v1/models",
             "BAD_REQUEST"),
            (httpx.get(url + "/v1/nothing?key=value", headers=auth), "GET", "/v1/nothing", "NOT_FOUND"),
            (httpx.delete(url + "/v1/health", headers=auth), "DELETE", "/v1/health", "METHOD_NOT_ALLOWED"),
            (httpx.post(url + "/v1/chat/completions", headers=auth, content=b"{not json"), "POST",
             "/v1/chat/completions", "BAD_REQUEST"),
            (httpx.post(url + "/v1/chat/completions", headers=auth, json={**chat, "model": "nothing"}), "POST",
             "/v1/chat/completions", "UNKNOWN_MODEL"),
        ]
        statuses = [response.status_code for response, *_ in sent]
        assert statuses == [401, 401, 303, 403, 400, 404, 405, 400, 404], [r.text for r, *_ in sent]
        head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        too_large = raw_request(url, f"{head}Content-Length: 5000000\r\nConnection: close\r\n\r\n".encode())
        chunk = raw_request(url, f"{head}Transfer-Encoding: chunked\r\n\r\nFFFFFFFF\r\n".encode())
        garbage = raw_request(url, b"NOT HTTP AT ALL\r\n\r\n")
        for answer in (too_large, chunk, garbage):
            assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        served = httpx.post(url + "/v1/chat/completions", headers=auth, json=chat, timeout=120)
        assert served.status_code == 200, served.text
        assert httpx.get(url + "/v1/models", headers=auth).status_code == 200  # served: no line (no record)
        time.sleep(0.2)  # the refused connections' lines are written on the server's loop

    lines = access_lines(caplog)
    refused = [line for line in lines if line["surface"] == "http"]
    expected = [(method, path, str(status), code)
                for (_, method, path, code), status in zip(sent, statuses, strict=True)]
    expected += [("POST", "/v1/completions", "400", "BAD_REQUEST"), ("POST", "/v1/completions", "400", "BAD_REQUEST"),
                 ("none", "none", "400", "BAD_REQUEST")]
    assert [(line["method"], line["path"], line["status"], line["error"]) for line in refused] == expected
    assert {line["outcome"] for line in refused} == {"refused"}
    assert {line["client"] for line in refused} == {"127.0.0.1"}
    assert [(line["surface"], line["outcome"]) for line in lines if line["surface"] != "http"] == [("openai", "ok")]
    for entry in caplog.records:  # the token, a wrong guess and bodies are never written
        text = entry.getMessage()
        assert TOKEN not in text and GUESS not in text and "not json" not in text
