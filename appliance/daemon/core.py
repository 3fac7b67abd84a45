"""The daemon core that every surface (line protocol, MAGN frames, HTTP) calls: ledger, refcounted models,
agent slots with KV swap, live contexts, idle unloading and device resync (SPEC L1–L11, R2, R3, R4).

Model memory is admitted by the :class:`~appliance.daemon.ledger.Ledger` before anything is loaded. A loaded model
(one :class:`~appliance.engine.interface.RuntimeProtocol`, a llama.cpp :class:`~appliance.engine.runtime.Runtime`
in production) holds its weights under its name and, while it has one, its live context under
:func:`~appliance.daemon.model.context_key`.

The :class:`Daemon` is composed of parts, one concept each (:mod:`appliance.daemon.base`): models and agents here;
requests and the step loop in :mod:`appliance.daemon.requests`; the live-context budget in
:mod:`appliance.daemon.contexts`; hot reload and retirement in :mod:`appliance.daemon.reload`. Its data types and
ledger keys are in :mod:`appliance.daemon.model`.

The daemon only knows the engine through :class:`~appliance.engine.interface.EngineProtocol` and time through its
``clock``: tests run it on :class:`appliance.engine.fake.FakeEngine` and a :class:`~appliance.engine.fake.ManualClock`
without a model and without sleeping (tests/test_daemon_core.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from appliance.config import modelfiles
from appliance.config.modelfiles import MissingModel
from appliance.config.validate import Config, ModelConfig
from appliance.daemon import accesslog, offload, policy
from appliance.daemon.adaptive import AdaptiveLoop
from appliance.daemon.base import log_load_failure
from appliance.daemon.contexts import LiveContexts
from appliance.daemon.devices import DeviceReading, MemoryDevice, physical_memory, process_bytes
from appliance.daemon.dormancy import Dormancy
from appliance.daemon.durable import RESTORED_FROM, Durable, durable
from appliance.daemon.ledger import Ledger, compute_cap, external_used
from appliance.daemon.model import (
    Agent,
    Model,
    ModelState,
    cold_key,
    context_key,
    embedding_key,
    file_identity,
    model_defaults,
    next_key,
)
from appliance.daemon.model import DecodeResult as DecodeResult
from appliance.daemon.model import reload_key as reload_key
from appliance.daemon.offload import Offload
from appliance.daemon.reload import HotReload
from appliance.daemon.reload import vocabulary_notice as vocabulary_notice
from appliance.daemon.requestlog import RequestLog
from appliance.daemon.requests import ACCEPTED, Requests
from appliance.engine import gguf_meta
from appliance.engine.interface import Conversation, EngineProtocol, RuntimeProtocol
from appliance.errors import ApplianceError
from appliance.protocol.identifiers import AGENT_ID_RULE, agent_id_problem

log = logging.getLogger(__name__)


class Daemon(Requests, LiveContexts, HotReload, Durable, Dormancy):
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
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.device = device
        if engine is None:
            from appliance.engine.runtime import Engine  # llama.cpp only when no other engine is given

            engine = Engine(config.engine.threads or None)
        self.engine: EngineProtocol = engine
        self.clock = clock
        self.wall = wall  # wall-clock time: what the agents' store keeps (it counts across restarts)
        self.store = None  # the agents' store and the disk tier of KV state (attach_durability; None: not kept)
        self.disk = None
        self.stored_responses = {}
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
                                         "kv_restore_bytes": 0, "disk_kv_spills": 0,
                                         **{f"restored_from_{where}": 0 for where in RESTORED_FROM}}
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
        self.requests = RequestLog()  # every request's record (surfaces add them; metrics observe)
        self.requests.observers.append(accesslog.log_request)  # one access log line per request
        self._tasks: set[asyncio.Task[Any]] = set()  # background unloads of retired models
        self._context_lock = asyncio.Lock()  # one claim of a live context at a time (SPEC L8)
        self.context_waiters: list[asyncio.Future[None]] = []  # claims waiting for a context to go idle
        self.adaptive = AdaptiveLoop(self)  # samples, decides and applies each model's tuning (SPEC E1-E5)
        for level, line in offload.startup_notes([(m.name, m.n_gpu_layers) for m in config.models], device.kind,
                                                 engine.gpu_offload):  # asked-for GPU layers that cannot be: loudly
            log.log(logging.WARNING if level == "warning" else logging.INFO, "%s", line)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def background(self, task: asyncio.Task[Any]) -> None:
        """Keep ``task`` until it ends (:meth:`settle` waits for it)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        """The named model's :data:`ModelState`, read from memory (``available`` for one never resolved), or
        ``missing`` for a configured one that is not in memory while its file is not there (looked at now)."""
        model = self.models.get(name)
        state = "available" if model is None else model.state
        if state == "available" and self.missing(name) is not None:
            return "missing"
        return state

    def missing(self, name: str) -> MissingModel | None:
        """The configured model ``name`` when it is not in memory and its file is not there now, else None. Looked
        at every time (a stat): a file put back serves at once, without a reload."""
        model = self.models.get(name)
        if model is not None and model.state != "available":
            return None
        return modelfiles.missing_model(self.config, name, self.engine.file_present)

    def missing_models(self) -> list[MissingModel]:
        """Every configured model that is :meth:`missing` now, in config order (health's ``degraded`` reasons)."""
        found = [self.missing(spec.name) for spec in self.config.models]
        return [model for model in found if model is not None]

    def estimate_parts(self, spec: ModelConfig, placed: Offload | None = None) -> tuple[int, int]:
        """``spec``'s ledger figure (the operator's ``vram_bytes``, else the GGUF table estimate) and the part of it
        that is its live context (KV cache + compute margin), which
        the ledger holds apart and releases while the context is freed (SPEC L8). An operator's ``vram_bytes`` is
        one figure: its context part is 0 (it stays reserved while the model is loaded). With ``placed``, the
        estimate counts only what its offloaded layers put on the device (all of it on a host-RAM device); None
        counts every layer."""
        if spec.vram_bytes is not None:
            return spec.vram_bytes, 0
        shape = gguf_meta.read_model_shape(spec.path)
        table = gguf_meta.estimate(shape, spec.n_ctx, spec.cache_type, offload.ledger_layers(placed))
        return table.total, table.kv + table.compute

    def place(self, spec: ModelConfig) -> Offload:
        """Where ``spec``'s layers run (:func:`appliance.daemon.offload.place`) on this device with this llama.cpp
        build, ``auto`` against the ledger's free bytes now. Blocking (it reads the GGUF): call it off the loop. With
        an operator's ``vram_bytes`` and a layer count, the file is not read (that figure is the estimate)."""
        explicit = spec.vram_bytes is not None and spec.n_gpu_layers is not None
        shape = None if explicit else gguf_meta.read_model_shape(spec.path)
        return offload.place(shape, requested=spec.n_gpu_layers, n_ctx=spec.n_ctx, cache_type=spec.cache_type,
                             device_kind=self.device.kind, build_offloads=self.engine.gpu_offload,
                             free_bytes=max(0, self.ledger.cap - self.ledger.allocated))

    async def acquire(self, model: Model) -> None:
        """Make sure ``model`` is loaded: estimate -> check -> reserve -> load; any failure rolls back (L3)."""
        async with model.lock:
            if model.runtime is not None:
                return
            missing = await asyncio.to_thread(modelfiles.missing_model, self.config, model.key,
                                              self.engine.file_present)
            if missing is not None:  # refused before it is "loading": it stays missing until its file is there
                raise missing.error()
            model.state = "loading"
            interrupted = False
            started = time.perf_counter()
            try:
                model.file = await asyncio.to_thread(file_identity, model.path)  # before the load
                if model.estimate is None or model.spec.n_gpu_layers is None:  # auto: placed for the ledger now
                    model.estimate, model.context_bytes = await asyncio.to_thread(self.tuned_parts, model,
                                                                                  model.spec)
                # A trial load in a child process (llama.cpp aborts on some bad files): off the loop and off
                # the engine thread, before anything is reserved.
                spec = model.spec
                await asyncio.to_thread(self.engine.check, model.path, n_ctx=spec.n_ctx,
                                        n_gpu_layers=model.gpu_layers)
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
                log.info("model %s loaded: estimate %d bytes, %.2f s, %s", model.key, model.estimate,
                         time.perf_counter() - started, offload.loaded_note(model.offload))
                if model.offload is not None and model.offload.cpu_fallback:  # at each load: loudly
                    log.warning("%s", offload.fallback_warning(model.key, model.offload))
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
        model.offload = self.place(spec)
        estimate, context = self.estimate_parts(spec, model.offload)
        if not context:
            return estimate, context
        tuned = self.adaptive.context_bytes(model, self.adaptive.tuner(model).current.pool_cells)
        return estimate - context + tuned, tuned

    def _load(self, model: Model) -> RuntimeProtocol:
        model.baseline = process_bytes(self.device.read())
        runtime = self._engine_load(model, model.spec)
        model.vocabulary = runtime.vocabulary()  # what a stored agent's tokens are checked with after a restart
        return runtime

    def _engine_load(self, model: Model, spec: ModelConfig) -> RuntimeProtocol:
        return self.engine.load(spec.path, n_ctx=spec.n_ctx, n_gpu_layers=model.gpu_layers,
                                live_slots=self.config.engine.live_slots,
                                flash_attention=self.config.engine.flash_attention, cache_type=spec.cache_type,
                                tuning=self.adaptive.tuner(model).current)

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
        """Unregister agents idle past ``agent_idle_ttl_s`` (L11), then unload models idle past their TTL (L7), those
        held only by idle HTTP agents too (they go dormant: dormancy.py); returns the names of the models unloaded."""
        await self.expire_agents()
        await self.drain_retired()
        idle: list[str] = await self.release_idle()
        names = policy.expired([m.view() for m in self.models.values()], self.clock())
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
    async def register(self, agent_id: str, ref: str, owner: object | None = None, *,
                       releases_model: bool = False) -> Agent:
        """Register ``agent_id`` on the model ``ref`` (loaded if need be); ``releases_model``: an HTTP agent, which
        goes dormant once its model idles past its ``idle_ttl_s`` (dormancy.py). Every surface checks the id
        first; this is the last line of defence: an id outside the one rule (:mod:`appliance.protocol.identifiers`) is
        BAD_REQUEST, one agent more than ``max_agents`` (all owners, registrations in progress included) is
        TOO_MANY_AGENTS; the agents already registered are not touched. Once a graceful stop began only a
        request accepted before it (:meth:`accepting`) may still register."""
        if self.closing and not ACCEPTED.get():
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
        model = None
        try:
            model = self.resolve(ref)
            model.registering += 1  # a burst's first step waits for it (burst.gather_wait)
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
            agent = self.agents[agent_id] = Agent(agent_id, model, owner=owner, last_used=self.clock(),
                                                  created=self.wall(), releases_model=releases_model)
            log.info("agent %s registered on model %s%s", agent_id, model.key,
                     "" if owner is None else " (owned by its connection)")
            await self.commit_agent(agent)  # before the reply: a restart brings it back
            return agent
        finally:
            self._claimed.discard(agent_id)
            if model is not None:
                model.registering -= 1

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
        log.info("agent %s unregistered (%s)", agent.id, reason)
        await self.forget_agent(agent)
        if agent.dormant:  # restored and never decoded since: it holds no model
            return
        model.refcount -= 1
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

    # -- device ----------------------------------------------------------------------------------
    def resync(self) -> DeviceReading:
        """Re-read the device and re-base the cap for memory other processes now use (L1)."""
        reading = self.device.read()
        self.reading = reading
        self.external = external_used(reading.used, reading.process_used, self.ledger.allocated)
        self.ledger.set_cap(compute_cap(reading.total, self.config.admission_percent, self.external))
        return reading

    async def close(self, deadline: float | None = None) -> None:
        """Refuse new work, stop running generations at their next token, write the durable agents' KV state to
        disk and commit them until ``deadline`` (``time.monotonic()``; None: no write-out), unload every model, then
        close the store, the engine and the device."""
        self.closing = True
        self.cancel_running()
        await self.adaptive.close()
        await self.settle()
        if deadline is not None:
            try:
                await self.write_out(deadline)
            except Exception:
                log.exception("stop: writing the agents out failed: they re-evaluate their tokens after a restart")
        for model in list(self.models.values()):
            await self.unload(model, reason="shutdown")
        if self.agents:
            kept = sum(durable(agent) for agent in self.agents.values()) if self.store is not None else 0
            log.info("%d agents dropped at shutdown%s", len(self.agents) - kept,
                     f", {kept} kept in the agents store for the next start" if kept else "")
        self.agents.clear()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
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
                            "kv_streams": tuning.streams,  # split KV streams; 0: one pool
                            "cold_cells": runtime.cold_cells, "cold_bytes": model.cold_bytes,
                            "plan": tuning.plan, "threads": tuning.threads,
                            "flash_attention": runtime.flash_attention,
                            "adaptive": self.config.engine.adaptive})
        return records

    def profiles(self) -> dict[str, dict[str, Any]]:
        """Each model's load profile (SPEC E1): counts and percentiles of its sampled requests."""
        return {model.key: model.tuner.profile.summary() for model in self.models.values()
                if model.tuner is not None}

    def snapshot(self) -> dict[str, Any]:
        """Everything STATUS, the admin page and metrics show, read from memory."""
        reading, ledger = self.reading, self.ledger.snapshot()
        unused_missing = [Model(spec) for spec in self.config.models  # configured, never used, its file not there
                          if spec.name not in self.models and self.missing(spec.name) is not None]
        models = [{"name": m.key, "state": self.model_state(m.key), "loaded": m.runtime is not None,
                   "refcount": m.refcount,
                   "estimate_bytes": m.estimate, "measured_bytes": m.measured, "inflight": m.inflight,
                   "decoding": m.decoding,
                   "n_ctx": m.spec.n_ctx, "path": str(m.path), "retired": m.retired,
                   "held_bytes": self.model_bytes(m), "idle_ttl_s": m.spec.idle_ttl_s,
                   "unloads_in_s": policy.unloads_in(m.view(), self.clock()),
                   **offload.record(m.offload)}
                  for m in [*self.models.values(), *unused_missing]]
        agents = [{"id": a.id, "model": a.model.key, "tokens": len(a.conversation.tokens),
                   "state": a.conversation.where, "state_bytes": a.conversation.nbytes,
                   "kv_cells": a.conversation.n_evaluated, "kv_restored_from": a.restored_from,
                   "dormant": a.dormant}
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
                           "flash_attention": self.config.engine.flash_attention,
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
