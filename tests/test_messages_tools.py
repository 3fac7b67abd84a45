"""MAGN messages' tool and sampling fields (SPEC P3): tool_choice, logprobs and the sampling settings of INFER_REQUEST,
a chat message's tool_calls / tool_call_id, a tool call's id. Each is optional, checked like the others, and left out
of the payload while it is null (a peer that does not know it still reads every message that does not use it)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.protocol.frames import LocalProtocolError, RemoteProtocolError
from appliance.protocol.messages import (
    MAX_SEED,
    MAX_TOOL_CALLS,
    ROLES,
    TOOL_CHOICES,
    ChatMessage,
    InferRequest,
    TaskComplete,
    ToolCall,
    Usage,
    parse_message,
)

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_1"}
CHAT = {"type": "INFER_REQUEST", "task_id": "t", "model": "qwen", "session_id": None, "prompt": None,
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": "", "tool_calls": [CALL]},
                     {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}],
        "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "stop": [], "stream": True,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "logprobs": True, "seed": 7,
        "top_k": 20, "min_p": 0.05, "repeat_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5}
NEW_FIELDS = ("tool_choice", "logprobs", "seed", "top_k", "min_p", "repeat_penalty", "frequency_penalty",
              "presence_penalty")


def with_(**changes: Any) -> dict[str, Any]:
    payload = dict(CHAT)
    for key, value in changes.items():
        if value is ...:
            payload.pop(key)
        else:
            payload[key] = value
    return payload


def refused_field(payload: dict[str, Any]) -> str:
    with pytest.raises(RemoteProtocolError) as info:
        parse_message(payload)
    assert info.value.code == "BAD_PAYLOAD" and not info.value.fatal
    return str(info.value.error.details["field"])


def test_every_new_field_parses_and_serialises_back_exactly() -> None:
    message = parse_message(CHAT)
    assert isinstance(message, InferRequest)
    assert message.to_payload() == CHAT
    assert message.messages is not None and message.messages[1].tool_calls == (
        ToolCall("get_weather", {"city": "Paris"}, "call_1"),)
    assert message.messages[2].tool_call_id == "call_1"
    assert (message.seed, message.top_k, message.logprobs) == (7, 20, True)
    assert isinstance(message.repeat_penalty, float) and message.frequency_penalty == 0.5


def test_null_new_fields_are_left_out_of_the_payload() -> None:
    payload = with_(**{key: None for key in NEW_FIELDS})
    message = parse_message(payload)
    assert isinstance(message, InferRequest) and message.tool_choice is None and message.seed is None
    sent = message.to_payload()
    assert not set(NEW_FIELDS) & set(sent)
    assert parse_message(sent) == message
    turns = InferRequest("t", model="m", messages=[ChatMessage("user", "hi")]).to_payload()["messages"]
    assert turns == [{"role": "user", "content": "hi"}]  # no "tool_calls": null, no "tool_call_id": null
    call = TaskComplete("t", "", Usage(1, 1), "tool_call", tool_call=ToolCall("f", {"a": 1}))
    assert call.to_payload()["tool_call"] == {"name": "f", "arguments": {"a": 1}}  # no "id": null


@pytest.mark.parametrize("choice", TOOL_CHOICES)
def test_the_three_tool_choice_words(choice: str) -> None:
    message = parse_message(with_(tool_choice=choice))
    assert isinstance(message, InferRequest) and message.tool_choice == choice


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": ["required"]}, "tool_choice"),
    ({"tool_choice": 1}, "tool_choice"),
    ({"tool_choice": "required", "prompt": "hi", "messages": None}, "tool_choice"),  # a prompt is raw text
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "stream": False}, "logprobs"),  # they come in STREAM_TOKEN only
    ({"seed": -1}, "seed"),
    ({"seed": MAX_SEED + 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": 11}, "repeat_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [CALL] * (MAX_TOOL_CALLS + 1)}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{}"}]}]},
     "messages[0].tool_calls[0].arguments"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "id": ""}]}]},
     "messages[0].tool_calls[0].id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize(("changes", "field"), INVALID, ids=[f"{f}-{i}" for i, (_, f) in enumerate(INVALID)])
def test_an_invalid_new_field_is_named(changes: dict[str, Any], field: str) -> None:
    assert refused_field(with_(**changes)) == field


def test_building_an_invalid_one_locally_raises_local_protocol_error() -> None:
    with pytest.raises(LocalProtocolError) as info:
        InferRequest("t", model="m", prompt="p", tool_choice="required")
    assert info.value.error.details == {"field": "tool_choice",
                                        "reason": "only allowed with messages (a prompt is raw text)"}
    with pytest.raises(LocalProtocolError):
        ChatMessage("system", "x", tool_call_id="c")


IDS = st.text(min_size=1, max_size=12)
JSON_OBJ = st.dictionaries(st.text(max_size=8), st.integers(-5, 5) | st.text(max_size=8), max_size=3)
CALLS = st.builds(ToolCall, IDS, JSON_OBJ, id=st.none() | IDS)
TURNS = st.builds(ChatMessage, st.sampled_from(ROLES), st.text(max_size=20)) | st.builds(
    ChatMessage, st.just("assistant"), st.text(max_size=20), tool_calls=st.lists(CALLS, min_size=1, max_size=2)) | \
    st.builds(ChatMessage, st.just("tool"), st.text(max_size=20), tool_call_id=IDS)
CHOICES = st.none() | st.sampled_from(TOOL_CHOICES) | st.builds(
    lambda name: {"type": "function", "function": {"name": name}}, IDS)
REQUESTS = st.builds(
    InferRequest, IDS, model=IDS, messages=st.lists(TURNS, min_size=1, max_size=4), stream=st.just(True),
    tool_choice=CHOICES, logprobs=st.none() | st.booleans(), seed=st.none() | st.integers(0, MAX_SEED),
    top_k=st.none() | st.integers(0, 100), min_p=st.none() | st.floats(0, 1),
    repeat_penalty=st.none() | st.floats(0.01, 10), frequency_penalty=st.none() | st.floats(-2, 2),
    presence_penalty=st.none() | st.floats(-2, 2))


@settings(max_examples=200, deadline=None)
@given(message=REQUESTS | st.builds(TaskComplete, IDS, st.text(max_size=10), st.builds(Usage, st.just(1), st.just(2)),
                                    st.just("tool_call"), tool_call=CALLS))
def test_parse_of_to_payload_round_trips(message: Any) -> None:
    assert parse_message(message.to_payload()) == message
