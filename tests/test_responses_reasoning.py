"""Reasoning (``<think>…</think>``) in the Responses API: a ``reasoning`` output item (its text as ``reasoning_text``
content) before the answer's message, streamed with ``response.reasoning_text.*`` events, kept out of the history a
follow-up renders, left in the text with ``models[].reasoning: inline``. Real Qwen3 and DeepSeek R1 templates; the
fake engine writes the reply; the official ``openai`` client reads it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from harness import Running
from reasoning_app import QWEN3_REPLY, R1_REPLY, reasoning_app, reply_with

from appliance.engine import reasoning, toolcalls
from appliance.errors import ApplianceError
from appliance.http import responses_schema as schema

ANSWER = "Rayleigh scattering."
CASES = [("r1", R1_REPLY, "The sky scatters blue light more."), ("qwen3", QWEN3_REPLY, "Short wavelengths scatter.")]


@pytest.fixture(scope="module")
def app(chat_model: Any) -> Iterator[Running]:
    with reasoning_app(chat_model) as running_app:
        yield running_app


@pytest.fixture
def client(app: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.appliance.http_url}/v1", api_key="none", max_retries=0, timeout=60)


# -- pure ----------------------------------------------------------------------------------------------------------


def test_output_puts_reasoning_in_its_own_item_before_the_message() -> None:
    output = schema.Output()
    events = output.feed([reasoning.Reasoning("Short "), reasoning.Reasoning("wavelengths."),
                          toolcalls.Content("Rayleigh.")])
    events += output.finish(False)
    kinds = [event["type"] for event in events]
    assert kinds == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    thought, message = output.items
    assert thought["type"] == "reasoning" and thought["id"].startswith("rs_") and thought["summary"] == []
    assert thought["content"] == [{"type": "reasoning_text", "text": "Short wavelengths."}]
    assert thought["status"] == "completed" and message["status"] == "completed"
    assert events[4]["text"] == "Short wavelengths." and events[4]["item_id"] == thought["id"]
    assert all(event["output_index"] == 1 for event in events[7:] if "output_index" in event)


def test_reasoning_cut_short_is_an_incomplete_reasoning_item_alone() -> None:
    output = schema.Output()
    output.feed([reasoning.Reasoning("still thinking")])
    output.finish(True)
    assert [(item["type"], item["status"]) for item in output.items] == [("reasoning", "incomplete")]


def test_reasoning_items_sent_back_as_input_are_not_rendered() -> None:
    item = {"type": "reasoning", "id": "rs_1", "summary": [],
            "content": [{"type": "reasoning_text", "text": "thought"}], "status": "completed"}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]}
    messages = schema.input_messages([{"role": "user", "content": "Hello"}, item, answer])
    assert [(message.role, message.text) for message in messages] == [("user", "Hello"), ("assistant", "Hi.")]


def test_a_malformed_reasoning_item_is_refused_naming_it() -> None:
    bad = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "output_text", "text": "x"}]}
    with pytest.raises(ApplianceError) as caught:
        schema.input_messages([{"role": "user", "content": "Hello"}, bad])
    assert caught.value.code == "BAD_REQUEST"
    assert caught.value.details["param"] == "input[1].summary[0]"


# -- over HTTP, with the official client ---------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "reply", "thought"), CASES)
def test_plain_response_has_a_reasoning_item_before_the_message(app: Running, client: openai.OpenAI, model: str,
                                                                reply: str, thought: str) -> None:
    reply_with(app, reply)
    response = client.responses.create(model=model, input="Why is the sky blue?", max_output_tokens=200)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    item = response.output[0]
    assert item.id.startswith("rs_") and item.summary == []
    assert [(part.type, part.text) for part in item.content or []] == [("reasoning_text", thought)]
    assert response.output_text == ANSWER


@pytest.mark.parametrize(("model", "reply", "thought"), CASES)
def test_stream_has_reasoning_text_events(app: Running, client: openai.OpenAI, model: str, reply: str,
                                          thought: str) -> None:
    reply_with(app, reply)
    with client.responses.stream(model=model, input="Why is the sky blue?", max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    done = [event.text for event in events if event.type == "response.reasoning_text.done"]
    assert deltas == thought and done == [thought]
    answered = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert answered == ANSWER
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == thought and final.output_text == ANSWER


def test_inline_keeps_the_reasoning_in_the_answer(app: Running, client: openai.OpenAI) -> None:
    reply_with(app, R1_REPLY)
    response = client.responses.create(model="r1-inline", input="Why?", max_output_tokens=200)
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == R1_REPLY


def test_a_follow_up_continues_after_a_reasoning_response(app: Running, client: openai.OpenAI) -> None:
    reply_with(app, QWEN3_REPLY)
    first = client.responses.create(model="qwen3", input="Why is the sky blue?", max_output_tokens=200)
    reply_with(app, "<think>\nAgain.\n</think>\n\nStill scattering.")
    second = client.responses.create(model="qwen3", input="And at sunset?", previous_response_id=first.id,
                                     max_output_tokens=200)
    assert second.output_text == "Still scattering."
    assert [item.type for item in second.output] == ["reasoning", "message"]
    manual = client.responses.create(model="qwen3", max_output_tokens=200, store=False, input=[
        {"role": "user", "content": "Why is the sky blue?"}, *[item.model_dump(exclude_none=True)
                                                                for item in first.output],
        {"role": "user", "content": "And at sunset?"}])
    assert manual.output_text == "Still scattering."
    assert manual.usage.input_tokens == second.usage.input_tokens  # the same conversation, rendered alike
