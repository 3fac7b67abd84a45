"""The sans-IO MAGN connection (SPEC P3): every conversation rule, in memory, without sockets.

A :class:`ConnectionPair` is a client :class:`Connection` and a server one with the bytes moved between them by hand
(h11's ``ConnectionPair``). The rules are checked from both sides: our side breaking one gets
``LocalProtocolError`` and nothing to send; the peer breaking one (its bytes built without a connection) gets a
non-fatal ``RemoteProtocolError`` and the conversation goes on.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.errors import ApplianceError
from appliance.protocol import frames
from appliance.protocol import messages as m
from appliance.protocol.connection import (
    CLIENT,
    CLOSED,
    NEED_DATA,
    RULES,
    SERVER,
    Connection,
    ConnectionState,
    Effect,
    Role,
    rule_for,
)
from appliance.protocol.frames import (
    HEADER,
    MAGIC,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    encode_frame,
)

ASK = m.ProtocolInfoRequest()
INFO = m.ProtocolInfo(1, (1,), m.SCHEMA, 1 << 24, "appliance", "0")
INFER = m.InferRequest("t1", model="m", prompt="hi", stream=True)
START = m.TaskStart("s1", "agent", "m")
ECHO = m.TaskStart("s1", "agent", "m", status="started")
TOKEN = m.StreamToken("t1", "a", 7, 1.0)
BEAT = m.Heartbeat("t1", 1.0)
DONE = m.TaskComplete("t1", "a", m.Usage(1, 1), "stop")
FAILED = m.ErrorMessage.of(ApplianceError("UNKNOWN_MODEL"), "t1")
CANCEL = m.Cancel("t1")
CANCELLED = m.ErrorMessage.of(ApplianceError("CANCELLED"), "t1")
START_FAILED = m.ErrorMessage.of(ApplianceError("AGENT_EXISTS"), "s1")
CONNECTION_ERROR = m.ErrorMessage.of(ApplianceError("SHUTTING_DOWN"))
EMBED = m.EmbedRequest("e1", "m", ("a", "b"))
VECTORS = m.Embeddings("e1", "m", ((1.0, 0.0), (0.0, 1.0)), m.EmbedUsage(2))
SAMPLES: list[m.Message] = [ASK, INFO, INFER, START, ECHO, TOKEN, BEAT, DONE, FAILED, CANCEL, CONNECTION_ERROR, EMBED,
                            VECTORS]

Step = tuple[Role, m.Message]


class ConnectionPair:
    """A client and a server connection; :meth:`send` moves one side's bytes to the other."""

    def __init__(self, **options: Any) -> None:
        self.conn = {CLIENT: Connection(CLIENT, **options), SERVER: Connection(SERVER, **options)}

    @property
    def client(self) -> Connection:
        return self.conn[CLIENT]

    @property
    def server(self) -> Connection:
        return self.conn[SERVER]

    def send(self, sender: Role, *messages: m.Message) -> list[m.Message]:
        """``sender`` sends ``messages`` (through its connection's rules); returns what its peer received."""
        data = b"".join(self.conn[sender].send(message) for message in messages)
        return self.deliver(sender.peer, data)

    def deliver(self, receiver: Role, data: bytes, chunk: int | None = None) -> list[m.Message]:
        """Feed ``data`` to ``receiver`` (in pieces of ``chunk`` bytes) and collect every message it returns."""
        conn = self.conn[receiver]
        got: list[m.Message] = []
        size = chunk or max(len(data), 1)
        for start in range(0, len(data), size):
            conn.receive_data(data[start:start + size])
            got += drain(conn)
        return got

    def play(self, steps: list[Step]) -> None:
        for sender, message in steps:
            assert self.send(sender, message) == [message]


def drain(conn: Connection) -> list[m.Message]:
    """Every message ``conn`` can return now."""
    got = []
    while True:
        event = conn.next_event()
        if event is NEED_DATA or event is CLOSED:
            return got
        got.append(event)


# --- the table -------------------------------------------------------------------------------------------------------


def test_the_table_has_one_row_per_type_and_sender_and_covers_every_type() -> None:
    keys = [(rule.message, rule.sender) for rule in RULES]
    assert len(keys) == len(set(keys))
    assert {rule.message for rule in RULES} == {*m.MESSAGE_TYPES.values(), m.ProtocolInfoRequest}
    for rule in RULES:  # a rule that concerns a task names which kinds of task
        assert bool(rule.tasks) == (rule.effect in (Effect.IN_TASK, Effect.END, Effect.CANCEL))


