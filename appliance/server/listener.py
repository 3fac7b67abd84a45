"""The Unix-socket server: one socket, two protocols (SPEC P5, L6, R1, R4).

The first bytes of a connection decide: the MAGN magic (``4d 47 4e 54``) -> binary frames
(:mod:`appliance.server.magn`), anything else -> the line protocol (:mod:`appliance.server.lines`). A connection
that sends nothing within ``socket.request_timeout_s`` is closed (header timeout). At most ``max_connections``
clients are served, all surfaces together (the HTTP server registers its count in
:attr:`SocketServer.other_connections`); the next one gets ``TOO_MANY_CONNECTIONS`` in the protocol it spoke and
is closed. Closing never waits on a client that does not read: after :data:`CLOSE_GRACE_S` its transport is
aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

from appliance.daemon.core import Daemon
from appliance.errors import ApplianceError, StartupError
from appliance.protocol import lines
from appliance.protocol.frames import MAGIC_BYTES as MAGIC
from appliance.protocol.frames import looks_like_magn
from appliance.server.lines import serve_lines
from appliance.server.magn import error_frame, serve_magn

log = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
SNIFF_TIMEOUT_S = 1.0
READER_LIMIT_BYTES = 1 << 16
"""A connection's stream reader stops reading from the socket once it holds twice this, unread by the session."""
CLOSE_GRACE_S = 2.0
"""How long a closing connection may take to flush and end before its transport is aborted."""


