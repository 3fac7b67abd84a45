"""Agent affinity on a real appliance: ``x-appliance-instance`` names the box on every API reply (generations of
each surface, plain and streamed, their errors, ``/v1/health``, ``/v1/models``), ``x-appliance-agent`` echoes the
agent a generation was keyed under (absent for a stateless one); ``/v1/health`` and STATUS show the name; a page
of an allowed origin may read both headers."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import Running, running

from appliance.http.affinity import AGENT_HEADER, INSTANCE_HEADER, instance_name, response_headers
from appliance.protocol.identifiers import user_agent_id
from appliance.protocol.lines import parse_reply

INSTANCE = "edge-7.lan:8080"
ORIGIN = "http://app.example:3000"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0}
ANTHROPIC = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0}


def test_the_instance_name_is_the_setting_or_host_and_port() -> None:
    assert instance_name("box-1", "host", 8080) == "box-1"
    assert instance_name(None, "host", 8080) == "host:8080"
    assert response_headers("box-1", None) == [(INSTANCE_HEADER, "box-1")]
    assert response_headers("box-1", "a@tiny") == [(INSTANCE_HEADER, "box-1"), (AGENT_HEADER, "a@tiny")]


@pytest.fixture(scope="module")
def app(tiny_model: Path) -> Iterator[Running]:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"instance_name": INSTANCE, "cors_origins": [ORIGIN]}) as running_app:
        yield running_app


def post(app: Running, path: str, body: dict, **headers: str) -> httpx.Response:
    response = httpx.post(app.appliance.http_url + path, json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response


def stream(app: Running, path: str, body: dict, **headers: str) -> tuple[httpx.Headers, str]:
    with httpx.stream("POST", app.appliance.http_url + path, json={**body, "stream": True}, headers=headers,
                      timeout=120) as response:
        text = response.read().decode()
        assert response.status_code == 200, text
        assert response.headers["content-type"].startswith("text/event-stream")
        return response.headers, text


def test_stateless_generations_name_the_box_and_no_agent(app: Running) -> None:
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 3}),
                       ("/v1/messages", ANTHROPIC),
                       ("/v1/responses", {"model": "tiny", "input": "Hello", "max_output_tokens": 3,
                                          "store": False})):
        plain = post(app, path, body)
        assert plain.headers[INSTANCE_HEADER] == INSTANCE, path
        assert AGENT_HEADER not in plain.headers, path
        headers, _ = stream(app, path, body)
        assert headers[INSTANCE_HEADER] == INSTANCE and AGENT_HEADER not in headers, path


def test_an_openai_user_is_echoed_as_its_agent_on_the_model(app: Running) -> None:
    expected = user_agent_id("alice", "tiny")
    plain = post(app, "/v1/chat/completions", {**CHAT, "user": "alice"})
    assert plain.headers[AGENT_HEADER] == expected and plain.headers[INSTANCE_HEADER] == INSTANCE
    assert expected in app.daemon.agents  # the id the conversation is kept under
    headers, text = stream(app, "/v1/chat/completions", {**CHAT, "user": "alice"})
    assert headers[AGENT_HEADER] == expected and "[DONE]" in text
    completion = post(app, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "user": "bob"})
    assert completion.headers[AGENT_HEADER] == user_agent_id("bob", "tiny")


def test_an_x_agent_id_header_is_echoed_as_it_is(app: Running) -> None:
    plain = post(app, "/v1/chat/completions", CHAT, **{"x-agent-id": "planner-7"})
    assert plain.headers[AGENT_HEADER] == "planner-7"
    headers, _ = stream(app, "/v1/chat/completions", CHAT, **{"x-agent-id": "planner-7"})
    assert headers[AGENT_HEADER] == "planner-7"
    assert "planner-7" in app.daemon.agents


def test_anthropic_metadata_user_id_is_echoed_as_its_agent(app: Running) -> None:
    body = {**ANTHROPIC, "metadata": {"user_id": "claude-agent-1"}}
    expected = user_agent_id("claude-agent-1", "tiny")
    assert post(app, "/v1/messages", body).headers[AGENT_HEADER] == expected
    headers, _ = stream(app, "/v1/messages", body)
    assert headers[AGENT_HEADER] == expected and headers[INSTANCE_HEADER] == INSTANCE
    assert expected in app.daemon.agents


def test_a_stored_response_chain_is_echoed_as_its_conversations_agent(app: Running) -> None:
    first = post(app, "/v1/responses", {"model": "tiny", "input": "Hello", "max_output_tokens": 3})
    ident = first.json()["id"]
    assert first.headers[AGENT_HEADER] == ident and ident in app.daemon.agents  # the chain's agent: its first id
    follow = {"model": "tiny", "input": "And then?", "max_output_tokens": 3, "previous_response_id": ident}
    assert post(app, "/v1/responses", follow).headers[AGENT_HEADER] == ident
    headers, _ = stream(app, "/v1/responses", follow)
    assert headers[AGENT_HEADER] == ident


def test_health_models_and_errors_name_the_box(app: Running) -> None:
    url = app.appliance.http_url
    health = httpx.get(url + "/v1/health", timeout=60)
    assert health.headers[INSTANCE_HEADER] == INSTANCE and health.json()["instance"] == INSTANCE
    assert httpx.get(url + "/health", timeout=60).headers[INSTANCE_HEADER] == INSTANCE
    models = httpx.get(url + "/v1/models", timeout=60)
    assert models.status_code == 200 and models.headers[INSTANCE_HEADER] == INSTANCE
    unknown = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "nope"}, timeout=60)
    assert unknown.status_code == 404 and unknown.headers[INSTANCE_HEADER] == INSTANCE
    assert INSTANCE_HEADER not in httpx.get(url + "/metrics", timeout=60).headers  # not an API route
    reply = parse_reply(app.line("STATUS"))
    assert reply.body is not None and f"instance name={INSTANCE}" in reply.body.splitlines()


def test_a_page_of_an_allowed_origin_may_read_both_headers(app: Running) -> None:
    response = post(app, "/v1/chat/completions", {**CHAT, "user": "carol"}, origin=ORIGIN)
    exposed = {name.strip() for name in response.headers["access-control-expose-headers"].split(",")}
    assert {INSTANCE_HEADER, AGENT_HEADER} <= exposed
    assert response.headers[AGENT_HEADER] == user_agent_id("carol", "tiny")


def test_without_a_name_the_box_is_its_host_name_and_port(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        expected = f"{socket.gethostname()}:{app.appliance.http_server.port}"
        health = httpx.get(app.appliance.http_url + "/v1/health", timeout=60)
        assert health.headers[INSTANCE_HEADER] == expected and health.json()["instance"] == expected
        assert post(app, "/v1/chat/completions", CHAT).headers[INSTANCE_HEADER] == expected
