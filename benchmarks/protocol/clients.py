"""The paths to the appliance process over its Unix socket (MAGN: a minimal client on the codec, the shipped
``AsyncMagnClient`` and ``MagnClient``) and to an OpenAI-style HTTP server (``/v1/completions`` over ``httpx``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from pathlib import Path
from typing import Any

from appliance.client import AsyncMagnClient, MagnClient
from appliance.protocol import messages as m
from appliance.protocol.frames import CLOSED, NEED_DATA, FrameParser
from benchmarks.protocol.workload import Contender, Sample, http_request, magn_request


class MagnRaw(Contender):
    """A minimal blocking client on the appliance's own codec: encode a frame, ``sendall``, parse replies."""

    name, label, kind = "magn_raw", "MAGN, minimal blocking socket client", "magn"

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.parser = FrameParser()
        self.ids = itertools.count(1)
        self.sock.sendall(m.encode_message(m.ProtocolInfoRequest()))  # opened now: see AsyncMagnClient's
        while (event := self.parser.next_event()) is NEED_DATA:
            self.parser.receive_data(self.sock.recv(1 << 16))
        if event is CLOSED or not isinstance(m.parse_message(event.payload), m.ProtocolInfo):
            raise ConnectionError(f"the appliance did not answer PROTOCOL_INFO: {event}")

    def _run(self, prompt: str, n: int, stream: bool) -> Sample:
        start = time.perf_counter()
        task_id = f"r{next(self.ids)}"
        self.sock.sendall(m.encode_message(m.InferRequest(task_id, **magn_request(prompt, n), stream=stream)))
        ttft = None
        while True:
            event = self.parser.next_event()
            if event is NEED_DATA:
                self.parser.receive_data(self.sock.recv(1 << 16))
                continue
            if event is CLOSED:
                raise ConnectionError("the appliance closed the connection")
            msg = m.parse_message(event.payload)
            if isinstance(msg, m.StreamToken) and ttft is None:
                ttft = time.perf_counter() - start
            elif isinstance(msg, m.TaskComplete):
                elapsed = time.perf_counter() - start
                return Sample(elapsed, msg.text, msg.usage.completion_tokens, ttft)
            elif isinstance(msg, m.ErrorMessage):
                raise msg.error.exception()

    def one(self, prompt: str) -> Sample:
        return self._run(prompt, 1, False)

    def stream(self, prompt: str, n: int) -> Sample:
        return self._run(prompt, n, True)

    def close(self) -> None:
        self.sock.close()


class MagnAsync(Contender):
    """``AsyncMagnClient`` on one connection, driven in one event loop; timed inside the loop."""

    name, label, kind = "magn_async", "MAGN, AsyncMagnClient (one event loop)", "magn"

    def __init__(self, path: Path) -> None:
        self.runner = asyncio.Runner()
        self.client = self.runner.run(AsyncMagnClient(str(path)).connect())
        # A connection that sends nothing within socket.request_timeout_s is closed: the setup of the other paths
        # and their warm-up before this one's first request can take longer than that on a busy box.
        self.runner.run(self.client.protocol_info())

    async def _one(self, prompt: str) -> Sample:
        start = time.perf_counter()
        done = await self.client.infer(**magn_request(prompt, 1))
        elapsed = time.perf_counter() - start
        return Sample(elapsed, done.text, done.usage.completion_tokens)

    async def _stream(self, prompt: str, n: int) -> Sample:
        ttft = None
        start = time.perf_counter()
        tokens = self.client.stream(**magn_request(prompt, n))
        async for _ in tokens:
            if ttft is None:
                ttft = time.perf_counter() - start
        elapsed = time.perf_counter() - start
        assert tokens.completion is not None
        return Sample(elapsed, tokens.completion.text, tokens.completion.usage.completion_tokens, ttft)

    def one(self, prompt: str) -> Sample:
        return self.runner.run(self._one(prompt))

    def stream(self, prompt: str, n: int) -> Sample:
        return self.runner.run(self._stream(prompt, n))

    def close(self) -> None:
        try:
            self.runner.run(self.client.close())
        finally:
            self.runner.close()


class MagnBlocking(Contender):
    """The shipped blocking ``MagnClient``, one instance (one connection) reused for every request."""

    name, label, kind = "magn", "MAGN, MagnClient (blocking)", "magn"

    def __init__(self, path: Path) -> None:
        self.client = MagnClient(str(path), timeout=60)
        self.client.protocol_info()  # opened now: see AsyncMagnClient's

    def one(self, prompt: str) -> Sample:
        start = time.perf_counter()
        done = self.client.infer(**magn_request(prompt, 1))
        elapsed = time.perf_counter() - start
        return Sample(elapsed, done.text, done.usage.completion_tokens)

    def stream(self, prompt: str, n: int) -> Sample:
        ttft = None
        start = time.perf_counter()
        tokens = self.client.stream(**magn_request(prompt, n))
        for _ in tokens:
            if ttft is None:
                ttft = time.perf_counter() - start
        elapsed = time.perf_counter() - start
        assert tokens.completion is not None
        return Sample(elapsed, tokens.completion.text, tokens.completion.usage.completion_tokens, ttft)

    def close(self) -> None:
        self.client.close()


class Http(Contender):
    """An OpenAI-style ``/v1/completions`` over one keep-alive ``httpx`` connection (SSE when streaming)."""

    kind = "http"

    def __init__(self, name: str, label: str, base_url: str, extra: dict[str, Any] | None = None,
                 usage_in_stream: bool = False) -> None:
        import httpx

        self.name, self.label, self.extra = name, label, extra or {}
        # a server that sends the stream's usage: its count of tokens (a late reader may get two tokens in one
        # chunk); else every text chunk counts as one token
        self.stream_extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage_in_stream else {}
        self.http = httpx.Client(base_url=base_url, timeout=60)

    def one(self, prompt: str) -> Sample:
        start = time.perf_counter()
        r = self.http.post("/v1/completions", json={**http_request(prompt, 1, False), **self.extra})
        r.raise_for_status()
        doc = r.json()
        elapsed = time.perf_counter() - start
        return Sample(elapsed, doc["choices"][0]["text"], doc["usage"]["completion_tokens"])

    def stream(self, prompt: str, n: int) -> Sample:
        parts: list[str] = []
        ttft = None
        usage: int | None = None
        body = {**http_request(prompt, n, True), **self.extra, **self.stream_extra}
        start = time.perf_counter()
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue  # the usage chunk
                choice = chunk["choices"][0]
                if choice.get("finish_reason") is not None and not choice.get("text"):
                    continue  # the closing chunk that only carries finish_reason
                if ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(choice.get("text") or "")
        elapsed = time.perf_counter() - start
        return Sample(elapsed, "".join(parts), len(parts) if usage is None else usage, ttft)

    def close(self) -> None:
        self.http.close()

