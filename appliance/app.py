"""The application object: what ``appliance run`` builds from a config and runs until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import gc
import hashlib
import json
import logging
import os
import secrets
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from appliance import __version__
from appliance.benchmark.jobs import BenchmarkJob
from appliance.config import secrets as secret_settings
from appliance.config import tune
from appliance.config.validate import Config, load_config
from appliance.daemon import policy, registry, store
from appliance.daemon.core import Daemon
from appliance.daemon.devices import MemoryDevice, open_device
from appliance.daemon.diskkv import DiskTier
from appliance.daemon.statefiles import StateFiles
from appliance.engine.adaptive import Tuner
from appliance.engine.interface import EngineProtocol
from appliance.errors import ApplianceError, StartupError
from appliance.http.affinity import instance_report
from appliance.http.app import HttpServer, create_app
from appliance.server.listener import SocketServer
from appliance.supervisor.logtail import LogTail
from appliance.supervisor.notify import Notifier, watchdog_period_s
from appliance.supervisor.plan import ReloadPlan
from appliance.supervisor.record import Reload, Trigger
from appliance.supervisor.reloader import ApplyFailed, Reloader

log = logging.getLogger(__name__)


def ensure_demo_models(config: Config) -> list[Path]:
    """Write the tiny random models that the config asks for and that are missing (offline first run)."""
    made = []
    for model in config.models:
        tiny = model.generate_if_missing
        if tiny is None or model.path.exists():
            continue
        from appliance.engine.tinymodel import write_tiny_model  # lazy: the GGUF writer (gguf) only to write one

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
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # a full disk: the lock is held all the same; a refused second run names no pid
            log.warning("holding the lock %s without its pid in it: %s", self.path, _reason(exc))
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
DRAIN_POLL_S = 0.05  # how often a graceful stop looks whether the running requests have ended
DUMP_INTERVAL_S = 1.0
"""At most one SIGUSR1 state dump per this many seconds."""


def sweep_period(config: Config) -> float:
    """Seconds between idle sweeps: :func:`~appliance.daemon.policy.sweep_period` of every model's idle TTL and
    the agents' idle TTL."""
    return policy.sweep_period([m.idle_ttl_s for m in config.models] + [config.agent_idle_ttl_s])


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter for the size from which an allocation is its own mmap."""
BIG_BUFFER_BYTES = 1 << 20


def return_big_buffers() -> None:
    """Have glibc serve every allocation of at least :data:`BIG_BUFFER_BYTES` (a frame or prompt being read, a
    request body) from a mmap of its own, so that it goes back to the system as soon as it is freed. By default the
    threshold rises after each such free, and later big buffers come from the heap, whose pages stay with the
    process (40 incomplete 16 MiB frames then left up to 36 MiB behind). Not glibc: nothing to do."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, BIG_BUFFER_BYTES)


def freeze_startup_objects() -> None:
    """Move every object alive once the appliance is up (modules, settings, the application itself) out of the
    garbage collector's reach (:func:`gc.freeze`: no collection first, it is O(1)): they live as long as the
    process, and each full collection walked them all. Measured (12x768 model, 8 agents a burst): full
    collections of 28-65 ms that found nothing to free, one of them right as a burst arrived, so the loop read six
    of the other seven requests 115 ms after the first and its prompt was evaluated without them (their first
    tokens one whole prefill later); frozen, 2.4-3.0 ms. :meth:`Appliance.stop` unfreezes them (an appliance run
    in a longer process, as the tests do, is freed)."""
    gc.freeze()


