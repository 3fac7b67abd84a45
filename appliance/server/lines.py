"""One line-protocol connection (SPEC L6): read lines, call the daemon, write replies.

Parsing and formatting live in :mod:`appliance.protocol.lines`; this is the IO shell around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from typing import Any

from appliance.config import tune
from appliance.daemon.core import Daemon
from appliance.daemon.model import DecodeResult
from appliance.engine.interface import GREEDY
from appliance.errors import ApplianceError
from appliance.protocol import lines, paging
from appliance.server import outcome
from appliance.server.peer import ReadClock, flush_within, peer_gone, read_within, socket_settings

log = logging.getLogger(__name__)


def yes_no(record: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``record`` with the flags ``keys`` written ``yes`` / ``no`` (STATUS's ``over_cap``, ``retired``)."""
    return {key: ("yes" if value else "no") if key in keys else value for key, value in record.items()}


def agents_header(page: paging.Page[Any]) -> dict[str, Any]:
    """STATUS's header line: how many agents there are and which of them the reply lists."""
    return {"agents_total": page.total, "agents_shown": page.shown, "agents_offset": page.offset,
            "agents_next_offset": page.next_offset}  # none on the last page; else: STATUS agents <it>


def status_reply(snapshot: dict[str, Any], offset: int | None) -> str:
    """STATUS (``offset`` None: everything, the first :data:`~appliance.protocol.paging.STATUS_AGENTS` agents), or
    ``STATUS agents <offset>`` (only agents, from there on)."""
    page = paging.page_of(snapshot["agents"], offset or 0, paging.STATUS_AGENTS)
    if offset is not None:
        return lines.format_reply("STATUS", [agents_header(page)], body=lines.format_records("agent", page.items))
    return lines.format_reply("STATUS", [agents_header(page)], body=status_body({**snapshot, "agents": page.items}))


def status_body(snapshot: dict[str, Any]) -> list[str]:
    body = lines.format_records("device", [snapshot["device"]])
    body += lines.format_records("ledger", [yes_no(snapshot["ledger"], "over_cap")])
    body += lines.format_records("host_kv", [snapshot["host_kv"]])
    body += lines.format_records("engine", [snapshot["engine"]])
    body += lines.format_records("context", snapshot["contexts"])
    body += lines.format_records("model", [yes_no(model, "retired") for model in snapshot["models"]])
    body += lines.format_records("agent", snapshot["agents"])
    body += lines.format_records("profile", profile_records(snapshot["profiles"]))
    body += lines.format_records("counters", [snapshot["counters"]])
    for key, value in snapshot.get("extra", {}).items():  # one record, or a list of them (the reload history)
        if isinstance(value, list):
            body += lines.format_records(key, value)
        else:
            body.append(f"{key} {lines.format_fields(value)}")
    return body


def profile_records(profiles: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One STATUS ``profile`` record per model from its :meth:`~appliance.engine.profile.LoadProfile.summary`:
    the counts, then each figure's percentiles flat (``input_tokens_p50=…``; ``none`` while the window is
    empty)."""
    records = []
    for model, summary in profiles.items():
        record: dict[str, Any] = {"model": model}
        for key, value in summary.items():
            if key != "percentiles":
                record[key] = value
        for figure, quantiles in summary["percentiles"].items():
            for quantile, value in quantiles.items():
                record[f"{figure}_{quantile}"] = value
        records.append(record)
    return records


def results_header(result: DecodeResult) -> dict[str, Any]:
    """A DECODE's counts and what it ran with (SPEC E6): the first header line of its reply."""
    gen = result.generation
    return {"prompt_tokens": gen.prompt_tokens, "generated_tokens": gen.generated_tokens,
            "stopped_on_eos": gen.stopped_on_eos,
            "prompt_evaluated": gen.prompt_evaluated if gen.prompt_evaluated is not None else gen.prompt_tokens,
            "peak_memory_bytes": result.peak_memory_bytes, "plan": result.plan, "threads": result.threads}


def timings_header(result: DecodeResult) -> dict[str, Any]:
    """A DECODE's times in milliseconds; ``ttft_ms=none`` when no token was generated."""
    gen = result.generation
    ttft_ms = round(gen.ttft_s * 1000, 3) if gen.ttft_s is not None else None
    return {"elapsed_ms": round(gen.elapsed_s * 1000, 3), "ttft_ms": ttft_ms}


