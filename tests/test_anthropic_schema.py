"""The Anthropic Messages API's pure translation (appliance/http/anthropic_schema.py): request bodies into the one
chat request, results and parser events into Anthropic's JSON and events, errors into its envelope. No sockets."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.engine import toolcalls
from appliance.engine.chat import Message
from appliance.engine.streamtext import StreamText
from appliance.errors import ApplianceError
from appliance.http import anthropic_schema as schema

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "The weather", "input_schema": SCHEMA}
USER = [{"role": "user", "content": "Hi"}]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": USER, **fields}


# -- requests ------------------------------------------------------------------------------------------------------


def test_defaults_and_sampling_fields() -> None:
    request = schema.messages_request(body())
    assert (request.model, request.max_tokens, request.stream, request.user) == ("m", 8, False, None)
    assert (request.temperature, request.top_p, request.stop) == (1.0, 1.0, ())
    assert request.messages == (Message("user", "Hi"),) and request.tools == () and request.tool_choice == "auto"
    request = schema.messages_request(body(temperature=0.2, top_p=0.5, top_k=7, stream=True,
                                           stop_sequences=["END", "\n\n"], metadata={"user_id": "agent-7"}))
    assert (request.temperature, request.top_p, request.top_k, request.stream) == (0.2, 0.5, 7, True)
    assert request.stop == ("END", "\n\n") and request.user == "agent-7"
    sampling = request.sampling(5)
    assert (sampling.temperature, sampling.top_k, sampling.stop) == (0.2, 7, ("END", "\n\n"))


@pytest.mark.parametrize(("system", "wanted"), [
    (None, ()),
    ("Be terse.", (Message("system", "Be terse."),)),
    ([{"type": "text", "text": "Be "}, {"type": "text", "text": "terse.", "cache_control": {"type": "ephemeral"}}],
     (Message("system", "Be terse."),)),
    ("", ()),
])
def test_system_is_a_system_message(system: Any, wanted: tuple[Message, ...]) -> None:
    fields = {} if system is None else {"system": system}
    assert schema.messages_request(body(**fields)).messages[:-1] == wanted


def test_blocks_become_the_chats_messages_calls_and_results() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look.", "citations": None},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}, "caller": None},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"},
             "caller": {"type": "direct"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "-4 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no station"}]},
            {"type": "text", "text": "And now?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
    ]
    got = schema.messages_request(body(messages=messages, tools=[TOOL])).messages
    assert got == (
        Message("user", "Weather in Oslo?"),
        Message("assistant", "Let me look.", (toolcalls.ToolCall("toolu_1", "get_weather", '{"city": "Oslo"}'),
                                              toolcalls.ToolCall("toolu_2", "get_weather", '{"city": "Rome"}'))),
        Message("tool", "-4 C", tool_call_id="toolu_1"),
        Message("tool", schema.ERROR_PREFIX + "no station", tool_call_id="toolu_2"),
        Message("user", "And now?"),
        Message("assistant", None, (toolcalls.ToolCall("toolu_3", "get_weather", '{"city": "Paris"}'),)),
        Message("tool", "", tool_call_id="toolu_3"),
    )


@pytest.mark.parametrize(("choice", "wanted", "parallel"), [
    (None, "auto", True),
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "get_weather"}, toolcalls.Named("get_weather"), True),
    ({"type": "none"}, "none", True),
])
def test_tool_choice_becomes_the_grammars_choice(choice: Any, wanted: toolcalls.Choice, parallel: bool) -> None:
    fields = {"tools": [TOOL]} if choice is None else {"tools": [TOOL], "tool_choice": choice}
    request = schema.messages_request(body(**fields))
    assert request.tools == (toolcalls.Tool("get_weather", "The weather", SCHEMA),)
    assert (request.tool_choice, request.parallel_tool_calls) == (wanted, parallel)
    assert request.calls_tools == (wanted != "none")


def test_count_tokens_takes_the_prompts_fields_only() -> None:
    request = schema.messages_request({"model": "m", "messages": USER, "system": "S"}, counting=True)
    assert request.messages == (Message("system", "S"), Message("user", "Hi")) and request.max_tokens is None
    for field, value in (("max_tokens", 8), ("stream", True), ("stop_sequences", ["x"])):
        with pytest.raises(ApplianceError) as caught:
            schema.messages_request({"model": "m", "messages": USER, field: value}, counting=True)
        assert caught.value.details["param"] == field


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
BAD = [
    ({"max_tokens": None}, "max_tokens", "max_tokens is required"),
    ({"model": ""}, "model", "model must be a string"),
    ({"max_tokens": 0}, "max_tokens", "from 1 to"),
    ({"temperature": 1.5}, "temperature", "from 0 to 1"),
    ({"top_k": -1}, "top_k", "integer"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"n": 2}, "n", "unknown or unsupported field"),
    ({"stop_sequences": "END"}, "stop_sequences", "a list"),
    ({"stop_sequences": [""]}, "stop_sequences", "1 to"),
    ({"metadata": {"user_id": ["agent-7"]}}, "metadata.user_id", "metadata.user_id must be a string"),
    ({"metadata": {"tenant": "x"}}, "metadata.tenant", "unknown field"),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens", "integer"),
    ({"messages": []}, "messages", "1 to"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role", "user, assistant or system"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0].type", "images are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type", "documents are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}]},
     "messages[0].content[0].content[0].type", "images are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type", "a user message takes text and tool_result blocks"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]},
     "messages[0].content[0].input", "must be an object"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {},
                                                      "caller": {"type": "code_execution_20250825"}}]}]},
     "messages[0].content[0].caller", "runs no tools"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}]},
     "messages[0].content[0].extra", "unknown field"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "no"}]}]},
     "messages[0].content[0].is_error", "true or false"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", "server tool"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "required"),
    ({"tools": [{"name": "bad name", "input_schema": SCHEMA}]}, "tools[0].name", "letters, digits"),
    ({"tools": [TOOL, TOOL]}, "tools[1].name", "two tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema", "of an object"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name", "not among the tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "required"}}, "tool_choice", "tool_choice must be"),
    ({"tools": [TOOL], "tool_choice": {"type": "auto", "name": "x"}}, "tool_choice.name", "unknown field"),
    ({"tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}},
     "tool_choice.disable_parallel_tool_use", "true or false"),
]


@pytest.mark.parametrize(("fields", "param", "says"), BAD)
def test_a_bad_field_is_a_bad_request_naming_it(fields: dict[str, Any], param: str, says: str) -> None:
    given = body(**fields)
    given = {key: value for key, value in given.items() if value is not None}
    with pytest.raises(ApplianceError) as caught:
        schema.messages_request(given)
    assert caught.value.code == "BAD_REQUEST"
    assert caught.value.details["param"] == param
    assert says in caught.value.message


# -- responses -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("reason", "called", "generated", "sequence", "wanted"), [
    ("eos", False, 3, None, "end_turn"),
    ("eos", True, 3, None, "tool_use"),
    ("stop", False, 3, "END", "stop_sequence"),
    ("stop", False, 3, None, "end_turn"),  # a grammar that allows no more tokens
    ("stop", True, 3, None, "tool_use"),
    ("length", False, 8, None, "max_tokens"),
    ("length", True, 8, None, "max_tokens"),
    ("length", False, 5, None, "model_context_window_exceeded"),
])
def test_stop_reason(reason: Any, called: bool, generated: int, sequence: str | None, wanted: str) -> None:
    assert schema.stop_reason(reason, called, generated, 8, sequence) == wanted


def test_usage_splits_the_prompt_into_evaluated_and_reused() -> None:
    assert schema.usage(100, 7, 60) == {"input_tokens": 40, "output_tokens": 7, "cache_read_input_tokens": 60,
                                        "cache_creation_input_tokens": 0}


def test_content_blocks() -> None:
    whole = toolcalls.ToolCall("toolu_a", "f", '{"city": "Oslo"}')
    cut = toolcalls.ToolCall("toolu_b", "f", '{"city": "Os')
    assert schema.content_blocks("", []) == [{"type": "text", "text": ""}]
    assert schema.content_blocks("", [whole, cut]) == [{"type": "tool_use", "id": "toolu_a", "name": "f",
                                                        "input": {"city": "Oslo"}}]
    assert [b["type"] for b in schema.content_blocks("Sure.", [whole])] == ["text", "tool_use"]


def test_ids_have_anthropics_prefixes_and_are_new() -> None:
    assert schema.message_id().startswith("msg_") and schema.tool_use_id().startswith("toolu_")
    assert len({schema.tool_use_id() for _ in range(50)}) == 50


def parsed(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """Each SSE event as (its event name, its data), checking the name is the data's type."""
    events = []
    for chunk in chunks:
        text = chunk.decode()
        assert text.endswith("\n\n")
        head, data = text.strip().split("\n")
        name = head.removeprefix("event: ")
        value = json.loads(data.removeprefix("data: "))
        assert value["type"] == name
        events.append((name, value))
    return events