# --- conversations that keep the rules --------------------------------------------------------------------------------

CONVERSATIONS: dict[str, list[Step]] = {
    "protocol info": [(CLIENT, ASK), (SERVER, INFO)],
    "two protocol infos asked at once": [(CLIENT, ASK), (CLIENT, ASK), (SERVER, INFO), (SERVER, INFO)],
    "task start": [(CLIENT, START), (SERVER, ECHO)],
    "task start refused": [(CLIENT, START), (SERVER, START_FAILED)],
    "inference": [(CLIENT, INFER), (SERVER, DONE)],
    "streamed inference": [(CLIENT, INFER), (SERVER, BEAT), (SERVER, TOKEN), (SERVER, TOKEN), (SERVER, DONE)],
    "inference failing": [(CLIENT, INFER), (SERVER, TOKEN), (SERVER, FAILED)],
    "cancelled inference": [(CLIENT, INFER), (SERVER, TOKEN), (CLIENT, CANCEL), (SERVER, BEAT), (SERVER, CANCELLED)],
    "a task_id used again once its task ended": [(CLIENT, INFER), (SERVER, DONE), (CLIENT, INFER), (SERVER, DONE)],
    "interleaved tasks": [(CLIENT, INFER), (CLIENT, START), (CLIENT, m.InferRequest("t2", model="m", prompt="x")),
                          (SERVER, TOKEN), (SERVER, ECHO), (SERVER, m.Heartbeat("t2")), (SERVER, DONE),
                          (SERVER, m.TaskComplete("t2", "", m.Usage(1, 0), "length"))],
    "embeddings": [(CLIENT, EMBED), (SERVER, VECTORS)],
    "embeddings refused": [(CLIENT, EMBED), (SERVER, m.ErrorMessage.of(ApplianceError("BAD_REQUEST"), "e1"))],
    "embeddings beside an inference": [(CLIENT, INFER), (CLIENT, EMBED), (SERVER, TOKEN), (SERVER, VECTORS),
                                       (SERVER, DONE)],
    "connection-level error": [(SERVER, CONNECTION_ERROR), (CLIENT, ASK), (SERVER, INFO), (SERVER, CONNECTION_ERROR)],
}


@pytest.mark.parametrize("steps", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_a_conversation_within_the_rules(steps: list[Step]) -> None:
    pair = ConnectionPair()
    pair.play(steps)
    for conn in pair.conn.values():
        assert dict(conn.in_flight) == {} and conn.info_requests_pending == 0
        assert conn.state is ConnectionState.OPEN and conn.ignored_cancels == 0


def test_both_sides_track_the_tasks_in_flight() -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER), (CLIENT, START), (CLIENT, ASK)])
    for conn in pair.conn.values():
        assert dict(conn.in_flight) == {"t1": "INFER_REQUEST", "s1": "TASK_START"}
        assert conn.info_requests_pending == 1
    pair.play([(SERVER, TOKEN), (SERVER, ECHO), (SERVER, INFO)])
    for conn in pair.conn.values():
        assert dict(conn.in_flight) == {"t1": "INFER_REQUEST"} and conn.info_requests_pending == 0


def test_embeddings_end_only_an_embed_request_and_a_task_complete_does_not_end_one() -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER)])
    with pytest.raises(LocalProtocolError) as wrong:
        pair.server.send(m.Embeddings("t1", "m", ((1.0,),), m.EmbedUsage(1)))
    assert wrong.value.error.details["task"] == "INFER_REQUEST"
    pair.play([(CLIENT, EMBED)])
    with pytest.raises(LocalProtocolError):
        pair.server.send(m.TaskComplete("e1", "", m.Usage(1, 0), "stop"))
    pair.play([(SERVER, VECTORS), (SERVER, DONE)])
    assert not pair.server.in_flight and not pair.client.in_flight


@pytest.mark.parametrize("end", [DONE, FAILED, CANCELLED], ids=lambda msg: msg.TYPE)
def test_a_task_ends_with_its_task_complete_or_error(end: m.Message) -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER), (SERVER, TOKEN), (SERVER, end)])
    assert not pair.client.in_flight and not pair.server.in_flight
    with pytest.raises(LocalProtocolError):
        pair.server.send(TOKEN)


