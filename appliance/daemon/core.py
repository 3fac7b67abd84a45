"""The daemon core that every surface (line protocol, MAGN frames, HTTP) calls: ledger, refcounted models,
agent slots with KV swap, live contexts, idle unloading and device resync (SPEC L1–L11, R2, R3, R4).

Model memory is admitted by the :class:`~appliance.daemon.ledger.Ledger` before anything is loaded. A loaded model
(one :class:`~appliance.engine.interface.RuntimeProtocol`, a llama.cpp :class:`~appliance.engine.runtime.Runtime`
in production) holds its weights under its name and, while it has one, its live context under
:func:`context_key`. The context's ``engine.live_slots`` sequences hold its agents' conversations, decoded together
by the model's step loop (:meth:`Daemon._steps`); a request that finds them all busy waits its turn
(:class:`~appliance.daemon.admission.Admission`), and a suspended agent's KV state waits in host RAM.

Live contexts (SPEC L8): ``engine.live_contexts`` bounds how many exist at once (``auto``: as many as the ledger
fits). A model that needs its context back while the budget is spent frees the least recently used idle context of
another model (its agents parked in host RAM; its weights stay loaded); with only busy ones in the way it waits
for one to go idle; a context that cannot fit even with every other one freed is ``VRAM_LEDGER_DENY``.

The daemon only knows the engine through :class:`~appliance.engine.interface.EngineProtocol` and time through its
``clock``: tests run it on :class:`appliance.engine.fake.FakeEngine` and a :class:`~appliance.engine.fake.ManualClock`
without a model and without sleeping (tests/test_daemon_core.py).

Hot reload (SPEC C3) changes a running daemon through two calls, :meth:`Daemon.apply_config` and
:meth:`Daemon.reload_model`; the rules:

* **Admission**: a new ``admission_percent`` re-bases the ledger cap at once. A lower cap never evicts anyone:
  while more is allocated than the cap allows, new loads are refused (``VRAM_LEDGER_DENY``) and STATUS shows
  ``over_cap=yes``, until enough unloads.
* **Removed model (retired)**: it takes no new agents and no stateless requests (its name is unknown; a REGISTER
  of its file by path loads it anew under the path's name). Its agents keep decoding. It unloads as soon as it has
  no agent and nothing in flight (at once if that is already so, else when its last agent leaves or its last
  request ends), then disappears from STATUS; meanwhile STATUS shows it with ``retired=yes``. A model that comes
  back in a later config before it unloaded serves again (reloaded first if its file or context settings changed).
* **Live model keys** (``idle_ttl_s``) apply in place; the model keeps its runtime.
* **Reloaded model** (file or context settings changed): the new estimate is admitted by the ledger under a
  temporary key while the old runtime still serves and holds its bytes; a denial or a failed load leaves the old
  one serving. Then, in one engine job, the old runtime closes and the new one takes its place and its ledger key.
  Its agents stay registered: with the same vocabulary their tokens are kept and re-evaluated on the new weights
  at their next decode; with a different vocabulary their conversations are reset and their next decode result
  carries a one-time notice. Other models and their agents are not touched.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from appliance.config import schema as settings
from appliance.config.validate import Config, ModelConfig
from appliance.daemon import hostkv, policy
from appliance.daemon.adaptive import AdaptiveLoop, cold_key, next_key
from appliance.daemon.admission import Admission
from appliance.daemon.devices import DeviceReading, MemoryDevice
from appliance.daemon.ledger import Ledger, compute_cap, external_used
from appliance.daemon.requests import RequestLog
from appliance.engine import gguf_meta
from appliance.engine.adaptive import Tuner, Tuning
from appliance.engine.embedding import Embeddings, context_size
from appliance.engine.interface import (
    GREEDY,
    Conversation,
    EngineProtocol,
    Generation,
    PromptText,
    RuntimeProtocol,
    Sampling,
    Token,
)
from appliance.engine.prompts import PromptVocabulary, tokenize_prompt
from appliance.engine.slots import ColdNeeded
from appliance.engine.worker import DEFAULT_QUEUE
from appliance.errors import ApplianceError
from appliance.protocol.identifiers import AGENT_ID_RULE, agent_id_problem

log = logging.getLogger(__name__)

_ACCEPTED: contextvars.ContextVar[bool] = contextvars.ContextVar("appliance_accepted", default=False)
"""Set while a task runs inside :meth:`Daemon.accepting`."""

ModelState = Literal["available", "loading", "loaded", "unloading"]
"""A model's lifecycle, as health, the registry file and STATUS show it: ``available`` (not in memory) ->
``loading`` (estimate, reserve, load; back to ``available`` on failure) -> ``loaded`` -> ``unloading`` (its
runtime is being closed) -> ``available``. Only :meth:`Daemon.acquire` and :meth:`Daemon.unload` change it,
under the model's lock."""


@dataclass(eq=False)
class Model:
    spec: ModelConfig
    estimate: int | None = None
    measured: int | None = None
    runtime: RuntimeProtocol | None = None
    state: ModelState = "available"
    refcount: int = 0
    inflight: int = 0
    last_used: float = 0.0
    baseline: int = 0
    kv_bytes_per_token: int = 0  # the largest ratio its KV swaps showed (engine thread): sizes a state before a swap
    retired: bool = False  # removed from the config: no new users, unloaded and forgotten once unused
    file: FileIdentity | None = None  # the model file as it was when the loaded runtime was read from it
    context_bytes: int = 0  # the ledger figure of its live context (KV cache and compute buffers), in the estimate
    context_claimed: bool = False  # its live context is admitted (built, or being built with its load)
    active: int = 0  # requests that claimed its live context and have not ended (it is not freed meanwhile)
    context_used: float = 0.0  # when its live context last served a request (least recently used goes first)
    ended: int = 0  # requests ended so far (a request waiting for a sequence retries when this moves)
    waiters: list[asyncio.Future[None]] = field(default_factory=list)  # woken when a request ends or one starts
    admission: Admission = field(default_factory=Admission)  # requests waiting to start, round-robin by queue
    stepper: asyncio.Task[None] | None = None  # the loop that steps its live context while requests are in flight
    serving: asyncio.Event = field(default_factory=asyncio.Event)  # cleared while a reload swaps its runtime
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tuner: Tuner | None = None  # its load profile and the tuning of its live context (SPEC E1-E4)
    shape: gguf_meta.ModelShape | None = None  # read once, for the ledger figure of each context size
    retuning: asyncio.Task[None] | None = None  # the adaptive loop's retune of its context in progress
    retune_again: bool = False  # a retune was asked for while one ran (new settings, say): it runs once more after
    pending: Tuning | None = None  # a tuning its next request applies inline (engine.async_switch: false)
    cold_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one cold context at a time
    cold_bytes: int = 0  # the ledger figure of its cold context while one exists

    @property
    def key(self) -> str:
        return self.spec.name

    def __post_init__(self) -> None:
        self.serving.set()

    @property
    def path(self) -> Path:
        return self.spec.path

    def view(self) -> policy.ModelView:
        return policy.ModelView(self.key, self.state == "loaded", self.refcount, self.inflight,
                                self.last_used, self.spec.idle_ttl_s, self.retired)


@dataclass(eq=False)
class Agent:
    id: str
    model: Model
    conversation: Conversation = field(default_factory=Conversation)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    owner: object | None = None  # a connection that owns this agent (MAGN sessions); None = until UNREGISTER
    last_used: float = 0.0  # when it registered or last decoded (agent_idle_ttl_s, host KV drop order)
    notice: str | None = None  # said once, by its next decode result (its model was reloaded: conversation reset)

    def view(self) -> policy.AgentView:
        return policy.AgentView(self.id, self.last_used, self.lock.locked())

    def held(self) -> hostkv.HeldState | None:
        """Its host KV buffer as the budget sees it (None when it holds none). Read on the engine thread."""
        conv = self.conversation
        if conv.buffer is None:
            return None
        return hostkv.HeldState(self.id, len(conv.buffer), conv.where == "host", self.last_used)