def test_stream_blocks_from_parser_events() -> None:
    blocks = schema.StreamBlocks()
    chunks = blocks.feed([toolcalls.Content("Let "), toolcalls.Content("me.")])
    chunks += blocks.feed([toolcalls.CallStart(0, "toolu_x", "f"), toolcalls.CallArguments(0, '{"city"'),
                           toolcalls.CallArguments(0, ': "Oslo"}'), toolcalls.CallStart(1, "toolu_y", "g")])
    chunks += blocks.finish()
    events = parsed(chunks)
    assert [name for name, _ in events] == [
        "content_block_start", "ping", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_stop"]
    assert events[0][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "me."}
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}
    assert [e[1]["delta"]["partial_json"] for e in events[6:8]] == ['{"city"', ': "Oslo"}']
    assert [e[1]["index"] for e in events if e[0] != "ping"] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert blocks.called


def test_a_stream_without_output_has_one_empty_text_block() -> None:
    blocks = schema.StreamBlocks()
    assert [name for name, _ in parsed(blocks.finish())] == ["content_block_start", "ping", "content_block_stop"]
    assert not blocks.called


def test_message_start_and_end() -> None:
    (name, start), = parsed([schema.message_start("msg_1", "m")])
    assert start["message"] == {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
                                "stop_reason": None, "stop_sequence": None, "usage": schema.usage(0, 0, 0)}
    end = parsed(schema.message_end("stop_sequence", "END", schema.usage(9, 2, 4)))
    assert end == [("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
                                      "usage": schema.usage(9, 2, 4)}),
                   ("message_stop", {"type": "message_stop"})]


