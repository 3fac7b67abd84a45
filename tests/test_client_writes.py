"""How ``AsyncMagnClient`` writes its frames, on a real Unix socket whose other end the test reads itself: a frame
goes to the socket at once when nothing waits before it (no wake-up of the writer task), and frames the socket
cannot take yet are written later by the writer task, in the order they were sent."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from appliance.client import AsyncMagnClient
from appliance.protocol import messages as m
from appliance.protocol.frames import NEED_DATA, Frame, FrameParser


def received_messages(parser: FrameParser) -> list[m.Message]:
    """The messages of the whole frames ``parser`` holds."""
    out = []
    while isinstance(event := parser.next_event(), Frame):
        out.append(m.parse_message(event.payload))
    assert event is NEED_DATA
    return out


def test_a_request_is_on_the_socket_before_the_loop_runs_again(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"

    async def main() -> bytes:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            server.listen()
            client = await AsyncMagnClient(str(path)).connect()
            peer, _ = server.accept()
            with peer:
                peer.setblocking(False)
                client.stream(model="m", prompt="hi", max_tokens=1, task_id="now")  # no await after it
                data = peer.recv(1 << 16)  # raises BlockingIOError if the frame waits for the writer task
                await client.close()
                return data

    parser = FrameParser()
    parser.receive_data(asyncio.run(main()))
    sent = received_messages(parser)
    assert len(sent) == 1 and isinstance(sent[0], m.InferRequest) and sent[0].task_id == "now"


def test_frames_the_socket_cannot_take_yet_arrive_whole_and_in_order(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    prompt = "x" * 60_000
    count = 200  # 12 MB: far more than the socket buffers hold

    async def main() -> list[m.Message]:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            server.listen()
            client = await AsyncMagnClient(str(path), max_frame_bytes=1 << 24).connect()
            peer, _ = server.accept()
            with peer:
                peer.setblocking(False)
                for n in range(count):  # sent while nobody reads: most wait in the outbox
                    client.stream(model="m", prompt=prompt, max_tokens=1, task_id=f"t{n}")
                parser = FrameParser(max_frame_bytes=1 << 24)
                sent: list[m.Message] = []
                deadline = time.monotonic() + 60
                while len(sent) < count and time.monotonic() < deadline:
                    try:
                        parser.receive_data(peer.recv(1 << 20))
                    except BlockingIOError:
                        await asyncio.sleep(0.001)  # the writer task writes the rest meanwhile
                        continue
                    sent += received_messages(parser)
                await client.close()
                return sent

    sent = asyncio.run(main())
    assert [getattr(message, "task_id", None) for message in sent] == [f"t{n}" for n in range(count)]
    assert all(isinstance(message, m.InferRequest) and message.prompt == prompt for message in sent)
