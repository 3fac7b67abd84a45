"""A blocking line-protocol client (SPEC L6) for the CLI and tests.

Replies are read line by line (split on ``\\n`` only) up to ``ERR …`` or ``END_RESPONSE``; the body is unescaped
by :func:`appliance.protocol.lines.parse_reply` (no body line can equal ``END_RESPONSE``: see that module).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from pathlib import Path

from appliance.errors import ApplianceError
from appliance.protocol.lines import parse_reply


def request(path: Path | str, line: str, timeout: float | None = 300.0) -> str:
    """Send one command line and return the whole reply (``ERR …`` line, or up to ``END_RESPONSE``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise ApplianceError("INTERNAL", f"cannot reach the appliance at {path}: {exc.strerror or exc}",
                                 {"socket": str(path)}) from exc
        sock.sendall(line.rstrip("\n").encode("utf-8") + b"\n")
        return read_reply(sock.makefile("r", encoding="utf-8", newline="\n"))


def read_reply(stream: Iterable[str]) -> str:
    """One whole reply from a text stream of ``\\n``-terminated lines (open it with ``newline="\\n"``)."""
    out: list[str] = []
    in_body = False
    for line in stream:
        out.append(line)
        text = line.rstrip("\n")
        if not in_body and text.startswith("ERR "):
            break
        if text == "BEGIN_RESPONSE":
            in_body = True
        elif text == "END_RESPONSE":
            break
    return "".join(out)


def response_body(reply: str) -> str:
    """The body's text, unescaped ("" when the reply has no body line); ValueError for an ERR reply."""
    parsed = parse_reply(reply)
    if parsed.error is not None:
        raise ValueError(f"an error reply has no body: {reply.strip()}")
    return parsed.body or ""


def header_fields(reply: str) -> dict[str, str]:
    """All ``key=value`` pairs of the OK header lines (or of the ERR line), values unquoted and unescaped."""
    return parse_reply(reply).fields
