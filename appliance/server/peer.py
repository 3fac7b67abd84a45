"""What a server can tell about its peer without reading from it."""

from __future__ import annotations

import asyncio
import select


def peer_gone(writer: asyncio.StreamWriter) -> bool:
    """After EOF: has the client closed the whole socket (POLLHUP), not just its sending half (``nc -N``)?"""
    if writer.is_closing():
        return True
    sock = writer.get_extra_info("socket")
    if sock is None:
        return True
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP)
    return any(event & select.POLLHUP for _, event in poller.poll(0))