def list_body(daemon: Daemon) -> list[str]:
    loaded = {m["name"]: m for m in daemon.snapshot()["models"]}
    records = []
    for spec in daemon.config.models:
        state = loaded.get(spec.name, {})
        records.append({"name": spec.name, "state": daemon.model_state(spec.name), "path": str(spec.path),
                        "n_ctx": spec.n_ctx,
                        "vram_bytes": spec.vram_bytes if spec.vram_bytes is not None else "auto",
                        "loaded": state.get("loaded", False), "refcount": state.get("refcount", 0),
                        "estimate_bytes": state.get("estimate_bytes"),
                        "measured_bytes": state.get("measured_bytes")})
    return lines.format_records("model", records)


async def execute(daemon: Daemon, command: lines.Command, cancel: threading.Event, owner: object = None) -> str:
    """Run one parsed command and return its full reply text (``owner``: the connection, for TUNE)."""
    name = command.name
    if name == "HELP":
        return lines.help_text()
    if name == "STATUS":
        return status_reply(daemon.snapshot(), command.offset)
    if name == "LIST":
        return lines.format_reply("LIST", body=list_body(daemon))
    if name == "RESYNC":
        reading = await asyncio.to_thread(daemon.resync)
        return lines.format_reply("RESYNC", [{"device_total_bytes": reading.total, "device_used_bytes": reading.used,
                                              "external_bytes": daemon.external,
                                              "ledger_max_bytes": daemon.ledger.cap,
                                              "ledger_allocated_bytes": daemon.ledger.allocated}])
    if name == "RELOAD":
        if daemon.on_reload is None:
            raise ApplianceError("FORBIDDEN", "this daemon runs without a config file to reload")
        assert command.trigger is not None
        record = await daemon.on_reload(command.trigger)
        return lines.format_reply("RELOAD", [{"result": record["result"], "trigger": record["trigger"],
                                              "diff": record["diff"] or "none", "applied": record["applied"] or "none",
                                              "error": record["error"] or "none"}])
    if name == "TUNE":
        if daemon.on_tune is None:
            raise ApplianceError("FORBIDDEN", "this daemon runs without a config file to tune")
        settings = dict(command.settings)
        tune.refuse_threads_over(tune.engine_values(settings), daemon.adaptive.cores)
        record = await daemon.on_tune(owner, settings)
        tuned = ",".join(f"{key}={value}" for key, value in command.settings) or "none"
        return lines.format_reply("TUNE", [{"result": record["result"], "trigger": record["trigger"],
                                            "diff": record["diff"] or "none", "error": record["error"] or "none",
                                            "tuned": tuned}])
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
    result = await outcome.generate(daemon, surface="lines", prompt=command.prompt, max_tokens=command.n_tokens,
                                    sampling=GREEDY, session_id=command.agent, cancel=cancel)
    headers: list[dict[str, Any]] = [
        results_header(result),
        timings_header(result),
        {"kv_swap_evicted": result.evicted or "none", "kv_swap_restored": result.restored,
         "kv_restored_from": result.restored_from},
    ]
    if result.notice is not None:  # once: its model was reloaded with another vocabulary
        headers.append({"notice": result.notice})
    return lines.format_reply("DECODE", headers, body=[result.generation.text], agent_id=command.agent)


READ_AHEAD_BYTES = 1 << 16
"""While a command runs, pipelined bytes are read ahead up to this much; then reading pauses (backpressure). Kept
small: the next command's parse takes whatever is buffered in one step on the event loop (a MiB of blank lines
takes the line reader about 0.4 s on the 2-core box; 64 KiB, a few ms)."""
READ_BYTES = 1 << 16
"""One read from the socket."""


