"""The adaptive loop: the daemon's side of the adaptive engine (SPEC E1-E5). It samples, asks each model's pure
:class:`~appliance.engine.adaptive.Tuner` what its live context should be, and applies the answer through the
engine and the ledger.

* **Sample.** Every finished request of a model becomes a :class:`~appliance.engine.profile.RequestSample` in its
  tuner's profile (:meth:`AdaptiveLoop.observe`); the CPU is read about once a second (:meth:`AdaptiveLoop.tick`:
  ``/proc/stat`` and this process's own ticks).
* **Threads** change in place at the next step (``llama_set_n_threads``), for every loaded model.
* **Pool and plan.** A sampled request may change what the tuner wants. The new context's bytes are reserved under
  :func:`next_key` first (a denial keeps the context as it is); with ``engine.async_switch`` it is built in its own
  engine job beside the live one, and swapped in once no request of the model is in flight (its live
  conversations carried over; a larger pool at once, its requests in flight carried over too); without, the
  model's next request rebuilds it inline before it starts. Then the live context's ledger key takes the new
  figure and the temporary key goes.
* **Queue demand.** A request refused for want of KV cells while a sequence was free (admission blocked on cells)
  tells :meth:`AdaptiveLoop.blocked` what the requests in flight and those waiting need; the tuner then asks for a
  pool that holds them at once (:meth:`~appliance.engine.adaptive.Tuner.queue_demand`). While a grown pool is
  built, the model's requests do not start (they queue); it is swapped in at the next step boundary, the requests
  in flight carried over into it (each sequence's cells, sampler and pending token: they go on where they were),
  and the waiting ones start in it at once.
* **Never more KV than ``n_ctx``.** A context is built beside the live one only when both together, with the
  model's host buffers (parked states, reuse buffers, the buffer a move copies through), hold at most the model's
  ``n_ctx`` cells (:func:`~appliance.engine.tuning.builds_beside`); otherwise the live conversations are parked
  in host RAM and the live context freed before the new one is built (``runtime.rebuild``), its ledger figure
  replaced in place. A growth goes no larger than what one of the two can build within ``n_ctx`` cells with the
  conversations and host buffers there are now (:func:`~appliance.engine.tuning.growth_ceiling`, before each
  retune): past it the pool stays, and the conversations it does not hold are parked in turn.
* **Cold path.** A request longer than the hot pool first grows the hot pool to hold it (:meth:`AdaptiveLoop.
  grow_for`); only where that is not possible (the ledger denies it, or ``engine.async_switch: false``) it reserves
  a one-sequence context of its size under :func:`cold_key` (one at a time per model), runs there, and the key is
  released when it ends.
* **Warm-up** (E5): ``engine.warmup_runs`` short generations seed a newly loaded model's profile, in their own
  engine queue and only while no request of the model is in flight; health says ``warming`` meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from appliance.daemon import offload
from appliance.daemon.model import Model, cold_key, context_key, next_key
from appliance.engine import gguf_meta, tuning
from appliance.engine.adaptive import POOL_GRANULARITY, CpuShare, Settings, Tuner, Tuning, cpu_share
from appliance.engine.interface import GREEDY, Conversation, EngineProtocol
from appliance.engine.profile import RequestSample
from appliance.errors import ApplianceError

if TYPE_CHECKING:
    from appliance.config.validate import Config
    from appliance.daemon.ledger import Ledger

log = logging.getLogger(__name__)

CPU_INTERVAL_S = 1.0
"""How often :meth:`AdaptiveLoop.tick` reads the CPU."""
SWITCH_POLL_S = 0.02
"""How often a prepared context looks whether its model's requests in flight have ended."""
WARMUP_TOKENS = 8
WARMUP_SHARES = (0.125, 0.25, 0.5, 0.75)
"""Prompt lengths the warm-up runs cycle through, in tokens, as shares of the first plan boundary
(``engine.plan_boundaries``; 16, 32, 64 and 96 tokens at the default 128): short agent turns, every one within plan
S, the plan a model starts with, so synthetic prompts never pick a larger plan. (They were 8 to 64 words: 129 tokens
at a real vocabulary's two a word, 257 with the demo model's, and their P90 rebuilt every model's first context
with plan M, twice plan S's compute buffer.)"""