@pytest.mark.parametrize(("code", "kind"), [
    ("BAD_REQUEST", "invalid_request_error"), ("CONTEXT_OVERFLOW", "invalid_request_error"),
    ("UNAUTHORIZED", "authentication_error"), ("FORBIDDEN", "permission_error"), ("NOT_FOUND", "not_found_error"),
    ("UNKNOWN_MODEL", "not_found_error"), ("TOO_MANY_AGENTS", "rate_limit_error"),
    ("SHUTTING_DOWN", "overloaded_error"), ("VRAM_LEDGER_DENY", "overloaded_error"), ("OOM", "overloaded_error"),
    ("TIMEOUT", "timeout_error"), ("INTERNAL", "api_error"), ("MODEL_LOAD_FAILED", "api_error"),
])
def test_errors_in_anthropics_envelope_keep_the_p4_error(code: str, kind: str) -> None:
    error = ApplianceError(code, "why", {"param": "x"})
    assert schema.error_document(error) == {"type": "error", "error": {
        "type": kind, "message": "why", "code": code, "retryable": error.retryable, "details": {"param": "x"}}}


# -- the engine's stop string --------------------------------------------------------------------------------------


def test_the_stream_text_says_which_stop_string_ended_it() -> None:
    text = StreamText(("zz", "END", "ND"))
    assert text.push(b"abc E") == "abc "
    assert text.matched is None
    assert text.push(b"ND more") == "" and text.stopped  # the held "E" began the stop string
    assert text.matched == "END"  # "ND" is found too, later in the text: the earliest one wins
    tie = StreamText(("ab", "abc"))
    tie.push(b"xabc", last=True)
    assert tie.matched == "ab"  # both begin at the same place: the first given