# --- who may send what -----------------------------------------------------------------------------------------------

WRONG_SENDER = [(message, role) for message in SAMPLES for role in Role if rule_for(type(message), role) is None]


@pytest.mark.parametrize(("message", "sender"), WRONG_SENDER,
                         ids=[f"{role.value} sends {type(msg).__name__}" for msg, role in WRONG_SENDER])
def test_a_type_sent_by_the_wrong_side(message: m.Message, sender: Role) -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER), (CLIENT, ASK)])  # whatever the message could belong to is in flight
    with pytest.raises(LocalProtocolError) as local:
        pair.conn[sender].send(message)
    assert local.value.code == "BAD_PAYLOAD" and local.value.error.details == {"type": message.TYPE}
    assert f"not by the {sender.value}" in local.value.error.message
    receiver = pair.conn[sender.peer]
    receiver.receive_data(m.encode_message(message))
    with pytest.raises(RemoteProtocolError) as remote:
        receiver.next_event()
    assert remote.value.code == "BAD_PAYLOAD" and not remote.value.fatal
    assert remote.value.error.message == f"{message.TYPE} is sent by the {sender.peer.value}, not to it"
    assert remote.value.task_id == getattr(message, "task_id", None)
    for conn in pair.conn.values():  # nothing changed on either side
        assert dict(conn.in_flight) == {"t1": "INFER_REQUEST"} and conn.info_requests_pending == 1


# --- rules about tasks in flight -----------------------------------------------------------------------------------

IN_FLIGHT = "task_id already in flight on this connection"
NOT_IN_FLIGHT = "in flight on this connection"
OTHER_KIND = "does not belong to a"

# (the conversation so far, who breaks a rule, with what, the P4 code, a part of the error message)
VIOLATIONS: dict[str, tuple[list[Step], Role, m.Message, str, str]] = {
    "duplicate INFER_REQUEST": ([(CLIENT, INFER)], CLIENT, INFER, "BAD_REQUEST", IN_FLIGHT),
    "TASK_START with an inference's task_id": ([(CLIENT, INFER)], CLIENT, m.TaskStart("t1", "a", "m"),
                                               "BAD_REQUEST", IN_FLIGHT),
    "INFER_REQUEST with a start's task_id": ([(CLIENT, START)], CLIENT, m.InferRequest("s1", model="m", prompt=""),
                                             "BAD_REQUEST", IN_FLIGHT),
    "STREAM_TOKEN for no task": ([], SERVER, TOKEN, "BAD_REQUEST", NOT_IN_FLIGHT),
    "HEARTBEAT for no task": ([], SERVER, BEAT, "BAD_REQUEST", NOT_IN_FLIGHT),
    "TASK_COMPLETE for no task": ([], SERVER, DONE, "BAD_REQUEST", NOT_IN_FLIGHT),
    "ERROR for no task": ([], SERVER, FAILED, "BAD_REQUEST", NOT_IN_FLIGHT),
    "TASK_START echo for no task": ([], SERVER, ECHO, "BAD_REQUEST", NOT_IN_FLIGHT),
    "STREAM_TOKEN for another task": ([(CLIENT, INFER)], SERVER, m.StreamToken("t9", "a", 1, 1.0), "BAD_REQUEST",
                                      NOT_IN_FLIGHT),
    "STREAM_TOKEN after the task completed": ([(CLIENT, INFER), (SERVER, DONE)], SERVER, TOKEN, "BAD_REQUEST",
                                              NOT_IN_FLIGHT),
    "HEARTBEAT after the task failed": ([(CLIENT, INFER), (SERVER, FAILED)], SERVER, BEAT, "BAD_REQUEST",
                                        NOT_IN_FLIGHT),
    "a second TASK_COMPLETE": ([(CLIENT, INFER), (SERVER, DONE)], SERVER, DONE, "BAD_REQUEST", NOT_IN_FLIGHT),
    "STREAM_TOKEN for a TASK_START": ([(CLIENT, START)], SERVER, m.StreamToken("s1", "a", 1, 1.0), "BAD_REQUEST",
                                      OTHER_KIND),
    "HEARTBEAT for a TASK_START": ([(CLIENT, START)], SERVER, m.Heartbeat("s1"), "BAD_REQUEST", OTHER_KIND),
    "TASK_COMPLETE for a TASK_START": ([(CLIENT, START)], SERVER, m.TaskComplete("s1", "", m.Usage(0, 0), "stop"),
                                       "BAD_REQUEST", OTHER_KIND),
    "TASK_START echo for an INFER_REQUEST": ([(CLIENT, INFER)], SERVER, m.TaskStart("t1", "a", "m", status="started"),
                                             "BAD_REQUEST", OTHER_KIND),
    "PROTOCOL_INFO reply never asked": ([], SERVER, INFO, "BAD_REQUEST", "reply without a request"),
    "a second PROTOCOL_INFO reply": ([(CLIENT, ASK), (SERVER, INFO)], SERVER, INFO, "BAD_REQUEST",
                                     "reply without a request"),
}


