"""The application object: what ``appliance run`` builds from a config and runs until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from appliance import __version__
from appliance.config.validate import Config, load_config
from appliance.daemon import policy, registry
from appliance.daemon.core import Daemon
from appliance.daemon.devices import MemoryDevice, open_device
from appliance.engine.interface import EngineProtocol
from appliance.errors import ApplianceError, StartupError
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
        log.info("writing demo model %s (%d layers, %d wide) to %s", model.name, tiny.layers, tiny.dim, model.path)
        try:
            model.path.parent.mkdir(parents=True, exist_ok=True)
            write_tiny_model(model.path, layers=tiny.layers, dim=tiny.dim, seed=tiny.seed)
        except OSError as exc:
            raise StartupError(f"cannot write the demo model {model.name} to {model.path}: {_reason(exc)}",
                               path=str(model.path), kind="filesystem") from None
        made.append(model.path)
    return made


# -- start-up checks and locks ----------------------------------------------------------------------
AF_UNIX_PATH_MAX = 108
"""Bytes in ``sockaddr_un.sun_path`` on Linux, the terminating NUL included."""
LOCK_NAME = "appliance.lock"
LOCK_SUFFIX = ".lock"


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def prepare_data_dir(data_dir: Path) -> None:
    """Create ``data_dir`` (its parent must exist) and check it is a writable folder; else StartupError."""
    try:
        data_dir.mkdir(exist_ok=True)
    except FileNotFoundError:
        raise StartupError(f"data_dir {data_dir}: its parent folder {data_dir.parent} does not exist",
                           path=str(data_dir), kind="filesystem") from None
    except OSError as exc:
        raise StartupError(f"data_dir {data_dir}: cannot create it: {_reason(exc)}", path=str(data_dir),
                           kind="filesystem") from None
    if not data_dir.is_dir():
        raise StartupError(f"data_dir {data_dir} exists and is not a folder", path=str(data_dir), kind="filesystem")
    if not os.access(data_dir, os.W_OK | os.X_OK):
        raise StartupError(f"data_dir {data_dir} is not writable by this user", path=str(data_dir),
                           kind="filesystem")


def check_socket_path(path: Path) -> None:
    """Refuse, before anything is bound, a socket path that is too long for AF_UNIX, a folder, a file or link
    that is not a socket (it is kept), or one under something that is not a folder. Creates its folder."""
    size = len(os.fsencode(path)) + 1
    if size > AF_UNIX_PATH_MAX:
        raise StartupError(f"socket.path {path} is {size - 1} bytes; a Unix socket path allows at most "
                           f"{AF_UNIX_PATH_MAX - 1}", path=str(path), kind="filesystem")
    if path.is_dir():
        raise StartupError(f"socket.path {path} is a folder", path=str(path), kind="filesystem")
    if (path.exists() or path.is_symlink()) and not path.is_socket():
        raise StartupError(f"socket.path {path} exists and is not a socket; it is left as it is", path=str(path),
                           kind="filesystem")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"socket.path {path}: cannot create its folder: {_reason(exc)}", path=str(path),
                           kind="filesystem") from None


class InstanceLock:
    """An exclusive ``flock`` on a lock file holding this process's pid: one appliance per state folder and per
    socket. The file is never deleted (deleting a lock file lets two processes hold "the" lock); a holder that
    dies releases it with its file descriptor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StartupError(f"cannot open the lock file {self.path}: {_reason(exc)}", path=str(self.path),
                               kind="filesystem") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StartupError(f"cannot lock {self.path}: {_reason(exc)}", path=str(self.path),
                                   kind="filesystem") from None
            who = "another appliance" if holder is None else f"another appliance (pid {holder})"
            raise StartupError(f"{who} holds {self.path}", path=str(self.path), kind="busy") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Empty the pid (the file stays) and unlock."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and text.isascii() else None


def lock_paths(config: Config) -> list[Path]:
    """The lock files of a config: one in its state folder, one beside its socket (once if they coincide)."""
    paths = [config.data_dir / LOCK_NAME, config.socket.path.with_name(config.socket.path.name + LOCK_SUFFIX)]
    if os.path.realpath(paths[0]) == os.path.realpath(paths[1]):
        return paths[:1]
    return paths


LOG_LEVEL_LOGGER = "appliance"
"""The logger whose level ``log_level`` sets: the appliance's own loggers, not the libraries'."""


EngineFactory = Callable[[Config], EngineProtocol]
"""Builds the daemon's engine from the config at :meth:`Appliance.start` (tests: a fake or gated engine)."""

IDLE_RESYNC_CHECK_S = 1.0  # how often a switched-off resync looks whether the config switched it on


def sweep_period(config: Config) -> float:
    """Seconds between idle sweeps: :func:`~appliance.daemon.policy.sweep_period` of every model's idle TTL and
    the agents' idle TTL."""
    return policy.sweep_period([m.idle_ttl_s for m in config.models] + [config.agent_idle_ttl_s])


