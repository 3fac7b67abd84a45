"""The application object: what ``appliance run`` builds from a config and runs until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from appliance import __version__
from appliance.config.validate import Config, load_config
from appliance.daemon import registry
from appliance.daemon.core import Daemon
from appliance.daemon.devices import MemoryDevice, open_device
from appliance.engine.interface import EngineProtocol
from appliance.http.app import HttpServer, create_app
from appliance.server.listener import SocketServer

log = logging.getLogger(__name__)


def ensure_demo_models(config: Config) -> list[Path]:
    """Write the tiny random models that the config asks for and that are missing (offline first run)."""
    from appliance.engine.tinymodel import write_tiny_model

    made = []
    for model in config.models:
        tiny = model.generate_if_missing
        if tiny is None or model.path.exists():
            continue
        model.path.parent.mkdir(parents=True, exist_ok=True)
        log.info("writing demo model %s (%d layers, %d wide) to %s", model.name, tiny.layers, tiny.dim, model.path)
        write_tiny_model(model.path, layers=tiny.layers, dim=tiny.dim, seed=tiny.seed)
        made.append(model.path)
    return made


EngineFactory = Callable[[Config], EngineProtocol]
"""Builds the daemon's engine from the config at :meth:`Appliance.start` (tests: a fake or gated engine)."""

SWEEP_MAX_PERIOD_S = 5.0
IDLE_RESYNC_CHECK_S = 1.0  # how often a switched-off resync looks whether the config switched it on


def sweep_period(config: Config) -> float:
    """Seconds between idle sweeps: a quarter of the shortest idle TTL, within [0.05, 5] s."""
    return max(0.05, min([m.idle_ttl_s / 4 for m in config.models if m.idle_ttl_s > 0] + [SWEEP_MAX_PERIOD_S]))


class Appliance:
    """The running appliance: what ``appliance run`` builds from a config.

    It owns: the :class:`Daemon` (built in :meth:`start`, with its engine and device), the socket server, the HTTP
    server, the background tasks (idle sweep, device resync, HTTP), the registry file, and the stop signal.
    ``config`` is the current configuration; the background loops read it on every iteration (periods, TTLs), so
    replacing it takes effect without restarting them.
    """

    def __init__(self, config: Config, *, device: MemoryDevice | None = None, http: bool = True,
                 engine_factory: EngineFactory | None = None) -> None:
        self.config = config
        self.version = __version__
        self._device = device
        self._engine_factory = engine_factory
        self._http_enabled = http
        self.daemon: Daemon | None = None
        self.socket_server: SocketServer | None = None
        self.http_server: HttpServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._stopped = False

    @classmethod
    def from_file(cls, path: Path, **kwargs: object) -> Appliance:
        config = load_config(path)  # a missing model file is fine when the config says how to generate it
        ensure_demo_models(config)
        return cls(config, **kwargs)  # type: ignore[arg-type]

    @property
    def http_url(self) -> str | None:
        return self.http_server.url if self.http_server else None

    async def start(self) -> None:
        config = self.config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        device = self._device or open_device(config.device)
        engine = self._engine_factory(config) if self._engine_factory is not None else None
        self.daemon = Daemon(config, device, engine)
        self.daemon.on_change = self.write_registry
        if self._http_enabled:  # bind first: a busy port fails the start before anything else is up
            self.http_server = HttpServer(create_app(self), config.http.host, config.http.port)
        self.socket_server = SocketServer(self.daemon, config.socket.path, mode=config.socket.mode,
                                          group=config.socket.group)
        await self.socket_server.start()
        self.daemon.reports["socket"] = self.socket_server.report
        if self.http_server is not None:
            self._tasks.append(asyncio.create_task(self.http_server.run_forever(), name="http"))
            while not self.http_server.started:
                await asyncio.sleep(0.01)
        self._tasks.append(asyncio.create_task(self._sweep(), name="idle-sweep"))
        self._tasks.append(asyncio.create_task(self._resync(), name="resync"))
        self.write_registry()
        log.info("appliance %s ready: socket %s, http %s, device %s", self.version, config.socket.path,
                 self.http_url, self.daemon.reading.name)

    def write_registry(self) -> None:
        assert self.daemon is not None
        registry.write(self.config.data_dir, registry.document(self.config, self.daemon, self.http_url))

    async def _sweep(self) -> None:
        """Unload idle models (L7); the period follows the current config's shortest TTL."""
        assert self.daemon is not None
        while True:
            await asyncio.sleep(sweep_period(self.config))
            try:
                await self.daemon.sweep_idle()
            except Exception:
                log.exception("idle sweep failed")

    async def _resync(self) -> None:
        """Re-read the device every ``resync_interval_s`` of the current config (0 = off, checked again later)."""
        assert self.daemon is not None
        while True:
            interval = self.config.resync_interval_s
            if interval <= 0:
                await asyncio.sleep(IDLE_RESYNC_CHECK_S)
                continue
            await asyncio.sleep(interval)
            if self.config.resync_interval_s <= 0:
                continue
            try:
                await asyncio.to_thread(self.daemon.resync)
            except Exception:
                log.exception("device resync failed")

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, then stop gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop accepting, end running tasks with SHUTTING_DOWN, free models, remove socket and registry.
        Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        log.info("stopping")
        if self.daemon is not None:
            self.daemon.closing = True
        if self.socket_server is not None:
            await self.socket_server.close()
        if self.http_server is not None:
            self.http_server.should_exit = True
        for task in self._tasks:
            if task.get_name() != "http":
                task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 5)
        self._tasks.clear()
        if self.daemon is not None:
            await self.daemon.close()
        with contextlib.suppress(FileNotFoundError):
            registry.path(self.config.data_dir).unlink()