@pytest.mark.parametrize(("setup", "sender", "message", "code", "text"), VIOLATIONS.values(), ids=VIOLATIONS.keys())
def test_our_side_breaking_a_rule_raises_local_and_sends_nothing(setup: list[Step], sender: Role, message: m.Message,
                                                                 code: str, text: str) -> None:
    pair = ConnectionPair()
    pair.play(setup)
    conn = pair.conn[sender]
    before = dict(conn.in_flight), conn.info_requests_pending
    with pytest.raises(LocalProtocolError) as info:
        conn.send(message)
    assert info.value.code == code and text in info.value.error.message
    assert info.value.task_id == getattr(message, "task_id", None)
    assert (dict(conn.in_flight), conn.info_requests_pending) == before


@pytest.mark.parametrize(("setup", "sender", "message", "code", "text"), VIOLATIONS.values(), ids=VIOLATIONS.keys())
def test_the_peer_breaking_a_rule_raises_remote_and_the_conversation_goes_on(
        setup: list[Step], sender: Role, message: m.Message, code: str, text: str) -> None:
    pair = ConnectionPair()
    pair.play(setup)
    receiver = pair.conn[sender.peer]
    before = dict(receiver.in_flight), receiver.info_requests_pending
    follow_up = CONNECTION_ERROR if sender is SERVER else m.Cancel("unknown")
    receiver.receive_data(m.encode_message(message) + m.encode_message(follow_up))
    with pytest.raises(RemoteProtocolError) as info:
        receiver.next_event()
    error = info.value
    assert error.code == code and text in error.error.message and not error.fatal
    assert error.task_id == getattr(message, "task_id", None)
    assert (dict(receiver.in_flight), receiver.info_requests_pending) == before
    assert receiver.state is ConnectionState.OPEN
    if sender is SERVER:
        assert receiver.next_event() == follow_up
    else:  # the late CANCEL is dropped
        assert receiver.next_event() is NEED_DATA and receiver.ignored_cancels == 1


def test_the_duplicate_task_id_error_keeps_the_servers_words() -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER)])
    pair.server.receive_data(m.encode_message(INFER))
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.next_event()
    assert info.value.error.to_dict() == ApplianceError(
        "BAD_REQUEST", "task_id already in flight on this connection", {"task_id": "t1"}).to_dict()


# --- late CANCEL ---------------------------------------------------------------------------------------------------

LATE_CANCELS: dict[str, list[Step]] = {
    "unknown task": [],
    "after TASK_COMPLETE": [(CLIENT, INFER), (SERVER, DONE)],
    "after ERROR": [(CLIENT, INFER), (SERVER, FAILED)],
    "a TASK_START in flight (nothing to stop)": [(CLIENT, m.TaskStart("t1", "a", "m"))],
}


@pytest.mark.parametrize("setup", LATE_CANCELS.values(), ids=LATE_CANCELS.keys())
def test_a_late_cancel_is_sent_and_dropped_on_receipt(setup: list[Step]) -> None:
    pair = ConnectionPair()
    pair.play(setup)
    before = dict(pair.server.in_flight)
    assert pair.send(CLIENT, CANCEL, ASK) == [ASK]  # the CANCEL is dropped, what follows it is returned
    assert pair.server.ignored_cancels == 1 and dict(pair.server.in_flight) == before
    assert dict(pair.client.in_flight) == before


def test_a_cancel_for_a_task_in_flight_is_returned_and_ends_nothing() -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER), (CLIENT, CANCEL)])
    assert pair.server.ignored_cancels == 0 and "t1" in pair.server.in_flight and "t1" in pair.client.in_flight


# --- refusals --------------------------------------------------------------------------------------------------------


