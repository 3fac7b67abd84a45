"""Hostile inputs on the wire: a model that writes reply markers, bad counts, an endless line, a frame of JSON
arrays. Each runs against the real appliance of the ``hostile`` fixture (its neighbour decodes, its prober times
``/v1/health`` throughout)."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from appliance.engine import tinymodel
from appliance.protocol import lines
from appliance.protocol.frames import HEADER, MAGIC, MAX_JSON_ITEMS, VERSION, Frame, FrameParser, encode_frame

FORGED = "\nEND_RESPONSE\nERR INTERNAL forged=1\n"
"""What the forger model writes, once per token: the end of a reply, then a reply of its own."""


def write_forger(path: Path) -> Path:
    """A real llama GGUF whose greedy output is :data:`FORGED` over and over: token 0 of its vocabulary is that
    text, and its output norm is zero, so every logit is 0 and greedy sampling takes the first token."""
    hp = tinymodel.resolve_hyperparams(1, 64, None, None, None, 2048)
    base = tinymodel.build_vocabulary()
    vocab = tinymodel.Vocabulary((FORGED, *base.tokens), (0.0, *base.scores),
                                 (int(gguf.TokenType.NORMAL), *base.types))
    writer = gguf.GGUFWriter(path, "llama")
    tinymodel._add_metadata(writer, hp, tinymodel.builtin_tokenizer(vocab), "f32")
    writer.add_unk_token_id(tinymodel.UNK_ID + 1)  # every special moved one place up (the later value wins)
    writer.add_bos_token_id(tinymodel.BOS_ID + 1)
    writer.add_eos_token_id(tinymodel.EOS_ID + 1)
    rng = np.random.default_rng(0)
    for spec in tinymodel.tensor_specs(hp, len(vocab.tokens)):
        data = tinymodel._tensor_data(spec, rng, np.float32)
        if spec.name == "output_norm.weight":
            data = np.zeros(spec.shape, dtype=np.float32)
        writer.add_tensor(spec.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def connect(path: Path, timeout: float = 30) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(path))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the daemon writes until it closes (a reset after the data counts as closed)."""
    data = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return bytes(data)


def pipelined(sock: socket.socket, commands: list[str]) -> tuple[list[lines.Reply], bytes]:
    """Send ``commands`` in one write and read one reply each; also return the raw bytes read."""
    sock.sendall("".join(f"{command}\n" for command in commands).encode())
    reader = lines.ReplyReader()
    replies: list[lines.Reply] = []
    raw = bytearray()
    while len(replies) < len(commands):
        event = reader.next_event()
        if isinstance(event, lines.Reply):
            replies.append(event)
            continue
        assert event is lines.NEED_DATA, "the daemon closed the connection"
        chunk = sock.recv(65536)
        raw += chunk
        reader.receive_data(chunk)
    return replies, bytes(raw)


def naive_replies(raw: bytes) -> list[list[str]]:
    """What a shell user's loop makes of the stream: lines (split every way Python splits lines), a reply
    ending at ``END_RESPONSE`` or at an ``ERR`` line."""
    replies: list[list[str]] = [[]]
    for line in raw.decode().splitlines():
        replies[-1].append(line)
        if line.strip() == "END_RESPONSE" or line.startswith("ERR"):
            replies.append([])
    return [reply for reply in replies if reply]


def test_a_model_that_writes_reply_markers_cannot_forge_a_reply(hostile):
    """Issue #8: a model that writes END_RESPONSE and an ERR line made a pipelined client read a forged reply.
    Here a real model writes exactly that on every token; the client reads its five replies, the text exact."""
    path = write_forger(hostile.model_dir / "forger.gguf")
    served = hostile.neighbour.served
    with connect(hostile.socket) as sock:
        replies, raw = pipelined(sock, [f"REGISTER forger {path}", "DECODE forger 3 Hello", "DECODE forger 2",
                                        "STATUS", "UNREGISTER forger"])
    assert [reply.error for reply in replies] == [None] * 5, [r.error for r in replies]
    decoded = replies[1:3]
    assert [reply.body for reply in decoded] == [FORGED * 3, FORGED * 2]
    assert [reply.fields["generated_tokens"] for reply in decoded] == ["3", "2"]
    assert "agent_id=forger" in raw.decode()
    naive = naive_replies(raw)
    assert len(naive) == 5, "a reader that stops at END_RESPONSE or ERR sees exactly the five real replies"
    assert not any(line.startswith("ERR") for reply in naive for line in reply)
    assert raw.decode().count("\\END_RESPONSE\n\\ERR INTERNAL forged=1\n") == 5
    assert hostile.neighbour_served_since(served)


def test_a_hostile_file_name_cannot_split_a_header_or_a_status_line(hostile):
    """Values are quoted and escaped on header, ERR and STATUS lines alike: a model path holding carriage returns
    and reply words stays on its line, for readers that split on \\r too."""
    name = "x\rEND_RESPONSE\rERR INTERNAL forged=1 \"q\".gguf"
    path = hostile.model_dir / name
    os.link(hostile.model_path("demo-b"), path)
    served = hostile.neighbour.served
    with connect(hostile.socket) as sock:
        replies, raw = pipelined(sock, [f"REGISTER odd {path}", "STATUS", "DECODE odd 0 x", "UNREGISTER odd"])
    assert replies[0].error is None, replies[0].error
    assert replies[0].fields["model"].endswith(name)
    records = [lines.parse_fields(line.partition(" ")[2]) for line in (replies[1].body or "").split("\n")]
    assert {"id": "odd", "model": str(path)}.items() <= next(r for r in records if r.get("id") == "odd").items()
    assert replies[2].error is not None and replies[2].error.code == "BAD_REQUEST"
    assert replies[3].error is None
    naive = naive_replies(raw)
    assert len(naive) == 4, naive
    assert "\r" not in raw.decode()
    assert hostile.neighbour_served_since(served)


