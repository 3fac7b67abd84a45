"""MAGN sessions with tools (issue #22): a TASK_START whose tools are huge or hostile, and the chat requests of such
a session, cost the event loop nothing (the schemas are checked and turned into grammars on worker threads, each
grammar once per session) and get a P4 answer; the connection and everyone else go on."""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import RawPeer

from appliance.protocol import messages as m
from appliance.protocol.frames import encode_frame

PATTERN = "^" + "[a-z]{1,3}-" * 80 + "$"
BIG_SCHEMA = {"type": "object", "properties": {f"p{index}": {"type": "string", "pattern": PATTERN}
                                               for index in range(8)}}
BIG_TOOLS = [{"type": "function", "function": {"name": f"tool_{index}", "parameters": BIG_SCHEMA}}
             for index in range(128)]
"""128 tools (the most a session takes) of 8 string properties with an 882-character pattern each: a 1.2 MB frame
whose check (each pattern rewritten and turned into grammar rules) takes over a second on this box."""


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


HOSTILE_TOOLS = [
    ("deep", [{"type": "function", "function": {"name": "deep", "parameters": nested(28)}}]),
    ("too_many", [{"type": "function", "function": {"name": f"t{index}"}} for index in range(129)]),
    ("huge_enum", [{"type": "function", "function": {"name": "rep", "parameters": {
        "type": "object", "properties": {"a": {"enum": list(range(1000))}}}}}]),  # over 512 values
]
"""(A count like ``minItems: 10**9`` is not among them: a tool's schema is relaxed, and a count its grammar cannot
spell is left out of it, so that session starts.)"""


@pytest.fixture(scope="module")
def big_start() -> bytes:
    """The TASK_START frame of :data:`BIG_TOOLS`, encoded before the appliance starts: encoding it holds this
    process's GIL for a while, and the appliance under test runs in this process."""
    return encode_frame({"type": "TASK_START", "task_id": "big", "session_id": "big", "model": "demo",
                         "tools": BIG_TOOLS})


def test_a_session_with_the_most_tools_is_checked_off_the_loop(big_start, hostile) -> None:  # type: ignore[no-untyped-def]
    served = hostile.neighbour.served
    peer = RawPeer(hostile.socket, timeout=120)
    try:
        peer.sock.sendall(big_start)
        peer.send({"type": "PROTOCOL_INFO"})
        started = peer.read_token()
        assert isinstance(started, m.TaskStart) and started.status == "started", started
        assert isinstance(peer.read_token(), m.ProtocolInfo)  # answered after the check: one connection, in order
        assert hostile.neighbour_served_since(served)
        ask = [{"role": "user", "content": "hi"}]
        for task in ("call-1", "call-2"):  # the tools' description is far over demo's 1024-token context
            peer.send({"type": "INFER_REQUEST", "task_id": task, "session_id": "big", "messages": ask,
                       "tool_choice": "required", "max_tokens": 4})
            refused = peer.read_until_end(task)[-1]
            assert isinstance(refused, m.ErrorMessage) and refused.error.code == "CONTEXT_OVERFLOW", refused
            assert refused.error.details["n_ctx"] == 1024
        peer.send({"type": "INFER_REQUEST", "task_id": "bad-choice", "session_id": "big", "messages": ask,
                   "tool_choice": {"type": "function", "function": {"name": "tool_999"}}})
        refused = peer.read_until_end("bad-choice")[-1]
        assert isinstance(refused, m.ErrorMessage) and refused.error.code == "BAD_REQUEST", refused
        assert refused.error.details["param"] == "tool_choice.function.name"
    finally:
        peer.close()


def test_hostile_tool_schemas_are_refused_and_the_connection_goes_on(hostile) -> None:  # type: ignore[no-untyped-def]
    peer = RawPeer(hostile.socket, timeout=60)
    try:
        for name, tools in HOSTILE_TOOLS:
            sent = time.monotonic()
            peer.send({"type": "TASK_START", "task_id": name, "session_id": f"s-{name}", "model": "demo",
                       "tools": tools})
            refused = peer.read_token()
            assert time.monotonic() - sent < 10, name
            assert isinstance(refused, m.ErrorMessage) and refused.task_id == name, (name, refused)
            assert refused.error.code == "BAD_REQUEST" and refused.error.details["param"].startswith("tools"), refused
            assert f"s-{name}" not in hostile.app.daemon.agents
        # a schema that refers to itself without end: refused by the schema check or by llama.cpp's grammar parser
        peer.send({"type": "TASK_START", "task_id": "loop", "session_id": "s-loop", "model": "demo", "tools": [
            {"type": "function", "function": {"name": "loop", "parameters": {
                "type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}}}]})
        answer = peer.read_token()
        if isinstance(answer, m.TaskStart):
            peer.send({"type": "INFER_REQUEST", "task_id": "loop-call", "session_id": "s-loop", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"})
            answer = peer.read_until_end("loop-call")[-1]
        assert isinstance(answer, m.ErrorMessage) and answer.error.code == "BAD_REQUEST", answer
        peer.send({"type": "INFER_REQUEST", "task_id": "after", "model": "demo", "prompt": "hi", "max_tokens": 2})
        assert isinstance(peer.read_until_end("after")[-1], m.TaskComplete)
    finally:
        peer.close()