def test_the_server_may_refuse_a_duplicate_without_ending_the_original_task() -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER)])
    pair.server.receive_data(m.encode_message(INFER))
    with pytest.raises(RemoteProtocolError) as info:
        pair.server.next_event()
    refusal = m.ErrorMessage.of(info.value.error, info.value.task_id)
    pair.server.send(refusal)  # owed: allowed, and t1 is still in flight
    assert dict(pair.server.in_flight) == {"t1": "INFER_REQUEST"}
    pair.server.send(TOKEN)
    pair.server.send(DONE)
    assert not pair.server.in_flight


def test_the_server_may_refuse_an_invalid_request_once() -> None:
    server = Connection(SERVER)
    server.receive_data(encode_frame({"type": "INFER_REQUEST", "task_id": "x", "model": "m", "prompt": "hi",
                                      "max_tokens": 0}))
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.code == "BAD_PAYLOAD" and info.value.task_id == "x" and not info.value.fatal
    refusal = m.ErrorMessage.of(info.value.error, "x")
    server.send(refusal)
    with pytest.raises(LocalProtocolError, match="no task 'x' in flight"):
        server.send(refusal)


def test_a_client_owes_no_refusals() -> None:
    client = Connection(CLIENT)
    client.receive_data(m.encode_message(TOKEN))
    with pytest.raises(RemoteProtocolError):
        client.next_event()
    with pytest.raises(LocalProtocolError):
        client.send(FAILED)


# --- bytes: whole, one by one, with trailing data ---------------------------------------------------------------------

SERVER_SIDE = [BEAT, TOKEN, m.StreamToken("t1", "h\u00e9 \u2713", 8, 2.0, -0.25), DONE]


@pytest.mark.parametrize("chunk", [None, 1, 3, 10, 11, 64], ids=lambda c: "whole" if c is None else f"{c} bytes")
def test_bytes_fed_in_any_pieces_give_the_same_messages(chunk: int | None) -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER)])
    data = b"".join(pair.server.send(message) for message in SERVER_SIDE)
    assert pair.deliver(CLIENT, data, chunk) == SERVER_SIDE
    assert not pair.client.in_flight and pair.client.trailing_data == b""


def test_trailing_data_waits_for_the_rest_of_its_frame() -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER)])
    first, second = pair.server.send(TOKEN), pair.server.send(DONE)
    pair.client.receive_data(first + second[:5])
    assert pair.client.next_event() == TOKEN
    assert pair.client.next_event() is NEED_DATA and pair.client.trailing_data == second[:5]
    pair.client.receive_data(second[5:])
    assert pair.client.next_event() == DONE and pair.client.next_event() is NEED_DATA


def test_end_of_stream_closes_the_receiving_side_only() -> None:
    pair = ConnectionPair()
    pair.play([(CLIENT, INFER)])
    pair.server.receive_data(pair.client.send(ASK))
    pair.server.receive_data(b"")
    assert pair.server.next_event() == ASK
    assert pair.server.next_event() is CLOSED and pair.server.state is ConnectionState.CLOSED
    assert pair.deliver(CLIENT, pair.server.send(INFO) + pair.server.send(DONE)) == [INFO, DONE]


# --- fatal errors ----------------------------------------------------------------------------------------------------

FATAL = {
    "bad magic": (b"GET / HTTP/1.1\r\n", "BAD_MAGIC"),
    "unsupported version": (HEADER.pack(MAGIC, 2, 4) + b"e30=", "UNSUPPORTED_VERSION"),
    "too large": (HEADER.pack(MAGIC, 1, 5000), "FRAME_TOO_LARGE"),
}


@pytest.mark.parametrize(("data", "code"), FATAL.values(), ids=FATAL.keys())
def test_a_fatal_error_puts_the_connection_in_error_for_good(data: bytes, code: str) -> None:
    pair = ConnectionPair(max_frame_bytes=4096)
    pair.play([(CLIENT, INFER)])
    server = pair.server
    server.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.code == code and info.value.fatal and server.state is ConnectionState.ERROR
    for call in (server.next_event, lambda: server.receive_data(m.encode_message(ASK))):
        with pytest.raises(RemoteProtocolError) as again:
            call()
        assert again.value is info.value
    # sending still works: the server says why it closes, the task in flight still ends
    assert pair.deliver(CLIENT, server.send(m.ErrorMessage.of(info.value.error)) + server.send(FAILED)) == [
        m.ErrorMessage.of(info.value.error), FAILED]


