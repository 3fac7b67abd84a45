"""Start a real appliance (real socket, real HTTP server, real models) in a background thread for tests.

Its engine is the real llama.cpp one behind a :class:`~appliance.engine.fake.GatedEngine` whose gate is open and
whose delay is 0, so it behaves like production until a test slows or holds its tokens (``app.engine.delay_s``,
``app.engine.gate``); ``engine_factory`` replaces it (e.g. with a :class:`~appliance.engine.fake.FakeEngine`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from appliance.app import Appliance, EngineFactory
from appliance.client import lines as lineclient
from appliance.config.validate import Config, parse_config
from appliance.engine.fake import GatedEngine
from appliance.protocol import messages as m
from appliance.protocol.events import NEED_DATA
from appliance.protocol.frames import FrameParser, encode_frame
from appliance.supervisor.notify import Notifier


def config_text(models: dict[str, dict[str, Any]], *, state: Path, model_dirs: list[Path],
                device: str = "fake:8GiB", **extra: Any) -> str:
    doc: dict[str, Any] = {
        "data_dir": str(state),
        "device": device,
        "model_dirs": [str(d) for d in model_dirs],
        "socket": {"path": str(state / "a.sock")},
        "http": {"host": "127.0.0.1", "port": 0},
        "resync_interval_s": 0,
        "shutdown_grace_s": 1,  # a test's teardown waits at most this for generations it left running
        "models": [{"name": name, **spec} for name, spec in models.items()],
    }
    for key, value in extra.items():  # a section given as a dict is merged into the one above (socket.path stays)
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return yaml.safe_dump(doc, sort_keys=False)


def gated_real_engine(config: Config) -> GatedEngine:
    """The production engine (llama.cpp), wrapped so that tests can gate or slow its tokens."""
    from appliance.engine.runtime import Engine

    return GatedEngine(Engine(config.engine.threads or None))


async def adaptive_idle(daemon: Any) -> None:
    """Return once the adaptive engine does nothing: no warm-up runs and no retune in progress, so the ledger's keys
    and the live contexts stay as they are until the next request."""
    while True:
        retuning = [m for m in daemon.models.values() if m.retuning is not None and not m.retuning.done()]
        if not retuning and not daemon.adaptive.warming and not daemon.adaptive.tasks:
            return
        await asyncio.sleep(0.02)


class Running:
    def __init__(self, appliance: Appliance, loop: asyncio.AbstractEventLoop) -> None:
        self.appliance = appliance
        self.loop = loop

    @property
    def socket(self) -> Path:
        return self.appliance.config.socket.path

    @property
    def daemon(self):  # type: ignore[no-untyped-def]
        return self.appliance.daemon

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        """The daemon's engine: a :class:`GatedEngine` unless ``running(engine_factory=...)`` said otherwise."""
        return self.appliance.daemon.engine

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def line(self, text: str, timeout: float = 120) -> str:
        return lineclient.request(self.socket, text, timeout)

    def settle(self, timeout: float = 60) -> None:
        """Wait until the adaptive engine is idle (:func:`adaptive_idle`)."""
        self.call(adaptive_idle(self.daemon), timeout)

    @property
    def config_file(self) -> Path:
        """The watched config file (``running(watch=True)``)."""
        assert self.appliance.config_path is not None, "running(watch=True) writes and watches a config file"
        return self.appliance.config_path

    def edit(self, text: str) -> None:
        """Replace the watched config file the way editors save: write a sibling, then rename it over."""
        temporary = self.config_file.with_name(".appliance.yaml.new")
        temporary.write_text(text)
        os.replace(temporary, self.config_file)

    def reload(self, trigger: str = "api", timeout: float = 60) -> Any:
        """Run one reload now and return its record (:class:`~appliance.supervisor.record.Reload`)."""
        reloader = self.appliance.reloader
        assert reloader is not None, "running(watch=True) has a reloader"
        return self.call(reloader.reload(trigger), timeout)


@contextmanager
def running(models: dict[str, dict[str, Any]], *, model_dirs: list[Path], http: bool = True,
            engine_factory: EngineFactory = gated_real_engine, watch: bool = False,
            notifier: Notifier | None = None, http_settings: dict[str, Any] | None = None,
            state: Path | None = None, **extra: Any) -> Iterator[Running]:
    """A real appliance on a short temporary socket path (AF_UNIX paths are limited to 108 bytes); ``extra``
    are more config settings. ``watch``: the config is written to ``<state>/appliance.yaml`` and hot-reloaded
    from there (:meth:`Running.edit`). ``http_settings``: the config's ``http`` section (``http`` itself says
    whether to serve HTTP at all). ``state``: a state folder of the caller's (kept: a restart on it finds the agents
    store and the KV files the last run left); by default a temporary one, removed after."""
    temporary = state is None
    if state is None:
        state = Path(tempfile.mkdtemp(prefix="ap-"))
    try:
        if http_settings is not None:
            extra["http"] = http_settings
        text = config_text(models, state=state, model_dirs=model_dirs, **extra)
        source = state / "appliance.yaml"
        config = parse_config(text, source=source, base_dir=state)
        if watch:
            source.write_text(text)
        appliance = Appliance(config, http=http, engine_factory=engine_factory,
                              config_path=source if watch else None, notifier=notifier)
        loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            asyncio.set_event_loop(loop)

            async def boot() -> None:
                try:
                    await appliance.start()
                except BaseException as exc:
                    failure.append(exc)
                finally:
                    started.set()

            loop.run_until_complete(boot())
            loop.run_forever()

        thread = threading.Thread(target=main, name="appliance", daemon=True)
        thread.start()
        started.wait(120)
        if failure:
            raise failure[0]
        run = Running(appliance, loop)
        try:
            yield run
        finally:
            run.call(appliance.stop())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
    finally:
        if temporary:
            shutil.rmtree(state, ignore_errors=True)


class RawPeer:
    """A hand-driven MAGN peer for tests: send payloads, read decoded messages."""

    def __init__(self, path: Path | str, *, timeout: float = 30) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.parser = FrameParser()

    def send(self, payload: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(payload))

    def read(self) -> m.Message:
        while True:
            event = self.parser.next_event()
            if event is not NEED_DATA:
                return m.parse_message(event.payload)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            self.parser.receive_data(chunk)

    def read_token(self) -> m.Message:
        """The next message that is not a HEARTBEAT (a busy machine may be slow to the first token)."""
        while True:
            message = self.read()
            if not isinstance(message, m.Heartbeat):
                return message

    def read_until_end(self, task_id: str) -> list[m.Message]:
        """Every message up to and including the TASK_COMPLETE or ERROR that ends ``task_id``."""
        out = []
        while True:
            message = self.read()
            out.append(message)
            if isinstance(message, m.TaskComplete | m.ErrorMessage) and getattr(message, "task_id", None) == task_id:
                return out

    def close(self) -> None:
        self.sock.close()
