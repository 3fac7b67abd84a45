"""MAGN messages (SPEC P3, P4): wire shapes, validation, refusals and round trips."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.errors import TABLE, ApplianceError
from appliance.protocol.frames import Frame, FrameParser, LocalProtocolError, RemoteProtocolError
from appliance.protocol.identifiers import AGENT_ID
from appliance.protocol.messages import (
    MAX_EMBED_DIMENSIONS,
    MAX_EMBED_INPUTS,
    MAX_ID_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
    MESSAGE_TYPES,
    ROLES,
    SCHEMA,
    STOP_REASONS,
    Cancel,
    ChatMessage,
    Embeddings,
    EmbedRequest,
    EmbedUsage,
    ErrorBody,
    ErrorMessage,
    Heartbeat,
    InferRequest,
    ProtocolInfo,
    ProtocolInfoRequest,
    StreamToken,
    TaskComplete,
    TaskStart,
    ToolCall,
    Usage,
    encode_message,
    parse_message,
)

# One valid payload per message type: the documented wire shapes.
VALID: dict[str, dict[str, Any]] = {
    "TASK_START": {"type": "TASK_START", "task_id": "t1", "session_id": "agent-1", "model": "qwen",
                   "tools": [{"name": "search"}], "status": None},
    "INFER_REQUEST": {"type": "INFER_REQUEST", "task_id": "t2", "model": "qwen", "session_id": None,
                      "prompt": "hello", "messages": None, "max_tokens": 16, "temperature": 0.0, "top_p": 1.0,
                      "stop": ["\n"], "stream": True},
    "STREAM_TOKEN": {"type": "STREAM_TOKEN", "task_id": "t2", "text": "he", "token_id": 42,
                     "timestamp": 1700000000.5, "logprob": -0.25},
    "HEARTBEAT": {"type": "HEARTBEAT", "task_id": "t2", "timestamp": 1700000001.0},
    "TASK_COMPLETE": {"type": "TASK_COMPLETE", "task_id": "t2", "text": "hello world",
                      "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "stop_reason": "tool_call",
                      "timings": {"ttft_ms": 12.5, "elapsed_ms": 40.0},
                      "tool_call": {"name": "search", "arguments": {"q": "x"}}, "stats": {"plan": "S", "threads": 4}},
    "EMBED_REQUEST": {"type": "EMBED_REQUEST", "task_id": "e1", "model": "embed", "input": ["hello", "world"],
                      "dimensions": 2},
    "EMBEDDINGS": {"type": "EMBEDDINGS", "task_id": "e1", "model": "embed", "data": [[0.6, -0.8], [1.0, 0.0]],
                   "usage": {"prompt_tokens": 4}},
    "CANCEL": {"type": "CANCEL", "task_id": "t2"},
    "PROTOCOL_INFO": {"type": "PROTOCOL_INFO", "version": 1, "supported_versions": [1], "schema": SCHEMA,
                      "max_frame_bytes": 16777216, "server": "appliance", "server_version": "0.1.0"},
    "ERROR": {"type": "ERROR", "task_id": "t2",
              "error": {"code": "UNKNOWN_MODEL", "message": "no model nope", "retryable": False,
                        "details": {"model": "nope"}}},
}


def with_(kind: str, **changes: Any) -> dict[str, Any]:
    payload = dict(VALID[kind])
    for key, value in changes.items():
        if value is ...:
            payload.pop(key)
        else:
            payload[key] = value
    return payload


def refusal(payload: Any) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        parse_message(payload)
    assert info.value.code == "BAD_PAYLOAD" and not info.value.fatal
    return info.value


@pytest.mark.parametrize("kind", VALID)
def test_valid_payloads_parse_and_serialise_back_exactly(kind: str) -> None:
    message = parse_message(VALID[kind])
    assert message.to_payload()["type"] == kind
    assert message.to_payload() == VALID[kind]
    assert parse_message(message.to_payload()) == message


def test_protocol_info_request_has_no_fields() -> None:
    assert parse_message({"type": "PROTOCOL_INFO"}) == ProtocolInfoRequest()
    assert ProtocolInfoRequest().to_payload() == {"type": "PROTOCOL_INFO"}


def test_constructors_normalise_and_are_frozen() -> None:
    request = InferRequest("t", session_id="a", messages=[{"role": "user", "content": "hi"}], stop=["x"],
                           temperature=1)
    assert request.messages == (ChatMessage("user", "hi"),) and request.stop == ("x",)
    assert isinstance(request.temperature, float)
    assert request.model is None and request.max_tokens == 256 and request.stream is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.max_tokens = 5  # type: ignore[misc]
    done = TaskComplete("t", "x", {"prompt_tokens": 1, "completion_tokens": 1}, "length")  # type: ignore[arg-type]
    assert done.usage == Usage(1, 1) and done.timings == {} and done.stats == {} and done.tool_call is None


def test_error_message_carries_the_p4_shape() -> None:
    error = ApplianceError("VRAM_LEDGER_DENY", "no room", {"requested_table_bytes": 10})
    message = ErrorMessage.of(error, task_id="t9")
    assert message.to_payload() == {"type": "ERROR", "task_id": "t9", "error": error.to_dict()}
    assert message.error.retryable is True  # from the table, whatever the peer claimed
    raised = message.error.exception()
    assert (raised.code, raised.message, raised.details) == (error.code, error.message, error.details)
    connection = ErrorMessage.of(ApplianceError("TOO_MANY_CONNECTIONS"))
    assert connection.task_id is None and connection.error.message == TABLE["TOO_MANY_CONNECTIONS"].summary
    assert parse_message({"type": "ERROR", "error": {"code": "OOM"}}) == ErrorMessage(ErrorBody("OOM"))
    lying = parse_message(with_("ERROR", error={"code": "OOM", "retryable": False}))
    assert isinstance(lying, ErrorMessage) and lying.error.retryable is True


def test_message_types_registry() -> None:
    assert set(MESSAGE_TYPES) == {"TASK_START", "INFER_REQUEST", "STREAM_TOKEN", "HEARTBEAT", "TASK_COMPLETE",
                                  "EMBED_REQUEST", "EMBEDDINGS", "CANCEL", "PROTOCOL_INFO", "ERROR"}


# --- refusals -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("payload", [[], "x", None, 3, {"no": "type"}, {"type": "NOPE"}, {"type": 7},
                                     {"type": "task_start"}], ids=repr)
def test_not_an_object_or_unknown_type(payload: Any) -> None:
    assert refusal(payload).error.details["field"] == "type"


REQUIRED = [(kind, f.name) for kind, cls in MESSAGE_TYPES.items() for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


@pytest.mark.parametrize(("kind", "name"), REQUIRED)
def test_missing_required_field(kind: str, name: str) -> None:
    error = refusal(with_(kind, **{name: ...}))
    assert error.error.details["field"] == name and error.error.details["reason"] == "missing"
    assert error.error.details["type"] == kind


@pytest.mark.parametrize("kind", VALID)
def test_unknown_field(kind: str) -> None:
    error = refusal(with_(kind, surprise=1))
    assert error.error.details == {"field": "surprise", "reason": "unknown field", "type": kind}


INVALID = [
    ("INFER_REQUEST", {"max_tokens": 0}, "max_tokens"),
    ("INFER_REQUEST", {"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    ("INFER_REQUEST", {"max_tokens": "5"}, "max_tokens"),
    ("INFER_REQUEST", {"max_tokens": True}, "max_tokens"),
    ("INFER_REQUEST", {"max_tokens": 5.0}, "max_tokens"),
    ("INFER_REQUEST", {"temperature": -0.1}, "temperature"),
    ("INFER_REQUEST", {"temperature": 2.01}, "temperature"),
    ("INFER_REQUEST", {"temperature": 10**400}, "temperature"),
    ("INFER_REQUEST", {"temperature": float("nan")}, "temperature"),
    ("INFER_REQUEST", {"top_p": float("inf")}, "top_p"),
    ("INFER_REQUEST", {"stream": 1}, "stream"),
    ("STREAM_TOKEN", {"token_id": True}, "token_id"),
    ("STREAM_TOKEN", {"token_id": 2**31}, "token_id"),
    ("INFER_REQUEST", {"top_p": 0}, "top_p"),
    ("INFER_REQUEST", {"top_p": 1.5}, "top_p"),
    ("INFER_REQUEST", {"stop": "\n"}, "stop"),
    ("INFER_REQUEST", {"stop": [1]}, "stop[0]"),
    ("INFER_REQUEST", {"stop": [""]}, "stop[0]"),
    ("INFER_REQUEST", {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ("INFER_REQUEST", {"stream": "yes"}, "stream"),
    ("INFER_REQUEST", {"task_id": ""}, "task_id"),
    ("INFER_REQUEST", {"task_id": "x" * (MAX_ID_CHARS + 1)}, "task_id"),
    ("INFER_REQUEST", {"task_id": 7}, "task_id"),
    ("INFER_REQUEST", {"model": None}, "model"),  # neither model nor session_id
    ("INFER_REQUEST", {"prompt": None}, "prompt"),  # neither prompt nor messages
    ("INFER_REQUEST", {"messages": [{"role": "user", "content": "x"}]}, "prompt"),  # both
    ("INFER_REQUEST", {"prompt": None, "messages": []}, "messages"),
    ("INFER_REQUEST", {"prompt": None, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("INFER_REQUEST", {"prompt": None, "messages": [{"role": "user"}]}, "messages[0].content"),
    ("INFER_REQUEST", {"prompt": None, "messages": [{"role": "user", "content": "x", "name": "n"}]},
     "messages[0].name"),
    ("INFER_REQUEST", {"prompt": None, "messages": ["hi"]}, "messages[0]"),
    ("INFER_REQUEST", {"prompt": None, "messages": {"role": "user"}}, "messages"),
    ("INFER_REQUEST", {"prompt": 5}, "prompt"),
    ("TASK_START", {"tools": "search"}, "tools"),
    ("TASK_START", {"session_id": None}, "session_id"),
    ("TASK_START", {"status": ""}, "status"),
    ("STREAM_TOKEN", {"token_id": -1}, "token_id"),
    ("STREAM_TOKEN", {"logprob": 0.5}, "logprob"),
    ("STREAM_TOKEN", {"timestamp": -1}, "timestamp"),
    ("STREAM_TOKEN", {"text": None}, "text"),
    ("HEARTBEAT", {"timestamp": "now"}, "timestamp"),
    ("TASK_COMPLETE", {"stop_reason": "bored"}, "stop_reason"),
    ("TASK_COMPLETE", {"stop_reason": []}, "stop_reason"),
    ("TASK_COMPLETE", {"usage": {"prompt_tokens": -1, "completion_tokens": 0}}, "usage.prompt_tokens"),
    ("TASK_COMPLETE", {"usage": {"prompt_tokens": 1}}, "usage.completion_tokens"),
    ("TASK_COMPLETE", {"usage": [1, 2]}, "usage"),
    ("TASK_COMPLETE", {"timings": {"ttft_ms": -1}}, "timings.ttft_ms"),
    ("TASK_COMPLETE", {"timings": {"ttft_ms": "fast"}}, "timings.ttft_ms"),
    ("TASK_COMPLETE", {"tool_call": {"arguments": {}}}, "tool_call.name"),
    ("TASK_COMPLETE", {"tool_call": {"name": "f", "arguments": "x=1"}}, "tool_call.arguments"),
    ("TASK_COMPLETE", {"stats": []}, "stats"),
    ("EMBED_REQUEST", {"input": []}, "input"),
    ("EMBED_REQUEST", {"input": "hello"}, "input"),
    ("EMBED_REQUEST", {"input": ["a", 1]}, "input[1]"),
    ("EMBED_REQUEST", {"dimensions": 0}, "dimensions"),
    ("EMBEDDINGS", {"data": []}, "data"),
    ("EMBEDDINGS", {"data": [[0.6, -0.8], [1.0]]}, "data"),
    ("EMBEDDINGS", {"data": [[0.6, "x"]]}, "data[0][1]"),
    ("EMBEDDINGS", {"data": [[]]}, "data[0]"),
    ("EMBEDDINGS", {"usage": {}}, "usage.prompt_tokens"),
    ("CANCEL", {"task_id": None}, "task_id"),
    ("PROTOCOL_INFO", {"version": 2}, "version"),
    ("PROTOCOL_INFO", {"supported_versions": []}, "supported_versions"),
    ("PROTOCOL_INFO", {"supported_versions": [1, "2"]}, "supported_versions[1]"),
    ("PROTOCOL_INFO", {"max_frame_bytes": -1}, "max_frame_bytes"),
    ("ERROR", {"error": {"code": "NOT_A_CODE"}}, "error.code"),
    ("ERROR", {"error": {"code": ["OOM"]}}, "error.code"),
    ("ERROR", {"error": {"message": "no code"}}, "error.code"),
    ("ERROR", {"error": {"code": "OOM", "retryable": "yes"}}, "error.retryable"),
    ("ERROR", {"error": {"code": "OOM", "details": "x"}}, "error.details"),
    ("ERROR", {"error": {"code": "OOM", "extra": 1}}, "error.extra"),
    ("ERROR", {"error": "OOM"}, "error"),
    ("ERROR", {"task_id": ""}, "task_id"),
]


@pytest.mark.parametrize(("kind", "changes", "field"), INVALID, ids=[f"{k}-{f}" for k, _, f in INVALID])
def test_invalid_field_is_named(kind: str, changes: dict[str, Any], field: str) -> None:
    error = refusal(with_(kind, **changes))
    assert error.error.details["field"] == field
    assert field in str(error)


def test_the_refusal_names_the_task_so_the_server_can_answer_it() -> None:
    assert refusal(with_("INFER_REQUEST", temperature=9)).task_id == "t2"
    assert refusal(with_("INFER_REQUEST", task_id=["t2"])).task_id is None
    assert refusal({"type": "NOPE", "task_id": "t3"}).task_id == "t3"


def test_building_an_invalid_message_locally_raises_local_protocol_error() -> None:
    with pytest.raises(LocalProtocolError) as info:
        InferRequest("t", model="m", prompt="p", top_p=0)
    assert info.value.code == "BAD_PAYLOAD" and info.value.error.details["field"] == "top_p"
    with pytest.raises(LocalProtocolError):
        StreamToken("t", "x", 1, math.nan)
    with pytest.raises(LocalProtocolError):
        TaskStart("t", "s", "m", tools={"bad": float("inf")})


def test_stop_reasons_are_the_documented_three() -> None:
    assert STOP_REASONS == ("stop", "length", "tool_call")


@pytest.mark.parametrize("stop_reason", ["stop", "length"])
def test_task_complete_without_a_tool_call_for_other_stop_reasons(stop_reason: str) -> None:
    done = parse_message(with_("TASK_COMPLETE", stop_reason=stop_reason, tool_call=None))
    assert isinstance(done, TaskComplete) and done.tool_call is None and done.stop_reason == stop_reason
    assert parse_message(with_("TASK_COMPLETE", stop_reason=stop_reason, tool_call=...)) == done


def test_task_complete_tool_call_stop_carries_its_tool_call() -> None:
    done = parse_message(VALID["TASK_COMPLETE"])
    assert isinstance(done, TaskComplete) and done.stop_reason == "tool_call"
    assert done.tool_call == ToolCall("search", {"q": "x"})
    usage = Usage(1, 1)
    assert TaskComplete("t", "", usage, "tool_call", tool_call=ToolCall("f")).tool_call == ToolCall("f", {})


def test_task_complete_tool_call_stop_without_tool_call_is_refused_locally() -> None:
    with pytest.raises(LocalProtocolError) as info:
        TaskComplete("t", "x", Usage(1, 1), "tool_call")
    assert info.value.code == "BAD_PAYLOAD"
    assert info.value.error.details == {"field": "tool_call", "reason": "required when stop_reason is 'tool_call'"}


@pytest.mark.parametrize("stop_reason", ["stop", "length"])
def test_task_complete_tool_call_with_another_stop_reason_is_refused_locally(stop_reason: str) -> None:
    with pytest.raises(LocalProtocolError) as info:
        TaskComplete("t", "x", Usage(1, 1), stop_reason, tool_call=ToolCall("search"))
    assert info.value.code == "BAD_PAYLOAD"
    assert info.value.error.details == {"field": "tool_call",
                                        "reason": "only allowed when stop_reason is 'tool_call'"}


@pytest.mark.parametrize("changes", [{"tool_call": None}, {"tool_call": ...}], ids=["null", "absent"])
def test_task_complete_tool_call_stop_without_tool_call_is_refused_from_the_peer(changes: dict[str, Any]) -> None:
    error = refusal(with_("TASK_COMPLETE", **changes))
    assert error.error.details == {"field": "tool_call", "reason": "required when stop_reason is 'tool_call'",
                                   "type": "TASK_COMPLETE"}
    assert error.task_id == "t2" and "tool_call" in str(error)


@pytest.mark.parametrize("stop_reason", ["stop", "length"])
def test_task_complete_tool_call_with_another_stop_reason_is_refused_from_the_peer(stop_reason: str) -> None:
    error = refusal(with_("TASK_COMPLETE", stop_reason=stop_reason))
    assert error.error.details == {"field": "tool_call", "reason": "only allowed when stop_reason is 'tool_call'",
                                   "type": "TASK_COMPLETE"}
    assert error.task_id == "t2"


# --- round trips ----------------------------------------------------------------------------------------------------

IDS = st.text(min_size=1, max_size=12)
AGENT_IDS = st.from_regex(AGENT_ID, fullmatch=True)  # a session_id names an agent: the agents' one rule
TEXT = st.text(max_size=30)
SCALAR = st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(allow_nan=False, allow_infinity=False) | TEXT
JSON_OBJ = st.dictionaries(TEXT, st.recursive(SCALAR, lambda k: st.lists(k, max_size=3), max_leaves=5), max_size=3)
NUM = st.floats(0, 1e9, allow_nan=False)
CHAT = st.builds(ChatMessage, st.sampled_from(ROLES), TEXT)
USAGE = st.builds(Usage, st.integers(0, 10**6), st.integers(0, 10**6))
INFER = st.builds(
    InferRequest, IDS, model=st.none() | IDS, session_id=AGENT_IDS, prompt=TEXT,
    max_tokens=st.integers(1, MAX_TOKENS_LIMIT), temperature=st.floats(0, 2), top_p=st.floats(0, 1, exclude_min=True),
    stop=st.lists(IDS, max_size=MAX_STOP_STRINGS), stream=st.booleans(),
) | st.builds(InferRequest, IDS, model=IDS, messages=st.lists(CHAT, min_size=1, max_size=4))
MESSAGES = st.one_of(
    st.builds(TaskStart, IDS, AGENT_IDS, IDS, tools=st.none() | JSON_OBJ | st.lists(JSON_OBJ, max_size=2),
              status=st.none() | IDS),
    INFER,
    st.builds(StreamToken, IDS, TEXT, st.integers(0, 2**31 - 1), NUM,
              logprob=st.none() | st.floats(max_value=0, allow_nan=False, allow_infinity=False)),
    st.builds(Heartbeat, IDS, st.none() | NUM),
    st.builds(TaskComplete, IDS, TEXT, USAGE, st.sampled_from(["stop", "length"]),
              timings=st.dictionaries(TEXT, NUM, max_size=3), stats=JSON_OBJ),
    st.builds(TaskComplete, IDS, TEXT, USAGE, st.just("tool_call"), timings=st.dictionaries(TEXT, NUM, max_size=3),
              tool_call=st.builds(ToolCall, IDS, JSON_OBJ), stats=JSON_OBJ),
    st.builds(Cancel, IDS),
    st.builds(EmbedRequest, IDS, IDS, st.lists(TEXT, min_size=1, max_size=3),
              dimensions=st.none() | st.integers(1, MAX_EMBED_DIMENSIONS)),
    st.integers(1, 4).flatmap(lambda dims: st.builds(
        Embeddings, IDS, IDS, st.lists(st.tuples(*[st.floats(-1, 1)] * dims), min_size=1, max_size=3),
        st.builds(EmbedUsage, st.integers(0, 10**6)))),
    st.just(ProtocolInfoRequest()),
    st.builds(ProtocolInfo, st.just(1), st.just((1,)), IDS, st.integers(0, 2**32 - 1), IDS, IDS),
    st.builds(lambda code, task, text, details: ErrorMessage.of(ApplianceError(code, text, details), task),
              st.sampled_from(sorted(TABLE)), st.none() | IDS, TEXT, JSON_OBJ),
)


@settings(max_examples=300, deadline=None)
@given(message=MESSAGES)
def test_parse_of_to_payload_round_trips(message: Any) -> None:
    assert parse_message(message.to_payload()) == message
    parser = FrameParser()
    parser.receive_data(encode_message(message))
    frame = parser.next_event()
    assert isinstance(frame, Frame) and parse_message(frame.payload) == message


JSON_ANY = st.recursive(SCALAR, lambda k: st.lists(k, max_size=3) | st.dictionaries(TEXT, k, max_size=3),
                        max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(sorted(VALID)), key=st.sampled_from(sorted({k for p in VALID.values() for k in p})),
       value=JSON_ANY | st.just(...))
def test_any_mutated_payload_parses_or_is_refused_as_bad_payload(kind: str, key: str, value: Any) -> None:
    try:
        message = parse_message(with_(kind, **{key: value}) if value is not ... or key in VALID[kind] else VALID[kind])
    except RemoteProtocolError as exc:
        assert exc.code == "BAD_PAYLOAD" and not exc.fatal and exc.error.details.get("field")
    else:
        assert parse_message(message.to_payload()) == message


@settings(max_examples=200, deadline=None)
@given(payload=st.dictionaries(st.sampled_from(["type", "task_id", "x", "error", "prompt", "model"]) | TEXT,
                               JSON_ANY, max_size=5))
def test_any_json_object_parses_or_is_refused_as_bad_payload(payload: dict[str, Any]) -> None:
    try:
        parse_message(payload)
    except RemoteProtocolError as exc:
        assert exc.code == "BAD_PAYLOAD" and not exc.fatal


@pytest.mark.parametrize(("kind", "changes", "bounds"), [
    ("INFER_REQUEST", {"max_tokens": MAX_TOKENS_LIMIT + 1}, f"[1, {MAX_TOKENS_LIMIT}]"),
    ("INFER_REQUEST", {"max_tokens": True}, f"[1, {MAX_TOKENS_LIMIT}]"),
    ("INFER_REQUEST", {"temperature": float("nan")}, "[0.0, 2.0]"),
    ("INFER_REQUEST", {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"0 to {MAX_STOP_STRINGS}"),
    ("INFER_REQUEST", {"task_id": "x" * (MAX_ID_CHARS + 1)}, f"1 to {MAX_ID_CHARS}"),
    ("EMBED_REQUEST", {"input": ["x"] * (MAX_EMBED_INPUTS + 1)}, f"1 to {MAX_EMBED_INPUTS}"),
    ("EMBED_REQUEST", {"dimensions": MAX_EMBED_DIMENSIONS + 1}, f"[1, {MAX_EMBED_DIMENSIONS}]"),
])
def test_a_refusal_names_the_limit_it_broke(kind: str, changes: dict[str, Any], bounds: str) -> None:
    assert bounds in refusal(with_(kind, **changes)).error.details["reason"]