def test_a_stream_that_ends_inside_a_frame_is_fatal() -> None:
    server = Connection(SERVER)
    server.receive_data(m.encode_message(ASK)[:-1])
    server.receive_data(b"")
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.fatal and info.value.error.details["reason"] == "truncated frame"
    assert server.state is ConnectionState.ERROR


def test_a_payload_that_is_not_a_message_is_not_fatal() -> None:
    server = Connection(SERVER)
    server.receive_data(HEADER.pack(MAGIC, 1, 8) + b"!!!!!!!!" + encode_frame({"type": "NOPE", "task_id": "q"})
                        + m.encode_message(ASK))
    for task_id in (None, "q"):
        with pytest.raises(RemoteProtocolError) as info:
            server.next_event()
        assert info.value.code == "BAD_PAYLOAD" and not info.value.fatal and info.value.task_id == task_id
    assert server.next_event() == ASK


def test_max_frame_bytes_may_change_at_any_time() -> None:
    server = Connection(SERVER, max_frame_bytes=1 << 20)
    frame = m.encode_message(ASK)
    server.receive_data(frame + frame)
    assert server.next_event() == ASK
    server.max_frame_bytes = 8  # a reloaded config: the next header is checked against it
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.code == "FRAME_TOO_LARGE" and info.value.error.details["max_frame_bytes"] == 8
    with pytest.raises(ValueError):
        server.max_frame_bytes = -1


def test_on_frame_sees_every_received_frame_with_its_length() -> None:
    seen: list[tuple[dict[str, Any], int]] = []
    server = Connection(SERVER, on_frame=lambda frame, length: seen.append((frame.payload, length)))
    data = m.encode_message(ASK) + m.encode_message(CANCEL)
    server.receive_data(data)
    assert drain(server) == [ASK]  # the late CANCEL is dropped, but it was seen
    assert seen == [({"type": "PROTOCOL_INFO"}, len(m.encode_message(ASK)) - HEADER.size),
                    ({"type": "CANCEL", "task_id": "t1"}, len(m.encode_message(CANCEL)) - HEADER.size)]


# --- fuzzing ---------------------------------------------------------------------------------------------------------

VALID = b"".join(m.encode_message(message) for message in (INFER, ASK, TOKEN, DONE, CANCEL))


def feed_everything(conn: Connection, data: bytes, sizes: list[int]) -> None:
    """Feed ``data`` in pieces, pull every event, go on after non-fatal errors; only protocol errors may escape."""
    pos = 0
    for size in [*sizes, len(data)]:
        piece, pos = data[pos:pos + size], pos + size
        if piece:
            conn.receive_data(piece)
        pull_all(conn)
    conn.receive_data(b"")
    pull_all(conn)


def pull_all(conn: Connection) -> None:
    while True:
        try:
            if conn.next_event() in (NEED_DATA, CLOSED):
                return
        except RemoteProtocolError as exc:
            if exc.fatal:
                raise


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(role=st.sampled_from(list(Role)), prefix=st.integers(0, len(VALID)), garbage=st.binary(max_size=300),
       sizes=st.lists(st.integers(1, 64), max_size=8))
def test_arbitrary_bytes_raise_only_protocol_errors(role: Role, prefix: int, garbage: bytes, sizes: list[int]) -> None:
    conn = Connection(role, max_frame_bytes=1 << 16)
    try:
        feed_everything(conn, VALID[:prefix] + garbage, sizes)
    except ProtocolError:
        assert conn.state is ConnectionState.ERROR
    else:
        assert conn.state is ConnectionState.CLOSED


json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                      max_size=3), max_leaves=8)
payloads = st.fixed_dictionaries({"type": st.sampled_from([*m.MESSAGE_TYPES, "NOPE"])},
                                 optional={"task_id": st.sampled_from(["t1", "t2", "s1", "", 5]),
                                           "model": st.just("m"), "prompt": st.text(max_size=5),
                                           "text": st.text(max_size=5), "token_id": st.integers(-1, 3),
                                           "timestamp": st.floats(allow_nan=False, allow_infinity=False),
                                           "session_id": st.just("a"),
                                           "extra": json_values}) | st.sampled_from([x.to_payload() for x in SAMPLES])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(role=st.sampled_from(list(Role)), frames=st.lists(payloads, max_size=12))
