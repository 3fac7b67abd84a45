"""One line-protocol connection (SPEC L6): read lines, call the daemon, write replies.

Parsing and formatting live in :mod:`appliance.protocol.lines`; this is the IO shell around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from appliance.protocol import lines
from appliance.daemon.core import Daemon
from appliance.errors import ApplianceError, internal
from appliance.server.peer import peer_gone

log = logging.getLogger(__name__)


def status_body(snapshot: dict[str, Any]) -> list[str]:
    body = lines.format_records("device", [snapshot["device"]])
    body += lines.format_records("ledger", [snapshot["ledger"]])
    body += lines.format_records("model", snapshot["models"])
    body += lines.format_records("agent", snapshot["agents"])
    body += lines.format_records("counters", [snapshot["counters"]])
    return body + [f"{key} {lines.format_fields(value)}" for key, value in snapshot.get("extra", {}).items()]


def list_body(daemon: Daemon) -> list[str]:
    loaded = {m["name"]: m for m in daemon.snapshot()["models"]}
    records = []
    for spec in daemon.config.models:
        state = loaded.get(spec.name, {})
        records.append({"name": spec.name, "path": str(spec.path), "n_ctx": spec.n_ctx,
                        "vram_bytes": spec.vram_bytes if spec.vram_bytes is not None else "auto",
                        "loaded": state.get("loaded", False), "refcount": state.get("refcount", 0),
                        "estimate_bytes": state.get("estimate_bytes"),
                        "measured_bytes": state.get("measured_bytes")})
    return lines.format_records("model", records)


async def execute(daemon: Daemon, command: lines.Command, cancel: threading.Event) -> str:
    """Run one parsed command and return its full reply text."""
    name = command.name
    if name == "HELP":
        return lines.help_text()
    if name == "STATUS":
        return lines.format_reply("STATUS", body=status_body(daemon.snapshot()))
    if name == "LIST":
        return lines.format_reply("LIST", body=list_body(daemon))
    if name == "RESYNC":
        reading = await asyncio.to_thread(daemon.resync)
        return lines.format_reply("RESYNC", [{"device_total_bytes": reading.total, "device_used_bytes": reading.used,
                                              "external_bytes": daemon.external,
                                              "ledger_max_bytes": daemon.ledger.cap,
                                              "ledger_allocated_bytes": daemon.ledger.allocated}])
    assert command.agent is not None
    if name == "REGISTER":
        assert command.model is not None
        agent = await daemon.register(command.agent, command.model)
        return lines.format_reply("REGISTER", [{"model": agent.model.key,
                                                "estimate_bytes": agent.model.estimate,
                                                "refcount": agent.model.refcount,
                                                "ledger_max_bytes": daemon.ledger.cap,
                                                "ledger_allocated_bytes": daemon.ledger.allocated}],
                                  agent_id=command.agent)
    if name == "UNREGISTER":
        await daemon.unregister(command.agent)
        return lines.format_reply("UNREGISTER", [{"ledger_allocated_bytes": daemon.ledger.allocated}],
                                  agent_id=command.agent)
    assert name == "DECODE" and command.n_tokens is not None
    result = await daemon.decode(command.agent, command.n_tokens, command.prompt, cancel=cancel)
    gen = result.generation
    if gen.stop_reason == "cancelled":
        raise ApplianceError("CANCELLED", "the client went away", {"generated_tokens": gen.generated_tokens})
    return lines.format_reply("DECODE", [
        {"prompt_tokens": gen.prompt_tokens, "generated_tokens": gen.generated_tokens,
         "stopped_on_eos": gen.stopped_on_eos},
        {"elapsed_ms": round(gen.elapsed_s * 1000, 3)},
        {"kv_swap_evicted": result.evicted or "none", "kv_swap_restored": result.restored},
    ], body=[gen.text], agent_id=command.agent)


async def serve_lines(daemon: Daemon, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      initial: bytes) -> None:
    """Serve one connection until EOF. Bad lines get ERR replies and the connection keeps working."""
    buffer = bytearray(initial)
    eof = False
    while True:
        newline = buffer.find(b"\n")
        if newline < 0:
            if len(buffer) > lines.MAX_LINE_BYTES:
                writer.write(lines.format_error(ApplianceError(
                    "BAD_REQUEST", f"line longer than {lines.MAX_LINE_BYTES} bytes")).encode())
                await writer.drain()
                return
            if eof:
                if not buffer.strip():
                    return
                newline = len(buffer)  # a last line without newline still counts (nc -N)
                buffer.append(10)
            else:
                chunk = await reader.read(65536)
                eof = not chunk
                buffer += chunk
                continue
        raw, buffer = bytes(buffer[:newline]), buffer[newline + 1:]
        if not raw.strip():
            continue
        cancel = threading.Event()
        try:
            command = lines.parse_line(raw)
            job = asyncio.ensure_future(execute(daemon, command, cancel))
            try:
                chunk, eof = await watch(job, reader, writer, cancel, eof)
            except asyncio.CancelledError:  # the daemon is stopping: say so, then let the connection go
                writer.write(lines.format_error(ApplianceError("SHUTTING_DOWN", "the appliance is stopping")).encode())
                raise
            buffer += chunk
            reply = job.result()
        except ApplianceError as exc:
            reply = lines.format_error(exc)
        except Exception as exc:  # never let one request take the daemon down
            log.exception("line command failed")
            reply = lines.format_error(internal(exc))
        if cancel.is_set():
            return
        writer.write(reply.encode("utf-8"))
        await writer.drain()


async def watch(job: asyncio.Future[str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                cancel: threading.Event, eof: bool) -> tuple[bytes, bool]:
    """Wait for ``job`` while reading ahead (pipelined lines are kept). The client closing its socket, or the
    server stopping, cancels the job's generation at the next token (R3); returns (read-ahead, eof)."""
    ahead = bytearray()
    try:
        while not job.done():
            reading = asyncio.ensure_future(reader.read(65536)) if not eof else None
            await asyncio.wait({job} if reading is None else {job, reading}, return_when=asyncio.FIRST_COMPLETED)
            if reading is not None and reading.done():
                chunk = reading.result()
                ahead += chunk
                eof = not chunk
                if eof and peer_gone(writer):
                    cancel.set()
            elif reading is not None:
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
    except asyncio.CancelledError:
        cancel.set()
        with contextlib.suppress(BaseException):
            await job
        raise
    return bytes(ahead), eof
