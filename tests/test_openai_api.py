"""The OpenAI-compatible API (SPEC W2) through the official ``openai`` client against a real appliance with real
tiny llama.cpp models; the pure request checks, conversation carry-over and chat templates as unit tests."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from harness import Running, running

from appliance.engine.chat import (
    GENERATION_PROMPT,
    ChatTemplate,
    Message,
    Turn,
    read_chat_template,
    render_chat,
    render_template,
)
from appliance.engine.tinymodel import write_tiny_model
from appliance.errors import ApplianceError
from appliance.http import openai_schema as schema

HUGE_BYTES = 64 * 1024**3  # over any ledger cap on the fake 8 GiB device
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m.role == 'system' %}{{ raise_exception('no system messages, please') }}{% endif %}"
            "<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LONG_STORY = ("Once upon a time there was a little model that wanted to answer every question with a good story "
              "about the world and the people in it, and each day it read more of the text that came its way. ") * 6


@pytest.fixture(scope="module")
def templated_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("templated") / "templated.gguf"
    return write_tiny_model(path, layers=2, dim=64, seed=3, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def app(tiny_model: Path, tiny_model_b: Path, templated_model: Path) -> Iterator[Running]:
    models = {"tiny": {"path": str(tiny_model)}, "tiny_b": {"path": str(tiny_model_b)},
              "templated": {"path": str(templated_model)}, "small": {"path": str(tiny_model_b), "n_ctx": 256},
              "huge": {"path": str(tiny_model_b), "vram_bytes": HUGE_BYTES}}
    with running(models, model_dirs=[tiny_model.parent, tiny_model_b.parent, templated_model.parent]) as running_app:
        yield running_app


@pytest.fixture
def client(app: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.appliance.http_url}/v1", api_key="none", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, content: str = "Hello there", **kwargs: Any) -> Any:
    options = {"model": "tiny", "max_tokens": 8, "temperature": 0, **kwargs}
    return client.chat.completions.create(messages=[{"role": "user", "content": content}], **options)


def wait_until(condition: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# -- through the official client -------------------------------------------------------------------------------


def test_lists_the_configured_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny_b", "templated", "small", "huge"]
    assert {m.object for m in models.data} == {"model"} and {m.owned_by for m in models.data} == {"appliance"}
    assert client.models.retrieve("tiny_b").id == "tiny_b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_and_completion(client: openai.OpenAI) -> None:
    reply = chat(client, max_tokens=6)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "tiny" and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert 0 < usage.completion_tokens <= 6 and usage.prompt_tokens > 3
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # stateless: everything evaluated

    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert done.object == "text_completion" and done.choices[0].text and done.usage.completion_tokens <= 6
    assert done.choices[0].finish_reason in ("stop", "length")


def test_streams_both_with_the_same_text_as_without(client: openai.OpenAI) -> None:
    plain = chat(client, "Tell me a story", max_tokens=12)
    chunks = list(chat(client, "Tell me a story", max_tokens=12, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    plain_text = client.completions.create(model="tiny", prompt="The water", max_tokens=10, temperature=0)
    streamed = list(client.completions.create(model="tiny", prompt="The water", max_tokens=10, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == plain_text.choices[0].text
    assert streamed[-1].choices[0].finish_reason == plain_text.choices[0].finish_reason


def test_sse_wire_shape(app: Running) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{app.appliance.http_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [block for block in raw.split("\n\n") if block and not block.startswith(":")]
    assert all(block.startswith("data: ") for block in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(block[len("data: "):]) for block in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and "usage" not in chunks[0]


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as caught:
            chat(client, model="no-such-model", stream=stream)
        assert caught.value.body["code"] == "UNKNOWN_MODEL"
        assert caught.value.body["details"]["known"][:2] == ["tiny", "tiny_b"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


def test_a_user_conversation_evaluates_only_the_new_turn(app: Running, client: openai.OpenAI) -> None:
    history = [{"role": "user", "content": LONG_STORY}]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                           user="story-agent")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    agent = app.daemon.agents["story-agent@tiny"]  # the user's agent on this model
    assert agent.owner is None and agent.model.key == "tiny"  # registered on first use; outlives the connection

    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                            user="story-agent")
    usage = second.usage
    cached = usage.prompt_tokens_details.cached_tokens
    evaluated = usage.prompt_tokens - cached
    # the conversation keeps its tokens up to where the re-rendered history's tokens differ: the first prompt, and
    # the reply but for its last tokens where the text that follows retokenizes them
    assert first.usage.prompt_tokens <= cached <= first.usage.total_tokens
    assert first.usage.total_tokens - cached <= 2
    assert 0 < evaluated < first.usage.prompt_tokens / 5  # only the new turn's tokens
    assert usage.prompt_evaluated == evaluated
    record = app.daemon.requests.recent(1)[0]
    assert record.agent == "story-agent@tiny" and record.surface == "openai"
    assert record.prompt_tokens == usage.prompt_tokens

    # The same conversation, stateless: it shares the agent's cells for the history they have in common (SPEC L10),
    # evaluates the rest, and the model says the same.
    stateless = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
    shared = stateless.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= shared < stateless.usage.prompt_tokens
    assert stateless.usage.prompt_tokens > 5 * evaluated
    assert stateless.choices[0].message.content == second.choices[0].message.content

    # An edited history is evaluated again from the edit on (only the first tokens, "user:", are kept).
    edited = [{"role": "user", "content": "A different start"}, *history[1:]]
    third = client.chat.completions.create(model="tiny", messages=edited, max_tokens=4, temperature=0,
                                           user="story-agent")
    assert third.usage.prompt_tokens_details.cached_tokens < 5
    assert len(agent.conversation.tokens) == third.usage.prompt_tokens + third.usage.completion_tokens


def test_the_agent_header_wins_and_an_agent_keeps_its_model(app: Running, client: openai.OpenAI) -> None:
    chat(client, user="ignored-user", extra_headers={"X-Agent-Id": "header-agent"})
    assert "header-agent" in app.daemon.agents and "ignored-user" not in app.daemon.agents
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, model="tiny_b", extra_headers={"X-Agent-Id": "header-agent"})
    assert caught.value.body["param"] == "model" and caught.value.body["details"]["agent_model"] == "tiny"


def test_completions_continue_an_agent_too(client: openai.OpenAI) -> None:
    first = client.completions.create(model="tiny", prompt=LONG_STORY, max_tokens=6, temperature=0,
                                      user="writer")
    prompt = LONG_STORY + first.choices[0].text + " The end."
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, user="writer")
    cached = second.usage.prompt_tokens_details.cached_tokens
    # kept: the first prompt and its completion up to where the new text retokenizes it (the completion's last
    # tokens, and the prompt's trailing space, which the completion's first word takes into its token)
    assert first.usage.prompt_tokens - 1 <= cached <= first.usage.total_tokens
    assert second.usage.prompt_tokens - cached < 8 + first.usage.completion_tokens


def test_stop_strings_and_max_tokens(client: openai.OpenAI) -> None:
    free = client.completions.create(model="tiny", prompt="Hello world", max_tokens=16, temperature=0)
    text = free.choices[0].text
    assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 16
    plain = [i for i in range(1, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalnum()]
    stop = text[plain[len(plain) // 2]:plain[len(plain) // 2] + 2]  # two plain characters from the middle
    expected = text[:text.find(stop)]
    for stops in (stop, ["zzzz-never", stop]):
        cut = client.completions.create(model="tiny", prompt="Hello world", max_tokens=16, temperature=0, stop=stops)
        assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=16, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected

    short = chat(client, max_completion_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_seed_reproduces_a_sampled_completion(client: openai.OpenAI) -> None:
    def sample(seed: int | None) -> str:
        reply = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                          top_p=0.95, seed=seed)
        return reply.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1  # other seeds sample other text
    greedy = {client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16,
                                        temperature=0).choices[0].text for _ in range(2)}
    assert len(greedy) == 1 and first not in greedy


@pytest.mark.parametrize(("field", "value", "param"), [
    ("temperature", 2.5, "temperature"),
    ("top_p", -0.1, "top_p"),
    ("max_tokens", 0, "max_tokens"),
    ("max_completion_tokens", "8", "max_completion_tokens"),
    ("seed", 1.5, "seed"),
    ("stop", ["ok", 3], "stop"),
    ("stop", [f"s{i}" for i in range(17)], "stop"),
    ("n", 2, "n"),
    ("stream_options", {"include_usage": True}, "stream_options"),
    ("tools", [{"type": "function", "function": {"name": "no spaces"}}], "tools[0].function.name"),
    ("tools", {"type": "function"}, "tools"),
    ("tool_choice", "required", "tool_choice"),  # without tools
    ("tool_choice", "sometimes", "tool_choice"),
    ("parallel_tool_calls", "yes", "parallel_tool_calls"),
    ("functions", [{"name": "f"}], "functions"),
    ("response_format", {"type": "xml"}, "response_format.type"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer",
                                                                                         "minimum": 3}}},
     "response_format.json_schema.schema"),
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", "1", "frequency_penalty"),
    ("repeat_penalty", 0, "repeat_penalty"),
    ("min_p", 1.5, "min_p"),
    ("logit_bias", {"hello": 1}, "logit_bias"),
    ("logit_bias", {"-5": 1}, "logit_bias"),
    ("logit_bias", {"5": 101}, "logit_bias"),
    ("logit_bias", [5, 1], "logit_bias"),
    ("logprobs", 1, "logprobs"),
    ("top_logprobs", 3, "top_logprobs"),  # without logprobs: true
    ("top_logprobs", 21, "top_logprobs"),
    ("audio", {"voice": "x"}, "audio"),
    ("user", "", "user"),
    ("messages", [], "messages"),
    ("messages", [{"role": "robot", "content": "hi"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
    ("messages", [{"role": "user"}], "messages[0].content"),
    ("messages", [{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
    ("messages", [{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls"),
    ("messages", [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "city=Paris"}}]}], "messages[0].tool_calls[0].function.arguments"),
    ("messages", [{"role": "assistant", "content": None, "function_call": {"name": "f"}}],
     "messages[0].function_call"),
    ("frobnicate", True, "frobnicate"),
])
def test_a_bad_field_is_400_naming_it(client: openai.OpenAI, field: str, value: Any, param: str) -> None:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/chat/completions", body=body, cast_to=object)
    error = caught.value.body
    assert caught.value.status_code == 400 and caught.value.param == param
    assert error["code"] == "BAD_REQUEST" and error["type"] == "invalid_request_error"
    assert error["details"]["param"] == param and error["retryable"] is False and error["message"]


def test_the_error_envelope_is_p4_and_openai(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=10**9)
    error = caught.value.body
    assert set(error) == {"code", "message", "retryable", "details", "type", "param"}
    assert caught.value.code == "BAD_REQUEST" and caught.value.type == "invalid_request_error"
    assert error["details"]["maximum"] == schema.MAX_TOKENS_LIMIT


def test_context_overflow_and_ledger_denial(client: openai.OpenAI, app: Running) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, "word " * 400, model="small")
    assert caught.value.body["code"] == "CONTEXT_OVERFLOW" and caught.value.body["details"]["n_ctx"] == 256
    response = httpx.post(f"{app.appliance.http_url}/v1/completions", timeout=60,
                          json={"model": "huge", "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "VRAM_LEDGER_DENY"


def test_the_body_is_bounded_and_must_be_json(app: Running) -> None:
    url = f"{app.appliance.http_url}/v1/chat/completions"
    big = httpx.post(url, content=b"{" + b" " * (schema.MAX_BODY_BYTES + 1) + b"}", timeout=60,
                     headers={"content-type": "application/json"})
    assert big.status_code == 400 and big.json()["error"]["details"]["max_body_bytes"] == schema.MAX_BODY_BYTES
    for content in (b"not json", b"[1, 2]", b'{"a": NaN}', b"[" * 100 + b"]" * 100):
        refused = httpx.post(url, content=content, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "BAD_REQUEST"


def test_the_models_chat_template_is_used(client: openai.OpenAI, templated_model: Path) -> None:
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": " Hi"},
                {"role": "user", "content": "How are you"}]
    rendered = render_template(read_chat_template(templated_model), [Turn(**m) for m in messages])
    assert rendered == "<|user|>Hello</s><|assistant|> Hi</s><|user|>How are you</s><|assistant|>"
    by_chat = client.chat.completions.create(model="templated", messages=messages, max_tokens=8, temperature=0)
    by_prompt = client.completions.create(model="templated", prompt=rendered, max_tokens=8, temperature=0)
    assert by_chat.choices[0].message.content == by_prompt.choices[0].text
    assert by_chat.usage.prompt_tokens == by_prompt.usage.prompt_tokens

    with pytest.raises(openai.BadRequestError) as caught:  # the template's own raise_exception
        client.chat.completions.create(model="templated", messages=[{"role": "system", "content": "x"}])
    assert caught.value.param == "messages" and "no system messages, please" in caught.value.body["message"]


def test_a_disconnect_cancels_the_generation(app: Running) -> None:
    url = f"{app.appliance.http_url}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go on"}], "max_tokens": 1500,
            "temperature": 0, "stream": True}
    app.engine.delay_s = 0.05  # 1500 tokens would take over a minute
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            lines = response.iter_lines()
            got = [line for _, line in zip(range(4), lines, strict=False)]
            assert got[0].startswith("data: ") and app.daemon.generating == 1
        assert wait_until(lambda: app.daemon.generating == 0, timeout=10)
        assert wait_until(lambda: app.daemon.requests.recent(1)[0].outcome == "cancelled", timeout=10)
        assert app.daemon.requests.recent(1)[0].generated_tokens < 500

        # A plain (not streamed) request whose client goes away is cancelled too.
        plain = json.dumps({**body, "stream": False}).encode()
        host, port = app.appliance.http_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(plain)).encode() + b"\r\n\r\n" + plain)
            assert wait_until(lambda: app.daemon.generating == 1, timeout=20)
        assert wait_until(lambda: app.daemon.generating == 0, timeout=10)
    finally:
        app.engine.delay_s = 0.0


def test_an_error_after_the_stream_started_is_an_error_event(app: Running, client: openai.OpenAI) -> None:
    app.engine.delay_s = 0.05
    try:
        stream = chat(client, "Go on", max_tokens=1500, stream=True)
        with pytest.raises(openai.APIError) as caught:
            for index, _chunk in enumerate(stream):
                if index == 1:
                    app.call(cancel_running(app))
        assert caught.value.body["code"] == "CANCELLED" and caught.value.body["details"]["completion_tokens"] < 500
    finally:
        app.engine.delay_s = 0.0


async def cancel_running(app: Running) -> None:
    app.daemon.cancel_running()


# -- pure parts ------------------------------------------------------------------------------------------------


def test_the_plain_template_continues_its_own_generation_prompt() -> None:
    first = render_chat([Turn("user", "hi")])
    assert first == "user: hi\n" + GENERATION_PROMPT
    second = render_chat([Turn("user", "hi"), Turn("assistant", " there"), Turn("user", "more")])
    assert second == first + " there\nuser: more\n" + GENERATION_PROMPT


def test_render_template_is_sandboxed_and_refuses_in_p4() -> None:
    turns = [Turn("user", "hi")]
    template = ChatTemplate("{{ bos_token }}[{{ messages[0].content | upper }}]{{ messages | tojson }}", "<s>", "</s>")
    assert render_template(template, turns) == '[HI][{"role": "user", "content": "hi"}]'  # the BOS text dropped
    for source in ("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",  # sandboxed
                   "{% for x in range(10) %}",  # does not compile
                   "{{ messages.append(1) }}",  # immutable
                   "{{ raise_exception('roles must alternate') }}"):
        with pytest.raises(ApplianceError) as caught:
            render_template(ChatTemplate(source), turns)
        assert caught.value.code == "BAD_REQUEST" and caught.value.details["param"] == "messages"


def test_read_chat_template_without_one(tiny_model: Path) -> None:
    assert read_chat_template(tiny_model) == ChatTemplate(None, "<s>", "</s>")


def test_request_checks() -> None:
    request = schema.chat_request({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": None,
                                                                        "tool_calls": []}],
        "stop": "x", "max_tokens": 5, "max_completion_tokens": 7, "stream": True,
        "stream_options": {"include_usage": True}, "n": 1, "metadata": {"k": "v"}})
    assert request.messages == (Message("user", "ab"), Message("assistant", None))
    assert request.stop == ("x",) and request.max_tokens == 7 and request.include_usage
    assert request.temperature == 1.0 and request.seed is None
    assert request.sampling(5).seed == 5 and schema.completion_request(
        {"model": "m", "prompt": ["p"], "seed": -1}).sampling(5).seed == (-1) % (2**32 - 1)
    assert schema.agent_name("u", None) == "u" and schema.agent_name("u", " h ") == "h"
    assert schema.agent_name(None, None) is None
    with pytest.raises(ApplianceError) as caught:
        schema.completion_request({"model": "m", "prompt": [1, 2, 3]})
    assert caught.value.details["param"] == "prompt"