def test_arbitrary_messages_in_any_order_raise_only_non_fatal_protocol_errors(role: Role,
                                                                              frames: list[dict[str, Any]]) -> None:
    conn = Connection(role)
    feed_everything(conn, b"".join(encode_frame(frame) for frame in frames), [])
    assert conn.state is ConnectionState.CLOSED


# --- payloads past the limits: refused one by one, the conversation goes on --------------------------------------

def raw_frame(text: bytes) -> bytes:
    import base64

    body = base64.b64encode(text)
    return HEADER.pack(MAGIC, 1, len(body)) + body


_INFER_HEAD = b'{"type":"INFER_REQUEST","task_id":"h","model":"m","prompt":"x"'
HOSTILE = {  # a raw payload and the detail that names the limit it breaks
    "wide stop list": (_INFER_HEAD + b',"stop":[' + b"[]," * frames.MAX_JSON_ITEMS + b"[]]}", "max_json_items"),
    "int of 5000 digits": (_INFER_HEAD + b',"max_tokens":' + b"7" * 5000 + b"}", "max_int_digits"),
    "NaN temperature": (_INFER_HEAD + b',"temperature":NaN}', "reason"),
    "Infinity top_p": (_INFER_HEAD + b',"top_p":Infinity}', "reason"),
    "bool max_tokens": (_INFER_HEAD + b',"max_tokens":true}', "reason"),
    "float max_tokens": (_INFER_HEAD + b',"max_tokens":5.0}', "reason"),
    "max_tokens past its limit": (_INFER_HEAD + b',"max_tokens":%d}' % (m.MAX_TOKENS_LIMIT + 1), "reason"),
    "deep tools": (b'{"type":"TASK_START","task_id":"h","session_id":"s","model":"m","tools":' + b"[" * 3000
                   + b"]" * 3000 + b"}", "max_depth"),
}


@pytest.mark.parametrize(("payload", "names"), HOSTILE.values(), ids=HOSTILE.keys())
def test_a_payload_past_a_limit_is_refused_by_task_and_the_next_message_is_read(payload: bytes, names: str) -> None:
    conn = Connection(SERVER)
    conn.receive_data(raw_frame(payload) + m.encode_message(INFER))
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_event()
    assert info.value.code == "BAD_PAYLOAD" and not info.value.fatal
    assert names in info.value.error.details
    if names == "reason":
        assert any(ch.isdigit() for ch in info.value.error.details["reason"]) or "finite" in str(info.value.error)
    assert conn.next_event() == INFER


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(role=st.sampled_from(list(Role)), frames_=st.lists(st.sampled_from(list(HOSTILE.values())) | payloads,
                                                          max_size=6), size=st.sampled_from([7, 4096, 1 << 20]))
def test_payloads_past_the_limits_mixed_with_others_raise_only_non_fatal_protocol_errors(
        role: Role, frames_: list[Any], size: int) -> None:
    wire = b"".join(raw_frame(item[0]) if isinstance(item, tuple) else encode_frame(item) for item in frames_)
    conn = Connection(role)
    feed_everything(conn, wire, [size] * (len(wire) // size))
    assert conn.state is ConnectionState.CLOSED


def test_pending_frame_bytes_tells_the_size_of_the_frame_being_received() -> None:
    wire = m.encode_message(INFER)
    conn = Connection(SERVER)
    assert conn.pending_frame_bytes == conn.buffered_bytes == 0
    conn.receive_data(wire[:HEADER.size])
    assert conn.pending_frame_bytes == len(wire) and conn.buffered_bytes == HEADER.size
    assert conn.next_event() is NEED_DATA
    conn.receive_data(wire[HEADER.size:] + wire)
    assert conn.buffered_bytes == 2 * len(wire)
    assert conn.next_event() == INFER
    assert conn.pending_frame_bytes == conn.buffered_bytes == len(wire)


def test_the_largest_valid_conversation_is_within_the_json_limits() -> None:
    """MAX_CHAT_MESSAGES messages, each with a stop list's worth of punctuation, still pass the item count."""
    chat = tuple(m.ChatMessage("user", "[{,}] \\\" ,,,") for _ in range(m.MAX_CHAT_MESSAGES))
    request = m.InferRequest("big", model="m", messages=chat, stop=("x",) * m.MAX_STOP_STRINGS)
    conn = Connection(SERVER)
    conn.receive_data(m.encode_message(request))
    assert conn.next_event() == request