class Owner(Protocol):
    """What the loop uses of the daemon that owns it (:class:`appliance.daemon.core.Daemon`)."""

    config: Config
    engine: EngineProtocol
    ledger: Ledger
    models: dict[str, Model]
    counters: dict[str, int]
    closing: bool

    def fit_host_kv(self, reserve: int = 0) -> list[str]: ...


def read_cpu() -> tuple[tuple[int, ...], int]:
    """``/proc/stat``'s aggregate counters and this process's user + system clock ticks (``/proc/self/stat``)."""
    with open("/proc/stat") as fh:
        counters = tuning.parse_proc_stat(fh.read())
    with open("/proc/self/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return counters, int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by the cgroup v2 quota (``cpu.max``) if any."""
    affinity = len(os.sched_getaffinity(0))
    quota: int | None = None
    period: int | None = None
    with contextlib.suppress(OSError, ValueError), open("/sys/fs/cgroup/cpu.max") as fh:
        quota, period = tuning.parse_cpu_max(fh.read())
    return tuning.usable_cores(affinity, quota, period)


@dataclass(frozen=True)
class KvCells:
    """One reading of a model's KV cells (:func:`kv_cells`): what each live conversation holds, or will hold by the
    end of its request in flight (``live``: a growth happens once the requests in flight ended, or carries them
    over), what they hold now (``evaluated``), and the host buffers: parked states and reuse buffers."""

    live: tuple[int, ...]
    evaluated: int
    parked: int
    reused: int

    @property
    def held(self) -> int:
        """What a context built beside the live one finds held in host RAM, in cells: the host buffers and the
        buffer the move copies its largest live conversation through."""
        return self.parked + self.reused + max(self.live, default=0)


def kv_cells(runtime: Any) -> KvCells:
    """``runtime``'s :class:`KvCells` now (a snapshot, safe off the engine thread)."""
    needs = {id(request.conv): request.need for request in list(runtime.slots.requests.values())}
    live = runtime.live
    parked, reused = runtime.slots.host_cells()
    return KvCells(tuple(max(conv.n_evaluated, needs.get(id(conv), 0)) for conv in live),
                   sum(conv.n_evaluated for conv in live), parked, reused)


def log_failure(job: asyncio.Future[Any]) -> None:
    if not job.cancelled() and job.exception() is not None:
        log.error("adaptive engine: an engine job failed", exc_info=job.exception())


def warmup_tokens(index: int, boundary: int) -> int:
    """The prompt tokens (BOS included) of warm-up run ``index`` under a first plan boundary of ``boundary``."""
    return max(2, int(boundary * WARMUP_SHARES[index % len(WARMUP_SHARES)]))


def warmup_prompt(runtime: Any, tokens: int) -> str:
    """``warmN`` words, as many as fit in ``tokens`` prompt tokens (BOS included) on ``runtime``'s vocabulary, at
    least one (engine thread: it tokenizes)."""
    per_word = max(1, len(runtime.tokenize(" warm0", bos=False)))
    words = max(1, (tokens - 1) // per_word)
    return " ".join(f"warm{n % 10}" for n in range(words))


def warm_up_run(runtime: Any, tokens: int) -> Any:
    """One warm-up generation of a ``tokens``-token prompt (engine thread): :meth:`warm_up`'s request or None."""
    return runtime.warm_up(warmup_prompt(runtime, tokens), WARMUP_TOKENS, GREEDY)


def fitted(daemon: Any, move: Callable[..., list[Conversation] | None], *args: Any,
           **kwargs: Any) -> tuple[list[Conversation] | None, list[str]]:
    """On the engine thread: ``move`` (a context switch or rebuild, which may park conversations in host RAM), then
    the host KV fitted in the same job (``daemon.fit_host_kv``: to ``host_kv_budget``, and to what the new pool
    leaves of ``n_ctx``), so that nothing reads the parked states over either between the two. Returns what ``move``
    returned (None: nothing changed) and the agents whose parked state was dropped."""
    parked = move(*args, **kwargs)
    if parked is None:  # nothing changed: host RAM holds what it held, beside the same pool
        return parked, []
    return parked, daemon.fit_host_kv()


def rebuilt(daemon: Any, model: Model, runtime: Any, wanted: Tuning, *,
            carry: bool) -> tuple[list[Conversation] | None, list[str]]:
    """On the engine thread: ``runtime.rebuild`` (:func:`fitted`), host RAM first made room in for the states of the
    idle conversations it parks (their exact sizes), so that the parked states never pass ``host_kv_budget`` nor
    ``model``'s share of ``n_ctx``, not even between the park and the fit."""
    slots = runtime.slots
    dropped: list[str] = []
    if runtime.context is not None and (carry or not slots.busy):
        idle = [seq_id for seq_id in list(slots.holders) if seq_id not in slots.requests]
        reserve = sum(slots.context.state_size(seq_id) for seq_id in idle)
        dropped = daemon.fit_host_kv(reserve, model)
    parked, more = fitted(daemon, runtime.rebuild, wanted, carry=carry)
    return parked, dropped + more


class AdaptiveLoop:
    """Samples, decides and applies for every model of ``daemon`` (module docstring). Event loop only."""

    def __init__(self, daemon: Owner) -> None:
        self.daemon = daemon
        self.cores = usable_cores()
        self.cpu: CpuShare | None = None
        self._last: tuple[tuple[int, ...], int] | None = None
        self.warming: set[str] = set()
        self.switches = 0
        self.colds = 0
        self.draining: set[str] = set()  # models whose requests wait to start while a grown pool is swapped in
        self.tasks: set[asyncio.Task[Any]] = set()  # warm-ups running

    async def close(self) -> None:
        """Stop the warm-ups and retunes in progress (shutdown)."""
        tasks = [*self.tasks, *(m.retuning for m in self.daemon.models.values() if m.retuning is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- settings --------------------------------------------------------------------------------------
    def settings(self) -> Settings:
        engine = self.daemon.config.engine
        return Settings(
            adaptive=engine.adaptive,
            window_size=engine.adaptive_window_size,
            sample_rate=engine.adaptive_sample_rate,
            hot_pool_slack=engine.hot_pool_slack,
            plan_boundaries=engine.plan_boundaries,
            thread_idle_thresholds=engine.thread_idle_thresholds,
            fixed_threads=self.fixed_threads(engine.threads),
            pinned_threads=engine.threads > 0,
            live_slots=engine.live_slots,
        )

    def fixed_threads(self, configured: int) -> int:
        """``engine.threads`` (0: the engine's default count), never more than the usable cores (logged when cut:
        more threads than cores only make every decode wait for the slowest)."""
        wanted = configured or self.daemon.engine.n_threads
        if wanted <= self.cores:
            return wanted
        log.warning("engine.threads: %d threads asked, %d usable cores: decoding with %d", wanted, self.cores,
                    self.cores)
        return self.cores

    def tuner(self, model: Model) -> Tuner:
        """``model``'s tuner (made on first use, with the current settings)."""
        if model.tuner is None:
            model.tuner = Tuner(self.settings(), model.spec.n_ctx, self.cores)
        return model.tuner

    def reconfigure(self) -> None:
        """The config changed (a reload): every tuner takes the new settings; loaded models are retuned."""
        settings = self.settings()
        for model in list(self.daemon.models.values()):
            if model.tuner is None:
                continue
            model.tuner.reconfigure(settings, model.spec.n_ctx)
            if model.runtime is not None:
                self.schedule(model)

    # -- engine settings held by a connection (TUNE) ------------------------------------------------------
    def keep_tuners(self) -> dict[str, Tuner | None]:
        """A copy of every model's tuner as it is now (None: it has none yet): its load profile and its context's
        tuning, for :meth:`restore_tuners` once the engine settings a connection holds with TUNE are let go."""
        return {key: copy.deepcopy(model.tuner) for key, model in self.daemon.models.items()}

    async def restore_tuners(self, kept: dict[str, Tuner | None]) -> None:
        """Put back the tuners :meth:`keep_tuners` copied, under the settings in force now: what the held settings'
        load taught the profiles goes, and each loaded model's context is retuned to what its own profile says (its
        pool and plan as they were, when the file did not change meanwhile)."""
        settings = self.settings()
        for key, tuner in kept.items():
            model = self.daemon.models.get(key)
            if model is None:
                continue
            while model.retuning is not None and not model.retuning.done():  # it applies to the tuner it found
                await asyncio.gather(model.retuning, return_exceptions=True)
            if tuner is not None:
                tuner.reconfigure(settings, model.spec.n_ctx)
            model.tuner = tuner
            if model.runtime is not None:
                self.schedule(model)
        log.info("adaptive engine: the load profiles are back as they were before the held engine settings")

    # -- ledger figures ---------------------------------------------------------------------------------
    def context_bytes(self, model: Model, cells: int) -> int:
        """The ledger figure of a context of ``cells`` KV cells for ``model`` (the KV cache of the layers its
        placement offloads + compute margin); 0 with an operator's ``vram_bytes`` (that one figure covers every
        context)."""
        spec = model.spec
        if spec.vram_bytes is not None:
            return 0
        if model.shape is None:
            model.shape = gguf_meta.read_model_shape(spec.path)
        table = gguf_meta.estimate(model.shape, cells, spec.cache_type, offload.ledger_layers(model.offload))
        return table.kv + table.compute

    def reserve(self, key: str, nbytes: int) -> None:
        """Reserve ``nbytes`` under ``key`` (nothing for 0: an operator's ``vram_bytes`` covers every context)."""
        if nbytes:
            self.daemon.ledger.try_reserve(key, nbytes)

    # -- the model's KV memory, in cells (never more than the fixed strategy's n_ctx) --------------------------
    def growth_ceiling(self, model: Model, runtime: Any, cells: KvCells) -> int:
        """The largest pool a growth of ``model``'s may build now (:func:`~appliance.engine.tuning.growth_ceiling`
        on its live conversations and host buffers, as ``cells`` read them)."""
        return tuning.growth_ceiling(max(runtime.pool_cells, 1), model.spec.n_ctx, live=sum(cells.live),
                                     largest=max(cells.live, default=0), parked=cells.parked, reused=cells.reused,
                                     granularity=POOL_GRANULARITY)

    # -- sampling ---------------------------------------------------------------------------------------
    def observe(self, model: Model, request: Any) -> None:
        """A request of ``model`` ended (loop side): its sample goes to the profile; a sampled one may retune."""
        generation = request.generation
        if generation is None or request.error is not None or generation.stop_reason == "cancelled":
            return
        ttft = generation.ttft_s if generation.ttft_s is not None else generation.elapsed_s
        sample = RequestSample(
            input_tokens=request.prompt_tokens,
            output_tokens=generation.generated_tokens,
            prompt_evaluated=generation.prompt_evaluated or 0,
            ttft_s=max(0.0, ttft),
            decode_s=max(0.0, generation.elapsed_s - ttft),
            kv_cells_used=request.conv.n_evaluated,
            kv_cells_peak=request.demand,
            live_sequences=request.live_sequences,
            threads=request.threads,
            queue_length=model.admission.waiting,
            burst_tokens=request.burst_tokens,
            kv_cells_need=request.need,
        )
        if self.tuner(model).observe(sample):
            self.schedule(model)

    def blocked(self, model: Model, demand: int) -> None:
        """Admission of ``model`` is blocked on cells: its requests in flight and those waiting need ``demand``
        cells. Grow its pool now when its tuner says so."""
        if model.runtime is None or not self.tuner(model).queue_demand(demand):
            return
        log.info("model %s: requests wait for KV cells (%d needed in flight and waiting, pool %d): growing the pool",
                 model.key, demand, model.runtime.pool_cells)
        self.schedule(model)

    def short_of_streams(self, model: Model, wanted: int) -> None:
        """Every stream of ``model``'s split context is busy and ``wanted`` requests want one (in flight and
        waiting): more streams now when its tuner says so."""
        tuner = self.tuner(model)
        floor = tuner.stream_floor
        if model.runtime is None or not tuner.stream_demand(wanted):
            return
        if tuner.stream_floor > floor:
            log.info("model %s: %d requests want a KV stream, the context has %d: more streams", model.key, wanted,
                     model.runtime.tuning.streams)
        self.schedule(model)

    async def grow_for(self, model: Model, cells: int) -> bool:
        """A request of ``model`` needs ``cells`` cells, more than its hot pool: grow the hot pool to hold it (no
        cold context beside it). True when the pool now holds it; False when the tuner, the ledger or
        ``engine.async_switch: false`` (the growth would wait for the next request) leave it smaller."""
        runtime = model.runtime
        if runtime is None or not self.daemon.config.engine.async_switch:
            return False
        if not self.tuner(model).queue_demand(cells):
            return False
        self.schedule(model)
        while model.retuning is not None and not model.retuning.done():
            await asyncio.gather(model.retuning, return_exceptions=True)
        return model.runtime is runtime and runtime.seq_cells >= cells

    def tick(self) -> None:
        """Read the CPU (every :data:`CPU_INTERVAL_S`) and move every loaded model's threads if their tuner says so."""
        reading = read_cpu()
        last, self._last = self._last, reading
        if last is None:
            return
        try:
            self.cpu = cpu_share(last[0], reading[0], reading[1] - last[1], os.cpu_count() or 1)
        except ValueError:  # no time passed between the two readings
            return
        for model in list(self.daemon.models.values()):
            if model.runtime is not None and model.tuner is not None and model.tuner.settings.adaptive:
                self.schedule(model, threads_only=True)

    async def run_ticks(self) -> None:
        """:meth:`tick` every :data:`CPU_INTERVAL_S` until cancelled."""
        while True:
            try:
                self.tick()
            except Exception:
                log.exception("adaptive engine: the CPU reading failed")
            await asyncio.sleep(CPU_INTERVAL_S)

    # -- applying ---------------------------------------------------------------------------------------
    def schedule(self, model: Model, *, threads_only: bool = False) -> None:
        """Retune ``model`` in the background (one retune at a time per model: one asked for meanwhile runs after
        it, a CPU tick's threads-only one excepted, as the next tick asks again)."""
        if self.daemon.closing:
            return
        if model.retuning is not None and not model.retuning.done():
            model.retune_again = model.retune_again or not threads_only
            return
        model.retuning = asyncio.get_running_loop().create_task(self.retune(model, threads_only=threads_only))

    async def retune(self, model: Model, *, threads_only: bool = False) -> None:
        try:
            await self._retune(model, threads_only)
        except ApplianceError as exc:
            log.warning("model %s: retune failed: %s", model.key, exc)
        except Exception:
            log.exception("model %s: retune failed", model.key)
        finally:
            if model.retune_again:
                model.retune_again = False
                model.retuning = None
                self.schedule(model)

    async def _retune(self, model: Model, threads_only: bool) -> None:
        runtime = model.runtime
        if runtime is None or not runtime.has_context:
            return
        tuner = self.tuner(model)
        tuner.splits = runtime.splits
        cells = kv_cells(runtime)
        if not threads_only:
            runtime.slots.keep_buffers = not tuner.settings.adaptive  # no second copy of a conversation in host RAM
            tuner.limit(self.growth_ceiling(model, runtime, cells))
        wanted = tuner.decide(cells.evaluated, self.cpu)
        current = runtime.tuning
        if wanted.threads != current.threads:
            await self.daemon.engine.call(runtime.set_threads, wanted.threads, queue=("tune", model.key))
            log.debug("model %s: %d threads (CPU share %.0f%% of %d cores)", model.key, wanted.threads,
                     self.cpu.percent if self.cpu else 100.0, self.cores)
        tuner.applied(replace(current, threads=wanted.threads))
        if threads_only or replace(wanted, threads=current.threads) == current:
            return
        if self.daemon.config.engine.async_switch:
            await self.switch(model, wanted)
        else:
            model.pending = wanted  # the next request rebuilds it inline (apply_pending)

    async def switch(self, model: Model, wanted: Tuning) -> bool:
        """Build ``wanted``'s context beside the live one, then swap it in: a larger pool at once, the requests in
        flight carried over (they go on from where they are), another once the model has no request in flight.
        False when the ledger denies it or the model's context went away meanwhile."""
        daemon = self.daemon
        runtime = model.runtime
        if runtime is None:
            return False
        # A larger pool, or the other layout (split streams or one pool), takes the requests in flight with it when
        # it holds them; any other waits until none is in flight.
        changes = wanted.pool_cells > runtime.pool_cells or wanted.streams != runtime.tuning.streams
        grow = changes and runtime.carries(wanted)
        if not tuning.builds_beside(runtime.pool_cells, wanted.pool_cells, model.spec.n_ctx,
                                    kv_cells(runtime).held):
            return await self.rebuild(model, wanted, drain=grow)
        nbytes = self.context_bytes(model, wanted.pool_cells)
        key = next_key(model.key)
        try:
            self.reserve(key, nbytes)
        except ApplianceError:
            log.info("model %s: a %d-cell pool (%d bytes) does not fit in the ledger now; kept %d cells",
                     model.key, wanted.pool_cells, nbytes, runtime.tuning.pool_cells)
            return False
        switched = False
        try:
            started = time.perf_counter()
            await daemon.engine.call(runtime.prepare, wanted, queue=("tune", model.key))
            prepared = time.perf_counter() - started
            if grow:
                self.draining.add(model.key)  # the requests waiting start in the grown pool, not before it
            while True:
                if model.runtime is not runtime or runtime.prepared is None or not runtime.has_context:
                    return False  # unloaded, or its context freed meanwhile
                if self.tuner(model).held_floor() > wanted.pool_cells:
                    return False  # more requests wait for cells than it was built for: the next retune builds it
                if grow or not runtime.slots.busy:  # a grown pool takes the requests in flight with it
                    parked, dropped = await daemon.engine.call(fitted, daemon, runtime.switch, carry=grow,
                                                               queue=("tune", model.key))
                    if parked is not None:
                        break
                await asyncio.sleep(SWITCH_POLL_S)  # requests in flight: look again soon
            daemon.counters["host_kv_drops"] += len(dropped)
            switched = True
            self._installed(model, wanted, nbytes, parked)
            log.info("model %s: context now %d cells, plan %s (built in %.0f ms beside the live one)", model.key,
                     wanted.pool_cells, wanted.plan, prepared * 1000)
            return True
        finally:
            self.undrain(model)
            if not switched:
                daemon.ledger.release(key)
                if model.runtime is runtime:
                    job = daemon.engine.submit(runtime.drop_prepared, queue=("tune", model.key))
                    asyncio.ensure_future(job).add_done_callback(log_failure)

    async def rebuild(self, model: Model, wanted: Tuning, *, drain: bool) -> bool:
        """Replace ``model``'s live context with ``wanted``'s without the two ever existing at once: its idle
        conversations are parked, it is freed and the new one built (``runtime.rebuild``). With ``drain`` (a
        growth) no request starts meanwhile and the requests in flight are carried over (lifted to host RAM, then
        go on in the new one); without, it waits until no request is in flight. The context's ledger figure is
        replaced in place first; False when the ledger denies the new one (the old one stays) or the context went
        away meanwhile."""
        daemon = self.daemon
        runtime = model.runtime
        if runtime is None:
            return False
        nbytes = self.context_bytes(model, wanted.pool_cells)
        key = context_key(model.key)
        if drain:
            self.draining.add(model.key)
        try:
            while True:
                if model.runtime is not runtime or not runtime.has_context:
                    return False
                if runtime.slots.busy and not drain:
                    await asyncio.sleep(SWITCH_POLL_S)  # requests in flight: look again soon
                    continue
                floor = min(self.tuner(model).held_floor(), model.spec.n_ctx)  # more may wait now than at first
                if floor > wanted.pool_cells:
                    wanted = replace(wanted, pool_cells=floor, streams=0)  # a floor is one pool's demand
                    nbytes = self.context_bytes(model, wanted.pool_cells)
                old = daemon.ledger.release(key)
                try:
                    self.reserve(key, nbytes)
                except ApplianceError:
                    self.reserve(key, old)  # just released: it fits again
                    log.info("model %s: a %d-cell pool (%d bytes) does not fit in the ledger now; kept %d cells",
                             model.key, wanted.pool_cells, nbytes, runtime.tuning.pool_cells)
                    return False
                try:
                    started = time.perf_counter()
                    parked, dropped = await daemon.engine.call(rebuilt, daemon, model, runtime, wanted, carry=drain,
                                                               queue=("tune", model.key))
                except BaseException:
                    daemon.ledger.release(key)
                    if runtime.has_context:
                        self.reserve(key, old)
                    raise
                if parked is not None:
                    break
                daemon.ledger.release(key)
                if not runtime.has_context:  # freed meanwhile (another model's context took its place): no key
                    return False
                self.reserve(key, old)  # a request started meanwhile: the old figure until it ends
            daemon.counters["host_kv_drops"] += len(dropped)
            self._record(model, wanted, nbytes, parked)
            log.info("model %s: context now %d cells, plan %s (rebuilt in place in %.0f ms, %d conversations parked)",
                     model.key, wanted.pool_cells, wanted.plan, (time.perf_counter() - started) * 1000, len(parked))
            return True
        finally:
            self.undrain(model)

    def undrain(self, model: Model) -> None:
        """``model``'s requests may start again: the ones waiting try now."""
        if model.key not in self.draining:
            return
        self.draining.discard(model.key)
        waiters, model.waiters = model.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def apply_pending(self, model: Model) -> None:
        """``async_switch: false``: rebuild the model's context now, inline (its next request waits for it)."""
        wanted = model.pending
        runtime = model.runtime
        if wanted is None or runtime is None or runtime.busy or not runtime.has_context:
            return
        model.pending = None
        if not tuning.builds_beside(runtime.pool_cells, wanted.pool_cells, model.spec.n_ctx,
                                    kv_cells(runtime).held):
            await self.rebuild(model, wanted, drain=False)  # the live context freed first: no peak above n_ctx
            return
        nbytes = self.context_bytes(model, wanted.pool_cells)
        key = next_key(model.key)
        try:
            self.reserve(key, nbytes)
        except ApplianceError:
            log.info("model %s: a %d-cell pool does not fit in the ledger now", model.key, wanted.pool_cells)
            return
        try:
            parked, dropped = await self.daemon.engine.call(fitted, self.daemon, runtime.retune, wanted,
                                                            queue=("tune", model.key))
        except BaseException:
            self.daemon.ledger.release(key)
            raise
        if parked is None:
            self.daemon.ledger.release(key)
            model.pending = wanted
            return
        self.daemon.counters["host_kv_drops"] += len(dropped)
        self._installed(model, wanted, nbytes, parked)
        log.info("model %s: context rebuilt inline: %d cells, plan %s", model.key, wanted.pool_cells, wanted.plan)

    def _installed(self, model: Model, wanted: Tuning, nbytes: int, parked: list[Conversation]) -> None:
        """The context built for ``wanted`` is live: its ledger key takes the temporary key's bytes."""
        ledger = self.daemon.ledger
        ledger.release(context_key(model.key))
        if nbytes:
            ledger.rename(next_key(model.key), context_key(model.key))
        else:
            ledger.release(next_key(model.key))
        self._record(model, wanted, nbytes, parked)

    def _record(self, model: Model, wanted: Tuning, nbytes: int, parked: list[Conversation]) -> None:
        """The model's estimate, tuner and counters after its context became ``wanted``'s (``nbytes`` in the
        ledger)."""
        weights = (model.estimate or 0) - model.context_bytes
        model.context_bytes = nbytes
        model.estimate = weights + nbytes
        self.tuner(model).applied(wanted)
        self.switches += 1
        self.daemon.counters["kv_swaps"] += len(parked)

    # -- the cold path ------------------------------------------------------------------------------------
    async def open_cold(self, model: Model, cells: int) -> None:
        """Reserve and build ``model``'s cold context of ``cells`` cells (the caller holds ``model.cold_lock``)."""
        runtime = model.runtime
        if runtime is None:
            raise ApplianceError("INTERNAL", f"model {model.key!r} is not loaded")
        cells = min(tuning.round_up(cells, POOL_GRANULARITY), max(model.spec.n_ctx, cells))
        nbytes = self.context_bytes(model, cells)
        key = cold_key(model.key)
        self.reserve(key, nbytes)
        try:
            await self.daemon.engine.call(runtime.open_cold, cells, queue=("tune", model.key))
        except BaseException:
            self.daemon.ledger.release(key)
            raise
        model.cold_bytes = nbytes
        self.colds += 1
        log.info("model %s: cold context of %d cells for a long request (%d bytes)", model.key, cells, nbytes)

    def close_cold(self, model: Model) -> asyncio.Future[Any]:
        """The cold request ended (its context was freed in the step that ended it) or never started (its context
        is freed by an engine job queued now): release its bytes. Returns the engine job that then fits the host
        KV budget (the cold conversation was parked beside the others): the caller awaits it before replying, so
        that no reader sees parked state over the budget."""
        runtime = model.runtime
        if runtime is not None and runtime.cold_cells:
            job = self.daemon.engine.submit(runtime.close_cold, queue=("tune", model.key))
            asyncio.ensure_future(job).add_done_callback(log_failure)
        self.daemon.ledger.release(cold_key(model.key))
        model.cold_bytes = 0
        job = asyncio.ensure_future(self.daemon.engine.submit(self.daemon.fit_host_kv, queue=("tune", model.key)))
        job.add_done_callback(self._count_drops)
        return job

    def _count_drops(self, job: asyncio.Future[Any]) -> None:
        log_failure(job)
        if not job.cancelled() and job.exception() is None:
            self.daemon.counters["host_kv_drops"] += len(job.result())

    # -- warm-up (E5) -----------------------------------------------------------------------------------
    def start_warmup(self, model: Model) -> None:
        runs = self.daemon.config.engine.warmup_runs
        if runs <= 0 or not self.daemon.config.engine.adaptive or model.runtime is None:
            return
        self.warming.add(model.key)
        task = asyncio.get_running_loop().create_task(self.warm_up(model, runs))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def warm_up(self, model: Model, runs: int) -> int:
        """``runs`` short generations on a throwaway conversation seed ``model``'s profile; returns those that
        ran (one is skipped while a request of the model is in flight, and one whose prompt does not fit a small
        ``n_ctx``)."""
        done = 0
        try:
            for index in range(runs):
                runtime = model.runtime
                if runtime is None or self.daemon.closing:
                    break
                try:
                    tokens = warmup_tokens(index, self.daemon.config.engine.plan_boundaries[0])
                    request = await self.daemon.engine.call(warm_up_run, runtime, tokens, queue=("warmup", model.key))
                except ApplianceError as exc:
                    if exc.code != "CONTEXT_OVERFLOW":
                        raise
                    log.debug("model %s: warm-up run %d skipped: its prompt does not fit n_ctx %d", model.key,
                              index, model.spec.n_ctx)
                    continue
                if request is None:
                    continue
                self.tuner(model).seed(RequestSample(
                    input_tokens=request.prompt_tokens, output_tokens=request.generation.generated_tokens,
                    prompt_evaluated=request.generation.prompt_evaluated or 0,
                    ttft_s=request.generation.ttft_s or 0.0,
                    decode_s=max(0.0, request.generation.elapsed_s - (request.generation.ttft_s or 0.0)),
                    kv_cells_used=request.need, kv_cells_peak=request.demand,
                    live_sequences=request.live_sequences, threads=request.threads, queue_length=0,
                    kv_cells_need=request.need))
                done += 1
            if done:
                self.schedule(model)
        finally:
            self.warming.discard(model.key)
        log.info("model %s: %d warm-up runs seeded its profile", model.key, done)
        return done
