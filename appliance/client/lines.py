"""A blocking line-protocol client (SPEC L6) for the CLI and tests."""

from __future__ import annotations

import socket
from pathlib import Path

from appliance.errors import ApplianceError


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


def read_reply(stream) -> str:  # type: ignore[no-untyped-def]
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
    """The text between BEGIN_RESPONSE and END_RESPONSE."""
    start = reply.index("BEGIN_RESPONSE\n") + len("BEGIN_RESPONSE\n")
    end = reply.rindex("END_RESPONSE")
    return reply[start:end].removesuffix("\n")


def header_fields(reply: str) -> dict[str, str]:
    """All ``key=value`` pairs of the OK header lines (values unquoted)."""
    import shlex

    fields: dict[str, str] = {}
    for line in reply.splitlines():
        if line == "BEGIN_RESPONSE":
            break
        if line.startswith("OK "):
            for part in shlex.split(line[3:]):
                key, _, value = part.partition("=")
                fields[key] = value
    return fields
