"""The Anthropic Messages API on a real appliance, driven by the official ``anthropic`` client (unmodified, its
``base_url`` at the appliance) on models with real tokenizers and chat templates (tests/conftest.py's
``chat_model``: random weights, so the text babbles, but tokens, templates and grammars are the real model's)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import llama_cpp
import pytest
from harness import Running, running
from test_real_vocab import CASES

from appliance.engine.chat import read_chat_template, render_prompt
from appliance.http import anthropic_schema as schema

NAMES = ("qwen2.5", "llama3.1")
TOKEN = "anthropic-test-token"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "celsius": {"type": "boolean"}},
                            "required": ["city", "celsius"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                         "required": ["zone"], "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
SYSTEM = "Be terse."
QUESTION = [{"role": "user", "content": "What is the weather?"}]
GREEDY = {"temperature": 0}  # this client has no temperature argument: the field goes in the body


@pytest.fixture(scope="module")
def models(chat_model: Callable[..., Path]) -> dict[str, Path]:
    return {name: chat_model(CASES[name].vocab, CASES[name].template, CASES[name].special_tokens) for name in NAMES}


@pytest.fixture(scope="module")
def app(models: dict[str, Path]) -> Iterator[Running]:
    specs = {name: {"path": str(path), "n_ctx": 2048} for name, path in models.items()}
    folders = sorted({path.parent for path in models.values()})
    with running(specs, model_dirs=folders, http_settings={"api_token": TOKEN}) as running_app:
        yield running_app


@pytest.fixture
def client(app: Running) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=app.appliance.http_url, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def vocabularies(models: dict[str, Path]) -> dict[str, llama_cpp.Llama]:
    return {name: llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
            for name, path in models.items()}


def llama_count(llm: llama_cpp.Llama, text: str) -> int:
    return len(llm.tokenize(text.encode(), add_bos=True, special=True))


def rendered_count(models: dict[str, Path], vocabularies: dict[str, llama_cpp.Llama], name: str,
                   body: dict[str, Any]) -> int:
    """llama.cpp's count of the prompt a Messages body renders to."""
    request = schema.messages_request(body, counting=True)
    prompt = render_prompt(read_chat_template(models[name]), request.messages, request.tools,
                           choice=request.tool_choice)
    return llama_count(vocabularies[name], prompt.text)


def test_a_plain_message_has_anthropics_shape_and_counts(client: anthropic.Anthropic, models: dict[str, Path],
                                                         vocabularies: dict[str, llama_cpp.Llama]) -> None:
    reply = client.messages.create(model="qwen2.5", max_tokens=5, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "qwen2.5"
    assert reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert reply.stop_reason in ("max_tokens", "end_turn")
    assert reply.usage.output_tokens == 5 or reply.stop_reason == "end_turn"
    whole = rendered_count(models, vocabularies, "qwen2.5", {"model": "qwen2.5", "system": SYSTEM,
                                                             "messages": QUESTION})
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == whole
    assert reply.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model="qwen2.5", system=SYSTEM, messages=QUESTION)
    assert counted.input_tokens == whole


def test_count_tokens_counts_tools_and_blocks_as_the_prompt_renders_them(
        client: anthropic.Anthropic, models: dict[str, Path], vocabularies: dict[str, llama_cpp.Llama]) -> None:
    for name in NAMES:
        body = {"model": name, "system": [{"type": "text", "text": SYSTEM}], "tools": TOOLS,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]}]}
        counted = client.messages.count_tokens(model=name, system=body["system"], tools=TOOLS,
                                               messages=body["messages"])
        assert counted.input_tokens == rendered_count(models, vocabularies, name, body)
        without = client.messages.count_tokens(model=name, messages=body["messages"])
        assert without.input_tokens < counted.input_tokens  # the tools and the system prompt are in the prompt


def test_a_stream_gives_text_and_the_final_message(client: anthropic.Anthropic) -> None:
    plain = client.messages.create(model="qwen2.5", max_tokens=12, messages=QUESTION, extra_body=GREEDY)
    with client.messages.stream(model="qwen2.5", max_tokens=12, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text and final.content[0].text == text
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens)


