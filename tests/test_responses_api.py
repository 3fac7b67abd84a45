"""The OpenAI Responses API on a real appliance, driven by the official ``openai`` client (``client.responses``), on a
model with Qwen2.5's real tokenizer and chat template (random weights: the text babbles, tokens and grammars are
real): plain, streamed, a function tool under ``tool_choice="required"``, ``previous_response_id`` evaluating only
the new turn, GET and DELETE of a stored response, and the input token count."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import llama_cpp
import openai
import pytest
from harness import Running, running
from test_real_vocab import CASES

from appliance.engine.chat import Message, read_chat_template, render_prompt

NAME = "qwen2.5"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def model(chat_model: Callable[..., Path]) -> Path:
    case = CASES[NAME]
    return chat_model(case.vocab, case.template, case.special_tokens)


@pytest.fixture(scope="module")
def app(model: Path) -> Iterator[Running]:
    with running({NAME: {"path": str(model), "n_ctx": 2048}}, model_dirs=[model.parent]) as running_app:
        yield running_app


@pytest.fixture
def client(app: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.appliance.http_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def vocabulary(model: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)


def count(llm: llama_cpp.Llama, messages: list[Message], **kwargs: Any) -> int:
    text = render_prompt(read_chat_template(Path(llm.model_path)), messages, **kwargs).text
    return len(llm.tokenize(text.encode(), add_bos=True, special=True))


def test_a_plain_response_has_its_message_and_usage(app: Running, client: openai.OpenAI,
                                                   vocabulary: llama_cpp.Llama) -> None:
    answer = client.responses.create(model=NAME, input="Hello", instructions="Be terse.", max_output_tokens=5,
                                     temperature=0, store=False)
    assert answer.id.startswith("resp_") and answer.object == "response"
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    [message] = answer.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].type == "output_text" and answer.output_text == message.content[0].text
    expected = count(vocabulary, [Message("system", "Be terse."), Message("user", "Hello")])
    assert answer.usage.input_tokens == expected
    assert answer.usage.output_tokens == 5 and answer.usage.total_tokens == expected + 5
    record = app.daemon.requests.recent(1)[0]  # the request log and the metrics name the API
    assert record.surface == "responses" and record.prompt_tokens == expected


def test_a_streamed_response_sends_the_documented_events(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=NAME, input="Hello", max_output_tokens=4, temperature=0,
                                          stream=True, store=False))
    kinds = [event.type for event in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas == events[-4].text and final.usage.output_tokens == 4


def test_a_required_tool_gives_a_call_whose_arguments_validate(client: openai.OpenAI) -> None:
    answer = client.responses.create(model=NAME, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=120, temperature=0, store=False)
    assert answer.status == "completed" and answer.parallel_tool_calls is False
    [call] = answer.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_the_stream_helper_assembles_a_call(client: openai.OpenAI) -> None:
    with client.responses.stream(model=NAME, input="Weather?", tools=[WEATHER], max_output_tokens=120,
                                 tool_choice={"type": "function", "name": "get_weather"}, store=False) as stream:
        pieces = [event.delta for event in stream if event.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert "".join(pieces) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_follow_up_evaluates_only_the_new_turn(app: Running, client: openai.OpenAI,
                                                 vocabulary: llama_cpp.Llama) -> None:
    first = client.responses.create(model=NAME, input="Hello", instructions="Be terse.", max_output_tokens=6,
                                    temperature=0)
    assert first.store and first.id in app.daemon.agents  # its conversation is an agent named by its id
    held = len(app.daemon.agents[first.id].conversation.tokens)
    second = client.responses.create(model=NAME, input="And tomorrow?", instructions="Be terse.",
                                     previous_response_id=first.id, max_output_tokens=4, temperature=0)
    history = [Message("system", "Be terse."), Message("user", "Hello"), Message("assistant", first.output_text),
               Message("user", "And tomorrow?")]
    assert second.usage.input_tokens == count(vocabulary, history)
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens <= cached < held  # all but the reply's last token (sampled, never evaluated)
    assert second.previous_response_id == first.id and second.id not in app.daemon.agents

    fetched = client.responses.retrieve(second.id)
    assert fetched.id == second.id and fetched.output_text == second.output_text
    client.responses.delete(first.id)
    assert first.id in app.daemon.agents  # the second response is still in that conversation
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(first.id)
    assert caught.value.body["code"] == "NOT_FOUND" and caught.value.body["param"] == "response_id"
    client.responses.delete(second.id)
    assert first.id not in app.daemon.agents  # its last stored response gone: so is the agent
    unknown = httpx.delete(f"{app.appliance.http_url}/v1/responses/no-such-thing", timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "NOT_FOUND"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAME, input="Hi", previous_response_id=second.id, max_output_tokens=2)


def test_input_tokens_counts_the_rendered_input(app: Running, vocabulary: llama_cpp.Llama) -> None:
    body = {"model": NAME, "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
            "instructions": "Be terse."}
    reply = httpx.post(f"{app.appliance.http_url}/v1/responses/input_tokens", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    expected = count(vocabulary, [Message("system", "Be terse."), Message("user", "Hello")])
    assert reply.json() == {"object": "response.input_tokens", "input_tokens": expected}


def test_stored_responses_follow_max_agents_and_expire_with_their_agent(model: Path) -> None:
    with running({NAME: {"path": str(model), "n_ctx": 1024}}, model_dirs=[model.parent], max_agents=1,
                 agent_idle_ttl_s=600) as app:
        client = openai.OpenAI(base_url=f"{app.appliance.http_url}/v1", api_key="none", max_retries=0, timeout=120)
        first = client.responses.create(model=NAME, input="Hello", max_output_tokens=2)
        with pytest.raises(openai.RateLimitError) as caught:  # a new stored conversation is a new agent
            client.responses.create(model=NAME, input="Hello", max_output_tokens=2)
        assert caught.value.body["code"] == "TOO_MANY_AGENTS"
        assert client.responses.create(model=NAME, input="Hello", max_output_tokens=2, store=False).output
        follow_up = client.responses.create(model=NAME, input="More", max_output_tokens=2,
                                            previous_response_id=first.id)
        assert follow_up.usage.input_tokens_details.cached_tokens > 0  # in first's conversation: no new agent

        later = app.daemon.clock() + 601

        def ten_minutes_on() -> float:  # idle past agent_idle_ttl_s, as the sweep sees it
            return later

        app.daemon.clock = ten_minutes_on
        assert app.call(app.daemon.expire_agents()) == [first.id]
        for gone in (first.id, follow_up.id):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(gone)
        assert client.responses.create(model=NAME, input="Hello", max_output_tokens=2).id in app.daemon.agents


def test_a_failed_stored_response_leaves_no_agent(app: Running, client: openai.OpenAI) -> None:
    before = set(app.daemon.agents)
    with pytest.raises(openai.BadRequestError) as caught:  # over the 2048-token context
        client.responses.create(model=NAME, input="word " * 3000, max_output_tokens=2)
    assert caught.value.body["code"] == "CONTEXT_OVERFLOW"
    deadline = time.monotonic() + 30
    while set(app.daemon.agents) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(app.daemon.agents) == before