class Appliance:
    """The running appliance: what ``appliance run`` builds from a config.

    It owns: the :class:`Daemon` (built in :meth:`start`, with its engine and device), the socket server, the HTTP
    server, the background tasks (idle sweep, device resync, HTTP), the registry file, and the stop signal.
    ``config`` is the current configuration; the background loops read it on every iteration (periods, TTLs), so
    replacing it takes effect without restarting them.
    """

    def __init__(self, config: Config, *, device: MemoryDevice | None = None, http: bool = True,
                 engine_factory: EngineFactory | None = None, log_level: str | None = None) -> None:
        """``log_level``: a level that overrides the config's ``log_level`` (the CLI's explicit ``--log-level``)."""
        self.config = config
        self.log_level_override = log_level
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
        self._locks: list[InstanceLock] = []
        self._wrote_registry = False  # only a registry this instance wrote is removed at stop
        self.stop_reason = "stop requested"

    @classmethod
    def from_file(cls, path: Path, **kwargs: object) -> Appliance:
        config = load_config(path)  # a missing model file is fine when the config says how to generate it
        ensure_demo_models(config)
        return cls(config, **kwargs)  # type: ignore[arg-type]

    @property
    def http_url(self) -> str | None:
        return self.http_server.url if self.http_server else None

    def apply_log_level(self) -> None:
        """Set the appliance loggers' level from the current config (or the override); called at start and by
        whoever replaces ``config`` (reload)."""
        level = (self.log_level_override or self.config.log_level).upper()
        logging.getLogger(LOG_LEVEL_LOGGER).setLevel(level)

    def _lock(self) -> None:
        """Check the state folder and socket path, then take both instance locks; StartupError otherwise.
        Nothing else is touched before this succeeds."""
        prepare_data_dir(self.config.data_dir)
        check_socket_path(self.config.socket.path)
        for path in lock_paths(self.config):
            lock = InstanceLock(path)
            lock.acquire()
            self._locks.append(lock)

    def _open_device(self) -> MemoryDevice:
        if self._device is not None:
            return self._device
        try:
            return open_device(self.config.device)
        except (ApplianceError, ValueError) as exc:
            message = exc.message if isinstance(exc, ApplianceError) else str(exc)
            raise StartupError(message, kind="device") from None

    async def start(self) -> None:
        """Take the instance locks, then open the device, bind HTTP and the socket, write the registry. A failure
        undoes what this instance made (never anything else) and raises, a :class:`StartupError` for the
        operator's problems."""
        try:
            await self._start()
        except StartupError as exc:
            self.stop_reason = f"start-up failed: {exc.message}"
            await self.stop()
            raise
        except BaseException as exc:
            self.stop_reason = f"start-up failed: {type(exc).__name__}"
            await self.stop()
            raise

    async def _start(self) -> None:
        config = self.config
        self.apply_log_level()
        self._lock()
        device = self._open_device()
        engine = self._engine_factory(config) if self._engine_factory is not None else None
        self.daemon = Daemon(config, device, engine)
        self.daemon.on_change = self.write_registry
        if self._http_enabled:  # bind first: a busy port fails the start before anything else is up
            self.http_server = HttpServer(create_app(self), config.http.host, config.http.port)
        self.socket_server = SocketServer(self.daemon, config.socket.path, mode=config.socket.mode,
                                          group=config.socket.group)
        try:
            await self.socket_server.start()
        except OSError as exc:
            raise StartupError(f"cannot listen on {config.socket.path}: {_reason(exc)}",
                               path=str(config.socket.path), kind="filesystem") from None
        self.daemon.reports["socket"] = self.socket_server.report
        if self.http_server is not None:
            self._tasks.append(asyncio.create_task(self.http_server.run_forever(), name="http"))
            while not self.http_server.started:
                await asyncio.sleep(0.01)
        self._tasks.append(asyncio.create_task(self._sweep(), name="idle-sweep"))
        self._tasks.append(asyncio.create_task(self._resync(), name="resync"))
        self.write_registry()
        log.info("appliance %s started (pid %d): socket %s, http %s, device %s, state %s", self.version, os.getpid(),
                 config.socket.path, self.http_url, self.daemon.reading.name, config.data_dir)

    def write_registry(self) -> None:
        assert self.daemon is not None
        registry.write(self.config.data_dir, registry.document(self.config, self.daemon, self.http_url))
        self._wrote_registry = True

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

    def request_stop(self, reason: str = "stop requested") -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
        self._stop.set()

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        self.request_stop(f"signal {sig.name}")

    def _on_later_signal(self, sig: signal.Signals) -> None:
        """SIGHUP (reload) and SIGUSR1 (state dump) get their work with the supervisor; until then they are
        logged and never kill the process."""
        log.warning("received %s: not acted on yet (this version has no %s); still running", sig.name,
                    "hot reload" if sig == signal.SIGHUP else "state dump")

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, then stop gracefully. SIGHUP and SIGUSR1 are logged, not fatal."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        for sig in (signal.SIGHUP, signal.SIGUSR1):
            loop.add_signal_handler(sig, self._on_later_signal, sig)
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop accepting, end running tasks with SHUTTING_DOWN, free models, remove the socket and registry
        this instance made (never another's), release the locks (their files stay). Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        log.info("appliance stopping (%s)", self.stop_reason)
        if self.daemon is not None:
            self.daemon.closing = True
        if self.socket_server is not None:
            await self.socket_server.close()
        if self.http_server is not None:
            self.http_server.should_exit = True
            if not any(task.get_name() == "http" for task in self._tasks):  # bound, never served
                self.http_server.socket.close()
        for task in self._tasks:
            if task.get_name() != "http":
                task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 5)
        self._tasks.clear()
        if self.daemon is not None:
            await self.daemon.close()
        if self._wrote_registry:
            with contextlib.suppress(FileNotFoundError):
                registry.path(self.config.data_dir).unlink()
        for lock in reversed(self._locks):
            lock.release()
        self._locks.clear()
        log.info("appliance stopped (%s)", self.stop_reason)
