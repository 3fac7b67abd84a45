"""Reasoning (``<think>…</think>``) in the Anthropic Messages API: a ``thinking`` block before the answer's blocks,
streamed as ``thinking_delta`` s, emptied with ``thinking.display: omitted``, dropped with ``thinking.type:
disabled``, left in the text with ``models[].reasoning: inline``. Real Qwen3 and DeepSeek R1 templates; the fake
engine writes the reply (one token a character); the official ``anthropic`` client reads it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from harness import Running
from reasoning_app import QWEN3_REPLY, R1_REPLY, reasoning_app, reply_with

from appliance.engine import reasoning, toolcalls
from appliance.engine.reply import ReplyStream
from appliance.http import anthropic_schema as schema

ANSWER = "Rayleigh scattering."
CASES = [("r1", R1_REPLY, "The sky scatters blue light more."), ("qwen3", QWEN3_REPLY, "Short wavelengths scatter.")]
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


def parsed(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """Each SSE event as (its event name, its data)."""
    events = []
    for chunk in chunks:
        head, data = chunk.decode().strip().split("\n")
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


# -- pure ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "display"), [
    (None, "shown"), ({"type": "adaptive"}, "shown"), ({"type": "enabled", "budget_tokens": 1024}, "shown"),
    ({"type": "adaptive", "display": "summarized"}, "shown"), ({"type": "enabled", "display": "omitted"}, "omitted"),
    ({"type": "disabled"}, "dropped"),
])
def test_thinking_field_says_how_the_reasoning_is_shown(value: Any, display: str) -> None:
    assert schema.thinking(value) == display


@pytest.mark.parametrize(("thought", "display", "shown"), [
    (None, "shown", None), (None, "omitted", None), ("why", "shown", "why"), ("why", "omitted", ""),
    ("why", "dropped", None), ("", "shown", ""),
])
def test_shown_thought(thought: str | None, display: schema.ThinkingDisplay, shown: str | None) -> None:
    assert schema.shown_thought(thought, display) == shown


def test_content_blocks_put_the_thinking_block_first() -> None:
    call = toolcalls.ToolCall("toolu_a", "f", '{"city": "Oslo"}')
    thinking = {"type": "thinking", "thinking": "hm", "signature": ""}
    assert schema.content_blocks("Hi.", [], "hm") == [thinking, {"type": "text", "text": "Hi."}]
    assert schema.content_blocks("", [], "hm") == [thinking]  # cut short in its reasoning: no empty text block
    assert [block["type"] for block in schema.content_blocks("", [call], "hm")] == ["thinking", "tool_use"]
    assert schema.content_blocks("Hi.", [], None) == [{"type": "text", "text": "Hi."}]


def test_stream_blocks_send_a_thinking_block_before_the_text() -> None:
    blocks = schema.StreamBlocks()
    chunks = blocks.feed([reasoning.Reasoning("Short "), reasoning.Reasoning("waves."), toolcalls.Content("Ray")])
    chunks += blocks.finish()
    events = parsed(chunks)
    assert [name for name, _ in events] == [
        "content_block_start", "ping", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop"]
    assert events[0][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [data["delta"] for _, data in events[2:4]] == [{"type": "thinking_delta", "thinking": "Short "},
                                                          {"type": "thinking_delta", "thinking": "waves."}]
    assert events[5][1] == {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}


def test_stream_blocks_omit_or_drop_the_reasoning_as_displayed() -> None:
    omitted = schema.StreamBlocks(display="omitted")
    events = parsed(omitted.feed([reasoning.Reasoning("secret"), toolcalls.Content("Hi.")]) + omitted.finish())
    assert [(name, data.get("content_block", data.get("delta"))) for name, data in events if name != "ping"] == [
        ("content_block_start", {"type": "thinking", "thinking": "", "signature": ""}), ("content_block_stop", None),
        ("content_block_start", {"type": "text", "text": ""}), ("content_block_delta",
                                                                {"type": "text_delta", "text": "Hi."}),
        ("content_block_stop", None)]
    dropped = schema.StreamBlocks(display="dropped")
    events = parsed(dropped.feed([reasoning.Reasoning("secret")]) + dropped.finish())
    assert [data.get("content_block") for name, data in events if name == "content_block_start"] == [
        {"type": "text", "text": ""}]


def test_reply_stream_splits_the_reasoning_before_parsing_the_answer() -> None:
    stream = ReplyStream(reasoning.StreamSplitter(reasoning.Markers(), inside=True), None)
    events = [event for piece in (R1_REPLY[:20], R1_REPLY[20:38], R1_REPLY[38:]) for event in stream.feed(piece)]
    events += stream.finish()
    thought = "".join(event.text for event in events if isinstance(event, reasoning.Reasoning))
    answer = "".join(event.text for event in events if isinstance(event, toolcalls.Content))
    assert (thought, answer) == ("The sky scatters blue light more.", ANSWER)
    plain = ReplyStream(None, None)
    assert [*plain.feed(QWEN3_REPLY), *plain.finish()] == [toolcalls.Content(QWEN3_REPLY)]


# -- over HTTP, with the official client ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(chat_model: Any) -> Iterator[Running]:
    with reasoning_app(chat_model) as running_app:
        yield running_app


@pytest.fixture
def client(app: Running) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=app.appliance.http_url, api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize(("model", "reply", "thought"), CASES)
def test_plain_message_has_a_thinking_block_before_the_text(app: Running, client: anthropic.Anthropic, model: str,
                                                            reply: str, thought: str) -> None:
    reply_with(app, reply)
    message = client.messages.create(model=model, max_tokens=200, messages=QUESTION)
    assert [block.type for block in message.content] == ["thinking", "text"]
    block, text = message.content
    assert isinstance(block, anthropic.types.ThinkingBlock)
    assert (block.thinking, block.signature) == (thought, "")
    assert isinstance(text, anthropic.types.TextBlock) and text.text == ANSWER
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize(("model", "reply", "thought"), CASES)
def test_stream_sends_thinking_deltas_before_the_text(app: Running, client: anthropic.Anthropic, model: str,
                                                      reply: str, thought: str) -> None:
    reply_with(app, reply)
    with client.messages.stream(model=model, max_tokens=200, messages=QUESTION) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert "".join(delta.thinking for delta in deltas if delta.type == "thinking_delta") == thought
    assert "".join(delta.text for delta in deltas if delta.type == "text_delta") == ANSWER
    kinds = [delta.type for delta in deltas]
    assert kinds.index("text_delta") > max(at for at, kind in enumerate(kinds) if kind == "thinking_delta")
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == thought and final.content[1].text == ANSWER


def test_reasoning_cut_short_is_a_thinking_block_alone(app: Running, client: anthropic.Anthropic) -> None:
    reply_with(app, R1_REPLY)
    message = client.messages.create(model="r1", max_tokens=10, messages=QUESTION)
    assert [block.type for block in message.content] == ["thinking"]
    assert message.content[0].thinking == R1_REPLY[:10] and message.stop_reason == "max_tokens"


def test_disabled_thinking_drops_the_reasoning(app: Running, client: anthropic.Anthropic) -> None:
    reply_with(app, QWEN3_REPLY)
    message = client.messages.create(model="qwen3", max_tokens=200, messages=QUESTION,
                                     thinking={"type": "disabled"})
    assert [(block.type, getattr(block, "text", None)) for block in message.content] == [("text", ANSWER)]
    with client.messages.stream(model="qwen3", max_tokens=200, messages=QUESTION,
                                thinking={"type": "disabled"}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == ANSWER and [block.type for block in final.content] == ["text"]


def test_omitted_display_sends_empty_thinking_blocks(app: Running, client: anthropic.Anthropic) -> None:
    reply_with(app, R1_REPLY)
    thinking: Any = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    message = client.messages.create(model="r1", max_tokens=200, messages=QUESTION, thinking=thinking)
    assert [(block.type, getattr(block, "thinking", None)) for block in message.content] == [("thinking", ""),
                                                                                             ("text", None)]
    with client.messages.stream(model="r1", max_tokens=200, messages=QUESTION, thinking=thinking) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert not [event for event in events if event.type == "content_block_delta" and event.delta.type ==
                "thinking_delta"]
    assert final.content[0].type == "thinking" and final.content[0].thinking == ""
    assert final.content[1].text == ANSWER


def test_inline_keeps_the_reasoning_in_the_text(app: Running, client: anthropic.Anthropic) -> None:
    reply_with(app, R1_REPLY)
    message = client.messages.create(model="r1-inline", max_tokens=200, messages=QUESTION)
    assert [(block.type, getattr(block, "text", None)) for block in message.content] == [("text", R1_REPLY)]


def test_count_tokens_counts_what_the_generation_counts(app: Running, client: anthropic.Anthropic) -> None:
    reply_with(app, QWEN3_REPLY)
    counted = client.messages.count_tokens(model="qwen3", messages=QUESTION)
    message = client.messages.create(model="qwen3", max_tokens=200, messages=QUESTION)
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