async def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a connection, giving its client :data:`CLOSE_GRACE_S` to take what is buffered, then abort it."""
    writer.close()
    with contextlib.suppress(Exception):  # TimeoutError included: the connection goes either way
        await asyncio.wait_for(writer.wait_closed(), CLOSE_GRACE_S)
    writer.transport.abort()  # nothing happens if it closed already


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


class SocketServer:
    """The listening Unix socket. It owns the socket file (created with ``mode``/``group``, removed at close,
    a stale one replaced only when nothing answers on it), the set of connection tasks, and the connection
    figures shown in STATUS. Each connection is handed to the session of the protocol its first bytes speak.
    ``max_connections`` is read from the daemon's current config at each accept."""

    def __init__(self, daemon: Daemon, path: Path, *, mode: int = 0o660, group: str | None = None,
                 max_connections: int | None = None) -> None:
        self.daemon = daemon
        self.path = path
        self.mode = mode
        self.group = group
        self._max_connections = max_connections  # a fixed limit overrides the config's (tests)
        self.connections: set[asyncio.Task[None]] = set()
        self.writers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self.other_connections: list[Callable[[], int]] = []  # other surfaces' open connections (HTTP)
        self.accepted = 0
        self.refused = 0
        self.buffer_bytes: dict[str, int] = {}
        self._server: asyncio.AbstractServer | None = None
        self._listening = False  # our socket file is bound at ``path`` (start) and not yet removed
        self._closing = False  # close began: a connection whose handler starts now is closed at once

    @property
    def max_connections(self) -> int:
        if self._max_connections is not None:
            return self._max_connections
        return self.daemon.config.max_connections

    def open_connections(self) -> int:
        """This server's open connections."""
        return len(self.connections)

    def total_connections(self) -> int:
        """Open connections of every surface: the socket's and the others' (HTTP)."""
        return len(self.connections) + sum(count() for count in self.other_connections)

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if not self.path.is_socket():
                raise StartupError(f"{self.path} exists and is not a socket", path=str(self.path))
            if _answers(self.path):
                raise StartupError(f"another appliance is already serving on {self.path}", path=str(self.path))
            self.path.unlink()  # a stale socket left by a killed daemon
        old_umask = os.umask(0o777 & ~self.mode)  # the socket is never reachable with looser permissions
        try:
            self._server = await asyncio.start_unix_server(self._accept, path=str(self.path),
                                                           limit=READER_LIMIT_BYTES, backlog=256)
        finally:
            os.umask(old_umask)
        self._listening = True
        os.chmod(self.path, self.mode)
        if self.group:
            os.chown(self.path, -1, grp.getgrnam(self.group).gr_gid)
        log.info("socket %s (mode %o) ready", self.path, self.mode)

    def _tune(self, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is None:
            return
        for option, name in ((socket.SO_SNDBUF, "sndbuf"), (socket.SO_RCVBUF, "rcvbuf")):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            granted = sock.getsockopt(socket.SOL_SOCKET, option)
            if self.buffer_bytes.get(name) != granted:
                self.buffer_bytes[name] = granted
                log.info("socket %s asked %d bytes, kernel granted %d", name, SOCKET_BUFFER_BYTES, granted)

    async def _sniff(self, reader: asyncio.StreamReader) -> bytes:
        data = b""
        while len(data) < len(MAGIC) and looks_like_magn(data):
            chunk = await reader.read(65536)
            if not chunk:
                break
            data += chunk
        return data

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closing:  # accepted just before close, its handler started after close cancelled the others
            await close_writer(writer)
            return
        over = self.total_connections() >= self.max_connections
        self.connections.add(task)
        self.writers[task] = writer
        try:
            self._tune(writer)
            if over:
                self.refused += 1
                await self._refuse(reader, writer)
                return
            self.accepted += 1
            try:
                initial = await asyncio.wait_for(self._sniff(reader), self.daemon.config.socket.request_timeout_s)
            except TimeoutError:
                return  # sent nothing (or a partial magic) in time: the header timeout
            if not initial:
                return
            if initial.startswith(MAGIC):
                self.daemon.connections["magn"] += 1
                await serve_magn(self.daemon, reader, writer, initial)
            else:
                self.daemon.connections["lines"] += 1
                await serve_lines(self.daemon, reader, writer, initial)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # the server is closing; ending quietly keeps asyncio from logging the cancellation
        except Exception:
            log.exception("connection handler failed")
        finally:
            self.connections.discard(task)
            self.writers.pop(task, None)
            with contextlib.suppress(Exception):
                await self.daemon.release_owner(writer)
            await close_writer(writer)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        error = ApplianceError("TOO_MANY_CONNECTIONS", f"the daemon serves at most {self.max_connections} clients",
                               {"max_connections": self.max_connections})
        try:
            initial = await asyncio.wait_for(self._sniff(reader), SNIFF_TIMEOUT_S)
        except TimeoutError:
            initial = b""
        if initial.startswith(MAGIC):
            self.daemon.errors["magn", error.code] += 1
            writer.write(error_frame(error, None))
        else:
            self.daemon.errors["lines", error.code] += 1
            writer.write(lines.format_error(error).encode())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(writer.drain(), SNIFF_TIMEOUT_S)

    def report(self) -> dict[str, object]:
        """Connection figures for STATUS (``connections``: the socket's; ``all_connections``: every surface's, as
        counted against ``max_connections``): the kernel's granted buffer sizes next to the 4 MiB asked."""
        return {"path": str(self.path), "connections": len(self.connections), "max_connections": self.max_connections,
                "all_connections": self.total_connections(),
                "accepted": self.accepted, "refused": self.refused, "buffer_asked_bytes": SOCKET_BUFFER_BYTES,
                "sndbuf_granted_bytes": self.buffer_bytes.get("sndbuf"),
                "rcvbuf_granted_bytes": self.buffer_bytes.get("rcvbuf")}

    def set_permissions(self, mode: int, group: str | None) -> None:
        """Apply a new ``mode`` and ``group`` to the bound socket file (a reload that changed only those)."""
        os.chmod(self.path, mode)
        if group:
            os.chown(self.path, -1, grp.getgrnam(group).gr_gid)
        self.mode = mode
        self.group = group

    def stop_accepting(self) -> None:
        """Close the listening socket and remove its file (only the one we bound); connections in flight go on
        until they end or :meth:`close`. A rebind does this to the old server once the new one listens."""
        if self._server is None or not self._listening:
            return
        self._listening = False
        self._server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        log.info("socket %s no longer accepts connections (%d still open)", self.path, len(self.connections))

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self.connections):
            task.cancel()
        if self.connections:
            await asyncio.wait(list(self.connections), timeout=CLOSE_GRACE_S)
        for writer in list(self.writers.values()):  # still flushing to a client that does not read
            writer.transport.abort()
        if self.connections:
            await asyncio.wait(list(self.connections), timeout=CLOSE_GRACE_S)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self._listening:  # only the socket we bound and still own: never a file that was there before
            self._listening = False
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