class Appliance:
    """The running appliance: what ``appliance run`` builds from a config.

    It owns: the :class:`Daemon` (built in :meth:`start`, with its engine and device), the socket server, the HTTP
    server, the background tasks (idle sweep, device resync, HTTP, watchdog, config reloader), the registry file,
    the systemd :class:`Notifier`, and the stop signal. ``config`` is the current configuration; the background
    loops read it on every iteration (periods, TTLs), so replacing it takes effect without restarting them.

    It is the reloader's :class:`~appliance.supervisor.reloader.Applier`: :meth:`apply` carries out a reload plan.
    """

    def __init__(self, config: Config, *, device: MemoryDevice | None = None, http: bool = True,
                 engine_factory: EngineFactory | None = None, log_level: str | None = None,
                 config_path: Path | None = None, notifier: Notifier | None = None) -> None:
        """``log_level``: a level that overrides the config's ``log_level`` (the CLI's explicit ``--log-level``).
        ``config_path``: the file to watch and re-read (hot reload); None runs ``config`` as it is."""
        self.config = config
        self.log_level_override = log_level
        self.version = __version__
        self.config_path = config_path
        self.overrides: dict[str, Path | None] = {"data_dir": None, "socket_path": None}
        self.setting_overrides: dict[str, str] = {}  # settings a command line gives (--host, --port), by key
        self.config_sha256 = file_sha256(config_path)
        self._loaded_sha256 = self.config_sha256  # of the file the last reload read (applied with it)
        self.started_at = time.time()
        self.csrf_token = secrets.token_urlsafe(32)  # the admin page's CSRF token (appliance.http.security)
        self.session_secret = secrets.token_bytes(32)  # keys the admin login's session cookie
        self.notifier = notifier or Notifier()
        self.reloader: Reloader | None = None
        self.benchmark_job = BenchmarkJob()  # the admin page's benchmark run, one at a time
        self.log_tail = LogTail()  # the newest log lines, for the admin page's live tail (attached at start)
        self.tunings: dict[int, dict[str, Any]] = {}  # TUNE: engine settings held by socket connections, by id
        self.kept_tuners: dict[str, Tuner | None] | None = None  # the tuners as they were before the first TUNE
        self._device = device
        self._engine_factory = engine_factory
        self._http_enabled = http
        self.daemon: Daemon | None = None
        self.socket_server: SocketServer | None = None
        self.http_server: HttpServer | None = None
        self._retired_sockets: list[SocketServer] = []  # rebound away from: their connections finish on them
        self._http_tasks: dict[HttpServer, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._stopped = False
        self._locks: list[InstanceLock] = []
        self._socket_lock: InstanceLock | None = None
        self._wrote_registry = False  # only a registry this instance wrote is removed at stop
        self.state_files = StateFiles()  # the registry's writes: a full or read-only disk never fails a request
        self.stop_reason = "stop requested"
        self._last_dump = -DUMP_INTERVAL_S
        self._dump_pending = False

    @classmethod
    def from_file(cls, path: Path, *, data_dir: Path | None = None, socket_path: Path | None = None,
                  settings: dict[str, str] | None = None, **kwargs: Any) -> Appliance:
        """The appliance of the config file at ``path``, watched for hot reload; ``data_dir`` and ``socket_path``
        override the file's (``appliance run --data-dir/--socket``: systemd's state and runtime folders), and so do
        ``settings`` (by key, as a command line gives them: ``appliance run --host/--port``), on every reload too."""
        config = load_config(path, data_dir=data_dir, socket_path=socket_path, settings=settings)
        ensure_demo_models(config)  # a missing model file is fine when the config says how to generate it
        appliance = cls(config, config_path=Path(os.path.abspath(path)), **kwargs)  # symlinks kept: watched as such
        appliance.overrides = {"data_dir": data_dir, "socket_path": socket_path}
        appliance.setting_overrides = dict(settings or {})
        return appliance

    @property
    def http_url(self) -> str | None:
        return self.http_server.url if self.http_server else None

    def apply_log_level(self) -> None:
        """Set the appliance loggers' level from the current config (or the override), and keep its secret settings
        out of every log line; at start and reload."""
        level = (self.log_level_override or self.config.log_level).upper()
        logging.getLogger(LOG_LEVEL_LOGGER).setLevel(level)
        secret_settings.remember(secret_settings.values_of(self.config))
        secret_settings.guard_logs()

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
        """Take the instance locks, then open the device, bind HTTP and the socket, write the registry, and tell
        systemd READY=1. A failure undoes what this instance made (never anything else) and raises, a
        :class:`StartupError` for the operator's problems."""
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
        self.notifier.ready(self.ready_status())
        freeze_startup_objects()

    async def _start(self) -> None:
        config = self.config
        self.apply_log_level()
        self.log_tail.attach()
        return_big_buffers()
        self._lock()
        device = self._open_device()
        engine = self._engine_factory(config) if self._engine_factory is not None else None
        self.daemon = Daemon(config, device, engine)
        for missing in self.daemon.missing_models():  # the config is valid: the other models serve
            log.warning("%s; it serves as soon as the file is there", missing.reason)
        self.daemon.on_change = self.write_registry
        self.daemon.reports["config"] = self.config_report
        self.daemon.reports["reload"] = self.reload_history
        self.daemon.reports["state_files"] = self.state_files.report
        self.daemon.reports["instance"] = functools.partial(instance_report, self)  # STATUS: the fleet's name
        await self._open_store(self.daemon)
        if self._http_enabled:  # bind first: a busy port fails the start before anything else is up
            self.http_server = HttpServer(create_app(self), config.http.host, config.http.port)
        self.socket_server = SocketServer(self.daemon, config.socket.path, mode=config.socket.mode,
                                          group=config.socket.group)
        try:
            await self.socket_server.start()
        except OSError as exc:
            raise StartupError(f"cannot listen on {config.socket.path}: {_reason(exc)}",
                               path=str(config.socket.path), kind="filesystem") from None
        self.socket_server.other_connections.append(self._http_connections)
        self.socket_server.other_connections.append(self._retired_socket_connections)
        self.daemon.reports["socket"] = self.socket_server.report
        if self.http_server is not None:
            await self._serve_http(self.http_server)
        self._tasks.append(asyncio.create_task(self._sweep(), name="idle-sweep"))
        self._tasks.append(asyncio.create_task(self._resync(), name="resync"))
        self._tasks.append(asyncio.create_task(self.daemon.adaptive.run_ticks(), name="adaptive-cpu"))
        period = watchdog_period_s()
        if period is not None and self.notifier.enabled:
            self._tasks.append(asyncio.create_task(self._watchdog(period), name="watchdog"))
        if self.config_path is not None:
            self.reloader = Reloader(self.config_path, self, self.notifier, loader=self._load)
            self._tasks.append(asyncio.create_task(self.reloader.run(), name="reloader"))
            self.daemon.on_reload = self._reload_from_socket
            self.daemon.on_tune = self._tune_from_socket
            self.daemon.on_untune = self._untune
        self.write_registry()
        log.info("appliance %s started (pid %d): socket %s, http %s, device %s, state %s, config %s", self.version,
                 os.getpid(), config.socket.path, self.http_url, self.daemon.reading.name, config.data_dir,
                 self.config_path or "(not watched)")

    async def _open_store(self, daemon: Daemon) -> None:
        """Open the agents' store and the disk tier of KV state under ``data_dir`` and bring the stored agents back
        (dormant: :mod:`appliance.daemon.durable`). A store that fails its integrity check is moved aside and a new one
        begun. One that cannot be opened at all (a new store on a full or read-only state folder) restores nothing:
        the appliance serves, health says ``degraded``, and the writer opens it once the folder takes writes."""
        config = self.config
        path = config.data_dir / store.FILE_NAME
        agents_store = None
        aside = None
        records: list[store.AgentRecord] = []
        responses: list[store.ResponseRecord] = []
        try:
            agents_store, aside = await asyncio.to_thread(store.AgentStore.open, path)
            records = await asyncio.to_thread(agents_store.load_agents)
            responses = await asyncio.to_thread(agents_store.load_responses)
        except (sqlite3.Error, OSError) as exc:
            log.error("cannot open the agents store %s (%s): no agent is restored; it is opened once the state "
                      "folder takes writes", path, exc)
            failure = exc
        writer = store.StoreWriter(agents_store, path=path)  # without a store: it retries opening it
        writer.moved_aside = aside
        if agents_store is None:  # degraded until the writer opens it
            writer.problem = store.StoreProblem(store.error_name(failure), f"cannot open the store: {failure}",
                                                time.time(), 1)
        disk = None
        if config.disk_kv_budget != 0:
            disk = await asyncio.to_thread(DiskTier, config.data_dir / "kv", config.disk_kv_budget)
        daemon.attach_durability(writer, disk)
        daemon.restore(records, responses)
        daemon.reports["store"] = writer.report
        if disk is not None:
            daemon.reports["disk_kv"] = disk.report

    async def _serve_http(self, server: HttpServer) -> None:
        """Run ``server`` in a task and wait until it accepts."""
        self._http_tasks[server] = asyncio.create_task(server.run_forever(), name="http")
        while not server.started:
            if self._http_tasks[server].done():
                await self._http_tasks[server]  # it failed: raise its exception
                raise StartupError(f"the HTTP server on {server.url} stopped at start-up")
            await asyncio.sleep(0.01)

    def _http_connections(self) -> int:
        """Open HTTP connections of every HTTP server (a rebound one's too), counted against max_connections."""
        return sum(server.open_connections() for server in self._http_tasks)

    def _retired_socket_connections(self) -> int:
        """Connections still open on sockets a reload moved away from."""
        return sum(server.open_connections() for server in self._retired_sockets)

    def open_connections(self) -> int:
        """Open connections of every surface and every listener (rebound ones' too): what max_connections caps."""
        sockets = self._retired_sockets + ([self.socket_server] if self.socket_server is not None else [])
        return sum(server.open_connections() for server in sockets) + self._http_connections()

    def write_registry(self) -> None:
        """Write the registry file now (the daemon's ``on_change``, inside the requests that load or unload a model).
        It never raises: a state folder that cannot take it makes health ``degraded`` until a retry writes the
        registry of that time (:class:`~appliance.daemon.statefiles.StateFiles`)."""
        self.state_files.write(registry.path(self.config.data_dir), self.registry_bytes)
        self._wrote_registry = True  # this instance holds the state folder: what is there now is its to remove

    def registry_bytes(self) -> bytes:
        assert self.daemon is not None
        return registry.encode(registry.document(self.config, self.daemon, self.http_url))

    def ready_status(self) -> str:
        """One line for systemd's STATUS= (``systemctl status``)."""
        if self.daemon is None:
            return "starting"
        snapshot = self.daemon.snapshot()
        loaded = sum(1 for model in snapshot["models"] if model["loaded"])
        ledger = snapshot["ledger"]
        text = (f"{loaded} model(s) loaded, {len(snapshot['agents'])} agent(s), ledger "
                f"{ledger['allocated_bytes']} of {ledger['cap_bytes']} bytes")
        if self.reloader is not None and self.reloader.degraded:
            text += f"; appliance.yaml invalid: {self.reloader.problems[0]}"
        return text

    async def _sweep(self) -> None:
        """Unload idle models (L7); the period follows the current config's shortest TTL."""
        assert self.daemon is not None
        while True:
            await asyncio.sleep(sweep_period(self.config))
            try:
                await self.daemon.sweep_idle()
                if self.daemon.disk is not None:
                    await asyncio.to_thread(self.daemon.disk.probe)
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

    async def _watchdog(self, period_s: float) -> None:
        """WATCHDOG=1 every ``period_s`` from the event loop itself: a blocked loop misses its pings and systemd
        restarts the service."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(period_s)

    # -- hot reload (SPEC C3) ----------------------------------------------------------------------------
    def _load(self, path: Path) -> Config:
        """Read and validate the config file with this instance's overrides and the engine settings socket
        connections hold (TUNE): the reloader's loader (a thread)."""
        config = load_config(path, data_dir=self.overrides["data_dir"], socket_path=self.overrides["socket_path"],
                             settings=self.setting_overrides)
        self._loaded_sha256 = file_sha256(path)
        return tune.tuned(config, tune.merged(self.tunings.values()))

    def config_report(self) -> dict[str, Any]:
        """The config's status for STATUS and health: ``ok`` or ``invalid`` (the file on disk; the appliance then
        runs the last valid one) with the first problem, and the last reload."""
        report: dict[str, Any] = {"file": str(self.config_path) if self.config_path else None,
                                  "sha256": self.config_sha256, "status": "ok"}
        reloader = self.reloader
        if reloader is None:
            return report
        if reloader.degraded:
            first = reloader.problems[0]
            report.update(status="invalid", problems=len(reloader.problems), reason=first.message, path=first.path,
                          line=first.line)
        report["reloads"] = len(reloader.history)
        held = tune.merged(self.tunings.values())
        if held:  # the engine runs with settings that are not the file's while a connection holds them
            report["tuned"] = {f"engine.{name}": value for name, value in held.items()}
        last = reloader.history.last
        if last is not None:
            report.update(last_reload=last.result, last_trigger=last.trigger, last_at=last.at)
        return report

    def replaced_files(self) -> tuple[str, ...]:
        return () if self.daemon is None else tuple(self.daemon.replaced_files())

    def reload_history(self) -> list[dict[str, Any]]:
        return [] if self.reloader is None else self.reloader.history.to_list()

    async def apply(self, new: Config, plan: ReloadPlan) -> str:
        """Carry out a reload ``plan`` towards ``new`` (the :class:`~appliance.supervisor.reloader.Applier` side).

        Order: write missing demo models of added models; swap the config (the daemon's too; the settings that need
        a restart keep their running values); reload changed models one by one (a failure keeps that model's old
        weights serving); rebind the socket and HTTP (new listener first). Returns what was done; raises
        :class:`ApplyFailed` with what was done when a step failed.
        """
        assert self.daemon is not None
        old = self.config
        done: list[str] = []
        errors: list[str] = []
        if plan.add_models:
            await asyncio.to_thread(ensure_demo_models, new)
        effective = keep_restart_settings(new, old)
        self.config = effective
        self.config_sha256 = self._loaded_sha256
        done.extend(self.daemon.apply_config(effective))
        self.apply_log_level()
        if plan.add_models:
            done.append(f"added {', '.join(plan.add_models)}")
        if plan.live_settings:
            done.append(f"settings {', '.join(plan.live_settings)}")
        stale = [name for name in self.daemon.models_to_reload() if name not in plan.reload_models]
        stale += [name for name in plan.replaced_files if name not in plan.reload_models and name not in stale]
        for name in plan.reload_models + tuple(stale):  # stale: changed while retired, then put back
            try:
                done.append(await self.daemon.reload_model(name))
            except ApplianceError as exc:
                errors.append(f"model {name} keeps its old weights: {exc.code}: {exc.message}")
        if plan.rebind_socket:
            try:
                done.append(await self._rebind_socket(old))
            except (StartupError, OSError) as exc:
                errors.append(f"socket stays at {old.socket.path}: {_message(exc)}")
                self.config = dataclasses.replace(self.config, socket=old.socket)
                self.daemon.config = self.config
        if plan.rebind_http:
            try:
                done.append(await self._rebind_http())
            except (StartupError, OSError) as exc:
                where = self.http_url or "(none)"
                errors.append(f"HTTP stays at {where}: {_message(exc)}")
                self.config = dataclasses.replace(self.config, http=dataclasses.replace(
                    self.config.http, host=old.http.host, port=old.http.port))
                self.daemon.config = self.config
        if plan.restart_needed:
            done.append(f"restart needed for {', '.join(plan.restart_needed)} (running values kept)")
        self.write_registry()
        applied = "; ".join(done) or "no changes"
        if errors:
            raise ApplyFailed("; ".join(errors), applied)
        return applied

    async def _rebind_socket(self, old: Config) -> str:
        """Move the socket to the current config's path, mode and group: the new listener first, then the old one
        stops accepting (its connections finish on it). A mode or group change alone is applied to the file."""
        assert self.daemon is not None and self.socket_server is not None
        wanted = self.config.socket
        current = self.socket_server
        if wanted.path == current.path:
            current.set_permissions(wanted.mode, wanted.group)
            return f"socket {wanted.path} mode {wanted.mode:o}"
        check_socket_path(wanted.path)
        lock = InstanceLock(wanted.path.with_name(wanted.path.name + LOCK_SUFFIX))
        lock.acquire()
        server = SocketServer(self.daemon, wanted.path, mode=wanted.mode, group=wanted.group)
        try:
            await server.start()
        except BaseException:
            lock.release()
            raise
        server.other_connections.append(self._http_connections)
        server.other_connections.append(self._retired_socket_connections)
        current.stop_accepting()
        self._retired_sockets.append(current)
        self.socket_server = server
        self.daemon.reports["socket"] = server.report
        old_lock = self._socket_lock_for(old.socket.path)
        if old_lock is not None:
            old_lock.release()
            self._locks.remove(old_lock)
        self._locks.append(lock)
        return f"socket moved from {old.socket.path} to {wanted.path}"

    def _socket_lock_for(self, path: Path) -> InstanceLock | None:
        wanted = path.with_name(path.name + LOCK_SUFFIX)
        for lock in self._locks:
            if lock.path == wanted:
                return lock
        return None

    async def _rebind_http(self) -> str:
        """Serve HTTP at the current config's host and port: bind the new server first, then the old one stops
        accepting and finishes the requests in flight."""
        http = self.config.http
        previous = self.http_server
        server = HttpServer(create_app(self), http.host, http.port)
        await self._serve_http(server)
        self.http_server = server
        if previous is not None:
            previous.config.timeout_graceful_shutdown = None  # in-flight requests finish, however long
            for listener in previous.servers:  # stop accepting now, not at uvicorn's next 0.1 s tick
                listener.close()
            previous.should_exit = True
            self._tasks.append(asyncio.create_task(self._forget_http(previous), name="http-retire"))
        return f"HTTP moved to {server.url}"

    async def _forget_http(self, server: HttpServer) -> None:
        task = self._http_tasks.get(server)
        if task is not None:
            with contextlib.suppress(Exception):
                await task
            self._http_tasks.pop(server, None)

    # -- signals and state ---------------------------------------------------------------------------
    def state_document(self) -> dict[str, Any]:
        """The whole internal state as one JSON-able document (SIGUSR1)."""
        snapshot = self.daemon.snapshot() if self.daemon is not None else {}
        return {"version": self.version, "pid": os.getpid(), "started_at": self.started_at,
                "config": {**self.config_report(), "data_dir": str(self.config.data_dir),
                           "socket": str(self.config.socket.path), "http": self.http_url},
                "daemon": snapshot,
                "generating": self.daemon.generating if self.daemon is not None else 0,
                "connections": {"all": self.open_connections(), "http": self._http_connections()},
                "reloads": self.reload_history()}

    def dump_state(self) -> str:
        """Log the state document as one line of JSON; returns it."""
        text = json.dumps(self.state_document(), sort_keys=True, default=str)
        log.warning("state: %s", text)
        return text

    def request_stop(self, reason: str = "stop requested") -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
        self._stop.set()

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        self.request_stop(f"signal {sig.name}")

    async def _reload_from_socket(self, trigger: str) -> dict[str, Any]:
        """RELOAD on the socket: a reload now, recorded with ``trigger`` (the line protocol allows only a
        :data:`~appliance.supervisor.record.Trigger`); its record."""
        assert self.reloader is not None
        record = await self.reloader.reload(cast(Trigger, trigger))
        return record.to_dict()

    async def _tune_from_socket(self, owner: object, settings: dict[str, str]) -> dict[str, Any]:
        """TUNE on the socket: ``owner``'s engine settings (none: cleared), applied by a reload now; its record."""
        assert self.daemon is not None
        values = tune.engine_values(settings)
        if values:
            if not self.tunings:
                self.kept_tuners = self.daemon.adaptive.keep_tuners()
            self.tunings[id(owner)] = values
        else:
            self.tunings.pop(id(owner), None)
        record = await self._apply_tunings()
        return record.to_dict()

    def _untune(self, owner: object) -> None:
        """A connection closed: the engine settings it held go back to the file's (a reload, now)."""
        held = self.tunings.pop(id(owner), None)
        if held is None or self.daemon is None or self.daemon.closing:
            return
        self.daemon.background(asyncio.get_running_loop().create_task(self._apply_tunings()))

    async def _apply_tunings(self) -> Reload:
        """A reload that applies the engine settings connections hold now (trigger ``tune``). Once none holds any,
        the models' load profiles and contexts go back to what they were before the first TUNE (the held settings'
        load leaves nothing behind)."""
        assert self.reloader is not None and self.daemon is not None
        record = await self.reloader.reload("tune")
        if not self.tunings and self.kept_tuners is not None:
            kept, self.kept_tuners = self.kept_tuners, None
            await self.daemon.adaptive.restore_tuners(kept)
        return record

    def _on_reload_signal(self) -> None:
        if self.reloader is None:
            log.warning("received SIGHUP: no config file to re-read (this appliance runs a config given in code)")
            return
        log.info("received SIGHUP: re-reading %s", self.config_path)
        self.reloader.request("SIGHUP")

    def _on_dump_signal(self) -> None:
        """SIGUSR1: dump now, or once :data:`DUMP_INTERVAL_S` after the last dump (a storm of signals is one
        dump a second, never a flood of log lines that could block on a slow log reader)."""
        if self._dump_pending:
            return
        wait = self._last_dump + DUMP_INTERVAL_S - time.monotonic()
        if wait <= 0:
            self._dump()
            return
        self._dump_pending = True
        asyncio.get_running_loop().call_later(wait, self._dump)

    def _dump(self) -> None:
        self._dump_pending = False
        self._last_dump = time.monotonic()
        try:
            self.dump_state()
        except Exception:
            log.exception("state dump failed")

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, then stop gracefully. SIGHUP reloads the config, SIGUSR1 logs the
        state."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)
        loop.add_signal_handler(signal.SIGUSR1, self._on_dump_signal)
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Graceful stop (S2): tell systemd STOPPING=1, stop accepting, give running requests ``shutdown_grace_s``
        to finish, end the rest with SHUTTING_DOWN, free models, remove the socket and registry this instance made
        (never another's), release the locks (their files stay). Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + self.config.shutdown_grace_s  # the drain, then the agents' write-out
        log.info("appliance stopping (%s)", self.stop_reason)
        self.notifier.stopping(f"stopping: {self.stop_reason}")
        await self.benchmark_job.stop()
        if self.reloader is not None:
            self.reloader.stop.set()
        if self.daemon is not None:
            self.daemon.closing = True  # new requests get SHUTTING_DOWN; accepted ones go on for the grace period
        servers = self._retired_sockets + ([self.socket_server] if self.socket_server is not None else [])
        for server in servers:
            server.stop_accepting()
        if self.daemon is not None:
            await self._drain(self.daemon, self.config.shutdown_grace_s)
            self.daemon.cancel_running()
        for server in servers:
            await server.close()
        if self.http_server is not None and self.http_server not in self._http_tasks:  # bound, never served
            self.http_server.socket.close()
        for http_server, task in list(self._http_tasks.items()):
            http_server.should_exit = True
            if not http_server.started:  # bound, never served
                http_server.socket.close()
                task.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks + list(self._http_tasks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 5)
        self._tasks.clear()
        self._http_tasks.clear()
        if self.daemon is not None:
            await self.daemon.close(deadline=deadline)
        self.state_files.close()  # no retry writes the registry once it is removed
        if self._wrote_registry:
            with contextlib.suppress(FileNotFoundError):
                registry.path(self.config.data_dir).unlink()
        for lock in reversed(self._locks):
            lock.release()
        self._locks.clear()
        log.info("appliance stopped (%s)", self.stop_reason)
        self.log_tail.detach()
        gc.unfreeze()

    @staticmethod
    async def _drain(daemon: Daemon, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the requests accepted before the stop (generating, queued, or waiting for
        their model to load) to end by themselves."""
        deadline = time.monotonic() + grace_s
        if daemon.accepted:
            log.info("waiting up to %g s for %d running request(s)", grace_s, daemon.accepted)
        while daemon.accepted and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if daemon.accepted:
            log.warning("%d request(s) still running after %g s: ending them with SHUTTING_DOWN", daemon.accepted,
                        grace_s)




def keep_restart_settings(new: Config, old: Config) -> Config:
    """``new`` with the running values of the settings a reload cannot change (``data_dir``, ``device``): they wait
    for a restart."""
    return dataclasses.replace(new, data_dir=old.data_dir, device=old.device)


def file_sha256(path: Path | None) -> str | None:
    """The SHA-256 of a config file's bytes (the state dump's config identity), None without a readable file."""
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _message(exc: BaseException) -> str:
    if isinstance(exc, StartupError):
        return exc.message
    if isinstance(exc, OSError):
        return _reason(exc)
    return str(exc)