BAD_COUNTS = ["²", "1" * 5000, "+5", "", "0x10", "٣", "0", "-1", str(lines.MAX_DECODE_TOKENS + 1), "1e3", "1_0"]


def test_bad_counts_are_bad_requests_naming_the_limit(hostile):
    """Issue #8: ``DECODE a ² x`` and a 5,000-digit count answered ERR INTERNAL; non-ASCII digits were numbers."""
    commands = ["REGISTER counted demo-b"] + [f"DECODE counted {count} x" for count in BAD_COUNTS]
    commands += ["DECODE counted  5 x", "DECODE counted 1 x", "UNREGISTER counted"]
    served = hostile.neighbour.served
    with connect(hostile.socket) as sock:
        replies, raw = pipelined(sock, commands)
    refused = replies[1:-2]
    assert len(refused) == len(BAD_COUNTS) + 1
    for command, reply in zip(commands[1:-2], refused, strict=True):
        assert reply.error is not None and reply.error.code == "BAD_REQUEST", (command, reply)
        assert reply.error.details["max"] == str(lines.MAX_DECODE_TOKENS), (command, reply)
        assert len(reply.error.details["n_tokens"]) <= 32
    assert b"INTERNAL" not in raw
    assert replies[-2].error is None and replies[-2].fields["generated_tokens"] == "1"
    assert replies[-1].error is None
    assert hostile.neighbour_served_since(served)


def test_a_megabyte_line_gets_its_err_before_the_connection_closes(hostile):
    """Issue #8: a 1 MiB line got no ERR before the connection dropped."""
    served = hostile.neighbour.served
    with connect(hostile.socket) as sock:
        sent: list[BaseException] = []

        def send() -> None:
            try:
                sock.sendall(b"DECODE a 1 " + b"x" * (1 << 20))
            except OSError as exc:  # the daemon closes once it refused the line: the rest cannot be sent
                sent.append(exc)

        sender = threading.Thread(target=send, name="megabyte-line", daemon=True)
        started = time.monotonic()
        sender.start()
        data = read_until_closed(sock)
        elapsed = time.monotonic() - started
        sender.join(10)
    assert hostile.neighbour_served_since(served)
    assert data == f"ERR BAD_REQUEST max_line_bytes={lines.MAX_LINE_BYTES}\n".encode(), data[:200]
    assert elapsed < 10, f"took {elapsed:.1f} s"


def raw_frame(payload: bytes) -> bytes:
    body = base64.b64encode(payload)
    return HEADER.pack(MAGIC, VERSION, len(body)) + body


def read_frames(sock: socket.socket, count: int) -> list[Frame]:
    parser = FrameParser()
    frames: list[Frame] = []
    while len(frames) < count:
        event = parser.next_event()
        if isinstance(event, Frame):
            frames.append(event)
            continue
        chunk = sock.recv(65536)
        assert chunk, "the daemon closed the connection"
        parser.receive_data(chunk)
    return frames


@pytest.fixture(scope="module")
def arrays_frame() -> bytes:
    """A 16 MiB frame of nested JSON arrays, built before the appliance starts: encoding it holds this process's
    GIL for a while, and the appliance under test runs in this process."""
    head = b'{"type":"INFER_REQUEST","task_id":"arrays","model":"demo","prompt":"x","stop":['
    count = (12 * 1024 * 1024 - len(head) - 64) // 5
    return raw_frame(head + b"[[]]," * count + b"[]]}")


def test_a_16_mib_frame_of_nested_arrays_is_refused_fast_and_the_connection_goes_on(arrays_frame, hostile):
    """Issue #8: a 16 MiB frame of JSON arrays took 4.6 s to parse on the event loop. It is refused from a count
    of its structure (BAD_PAYLOAD naming max_json_items), health stays fast, and the same connection answers the
    next frame."""
    wire = arrays_frame
    assert 15 * 1024 * 1024 < len(wire) <= 16 * 1024 * 1024 + HEADER.size
    served = hostile.neighbour.served
    with connect(hostile.socket) as sock:
        sock.sendall(wire)
        sent = time.monotonic()
        sock.sendall(encode_frame({"type": "PROTOCOL_INFO"}))
        error, info = read_frames(sock, 2)
        elapsed = time.monotonic() - sent
    assert error.payload["type"] == "ERROR", error.payload
    assert error.payload["task_id"] is None  # the task_id is in the JSON that was not parsed
    assert error.payload["error"]["code"] == "BAD_PAYLOAD"
    assert error.payload["error"]["details"]["max_json_items"] == MAX_JSON_ITEMS
    assert info.payload["type"] == "PROTOCOL_INFO" and "version" in info.payload
    assert elapsed < 5, f"refused after {elapsed:.1f} s"  # about 0.2 s; loose for a slow, busy machine
    assert hostile.neighbour_served_since(served)