@dataclass(frozen=True)
class DecodeResult:
    agent: str | None
    model: str
    generation: Generation
    evicted: str | None
    restored: bool
    rebuilt: bool = False  # its parked KV state had been dropped (host_kv_budget): its tokens were re-evaluated
    dropped: tuple[str, ...] = ()  # agents whose parked KV state this decode dropped to stay within host_kv_budget
    notice: str | None = None  # a one-time message for the client (its conversation was reset by a model reload)
    plan: str = ""  # the plan of the context it ran in (S, M, L or fixed; L for a cold context)
    threads: int = 0  # the threads that context decoded with
    peak_memory_bytes: int = 0  # the ledger bytes of the model (weights, live and cold contexts) while it ran


FileIdentity = tuple[int, int, int, int]
"""A file's (device, inode, size, mtime_ns); (0, 0, 0, 0) when it cannot be read."""


def file_identity(path: Path) -> FileIdentity:
    try:
        stat = path.stat()
    except OSError:
        return (0, 0, 0, 0)
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def model_defaults(name: str, path: Path) -> ModelConfig:
    """A model registered by path takes every ``models[]`` setting's schema default."""
    def default(key: str) -> Any:
        setting = settings.BY_KEY[f"models[].{key}"]
        return setting.kind.convert(setting.default)

    return ModelConfig(name=name, path=path, aliases=(), vram_bytes=default("vram_bytes"), n_ctx=default("n_ctx"),
                       n_gpu_layers=default("n_gpu_layers"), idle_ttl_s=default("idle_ttl_s"),
                       embeddings=default("embeddings"), reasoning=default("reasoning"),
                       cache_type=default("cache_type"), generate_if_missing=None)


def process_bytes(reading: DeviceReading) -> int:
    """This process's footprint on the device, or its RSS when the device cannot tell."""
    if reading.process_used is not None:
        return reading.process_used
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def physical_memory() -> int:
    """Physical RAM in bytes: ``MemTotal`` of ``/proc/meminfo``, else ``sysconf``."""
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as fh:
            total = hostkv.meminfo_total(fh.read())
        if total is not None:
            return total
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def log_load_failure(name: str, error: ApplianceError) -> None:
    """One WARNING line for a model that was not loaded: a ledger denial with its figures, or the failure."""
    if error.code == "VRAM_LEDGER_DENY":
        details = error.details or {}
        log.warning("model %s denied by the VRAM ledger: needs %s bytes, %s of %s bytes allocated", name,
                    details.get("requested_table_bytes"), details.get("ledger_allocated_bytes"),
                    details.get("ledger_max_bytes"))
    else:
        log.warning("model %s not loaded: %s %s", name, error.code, error.message)


RELOAD_KEYS = frozenset(s.name for s in settings.SETTINGS if s.section == "models" and not s.live)
"""The ``models[]`` keys whose change needs the model's weights reloaded (the others apply in place)."""


def needs_reload(before: ModelConfig, after: ModelConfig) -> bool:
    """True when two specs of one model differ in a key that only a reload applies (path, n_ctx, ...)."""
    return any(getattr(before, key) != getattr(after, key) for key in RELOAD_KEYS)


def reload_key(name: str) -> str:
    """The ledger key that holds a reloading model's new estimate while its old runtime still serves."""
    return f"{name} (reloading)"


STEPS_AHEAD = 2
"""Step jobs a model keeps queued on the engine thread while its requests are in flight (the one running, the
next)."""

WAIT_TURN = object()
"""What a request's start returns when others already wait for a sequence of its model (it queues behind them)."""


def context_key(name: str) -> str:
    """The ledger key of a model's live context (its KV cache and compute buffers), apart from its weights."""
    return f"{name} (context)"


def embedding_key(name: str) -> str:
    """The ledger key of a model's embeddings context (``models[].embeddings``), apart from its live context."""
    return f"{name} (embeddings)"


def vocabulary_notice(name: str) -> str:
    return f"conversation reset: model {name} was reloaded with a different vocabulary"


async def finish(job: asyncio.Future[Any]) -> Any:
    """Await an engine ``job`` to its end: a caller cancelled meanwhile still waits for it, then is cancelled
    (so that what the job made, a runtime, can be cleaned up)."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await job
        raise


def job_result(job: asyncio.Future[Any]) -> Any:
    """A finished job's value, or None when it failed, was cancelled or has not finished."""
    if not job.done() or job.cancelled() or job.exception() is not None:
        return None
    return job.result()


def buffer_bytes(conv: Conversation) -> int:
    """The bytes of ``conv``'s host buffer (read once: the engine thread may drop it meanwhile)."""
    buffer = conv.buffer
    return 0 if buffer is None else len(buffer)


def forget_parked(conv: Conversation) -> None:
    """Drop a parked conversation's KV state: it keeps its tokens, and its next request re-evaluates them (the
    runtime starts from an empty context when ``where`` is not ``host``). Engine thread only."""
    conv.buffer = None
    conv.nbytes = 0
    conv.where = "empty"
    conv.n_evaluated = 0