class LineSession:
    """One line-protocol connection. It owns the connection's :class:`~appliance.protocol.lines.LineReader`
    (bytes to commands) and its :class:`~appliance.server.peer.ReadClock` (request and idle timeouts), runs one
    command at a time in order, and watches the socket while a command runs: a client that closes its socket
    cancels its generation at the next token (R3).

    Every buffer is bounded: while a command runs, pipelined bytes are read ahead up to
    :data:`READ_AHEAD_BYTES`, then reading pauses until the command is answered (the kernel's socket buffer then
    fills and the client's writes block); a reply the client does not read for ``socket.stall_timeout_s`` ends
    the connection."""

    def __init__(self, daemon: Daemon, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.daemon = daemon
        self.reader = reader
        self.writer = writer
        self.lines = lines.LineReader()
        self.clock = ReadClock(functools.partial(socket_settings, daemon))
        self.eof = False

    async def serve(self, initial: bytes) -> None:
        """Serve until EOF. Bad lines get ERR replies and the connection keeps working."""
        if initial:
            self.lines.receive_data(initial)
        while True:
            try:
                event = self.lines.next_event()
            except lines.LineProtocolError as exc:
                self.clock.pending(False)
                self.writer.write(self.error_line(exc.error).encode())
                if not await self.flush() or exc.fatal:
                    return
                continue
            if event is lines.CLOSED:
                return
            if event is lines.NEED_DATA:
                self.clock.pending(self.lines.buffered > 0)
                if not await self.read():
                    return
                continue
            self.clock.pending(False)
            cancel = threading.Event()
            reply = await self.run(event, cancel)
            if cancel.is_set():
                return  # the client went away: nobody to answer
            self.writer.write(reply.encode("utf-8"))
            if not await self.flush():
                return

    async def read(self) -> bool:
        """Read the next bytes; False when the connection timed out (it was told why)."""
        chunk = await read_within(self.reader, self.clock, READ_BYTES)
        if chunk is None:
            self.writer.write(self.error_line(self.clock.error("request line")).encode())
            await self.flush()
            return False
        self.eof = not chunk
        self.lines.receive_data(chunk)
        return True

    async def flush(self) -> bool:
        """Wait until the transport took the reply; False (connection aborted) if the client stopped reading."""
        return await flush_within(self.writer, self.daemon.config.socket.stall_timeout_s)

    async def run(self, command: lines.Command, cancel: threading.Event) -> str:
        """The full reply text for one command: its answer, or its error as one ERR line."""
        try:
            job = asyncio.ensure_future(execute(self.daemon, command, cancel, self))
            try:
                await self.watch(job, cancel)
            except asyncio.CancelledError:  # the daemon is stopping: say so, then let the connection go
                error = ApplianceError("SHUTTING_DOWN", "the appliance is stopping")
                self.writer.write(self.error_line(error).encode())
                raise
            return job.result()
        except Exception as exc:  # never let one request take the daemon down
            return self.error_line(outcome.error_of(exc))

    def error_line(self, error: ApplianceError) -> str:
        """``error`` as one ERR line, counted for the metrics."""
        self.daemon.errors["lines", error.code] += 1
        return lines.format_error(error)

    async def watch(self, job: asyncio.Future[str], cancel: threading.Event) -> None:
        """Wait for ``job`` while reading ahead (pipelined lines are kept, up to :data:`READ_AHEAD_BYTES`).
        The client closing its socket, or the server stopping, cancels the job's generation at the next
        token (R3)."""
        try:
            while not job.done():
                if self.eof or self.lines.buffered >= READ_AHEAD_BYTES:
                    await asyncio.wait({job})
                    continue
                reading = asyncio.ensure_future(self.reader.read(READ_BYTES))
                await asyncio.wait({job, reading}, return_when=asyncio.FIRST_COMPLETED)
                if reading.done():
                    chunk = reading.result()
                    self.clock.received()
                    self.eof = not chunk
                    self.lines.receive_data(chunk)
                    if self.eof and peer_gone(self.writer):
                        cancel.set()
                else:
                    reading.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reading
        except asyncio.CancelledError:
            cancel.set()
            with contextlib.suppress(BaseException):
                await job
            raise


async def serve_lines(daemon: Daemon, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      initial: bytes) -> None:
    session = LineSession(daemon, reader, writer)
    try:
        await session.serve(initial)
    finally:
        if daemon.on_untune is not None:
            daemon.on_untune(session)  # the engine settings it held with TUNE go back to the file's
