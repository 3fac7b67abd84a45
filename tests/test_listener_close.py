"""The socket server's close against a connection accepted just before it (appliance.server.listener): asyncio
starts a connection's handler one loop iteration after accepting it, so a close in between cancels every handler
it knows and misses that one. Its handler, starting once the close began, must close the connection at once, not
wait ``socket.request_timeout_s`` for the client's first bytes (a stop hung 30 s on it under load)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import yaml

from appliance.config.validate import parse_config
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.engine.fake import FakeEngine
from appliance.server.listener import SocketServer


def test_a_connection_whose_handler_starts_after_close_is_closed_at_once(tmp_path: Path) -> None:
    config = parse_config(yaml.safe_dump({"data_dir": str(tmp_path / "state"), "device": "fake:1GiB", "models": [],
                                          "socket": {"request_timeout_s": 30}}), base_dir=tmp_path)

    async def scenario() -> tuple[float, bytes]:
        daemon = Daemon(config, FakeDevice(2**30), FakeEngine())
        server = SocketServer(daemon, tmp_path / "a.sock")
        await server.start()
        ours, theirs = socket.socketpair()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            await server.close()
            started = time.monotonic()
            # The handler asyncio starts late (it swallows its cancellation: a bound reached ends it quietly).
            await asyncio.wait_for(server._accept(reader, writer), 10)
            took = time.monotonic() - started
            theirs.settimeout(5)
            return took, theirs.recv(16)
        finally:
            theirs.close()
            await daemon.close()

    took, sent = asyncio.run(scenario())
    assert took < 5  # at once, not after the 10 s bound (nor the 30 s request timeout)
    assert sent == b""  # closed, nothing sent