class Daemon:
    """The one owner of the daemon's state; every surface calls it on the event loop.

    It owns: the VRAM :class:`Ledger` (its cap re-based on each :meth:`resync` of ``device``), the :class:`Model` s
    (refcount, in-flight count, :data:`ModelState`, loaded runtime, estimate and measured bytes), the registered
    :class:`Agent` s with their conversations, the ``engine`` (its worker thread and every runtime loaded on it;
    :meth:`close` closes both, and the ``device``), the counters STATUS shows, and the cancel events of the
    generations running now (:meth:`close` sets them).

    It borrows: ``config``, read at use time (model specs, ``model_dirs``, ``admission_percent``), except for the
    engine it builds from ``engine.threads`` once, here (a new thread count takes a restart); and ``clock``, the
    monotonic time source of idle TTLs (L7), which tests drive by hand.
    """

    def __init__(self, config: Config, device: MemoryDevice, engine: EngineProtocol | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.device = device
        if engine is None:
            from appliance.engine.runtime import Engine  # llama.cpp only when no other engine is given

            engine = Engine(config.engine.threads or None)
        self.engine: EngineProtocol = engine
        self.clock = clock
        self.models: dict[str, Model] = {}
        self.agents: dict[str, Agent] = {}
        self._claimed: set[str] = set()
        self._running: set[threading.Event] = set()  # cancel events of the generations now on the engine
        self.reading = device.read()
        self.external = external_used(self.reading.used, self.reading.process_used, 0)
        self.ledger = Ledger(compute_cap(self.reading.total, config.admission_percent, self.external))
        self.counters: dict[str, int] = {"kv_swaps": 0, "kv_restores": 0, "decodes": 0, "tokens": 0,
                                         "denials": 0, "host_kv_drops": 0, "host_kv_rebuilds": 0,
                                         "agents_expired": 0, "reloads": 0, "kv_swap_bytes": 0,
                                         "kv_restore_bytes": 0}
        self.kv_swap_seconds = 0.0  # engine time in KV swaps: parking live states and restoring the decoding one
        self.decoding = 0  # generations running on the engine thread now (written by that thread only)
        self.errors: collections.Counter[tuple[str, str]] = collections.Counter()  # P4 errors sent: (surface, code)
        self.connections: collections.Counter[str] = collections.Counter()  # socket connections by protocol
        self.physical_memory = physical_memory()
        self.closing = False  # a graceful stop began: new requests get SHUTTING_DOWN
        self.grace_over = False  # its grace ran out: requests accepted before it end with SHUTTING_DOWN too
        self.accepted = 0  # generation requests accepted and not answered yet (loading their model, queued, running)
        self.on_change: Callable[[], None] | None = None  # models loaded or unloaded (registry file, C4)
        self.reports: dict[str, Callable[[], Any]] = {}  # other parts' figures for STATUS
        self.on_reload: Callable[[str], Awaitable[dict[str, Any]]] | None = None  # RELOAD: the supervisor's reload
        self.on_tune: Callable[[object, dict[str, str]], Awaitable[dict[str, Any]]] | None = None  # TUNE, by owner
        self.on_untune: Callable[[object], None] | None = None  # a TUNE owner's connection closed
        self.requests = RequestLog()  # every generation request's record (surfaces add them; metrics observe)
        self._tasks: set[asyncio.Task[Any]] = set()  # background unloads of retired models
        self._context_lock = asyncio.Lock()  # one claim of a live context at a time (SPEC L8)
        self.context_waiters: list[asyncio.Future[None]] = []  # claims waiting for a context to go idle
        self.adaptive = AdaptiveLoop(self)  # samples, decides and applies each model's tuning (SPEC E1-E5)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- models ----------------------------------------------------------------------------------
    def resolve(self, ref: str) -> Model:
        """A configured model's name or alias, or a GGUF path inside the model directories (R4)."""
        spec = self.config.named(ref)
        if spec is None and ("/" in ref or ref.endswith(".gguf")):
            path = Path(ref).expanduser()
            resolved = path.resolve()
            folders = [Path(d).resolve() for d in self.config.model_dirs]
            if not policy.inside(resolved, folders):
                raise ApplianceError("FORBIDDEN", "model path is outside the configured model directories",
                                     {"path": ref, "model_dirs": [str(d) for d in self.config.model_dirs]})
            if not resolved.is_file():
                raise ApplianceError("UNKNOWN_MODEL", "no such model file", {"path": ref})
            if not gguf_meta.is_gguf(resolved):
                raise ApplianceError("BAD_REQUEST", "not a GGUF file", {"path": ref})
            configured = [m for m in self.config.models if m.path.resolve() == resolved]
            spec = configured[0] if configured else model_defaults(str(resolved), resolved)
        if spec is None:
            raise ApplianceError("UNKNOWN_MODEL", f"no model named {ref!r}",
                                 {"model": ref, "known": [m.name for m in self.config.models]})
        model = self.models.get(spec.name)
        # A changed spec (the config was replaced) takes effect from the model's next load: never while it loads
        # or unloads, since both models would hold the same ledger key.
        if model is None or (model.spec != spec and model.state == "available"):
            model = self.models[spec.name] = Model(spec)
        return model

    def model_state(self, name: str) -> ModelState:
        """The named model's :data:`ModelState`, read from memory (``available`` for one never resolved)."""
        model = self.models.get(name)
        return "available" if model is None else model.state

    def estimate_parts(self, spec: ModelConfig) -> tuple[int, int]:
        """``spec``'s ledger figure (the operator's ``vram_bytes``, else the GGUF table estimate) and the part of it
        that is its live context (KV cache + compute margin), which
        the ledger holds apart and releases while the context is freed (SPEC L8). An operator's ``vram_bytes`` is
        one figure: its context part is 0 (it stays reserved while the model is loaded)."""
        if spec.vram_bytes is not None:
            return spec.vram_bytes, 0
        shape = gguf_meta.read_model_shape(spec.path)
        table = gguf_meta.estimate(shape, spec.n_ctx, spec.cache_type)
        return table.total, table.kv + table.compute

    async def acquire(self, model: Model) -> None:
        """Make sure ``model`` is loaded: estimate -> check -> reserve -> load; any failure rolls back (L3)."""
        async with model.lock:
            if model.runtime is not None:
                return
            model.state = "loading"
            interrupted = False
            started = time.perf_counter()
            try:
                model.file = await asyncio.to_thread(file_identity, model.path)  # before the load
                if model.estimate is None:
                    model.estimate, model.context_bytes = await asyncio.to_thread(self.tuned_parts, model,
                                                                                  model.spec)
                # A trial load in a child process (llama.cpp aborts on some bad files): off the loop and off
                # the engine thread, before anything is reserved.
                spec = model.spec
                await asyncio.to_thread(self.engine.check, model.path, n_ctx=spec.n_ctx,
                                        n_gpu_layers=spec.n_gpu_layers)
                weights = model.estimate - model.context_bytes
                await self._claim_context(model, extra=weights)  # it is loaded with its context
                try:
                    with self.ledger.reservation(model.key, weights) as pending:
                        load = asyncio.ensure_future(self.engine.call(self._load, model))
                        try:
                            model.runtime = await asyncio.shield(load)
                        except asyncio.CancelledError:
                            # The caller went away; the load still finishes on the engine thread. Keep it:
                            # the model stays loaded without agents and the idle sweep frees it.
                            interrupted = True
                            model.runtime = await load
                        pending.commit()
                finally:
                    if model.runtime is None:
                        self.ledger.release(context_key(model.key))
                        model.context_claimed = False
                model.context_used = self.clock()
                log.info("model %s loaded: estimate %d bytes, %.2f s", model.key, model.estimate,
                         time.perf_counter() - started)
                self.adaptive.start_warmup(model)
            except ApplianceError as exc:
                self.counters["denials"] += exc.code == "VRAM_LEDGER_DENY"
                log_load_failure(model.key, exc)
                raise
            finally:
                model.state = "available" if model.runtime is None else "loaded"
            model.last_used = self.clock()
            self._changed()
            if interrupted:
                raise asyncio.CancelledError

    def tuned_parts(self, model: Model, spec: ModelConfig) -> tuple[int, int]:
        """:meth:`estimate_parts` with the context part for the pool ``model``'s tuner wants now (the full
        ``n_ctx`` with ``engine.adaptive: false``). Blocking (it may read the GGUF): call it off the loop."""
        estimate, context = self.estimate_parts(spec)
        if not context:
            return estimate, context
        tuned = self.adaptive.context_bytes(model, self.adaptive.tuner(model).current.pool_cells)
        return estimate - context + tuned, tuned

    def _load(self, model: Model) -> RuntimeProtocol:
        model.baseline = process_bytes(self.device.read())
        return self._engine_load(model, model.spec)

    def _engine_load(self, model: Model, spec: ModelConfig) -> RuntimeProtocol:
        return self.engine.load(spec.path, n_ctx=spec.n_ctx, n_gpu_layers=spec.n_gpu_layers,
                                live_slots=self.config.engine.live_slots,
                                flash_attention=self.config.engine.flash_attention, cache_type=spec.cache_type,
                                tuning=self.adaptive.tuner(model).current)

    # -- live contexts (SPEC L8) ---------------------------------------------------------------------
    def live_contexts(self) -> list[Model]:
        """The models whose live context is admitted (built, or being built with the model's load)."""
        return [m for m in self.models.values() if m.context_claimed]

    async def _claim_context(self, model: Model, *, extra: int = 0) -> list[Conversation]:
        """Reserve ``model``'s live context in the ledger (with ``extra`` bytes free beside it), within
        ``engine.live_contexts``: the least recently used idle context of another model is freed (its agents
        parked in host RAM) until it fits; while only busy ones stand in the way, wait for one to go idle. A
        context that cannot fit even with every other one freed is ``VRAM_LEDGER_DENY``. Returns the
        conversations parked on the way."""
        parked: list[Conversation] = []
        async with self._context_lock:
            while True:
                others = [m for m in self.live_contexts() if m is not model]
                limit = self.config.engine.live_contexts
                counted = limit is None or len(others) < limit
                if counted and self.ledger.free >= model.context_bytes + extra:
                    if model.context_bytes:
                        self.ledger.try_reserve(context_key(model.key), model.context_bytes)
                    model.context_claimed = True
                    return parked
                reclaimable = sum(m.context_bytes for m in others)
                if self.ledger.free + reclaimable < model.context_bytes + extra:  # even with every other freed
                    self.ledger.try_reserve(context_key(model.key), model.context_bytes + extra)  # the denial
                idle = [m for m in others if m.active == 0 and m.runtime is not None]
                if idle:
                    victim = min(idle, key=self._context_age)
                    parked.extend(await self._free_context(victim))
                    continue
                if not others:
                    raise ApplianceError("INTERNAL", "no live context to wait for")
                waiter = asyncio.get_running_loop().create_future()
                self.context_waiters.append(waiter)
                self._context_lock.release()
                try:
                    await waiter
                finally:
                    await self._context_lock.acquire()

    def _context_age(self, model: Model) -> float:
        return model.context_used

    async def _free_context(self, model: Model) -> list[Conversation]:
        """Park ``model``'s live conversations and free its context (its weights stay); releases its ledger key."""
        runtime = model.runtime
        if runtime is None:
            return []
        parked = await self.engine.call(runtime.close_context)  # a context prepared beside it goes too
        self.ledger.release(context_key(model.key))
        self.ledger.release(next_key(model.key))
        model.context_claimed = False
        log.info("model %s: live context freed (%d conversations parked in host RAM)", model.key, len(parked))
        return parked

    async def _open_context(self, model: Model) -> list[Conversation]:
        """Make sure ``model`` (loaded, ``active``) has its live context; returns what was parked to make room."""
        runtime = model.runtime
        if runtime is None:
            raise ApplianceError("INTERNAL", f"model {model.key!r} is not loaded")
        model.context_used = self.clock()
        if runtime.has_context:
            return []
        parked = await self._claim_context(model)
        try:
            await self.engine.call(runtime.open_context)
        except BaseException:
            self.ledger.release(context_key(model.key))
            model.context_claimed = False
            raise
        log.info("model %s: live context built", model.key)
        return parked

    def _context_idle(self) -> None:
        """A model's last active request ended: wake whoever waits for a context to go idle."""
        waiters, self.context_waiters = self.context_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def unload(self, model: Model, still: Callable[[policy.ModelView], bool] | None = None,
                     reason: str = "requested") -> bool:
        """Unload ``model`` and release its bytes; with ``still``, only if the policy still agrees once the
        model's lock is held (an agent may have registered meanwhile). ``reason`` goes to the log line."""
        async with model.lock:
            if model.runtime is None or (still is not None and not still(model.view())):
                return False
            runtime, model.runtime = model.runtime, None
            model.state = "unloading"
            try:
                await self.engine.call(runtime.close)
            finally:  # the runtime is gone from the daemon either way: so are its bytes
                model.state = "available"
                self.ledger.release(model.key)
                self.ledger.release(context_key(model.key))
                self.ledger.release(next_key(model.key))
                self.ledger.release(cold_key(model.key))
                self.ledger.release(embedding_key(model.key))
                model.context_claimed = False
                model.cold_bytes = 0
                model.pending = None
        log.info("model %s unloaded (%s)", model.key, reason)
        self._changed()
        return True

    async def sweep_idle(self) -> list[str]:
        """Unregister agents idle past ``agent_idle_ttl_s`` (L11), then unload models idle past their TTL (L7);
        returns the names of the models unloaded."""
        await self.expire_agents()
        await self.drain_retired()
        names = policy.expired([m.view() for m in self.models.values()], self.clock())
        idle: list[str] = []
        for name in names:
            model = self.models[name]
            if await self.unload(model, self._still_expired, reason="idle TTL"):
                idle.append(name)
        return idle

    def _still_expired(self, view: policy.ModelView) -> bool:
        """The TTL decision again, under the model's lock (it may have been used meanwhile); logged."""
        now = self.clock()
        if not policy.expired([view], now):
            return False
        log.info("model %s expired: idle for %.1f s, TTL %g s", view.key, now - view.last_used, view.idle_ttl_s)
        return True

    async def expire_agents(self) -> list[str]:
        """Unregister the agents that have not registered or decoded for ``agent_idle_ttl_s`` (L11; 0 = never),
        whoever owns them (a MAGN connection's next request on one gets ``UNKNOWN_AGENT``); returns their ids."""
        ttl = self.config.agent_idle_ttl_s
        expired: list[str] = []
        for agent_id in policy.idle_agents([a.view() for a in self.agents.values()], self.clock(), ttl):
            agent = self.agents.get(agent_id)
            if agent is None:
                continue
            async with agent.lock:
                view = policy.AgentView(agent.id, agent.last_used, busy=False)  # the lock is ours now
                still = policy.idle_agents([view], self.clock(), self.config.agent_idle_ttl_s)
                if self.agents.get(agent_id) is not agent or not still:
                    continue
                idle_s = self.clock() - agent.last_used
                self.counters["agents_expired"] += 1  # counted as it leaves the table, not after its model's unload
                await self._remove(agent, f"expired: idle for {idle_s:.1f} s, agent_idle_ttl_s {ttl:g} s")
            expired.append(agent_id)
        return expired

    # -- agents ----------------------------------------------------------------------------------
    async def register(self, agent_id: str, ref: str, owner: object | None = None) -> Agent:
        """Register ``agent_id`` on the model ``ref`` (loaded if need be). Every surface checks the id
        first; this is the last line of defence: an id outside the one rule (:mod:`appliance.protocol.identifiers`) is
        BAD_REQUEST, one agent more than ``max_agents`` (all owners, registrations in progress included) is
        TOO_MANY_AGENTS; the agents already registered are not touched. Once a graceful stop began only a
        request accepted before it (:meth:`accepting`) may still register."""
        if self.closing and not _ACCEPTED.get():
            raise ApplianceError("SHUTTING_DOWN")
        problem = agent_id_problem(agent_id)
        if problem is not None:
            raise ApplianceError("BAD_REQUEST", f"agent id {problem}",
                                 {"agent": str(agent_id)[:80], "rule": AGENT_ID_RULE})
        if agent_id in self.agents or agent_id in self._claimed:
            raise ApplianceError("AGENT_EXISTS", f"agent {agent_id!r} is already registered",
                                 {"agent": agent_id})
        limit = self.config.max_agents
        if len(self.agents) + len(self._claimed) >= limit:
            raise ApplianceError("TOO_MANY_AGENTS", f"the appliance holds {limit} agents (max_agents): one must be "
                                                    "unregistered, or expire (agent_idle_ttl_s), first",
                                 {"max_agents": limit})
        self._claimed.add(agent_id)
        try:
            model = self.resolve(ref)
            model.refcount += 1  # held while loading, so an idle sweep cannot race the load
            try:
                await self.acquire(model)
            except BaseException:
                model.refcount -= 1
                raise
            if model.retired:  # removed from the config while it loaded
                model.refcount -= 1
                self._settle_retired(model)
                raise ApplianceError("UNKNOWN_MODEL", f"model {model.key!r} was removed from the config",
                                     {"model": model.key, "known": [m.name for m in self.config.models]})
            agent = self.agents[agent_id] = Agent(agent_id, model, owner=owner, last_used=self.clock())
            log.info("agent %s registered on model %s%s", agent_id, model.key,
                     "" if owner is None else " (owned by its connection)")
            return agent
        finally:
            self._claimed.discard(agent_id)

    async def unregister(self, agent_id: str, reason: str = "UNREGISTER") -> None:
        agent = self.agent(agent_id)
        async with agent.lock:
            if self.agents.get(agent_id) is not agent:
                raise ApplianceError("UNKNOWN_AGENT", f"no agent {agent_id!r}", {"agent": agent_id})
            await self._remove(agent, reason)

    async def _remove(self, agent: Agent, reason: str) -> None:
        """Unregister ``agent``, whose lock the caller holds; a model's last agent unloads it (L4)."""
        del self.agents[agent.id]
        model = agent.model
        model.refcount -= 1
        log.info("agent %s unregistered (%s)", agent.id, reason)
        await self.engine.call(self._detach, model, agent.conversation)
        await self.unload(model, policy.unload_on_release, reason="last agent left")
        self._forget_retired(model)

    def _detach(self, model: Model, conv: Conversation) -> None:
        """Detach ``conv`` from its model's runtime as it is when this runs (engine thread): a reload may have
        replaced the runtime since the job was queued."""
        runtime = model.runtime
        if runtime is not None:
            runtime.detach(conv)

    def agent(self, agent_id: str) -> Agent:
        agent = self.agents.get(agent_id)
        if agent is None:
            raise ApplianceError("UNKNOWN_AGENT", f"no agent {agent_id!r}", {"agent": agent_id})
        return agent

    async def release_owner(self, owner: object) -> None:
        """Unregister every agent a closed connection owned (R3)."""
        for agent in [a for a in self.agents.values() if a.owner is owner]:
            with contextlib.suppress(ApplianceError):
                await self.unregister(agent.id, reason="its connection closed")

    # -- decoding --------------------------------------------------------------------------------
    async def decode(self, agent_id: str, n_tokens: int, prompt: PromptText, sampling: Sampling = GREEDY,
                     on_token: Callable[[Token], None] | None = None,
                     cancel: threading.Event | None = None) -> DecodeResult:
        with self.accepting():
            agent = self.agent(agent_id)
            async with agent.lock:
                if self.agents.get(agent_id) is not agent:
                    raise ApplianceError("UNKNOWN_AGENT", f"no agent {agent_id!r}", {"agent": agent_id})
                agent.last_used = self.clock()  # the most recently used: the last whose parked state is dropped
                try:
                    return await self._run(agent.model, agent.conversation, agent, n_tokens, prompt, sampling,
                                           on_token, cancel, queue=("agent", agent_id))
                finally:
                    agent.last_used = self.clock()

    async def complete(self, ref: str, n_tokens: int, prompt: PromptText, sampling: Sampling = GREEDY,
                       on_token: Callable[[Token], None] | None = None,
                       cancel: threading.Event | None = None, queue: Hashable | None = None) -> DecodeResult:
        """A stateless request (HTTP, MAGN without a session): a fresh conversation every time. ``queue`` is the
        engine queue it waits in (its connection; default: one queue for the model's stateless requests)."""
        with self.accepting():
            model = self.resolve(ref)
            model.inflight += 1
            try:
                await self.acquire(model)
                return await self._run(model, Conversation(), None, n_tokens, prompt, sampling, on_token, cancel,
                                       ephemeral=True, queue=("stateless", model.key) if queue is None else queue)
            finally:
                model.inflight -= 1
                model.last_used = self.clock()
                if policy.unload_retired(model.view()):
                    self._settle_retired(model)

    async def count(self, ref: str, prompt: PromptText) -> int:
        """The tokens ``prompt`` is on model ``ref``'s vocabulary, its BOS token included (what a generation of it
        counts as ``prompt_tokens``; nothing is generated): loaded if need be and counted in flight meanwhile (the
        idle sweep leaves it), tokenized on the engine thread (where a model is unloaded)."""
        with self.accepting():
            model = self.resolve(ref)
            model.inflight += 1
            try:
                await self.acquire(model)
                return int(await self.engine.call(self._count, model, prompt, queue=("count", model.key)))
            finally:
                model.inflight -= 1
                model.last_used = self.clock()
                if policy.unload_retired(model.view()):
                    self._settle_retired(model)

    def _count(self, model: Model, prompt: PromptText) -> int:
        """``prompt``'s tokens on ``model``'s loaded vocabulary (engine thread)."""
        runtime = model.runtime
        if runtime is None:
            raise ApplianceError("MODEL_BUSY", f"model {model.key!r} was unloaded while its tokens were counted",
                                 {"model": model.key})
        return len(tokenize_prompt(cast(PromptVocabulary, runtime), prompt, bos=True))

    async def embed(self, ref: str, inputs: Sequence[str | Sequence[int]],
                    dimensions: int | None = None) -> Embeddings:
        """The embeddings of ``inputs`` (texts or token ids; ``dimensions``, if given, the model's) from the model
        ``ref``, which must have
        ``models[].embeddings: true`` (else ``BAD_REQUEST`` naming the setting): loaded if need be, its
        embeddings context opened at its first such request (:meth:`_open_embeddings`)."""
        with self.accepting():
            model = self.resolve(ref)
            if not model.spec.embeddings:
                raise ApplianceError("BAD_REQUEST", f"model {model.key!r} does not serve embeddings: set "
                                                    "models[].embeddings: true for it in appliance.yaml",
                                     {"param": "model", "model": model.key, "setting": "models[].embeddings"})
            model.inflight += 1
            try:
                await self.acquire(model)
                runtime = await self._open_embeddings(model)
                return await self.engine.call(runtime.embed, inputs, dimensions,
                                             queue=("embeddings", model.key))
            finally:
                model.inflight -= 1
                model.last_used = self.clock()
                if policy.unload_retired(model.view()):
                    self._settle_retired(model)

    async def _open_embeddings(self, model: Model) -> Any:
        """``model``'s runtime with its embeddings context open: built once, its estimate (KV cache and compute
        margin for :func:`~appliance.engine.embedding.context_size` cells) admitted under :func:`embedding_key`
        first (``VRAM_LEDGER_DENY`` when it does not fit)."""
        async with model.lock:
            runtime = model.runtime
            if runtime is None:
                raise ApplianceError("INTERNAL", f"model {model.key!r} is not loaded")
            if runtime.has_embeddings:
                return runtime
            shape = await asyncio.to_thread(gguf_meta.read_model_shape, model.path)
            table = gguf_meta.estimate(shape, context_size(model.spec.n_ctx), model.spec.cache_type)
            with self.ledger.reservation(embedding_key(model.key), table.kv + table.compute) as pending:
                await finish(asyncio.ensure_future(self.engine.call(runtime.open_embeddings)))
                pending.commit()
            log.info("model %s: embeddings context built (%d bytes in the ledger)", model.key,
                     table.kv + table.compute)
            self._changed()
            return runtime

    @contextlib.contextmanager
    def accepting(self) -> Iterator[None]:
        """One client request from its arrival to its answer (:meth:`decode`, :meth:`complete`; a surface whose one
        request registers an agent and then decodes, as an OpenAI chat with ``user``, wraps both): refused with
        SHUTTING_DOWN once a graceful stop began, else counted in :attr:`accepted` until it ends, so that the
        stop's grace covers it while it waits for its model to load, for its agent or for a sequence. Nested
        ones (in the same task) are the outer one."""
        if _ACCEPTED.get():
            yield
            return
        if self.closing:
            raise ApplianceError("SHUTTING_DOWN")
        self.accepted += 1
        mark = _ACCEPTED.set(True)
        try:
            yield
        finally:
            _ACCEPTED.reset(mark)
            self.accepted -= 1

    async def _run(self, model: Model, conv: Conversation, agent: Agent | None, n_tokens: int,
                   prompt: PromptText, sampling: Sampling, on_token: Callable[[Token], None] | None,
                   cancel: threading.Event | None, ephemeral: bool = False,
                   queue: Hashable = DEFAULT_QUEUE) -> DecodeResult:
        """Generate in the model's live context: claim the context (SPEC L8), start the request on the engine
        thread (``queue`` is the engine queue it waits in: an agent's decodes, a connection's stateless requests)
        once a sequence is free for it, then let the model's step loop decode it together with the others
        (SPEC L9) until it ends. The start reads the model's runtime when it runs: a reload queued before it may
        have replaced the runtime. Accepted before a graceful stop began, it still runs until the grace is over."""
        if self.grace_over:
            raise ApplianceError("SHUTTING_DOWN")
        if model.runtime is None:
            raise ApplianceError("INTERNAL", f"model {model.key!r} is not loaded")
        agent_id = None if agent is None else agent.id
        cancel = cancel or threading.Event()
        owner = {id(a.conversation): a.id for a in self.agents.values()}
        dropped: list[str] = []
        moved = {"swap_bytes": 0, "restore_bytes": 0, "seconds": 0.0}  # this request's KV swap (metrics)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[Any] = loop.create_future()
        rebuilt = False

        def on_done(request: Any) -> None:  # engine thread
            self.decoding -= 1
            loop.call_soon_threadsafe(self._request_ended, model, ended, request)

        def start(queued: bool, cold: bool = False) -> Any:
            nonlocal rebuilt
            if not queued and not cold and model.admission.waiting:  # others wait for a sequence: not before them
                return WAIT_TURN
            runtime = model.runtime
            if runtime is None:
                raise ApplianceError("INTERNAL", f"model {model.key!r} is not loaded")
            # The agents as they are now, not at submit time: the engine may have served other queues first.
            # dict.copy() runs under the GIL in one piece, so the loop cannot change the dict halfway through.
            agents = list(self.agents.copy().values())
            rebuilt = conv.where != "device" and bool(conv.tokens)  # unless its state comes back (below)
            restoring = conv.nbytes if conv.where == "host" else 0
            started = time.perf_counter()

            def before_park(parking: Conversation) -> None:  # make room in host RAM for the state it parks
                reserve = hostkv.parked_estimate(model.kv_bytes_per_token, parking.n_evaluated,
                                                 buffer_bytes(parking))
                dropped.extend(self._fit_host_kv(agents, reserve=reserve, parking=parking, attaching=conv))

            request = runtime.begin(conv, prompt, n_tokens, sampling, on_token=on_token, cancelled=cancel.is_set,
                                    on_done=on_done, ephemeral=ephemeral, before_park=before_park, cold=cold)
            if request is None or isinstance(request, ColdNeeded):
                return request
            if request.evicted or request.restored:
                moved["seconds"] += time.perf_counter() - started
                moved["swap_bytes"] += sum(parked.nbytes for parked in request.evicted)
                moved["restore_bytes"] += restoring if request.restored else 0
            for parked in request.evicted:
                ratio = hostkv.per_token(parked.nbytes, parked.n_evaluated)
                model.kv_bytes_per_token = max(model.kv_bytes_per_token, ratio)
            dropped.extend(self._fit_host_kv(agents))
            self.decoding += 1
            return request

        model.inflight += 1
        self._running.add(cancel)
        request: Any = None
        try:
            await model.serving.wait()  # a reload swapping the runtime
        except BaseException:
            self._running.discard(cancel)
            model.inflight -= 1
            raise
        model.active += 1
        cold_held = False
        try:
            parked = await self._open_context(model)
            if model.pending is not None:
                await self.adaptive.apply_pending(model)
            request = await self._admit(model, start, queue)
            if isinstance(request, ColdNeeded):  # longer than the hot pool: a cold context of its own (SPEC E2)
                needed = request
                request = None
                await model.cold_lock.acquire()
                cold_held = True
                await self.adaptive.open_cold(model, needed.cells)
                request = await self._admit(model, functools.partial(start, cold=True), ("cold", model.key))
            self._drive(model)
            await asyncio.shield(ended)
        except asyncio.CancelledError:
            # Stop at the next step (a start that ran while its caller went away is reaped there too); wait for a
            # request we know of, so that nothing is left running (R3).
            cancel.set()
            self._drive(model)
            if request is not None:
                with contextlib.suppress(Exception):
                    await ended
            raise
        finally:
            fitted = None
            if cold_held:
                if request is None or request.done:  # else its step frees the cold context: released just below
                    fitted = self.adaptive.close_cold(model)
                model.cold_lock.release()
            self._running.discard(cancel)
            model.inflight -= 1
            model.active -= 1
            if model.active == 0:
                self._context_idle()
            model.last_used = self.clock()
            if fitted is not None:  # the parked cold conversation fits the host budget before the reply
                with contextlib.suppress(Exception):
                    await asyncio.shield(fitted)
            self.counters["host_kv_drops"] += len(dropped)
            self.counters["kv_swap_bytes"] += int(moved["swap_bytes"])
            self.counters["kv_restore_bytes"] += int(moved["restore_bytes"])
            self.kv_swap_seconds += moved["seconds"]
        if request.error is not None:
            raise request.error
        generation: Generation = request.generation
        evicted_convs = [*parked, *request.evicted]
        evicted = None
        if evicted_convs:
            evicted = owner.get(id(evicted_convs[0]), "~anonymous")
        rebuilt = rebuilt and not request.restored  # re-evaluated, or shared from a live conversation (L10)
        notice = None
        if agent is not None and generation.stop_reason != "cancelled":  # its client gets this result
            notice, agent.notice = agent.notice, None
        result = DecodeResult(agent_id, model.key, generation, evicted, request.restored, rebuilt, tuple(dropped),
                              notice, request.plan, request.threads, request.memory_bytes)
        self.counters["decodes"] += 1
        self.counters["host_kv_rebuilds"] += result.rebuilt
        self.counters["tokens"] += generation.generated_tokens
        self.counters["kv_swaps"] += len(evicted_convs)
        self.counters["kv_restores"] += result.restored
        if model.measured is None:
            model.measured = max(0, process_bytes(await asyncio.to_thread(self.device.read)) - model.baseline)
        return result

    async def _admit(self, model: Model, start: Callable[[bool], Any], queue: Hashable) -> Any:
        """Start a request (``start`` on the engine thread). While sequences are free every request starts at once
        (the engine serves its queues in turn, so requests arriving together join the same step). A request that
        finds every sequence busy, or others already waiting, waits its turn (:class:`~appliance.daemon.admission.
        Admission`: round-robin over the engine queues, so a client keeping every sequence busy cannot starve
        another); the one whose turn it is retries each time a request ends."""
        ticket = object()
        queued = False
        try:
            while True:
                seen = model.ended
                if not queued or model.admission.head() is ticket:
                    request = await finish(self.engine.submit(functools.partial(start, queued), queue=queue))
                    if request is not None and request is not WAIT_TURN:
                        return request
                    if not queued:
                        model.admission.join(queue, ticket)
                        queued = True
                        if request is WAIT_TURN:
                            continue  # it never tried: try in its turn, which may be now
                if model.ended == seen or model.admission.head() is not ticket:
                    waiter = asyncio.get_running_loop().create_future()
                    model.waiters.append(waiter)
                    await waiter
        finally:
            if queued:
                model.admission.leave(queue, ticket)
                self._wake(model)

    def model_bytes(self, model: Model) -> int:
        """The ledger bytes ``model`` holds now: weights, live context, a context being prepared, a cold one."""
        held = self.ledger.reservations()
        return sum(held.get(key, 0) for key in (model.key, context_key(model.key), next_key(model.key),
                                                cold_key(model.key), embedding_key(model.key)))

    def background(self, task: asyncio.Task[Any]) -> None:
        """Keep ``task`` until it ends (:meth:`settle` waits for it)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _wake(self, model: Model) -> None:
        waiters, model.waiters = model.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _request_ended(self, model: Model, ended: asyncio.Future[Any], request: Any) -> None:
        """A request of ``model`` ended on the engine thread (now on the loop): its caller wakes, and so does
        every request waiting for a free sequence of the model."""
        model.ended += 1
        request.memory_bytes = self.model_bytes(model)  # the pool cannot change while it runs: its peak
        if not ended.done():
            ended.set_result(request)
        self._wake(model)
        self.adaptive.observe(model, request)

    def _drive(self, model: Model) -> None:
        """Make sure the model's step loop runs (a request was just started)."""
        if model.stepper is None or model.stepper.done():
            model.stepper = asyncio.get_running_loop().create_task(self._steps(model))

    async def _steps(self, model: Model) -> None:
        """Step the model's live context while requests are in flight: one engine job per step, in its own engine
        queue, so that other work (new requests joining, other models' steps, loads) runs between two steps. The
        next step is queued before this one ends, so the engine thread never waits for the event loop (busy with
        the streams) to ask for it; a step with nothing to do returns at once."""
        queued: collections.deque[Any] = collections.deque()
        try:
            while True:
                runtime = model.runtime
                while runtime is not None and runtime.busy and len(queued) < STEPS_AHEAD:
                    queued.append(self.engine.submit(runtime.step, queue=("steps", model.key)))
                if not queued:
                    return
                await queued.popleft()
        except Exception:  # a step's failure is its requests' (they ended with it); log anything else
            log.exception("model %s: a decode step failed", model.key)
        finally:
            for job in queued:
                job.cancel()

    @property
    def host_kv_budget(self) -> int:
        """Bytes of host RAM that parked KV state may hold (``host_kv_budget``; ``auto`` = a share of RAM)."""
        configured = self.config.host_kv_budget
        return hostkv.auto_budget(self.physical_memory) if configured is None else configured

    def fit_host_kv(self) -> list[str]:
        """:meth:`_fit_host_kv` for every agent, after the adaptive loop parked some (engine thread)."""
        return self._fit_host_kv(list(self.agents.copy().values()))

    def _fit_host_kv(self, agents: list[Agent], *, reserve: int = 0, parking: Conversation | None = None,
                     attaching: Conversation | None = None) -> list[str]:
        """Free host KV buffers until ``agents`` fit in the budget (policy: :mod:`appliance.daemon.hostkv`);
        returns the agents whose parked state was dropped. Before a swap: ``reserve`` bytes are kept free for the
        ``parking`` conversation (its own buffer counts in them), and the ``attaching`` one goes last. Runs on the
        engine thread, the only one that moves KV state, so no swap races a drop."""
        budget = self.host_kv_budget
        held = [state for state in (agent.held() for agent in agents if agent.conversation is not parking)
                if state is not None]
        by_id = {agent.id: agent for agent in agents}
        last = frozenset(agent.id for agent in agents if agent.conversation is attaching)
        dropped: list[str] = []
        for key in hostkv.to_drop(held, max(0, budget - reserve), last):
            conv = by_id[key].conversation
            nbytes = buffer_bytes(conv)
            if conv.where != "host":
                conv.buffer = None  # a live conversation's reuse buffer: nothing is lost
                continue
            forget_parked(conv)
            dropped.append(key)
            log.info("host KV: dropped agent %s's parked state (%d bytes; budget %d bytes, %d held before): "
                     "its next decode re-evaluates its %d tokens", key, nbytes, budget, hostkv.held_bytes(held),
                     len(conv.tokens))
        return dropped

    def host_kv(self) -> dict[str, int]:
        """Host RAM held for KV state, next to the device ledger (STATUS, health)."""
        convs = [agent.conversation for agent in self.agents.values()]
        return {"budget_bytes": self.host_kv_budget,
                "parked_bytes": sum(buffer_bytes(conv) for conv in convs),
                "parked_agents": sum(conv.where == "host" for conv in convs),
                "drops": self.counters["host_kv_drops"], "rebuilds": self.counters["host_kv_rebuilds"]}

    # -- hot reload ------------------------------------------------------------------------------
    def apply_config(self, new: Config) -> list[str]:
        """Swap in ``new`` (validated) and apply what takes no load: the ledger cap for ``admission_percent``,
        live model keys in place, retiring removed models and un-retiring returned ones (module docstring).
        Models whose file or context settings changed are left to :meth:`reload_model` (see
        :meth:`models_to_reload`). Returns one short line per thing done."""
        old, self.config = self.config, new
        done: list[str] = []
        cap = compute_cap(self.reading.total, new.admission_percent, self.external)
        if cap != self.ledger.cap:
            self.ledger.set_cap(cap)
            allocated = self.ledger.allocated
            over = f": {allocated} bytes allocated, over it: new loads are refused meanwhile" if allocated > cap else ""
            done.append(f"ledger cap {cap} bytes (admission_percent {new.admission_percent:g}){over}")
        configured = {spec.name for spec in old.models}
        for model in list(self.models.values()):
            spec = new.model(model.key)
            if spec is None:
                if model.key in configured and not model.retired:  # a model registered by path is in no config
                    model.retired = True
                    done.append(f"{model.key} retired: no new agents; it unloads when nothing uses it")
                    log.info("model %s removed from the config: retired (%d agents, %d requests in flight)",
                             model.key, model.refcount, model.inflight)
                    self._settle_retired(model)
                continue
            if model.retired:
                model.retired = False
                done.append(f"{model.key} is back in the config: it serves again")
            if spec == model.spec:
                continue
            if not needs_reload(model.spec, spec):
                model.spec = spec
                done.append(f"{model.key} updated in place")
            elif model.state == "available":
                model.spec = spec
                model.estimate = None
                model.measured = None
                done.append(f"{model.key} is not loaded: its next load uses the new settings")
            else:
                done.append(f"{model.key} changed: it needs a reload")
        if old.engine != new.engine:
            self.adaptive.reconfigure()
            if old.engine.adaptive != new.engine.adaptive:
                done.append("engine: " + ("adaptive" if new.engine.adaptive else "fixed strategy") +
                            " for every loaded model")
        return done

    def replaced_files(self) -> list[str]:
        """The loaded models whose file on disk is no longer the one they were loaded from (replaced in place:
        the config did not change), listed or registered by path; a reload (SIGHUP) reloads them. A retired model
        is not one: it unloads once unused."""
        replaced: list[str] = []
        for name, model in self.models.items():
            if model.retired or model.runtime is None or model.file is None:
                continue
            if file_identity(model.path) != model.file:
                replaced.append(name)
        return replaced

    def reload_spec(self, name: str) -> ModelConfig:
        """The spec :meth:`reload_model` reloads ``name`` with: its spec in the current config, or, for a model
        registered by its path (in no config, and not retired), the spec it was registered with."""
        spec = self.config.model(name)
        if spec is not None:
            return spec
        model = self.models.get(name)
        if model is not None and not model.retired:
            return model.spec
        raise ApplianceError("UNKNOWN_MODEL", f"no model named {name!r}",
                             {"model": name, "known": [m.name for m in self.config.models]})

    def models_to_reload(self) -> list[str]:
        """The models whose loaded runtime no longer matches the config (a file or context setting changed):
        what :meth:`reload_model` should be called for after :meth:`apply_config` (this includes a changed
        model that came back after being retired, which a diff of the two configs calls added)."""
        stale: list[str] = []
        for name, model in self.models.items():
            spec = self.config.model(name)
            if spec is not None and model.state != "available" and needs_reload(model.spec, spec):
                stale.append(name)
        return stale

    async def reload_model(self, name: str) -> str:
        """Reload the model ``name`` with its spec in the current config, or its own for a model registered by
        path (:meth:`reload_spec`; its file or context settings changed, or its file was replaced). Not loaded:
        its next load uses the new spec. Loaded: estimate, trial-check and admit the new figure under
        :func:`reload_key` while the old runtime serves, load, then swap in one engine job (:meth:`_install`).
        Any failure leaves the old runtime serving and the ledger as it was, and raises its
        :class:`ApplianceError`. Returns one line saying what happened."""
        if self.closing:
            raise ApplianceError("SHUTTING_DOWN")
        spec = self.reload_spec(name)
        model = self.models.get(name)
        if model is None:
            return f"{name} is not loaded: its next load uses the new settings"
        async with model.lock:
            if model.runtime is None:
                model.spec = spec
                model.estimate = None
                model.measured = None
                return f"{name} is not loaded: its next load uses the new settings"
            started = time.perf_counter()
            try:
                identity = await asyncio.to_thread(file_identity, spec.path)  # before the load: a later change shows
                if model.tuner is not None:
                    model.tuner.reconfigure(self.adaptive.settings(), spec.n_ctx)
                model.shape = None  # the file may have changed
                estimate, context_bytes = await asyncio.to_thread(self.tuned_parts, model, spec)
                await asyncio.to_thread(self.engine.check, spec.path, n_ctx=spec.n_ctx,
                                        n_gpu_layers=spec.n_gpu_layers)
                with self.ledger.reservation(reload_key(name), estimate):
                    kept, reset = await self._replace_runtime(model, spec, estimate, context_bytes)
            except ApplianceError as exc:
                self.counters["denials"] += exc.code == "VRAM_LEDGER_DENY"
                log_load_failure(name, exc)
                log.warning("model %s not reloaded: the loaded one keeps serving", name)
                raise
        self.counters["reloads"] += 1
        model.file = identity
        model.last_used = self.clock()
        log.info("model %s reloaded: estimate %d bytes, %.2f s, %d agents keep their tokens, %d reset", name,
                 estimate, time.perf_counter() - started, kept, reset)
        self._changed()
        if reset:
            return f"{name} reloaded with a different vocabulary ({reset} agents' conversations reset)"
        return f"{name} reloaded ({kept} agents re-evaluate their tokens)"

    async def _replace_runtime(self, model: Model, spec: ModelConfig, estimate: int,
                               context_bytes: int) -> tuple[int, int]:
        """Load ``spec`` next to the serving runtime, let the requests in flight on the old one end (new ones
        wait meanwhile), then install it; a new runtime that was not installed (a failure, or the caller
        cancelled) is closed again. Returns :meth:`_install`'s counts."""
        load = asyncio.ensure_future(self.engine.call(self._load_spare, model, spec))
        try:
            runtime, loaded_bytes = await finish(load)
            model.serving.clear()
            while model.active > 0:
                waiter = asyncio.get_running_loop().create_future()
                self.context_waiters.append(waiter)
                await waiter
            install = asyncio.ensure_future(self.engine.call(self._install, model, spec, estimate, context_bytes,
                                                             runtime, loaded_bytes))
            return await finish(install)
        finally:
            model.serving.set()
            spare = job_result(load)
            if spare is not None and model.runtime is not spare[0]:
                await finish(asyncio.ensure_future(self.engine.call(spare[0].close)))

    def _load_spare(self, model: Model, spec: ModelConfig) -> tuple[RuntimeProtocol, int]:
        """Load ``spec`` while the model's old runtime still serves (engine thread); returns the runtime and the
        process bytes the load added."""
        before = process_bytes(self.device.read())
        runtime = self._engine_load(model, spec)
        return runtime, max(0, process_bytes(self.device.read()) - before)

    def _install(self, model: Model, spec: ModelConfig, estimate: int, context_bytes: int,
                 runtime: RuntimeProtocol, loaded_bytes: int) -> tuple[int, int]:
        """Put ``runtime`` in place of ``model``'s (engine thread, one job, so no decode sees a half-done swap):
        the model's ledger key takes the new estimate (then the temporary key goes: the bytes are never counted
        for neither), the old runtime closes, and each agent on the model forgets its KV state; with a different
        vocabulary its tokens go too and it gets a notice. Returns (agents that keep their tokens, agents reset)."""
        old = model.runtime
        if old is None:
            raise ApplianceError("INTERNAL", f"model {model.key!r} was unloaded during its reload")
        same_vocabulary = old.vocabulary() == runtime.vocabulary()
        # The old weights' and context's keys take the new figures; the temporary key's bytes become the new
        # context's key (the new runtime is loaded with its context), so the bytes are never counted for neither.
        self.ledger.release(context_key(model.key))
        self.ledger.release(embedding_key(model.key))  # closes with the old runtime; the next request opens one
        self.ledger.adjust(model.key, estimate - context_bytes)
        if context_bytes:
            self.ledger.adjust(reload_key(model.key), context_bytes)
            self.ledger.rename(reload_key(model.key), context_key(model.key))
        else:
            self.ledger.release(reload_key(model.key))
        try:
            old.close()
        except Exception:  # it is gone from the daemon either way, as in unload
            log.exception("model %s: closing the replaced runtime failed", model.key)
        model.runtime = runtime
        model.spec = spec
        model.estimate = estimate
        model.context_bytes = context_bytes
        model.context_claimed = True  # the new runtime was loaded with its context
        model.context_used = self.clock()
        model.measured = None
        model.kv_bytes_per_token = 0
        kept = 0
        reset = 0
        for agent in list(self.agents.copy().values()):
            if agent.model is not model:
                continue
            conv = agent.conversation
            forget_parked(conv)
            if same_vocabulary:
                kept += 1
            else:
                conv.tokens.clear()
                agent.notice = vocabulary_notice(model.key)
                reset += 1
        try:  # the measured figure's baseline: as if only the new runtime had been loaded
            model.baseline = process_bytes(self.device.read()) - loaded_bytes
        except Exception:
            log.warning("model %s: no device reading after its reload; its measured figure may be off", model.key)
        return kept, reset

    async def drain_retired(self) -> list[str]:
        """Unload every retired model that nothing uses any more and forget it; returns their names."""
        gone: list[str] = []
        for model in [m for m in self.models.values() if m.retired]:
            await self.unload(model, policy.unload_retired, reason="removed from the config")
            if self._forget_retired(model):
                gone.append(model.key)
        return gone

    def _forget_retired(self, model: Model) -> bool:
        """Drop a retired model that is unloaded and unused from :attr:`models` (and so from STATUS)."""
        unused = model.refcount == 0 and model.inflight == 0 and model.state == "available"
        if not (model.retired and unused and self.models.get(model.key) is model):
            return False
        del self.models[model.key]
        log.info("model %s forgotten: removed from the config and unused", model.key)
        self._changed()
        return True

    def _settle_retired(self, model: Model) -> None:
        """Unload ``model`` in the background if it is retired and unused (a caller on the loop cannot wait)."""
        if not policy.unload_retired(model.view()):
            return
        self.background(asyncio.get_running_loop().create_task(self.drain_retired()))

    async def settle(self) -> None:
        """Wait for the background unloads of retired models (tests; shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- device ----------------------------------------------------------------------------------
    def resync(self) -> DeviceReading:
        """Re-read the device and re-base the cap for memory other processes now use (L1)."""
        reading = self.device.read()
        self.reading = reading
        self.external = external_used(reading.used, reading.process_used, self.ledger.allocated)
        self.ledger.set_cap(compute_cap(reading.total, self.config.admission_percent, self.external))
        return reading

    @property
    def generating(self) -> int:
        """Generations on the engine now (queued or running): what a graceful stop waits for."""
        return len(self._running)

    def cancel_running(self) -> None:
        """End the grace: stop every running generation at its next token (SHUTTING_DOWN for its client while
        ``closing``); an accepted request that has not started yet (its model still loading) gets SHUTTING_DOWN
        when it would start."""
        self.grace_over = True
        for cancel in list(self._running):
            cancel.set()

    async def close(self) -> None:
        """Refuse new work, stop running generations at their next token, unload every model, then close the
        engine and the device."""
        self.closing = True
        self.cancel_running()
        await self.adaptive.close()
        await self.settle()
        for model in list(self.models.values()):
            await self.unload(model, reason="shutdown")
        if self.agents:
            log.info("%d agents dropped at shutdown", len(self.agents))
        self.agents.clear()
        self.engine.close()
        self.device.close()

    def contexts(self) -> list[dict[str, Any]]:
        """Each live context (SPEC L8): its model, its sequences in use and its ledger bytes."""
        records = []
        for model in self.live_contexts():
            runtime = model.runtime
            if runtime is None:
                continue
            tuning = runtime.tuning
            records.append({"model": model.key, "slots": runtime.live_slots, "slots_used": len(runtime.live),
                            "requests": model.active, "kv_bytes": model.context_bytes,
                            "pool_cells": runtime.pool_cells, "pool_bytes": model.context_bytes,
                            "cold_cells": runtime.cold_cells, "cold_bytes": model.cold_bytes,
                            "plan": tuning.plan, "threads": tuning.threads,
                            "adaptive": self.config.engine.adaptive})
        return records

    def profiles(self) -> dict[str, dict[str, Any]]:
        """Each model's load profile (SPEC E1): counts and percentiles of its sampled requests."""
        return {model.key: model.tuner.profile.summary() for model in self.models.values()
                if model.tuner is not None}

    def snapshot(self) -> dict[str, Any]:
        """Everything STATUS, the admin page and metrics show, read from memory."""
        reading, ledger = self.reading, self.ledger.snapshot()
        models = [{"name": m.key, "state": m.state, "loaded": m.runtime is not None, "refcount": m.refcount,
                   "estimate_bytes": m.estimate, "measured_bytes": m.measured, "inflight": m.inflight,
                   "n_ctx": m.spec.n_ctx, "path": str(m.path), "retired": m.retired} for m in self.models.values()]
        agents = [{"id": a.id, "model": a.model.key, "tokens": len(a.conversation.tokens),
                   "state": a.conversation.where, "state_bytes": a.conversation.nbytes,
                   "kv_cells": a.conversation.n_evaluated}
                  for a in self.agents.values()]
        return {"device": {"name": reading.name, "kind": reading.kind, "total_bytes": reading.total,
                           "used_bytes": reading.used, "free_bytes": reading.free,
                           "external_bytes": self.external},
                "ledger": {"cap_bytes": ledger.cap, "allocated_bytes": ledger.allocated,
                           "admission_percent": self.config.admission_percent,
                           "over_cap": ledger.allocated > ledger.cap},
                "host_kv": self.host_kv(),
                "engine": {"live_slots": self.config.engine.live_slots,
                           "live_contexts": self.config.engine.live_contexts or "auto",
                           "contexts_live": len(self.live_contexts()),
                           "adaptive": self.config.engine.adaptive,
                           "warming": bool(self.adaptive.warming),
                           "cpu_percent": None if self.adaptive.cpu is None else round(self.adaptive.cpu.percent, 1),
                           "usable_cores": self.adaptive.cores,
                           "switches": self.adaptive.switches, "cold_requests": self.adaptive.colds},
                "contexts": self.contexts(),
                "profiles": self.profiles(),
                "models": models, "agents": agents, "counters": dict(self.counters),
                "extra": {name: report() for name, report in self.reports.items()}}