def test_the_raw_stream_is_in_anthropics_event_order(app: Running) -> None:
    body = {"model": "qwen2.5", "max_tokens": 4, "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{app.appliance.http_url}/v1/messages", json=body, headers={"x-api-key": TOKEN},
                      timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [data["type"] for data in datas] == names
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta", "ping"}
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 4


@pytest.mark.parametrize("name", NAMES)
def test_tool_choice_any_gives_a_schema_valid_tool_use_and_its_result_is_answered(client: anthropic.Anthropic,
                                                                                  name: str) -> None:
    reply = client.messages.create(model=name, max_tokens=120, messages=QUESTION, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert reply.stop_reason == "tool_use"
    uses = [block for block in reply.content if block.type == "tool_use"]
    assert len(uses) == 1
    use = uses[0]
    assert use.id.startswith("toolu_") and isinstance(use.input, dict)
    jsonschema.validate(use.input, SCHEMAS[use.name])

    with client.messages.stream(model=name, max_tokens=120, messages=QUESTION, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_time"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    streamed = [block for block in final.content if block.type == "tool_use"]
    assert [block.name for block in streamed] == ["get_time"]
    jsonschema.validate(streamed[0].input, SCHEMAS["get_time"])

    history = [*QUESTION, {"role": "assistant", "content": [block.model_dump() for block in reply.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "Minus four and snowing"}]}]}]
    follow = client.messages.create(model=name, max_tokens=6, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"})
    assert follow.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in follow.content] == ["text"]
    assert follow.usage.output_tokens > 0


def test_a_stop_sequence_is_reported(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model="qwen2.5", max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    text = free.content[0].text
    assert len(text) > 4, text
    sequence = text[2:5]
    stopped = client.messages.create(model="qwen2.5", max_tokens=16, messages=QUESTION, extra_body=GREEDY,
                                     stop_sequences=["never-in-babble-\u2603", sequence])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == sequence
    assert stopped.content[0].text == text[:text.index(sequence)]


def test_metadata_user_id_reuses_the_agents_conversation(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model="qwen2.5", max_tokens=4, messages=QUESTION, extra_body=GREEDY,
                                   metadata={"user_id": "anthropic-agent-1"})
    history = [*QUESTION, {"role": "assistant", "content": first.content[0].text or "ok"},
               {"role": "user", "content": "And tomorrow?"}]
    second = client.messages.create(model="qwen2.5", max_tokens=4, messages=history, extra_body=GREEDY,
                                    metadata={"user_id": "anthropic-agent-1"})
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens < second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_errors_are_anthropics_and_the_client_raises_its_classes(client: anthropic.Anthropic, app: Running) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="qwen2.5", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    error = bad.value.body["error"]
    assert bad.value.body["type"] == "error" and error["type"] == "invalid_request_error"
    assert error["code"] == "BAD_REQUEST" and error["details"]["param"] == "messages[0].content[0].type"
    assert "images are not supported" in error["message"]

    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert missing.value.body["error"]["code"] == "UNKNOWN_MODEL"

    too_long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(anthropic.BadRequestError) as overflow, client.messages.stream(  # before the stream starts
            model="qwen2.5", max_tokens=4, messages=too_long) as stream:
        stream.get_final_message()
    assert overflow.value.body["error"]["code"] == "CONTEXT_OVERFLOW"

    with pytest.raises(anthropic.BadRequestError) as no_max:
        client.post("/v1/messages", body={"model": "qwen2.5", "messages": QUESTION}, cast_to=httpx.Response)
    assert no_max.value.body["error"]["details"]["param"] == "max_tokens"

    stranger = anthropic.Anthropic(base_url=app.appliance.http_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        stranger.messages.create(model="qwen2.5", max_tokens=4, messages=QUESTION)
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert refused.value.body["error"]["code"] == "UNAUTHORIZED"

    bearer = httpx.post(f"{app.appliance.http_url}/v1/messages/count_tokens", timeout=60,
                        headers={"Authorization": f"Bearer {TOKEN}"},
                        json={"model": "qwen2.5", "messages": QUESTION})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    nothing = httpx.post(f"{app.appliance.http_url}/v1/messages/count_tokens", timeout=60,
                         json={"model": "qwen2.5", "messages": QUESTION})
    assert nothing.status_code == 401 and nothing.json()["error"]["type"] == "authentication_error"


async def cancel_running(app: Running) -> None:
    app.daemon.cancel_running()


def test_an_error_after_the_stream_started_is_an_error_event_the_client_raises(client: anthropic.Anthropic,
                                                                              app: Running) -> None:
    app.engine.delay_s = 0.05  # each token waits: the stream is still going when its generation is cancelled
    try:
        with pytest.raises(anthropic.APIStatusError) as caught, client.messages.stream(
                model="qwen2.5", max_tokens=1500, messages=QUESTION) as stream:
            for index, _event in enumerate(stream):
                if index == 4:
                    app.call(cancel_running(app))
        body = caught.value.body
        assert body["type"] == "error" and body["error"]["code"] == "CANCELLED"
        assert body["error"]["details"]["completion_tokens"] < 500
    finally:
        app.engine.delay_s = 0.0
