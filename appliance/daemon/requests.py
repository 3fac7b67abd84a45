"""Requests and the step loop: the Daemon's part that runs every generation (SPEC L9, L10), stateful
(:meth:`Requests.decode`) or stateless (:meth:`Requests.complete`), counts a prompt's tokens and embeds texts.

The live context's ``engine.live_slots`` sequences hold its agents' conversations, decoded together by the model's
step loop (:meth:`Requests._steps`); a request that finds them all busy waits its turn
(:class:`~appliance.daemon.admission.Admission`), and a suspended agent's KV state waits in host RAM, within
``host_kv_budget`` (:meth:`Requests._fit_host_kv`, policy: :mod:`appliance.daemon.hostkv`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, cast

from appliance.daemon import burst, hostkv, offload, policy
from appliance.daemon.admission import ShortOfCells, ShortOfStreams
from appliance.daemon.base import DaemonBase, finish, log
from appliance.daemon.devices import process_bytes
from appliance.daemon.model import (
    Agent,
    DecodeResult,
    Model,
    buffer_bytes,
    cold_key,
    context_key,
    embedding_key,
    forget_parked,
    next_key,
)
from appliance.engine import gguf_meta, wakeups
from appliance.engine.embedding import Embeddings, context_size
from appliance.engine.interface import GREEDY, Conversation, Generation, PromptText, Sampling, Token
from appliance.engine.prompts import PromptVocabulary, tokenize_prompt
from appliance.engine.slots import ColdNeeded, Request
from appliance.engine.worker import DEFAULT_QUEUE, jobs_waiting, others_waiting
from appliance.errors import ApplianceError

ACCEPTED: contextvars.ContextVar[bool] = contextvars.ContextVar("appliance_accepted", default=False)
"""Set while a task runs inside :meth:`Requests.accepting`."""

STEPS_AHEAD = 2
"""Step jobs a model keeps queued on the engine thread while its requests are in flight (the one running, the
next)."""

WAIT_TURN = object()
"""What a request's start returns when others already wait for a sequence of its model (it queues behind them)."""
DRAINING = object()
"""What a request's start returns while a grown pool is about to replace the live one (it starts in the new one)."""


def first_step(runtime: Any, cancelled: bool = False) -> None:
    """On the engine thread, right after a request started: its first step (its prompt and first token) in the
    same engine job when no other job waits on the engine (nothing that could join that step: the step loop keeps a
    step queued while requests are in flight, so a request that arrives then joins the others' next step). A
    1-token request ends here: one engine job from its start to its end. A request ``cancelled`` before it started
    (its caller left, the stop's grace is over) always steps here: it is reaped at once, before any job queued
    behind it (an unload) could end it otherwise. A step's failure is its requests' (they ended with it): anything
    else is logged, as the step loop does, and the step loop goes on."""
    if jobs_waiting() != 0 and not cancelled:
        return
    try:
        runtime.step()
    except Exception:
        log.exception("a decode step failed")


def gathers(model: Model, runtime: Any, request: Request, began: float) -> bool:
    """On the engine thread, as ``request`` starts (its start began at ``began``, before any park it made): whether
    its first step waits for the step loop, which waits until ``model.gather_until`` (:mod:`~appliance.daemon.burst`)
    so that requests arriving meanwhile join that step. A request opens the window when it starts alone in the hot
    pool and its prompt is long enough (:func:`~appliance.daemon.burst.gather_window`); one whose start began while
    the window was open joins it and extends it (:func:`~appliance.daemon.burst.extended`)."""
    now = time.monotonic()
    if began < model.gather_until:
        model.gather_until = burst.extended(model.gather_until, model.gather_limit, now, model.gather_window)
        return True
    if request.cold or len(runtime.slots.requests) != 1:
        return False
    expected = runtime.slots.pace.seconds(request.evaluated)
    window = burst.gather_window(expected)
    if window <= 0:
        return False
    model.gather_window = window
    model.gather_opened = began
    model.gather_limit = began + burst.gather_span(expected)
    model.gather_until = max(now, min(model.gather_limit, now + window))
    return True


def steps(runtime: Any) -> None:
    """On the engine thread, one step job: a step, and more while the runtime has requests in flight and no job of
    another engine queue waits (a request starting, another model's step, a load: it runs between two steps as
    before, when this job makes way). Each step's tokens go to the loop as the step ends (:func:`wakeups.flush`),
    so a stream gets every step's tokens as they come; the loop is not asked for each next step."""
    runtime.step()
    while runtime.busy and not others_waiting():
        wakeups.flush()
        runtime.step()


def held_states(agents: list[Agent], parking: Conversation | None) -> list[hostkv.HeldState]:
    """The host buffers of ``agents`` as the budget sees them, but that of the conversation being parked (its
    reserve stands for it)."""
    states = [agent.held() for agent in agents if agent.conversation is not parking]
    return [state for state in states if state is not None]


def bytes_per_token(model: Model, agents: list[Agent]) -> int:
    """The largest bytes-per-token ratio of ``model``'s saved states: its swaps' (``kv_bytes_per_token``) and that
    of every state its ``agents`` hold in host RAM now (one read back from disk was not saved by this process)."""
    ratios = [hostkv.per_token(agent.conversation.nbytes, agent.conversation.n_evaluated) for agent in agents
              if agent.conversation.where == "host"]
    return max([model.kv_bytes_per_token, *ratios])


def conversation_cells(agents: list[Agent]) -> list[int]:
    """The KV cells of each of ``agents``' conversations that holds some, wherever they are (live, parked or on
    disk): what the fixed strategy would hold of them, in its context or parked."""
    kept = ("device", "host", "disk")
    return [agent.conversation.n_evaluated for agent in agents if agent.conversation.where in kept]


async def gathered(model: Model) -> None:
    """Wait until the model's burst window (:func:`gathers`) is over, extensions, the starts still queued and the
    agents still being registered included (:func:`~appliance.daemon.burst.gather_wait`)."""
    while True:
        delay = burst.gather_wait(time.monotonic(), model.gather_until, model.gather_opened,
                                  model.starting + model.registering)
        if delay <= 0:
            return
        await asyncio.sleep(delay)


async def started(job: asyncio.Future[Any], cancel: threading.Event | None) -> Any:
    """:func:`~appliance.daemon.base.finish` for a request's start: a caller cancelled meanwhile sets ``cancel``
    first, so that a first step taken in the start's job (held by a paused stream) ends at its next token."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        if cancel is not None:
            cancel.set()
        with contextlib.suppress(Exception):
            await job
        raise


class Requests(DaemonBase):
    """Requests and the step loop of a :class:`~appliance.daemon.core.Daemon` (module docstring)."""

    async def decode(self, agent_id: str, n_tokens: int, prompt: PromptText, sampling: Sampling = GREEDY,
                     on_token: Callable[[Token], None] | None = None,
                     cancel: threading.Event | None = None,
                     on_result: Callable[[DecodeResult], None] | None = None) -> DecodeResult:
        """A request in agent ``agent_id``'s conversation. ``on_result`` (see :meth:`_run`) is called once the
        finished turn is committed to the store: a durable agent's reply never comes before its commit."""
        with self.accepting():
            agent = self.agent(agent_id)
            async with agent.lock:
                if self.agents.get(agent_id) is not agent:
                    raise ApplianceError("UNKNOWN_AGENT", f"no agent {agent_id!r}", {"agent": agent_id})
                agent.last_used = self.clock()  # the most recently used: the last whose parked state is dropped
                if agent.dormant:  # restored at start-up: its model loads now
                    await self.rouse(agent)
                try:
                    result = await self._run(agent.model, agent.conversation, agent, n_tokens, prompt, sampling,
                                             on_token, cancel, queue=("agent", agent_id))
                finally:
                    agent.last_used = self.clock()
                agent.restored_from = result.restored_from
                if result.generation.stop_reason != "cancelled":  # a cancelled one was rolled back: nothing new
                    await self.commit_agent(agent)  # before the reply's last line: a restart keeps this turn
                if on_result is not None:
                    on_result(result)
                return result

    async def complete(self, ref: str, n_tokens: int, prompt: PromptText, sampling: Sampling = GREEDY,
                       on_token: Callable[[Token], None] | None = None,
                       cancel: threading.Event | None = None, queue: Hashable | None = None,
                       on_result: Callable[[DecodeResult], None] | None = None) -> DecodeResult:
        """A stateless request (HTTP, MAGN without a session): a fresh conversation every time. ``queue`` is the
        engine queue it waits in (its connection; default: one queue for the model's stateless requests);
        ``on_result`` see :meth:`_run`."""
        with self.accepting():
            model = self.resolve(ref)
            model.inflight += 1
            try:
                await self.acquire(model)
                return await self._run(model, Conversation(), None, n_tokens, prompt, sampling, on_token, cancel,
                                       ephemeral=True, queue=("stateless", model.key) if queue is None else queue,
                                       on_result=on_result)
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
            table = gguf_meta.estimate(shape, context_size(model.spec.n_ctx), model.spec.cache_type,
                                       offload.ledger_layers(model.offload))  # the offloaded layers' KV only
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
        if ACCEPTED.get():
            yield
            return
        if self.closing:
            raise ApplianceError("SHUTTING_DOWN")
        self.accepted += 1
        mark = ACCEPTED.set(True)
        try:
            yield
        finally:
            ACCEPTED.reset(mark)
            self.accepted -= 1

    async def _run(self, model: Model, conv: Conversation, agent: Agent | None, n_tokens: int,
                   prompt: PromptText, sampling: Sampling, on_token: Callable[[Token], None] | None,
                   cancel: threading.Event | None, ephemeral: bool = False,
                   queue: Hashable = DEFAULT_QUEUE,
                   on_result: Callable[[DecodeResult], None] | None = None) -> DecodeResult:
        """Generate in the model's live context: claim the context (SPEC L8), start the request on the engine
        thread (``queue`` is the engine queue it waits in: an agent's decodes, a connection's stateless requests)
        once a sequence is free for it, then let the model's step loop decode it together with the others
        (SPEC L9) until it ends. The start reads the model's runtime when it runs: a reload queued before it may
        have replaced the runtime. Accepted before a graceful stop began, it still runs until the grace is over.

        ``on_result`` (on the loop, must not raise) gets the result as soon as it is known, before the bookkeeping
        that no reply needs (counters, the model's load profile sample): a surface writes its reply from it. A
        request in the live context gets it in the loop callback that learns of its end (:meth:`_request_ended`,
        the first of its engine job's wake-up), not after the job's result has travelled through the futures to
        this task (two more loop iterations and this method's tail). It is not called for a request that ended
        with an error."""
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
        source: str | None = None  # where its KV state was when it first tried to start
        from_disk = False  # its state was read back from its KV file

        answered = False  # on_result was called as the request ended (answer_at_end)

        def result_of(request: Any) -> DecodeResult:
            """The request's result, once it ended without an error (on the loop)."""
            generation: Generation = request.generation
            evicted_convs = [*parked, *request.evicted]
            evicted = owner.get(id(evicted_convs[0]), "~anonymous") if evicted_convs else None
            re_evaluated = rebuilt and not request.restored  # re-evaluated, or shared from a live conversation (L10)
            notice = None
            if agent is not None and generation.stop_reason != "cancelled":  # its client gets this result
                notice, agent.notice = agent.notice, None
            restored_from = "none"
            if request.restored:
                restored_from = "disk" if from_disk else "host"
            elif source == "device":
                restored_from = "device"
            elif re_evaluated:
                restored_from = "tokens"
            return DecodeResult(agent_id, model.key, generation, evicted, request.restored, re_evaluated,
                                tuple(dropped), notice, request.plan, request.threads, request.memory_bytes,
                                restored_from, request.burst_tokens)

        def answer_at_end(request: Any) -> None:
            """On the loop, in the callback that learns of the request's end: ``on_result`` now, unless what comes
            before the reply is not done yet (a cold context to close, the model's first memory reading)."""
            nonlocal answered, result
            if on_result is None or cold_held or model.measured is None or request.error is not None:
                return
            result = result_of(request)
            answered = True
            on_result(result)

        def on_done(request: Any) -> None:  # engine thread
            self.decoding -= 1
            model.decoding -= 1
            # With the job's result: one wake-up; its first callback answers the request (answer_at_end).
            wakeups.call_soon(loop, self._request_ended, model, ended, request, answer_at_end)

        def start(queued: bool, cold: bool = False) -> Any:
            nonlocal rebuilt, source, from_disk
            if not queued and not cold and model.admission.waiting:  # others wait for a sequence: not before them
                return WAIT_TURN
            runtime = model.runtime
            if runtime is None:
                raise ApplianceError("INTERNAL", f"model {model.key!r} is not loaded")
            if model.key in self.adaptive.draining:  # a grown pool is about to replace this one: start in it
                return DRAINING
            # The agents as they are now, not at submit time: the engine may have served other queues first.
            # dict.copy() runs under the GIL in one piece, so the loop cannot change the dict halfway through.
            agents = list(self.agents.copy().values())
            if source is None:
                source = conv.where
            if conv.where == "disk" and agent is not None:  # the third tier: back into host RAM first
                from_disk = self.unspill(agent)
            rebuilt = conv.where != "device" and bool(conv.tokens)  # unless its state comes back (below)
            restoring = conv.nbytes if conv.where == "host" else 0
            began = time.monotonic()
            started = time.perf_counter()

            def before_park(parking: Conversation, state_bytes: int) -> None:  # room in host RAM for its state
                reserve = max(state_bytes, hostkv.parked_estimate(model.kv_bytes_per_token, parking.n_evaluated,
                                                                  buffer_bytes(parking)))
                dropped.extend(self._fit_host_kv(agents, reserve=reserve, parking=parking, attaching=conv,
                                                 model=model))

            request = runtime.begin(conv, prompt, n_tokens, sampling, on_token=on_token, cancelled=cancel.is_set,
                                    on_done=on_done, ephemeral=ephemeral, before_park=before_park, cold=cold)
            if request is None and not cold and len(runtime.slots.requests) < runtime.sequences:
                # A sequence was free: the cells are short (the pool's demand counts this request, AdaptiveLoop).
                return ShortOfCells(runtime.slots.refused_need,
                                    sum(other.need for other in runtime.slots.requests.values()))
            if request is None and not cold and runtime.sequences < runtime.live_slots:
                return ShortOfStreams(len(runtime.slots.requests))  # a split context's streams are all busy
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
            model.decoding += 1
            if cancel.is_set():
                first_step(runtime, cancelled=True)
            elif not queued and not gathers(model, runtime, request, began):  # else the step loop steps it
                first_step(runtime)
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
        parked: list[Conversation] = []
        result: DecodeResult | None = None
        try:
            parked = await self._open_context(model)
            if model.pending is not None:
                await self.adaptive.apply_pending(model)
            request = await self._admit(model, start, queue, cancel)
            if isinstance(request, ColdNeeded) and await self.adaptive.grow_for(model, request.cells):
                request = await self._admit(model, start, queue, cancel)  # the hot pool grew to hold it
            if isinstance(request, ColdNeeded):  # longer than the hot pool: a cold context of its own (SPEC E2)
                needed = request
                request = None
                await model.cold_lock.acquire()
                cold_held = True
                await self.adaptive.open_cold(model, needed.cells)
                request = await self._admit(model, functools.partial(start, cold=True), ("cold", model.key), cancel)
            if not request.done:  # a request alone took its first step as it started (first_step)
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
                if isinstance(request, Request):
                    self.adaptive.observe(model, request)
            if answered and result is not None:  # its client got its reply: it counts like any other
                self._tally(result, len(parked) + len(request.evicted))
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
        if result is None:
            result = result_of(request)
        self._tally(result, len(parked) + len(request.evicted))
        if model.measured is None:
            model.measured = max(0, process_bytes(await asyncio.to_thread(self.device.read)) - model.baseline)
        if on_result is not None and not answered:  # its reply goes out now (nothing awaited after it)
            on_result(result)
        self.adaptive.observe(model, request)
        return result

    def _tally(self, result: DecodeResult, swaps: int) -> None:
        """Count a request that got its result (``swaps``: the conversations it parked)."""
        self.counters[f"restored_from_{result.restored_from}"] += 1
        self.counters["decodes"] += 1
        self.counters["host_kv_rebuilds"] += result.rebuilt
        self.counters["tokens"] += result.generation.generated_tokens
        self.counters["kv_swaps"] += swaps
        self.counters["kv_restores"] += result.restored

    async def _admit(self, model: Model, start: Callable[[bool], Any], queue: Hashable,
                     cancel: threading.Event | None = None) -> Any:
        """Start a request (``start`` on the engine thread). While sequences are free every request starts at once
        (the engine serves its queues in turn, so requests arriving together join the same step). A request that
        finds every sequence busy, or others already waiting, waits its turn (:class:`~appliance.daemon.admission.
        Admission`: round-robin over the engine queues, so a client keeping every sequence busy cannot starve
        another); the one whose turn it is retries each time a request ends. A caller that goes away while its
        start runs sets ``cancel`` at once: a start that took the first step (:func:`first_step`) stops there."""
        ticket = object()
        queued = False
        try:
            while True:
                seen = model.ended
                if not queued or self._may_try(model, ticket):
                    model.starting += 1
                    try:
                        request = await started(self.engine.submit(functools.partial(start, queued), queue=queue),
                                                cancel)
                    finally:
                        model.starting -= 1
                    short = request if isinstance(request, ShortOfCells) else None
                    streams = request if isinstance(request, ShortOfStreams) else None
                    if request is not None and request is not WAIT_TURN and request is not DRAINING and short is None \
                            and streams is None:
                        if not isinstance(request, ColdNeeded):  # its pool demand counts the cells still waiting
                            request.demand += model.admission.waiting_cells - model.admission.cells_of(ticket)
                        return request
                    if not queued:
                        model.admission.join(queue, ticket)
                        queued = True
                    if short is not None:
                        model.admission.short_of_cells(ticket, short.need, short.in_flight)
                    if model.admission.demand:  # blocked on cells: the queue's demand may grow the pool now
                        self.adaptive.blocked(model, model.admission.demand)
                    if streams is not None:  # blocked on streams: more of them now
                        self.adaptive.short_of_streams(model, streams.in_flight + model.admission.waiting)
                    if request is WAIT_TURN:
                        continue  # it never tried: try in its turn, which may be now
                    if request is DRAINING:
                        if model.key not in self.adaptive.draining:
                            continue  # the grown pool went live while it tried (its wake-up came before this wait)
                        await self._wait_for_wake(model)  # the pool's swap (undrain) wakes it
                        continue
                if model.ended == seen or not self._may_try(model, ticket):
                    await self._wait_for_wake(model)
        finally:
            if queued:
                model.admission.leave(queue, ticket)
                self._wake(model)

    def _may_try(self, model: Model, ticket: object) -> bool:
        """Whether the queued ``ticket`` tries to start now: it is among the first waiting requests, one for each
        sequence free now (at least the head), so that requests let in together start before the same step."""
        runtime = model.runtime
        free = 1 if runtime is None else runtime.sequences - len(runtime.slots.requests)
        return ticket in model.admission.turn(free)

    def model_bytes(self, model: Model) -> int:
        """The ledger bytes ``model`` holds now: weights, live context, a context being prepared, a cold one."""
        return self.ledger.held((model.key, context_key(model.key), next_key(model.key), cold_key(model.key),
                                 embedding_key(model.key)))

    async def _wait_for_wake(self, model: Model) -> None:
        """Wait until a request of ``model`` ends or its grown pool goes live (:meth:`_wake`)."""
        waiter = asyncio.get_running_loop().create_future()
        model.waiters.append(waiter)
        await waiter

    def _wake(self, model: Model) -> None:
        waiters, model.waiters = model.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _request_ended(self, model: Model, ended: asyncio.Future[Any], request: Any,
                       answer: Callable[[Any], None]) -> None:
        """A request of ``model`` ended on the engine thread (now on the loop): its caller wakes, and so does
        every request waiting for a free sequence of the model; then ``answer`` (its reply, before anything the
        caller does once it wakes)."""
        model.ended += 1
        request.memory_bytes = self.model_bytes(model)  # the pool only grows while it runs: its peak
        if not ended.done():
            ended.set_result(request)
        self._wake(model)
        answer(request)

    def _drive(self, model: Model) -> None:
        """Make sure the model's step loop runs (a request was just started)."""
        if model.stepper is None or model.stepper.done():
            model.stepper = asyncio.get_running_loop().create_task(self._steps(model))

    async def _steps(self, model: Model) -> None:
        """Step the model's live context while requests are in flight: engine jobs of one or more steps
        (:func:`steps`), in their own engine queue, so that other work (new requests joining, other models' steps,
        loads) runs between two steps. The next job is queued before this one ends, so the engine thread never
        waits for the event loop (busy with the streams) to ask for it; a step with nothing to do returns at once."""
        queued: collections.deque[Any] = collections.deque()
        try:
            while True:
                if not queued:
                    await gathered(model)
                runtime = model.runtime
                while runtime is not None and runtime.busy and len(queued) < STEPS_AHEAD:
                    queued.append(self.engine.submit(functools.partial(steps, runtime), queue=("steps", model.key)))
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

    def fit_host_kv(self, reserve: int = 0, model: Model | None = None) -> list[str]:
        """:meth:`_fit_host_kv` for every agent, after the adaptive loop parked some, or before, ``reserve`` bytes
        kept free for the states it is about to park from ``model``'s context (engine thread)."""
        return self._fit_host_kv(list(self.agents.copy().values()), reserve=reserve, model=model)

    def _fit_host_kv(self, agents: list[Agent], *, reserve: int = 0, parking: Conversation | None = None,
                     attaching: Conversation | None = None, model: Model | None = None) -> list[str]:
        """Free host KV buffers until ``agents`` fit in the budget (policy: :mod:`appliance.daemon.hostkv`), and each
        adaptive pool's agents in what its pool leaves of ``n_ctx`` (:func:`~appliance.daemon.hostkv.pool_cap`): a
        parked state goes to the disk tier when there is one (:meth:`spill`), else it is dropped; returns the agents
        whose parked state was dropped. Before a swap: ``reserve`` bytes are kept free for the ``parking``
        conversation of ``model``'s context (its own buffer counts in them), and the ``attaching`` one goes last.
        Runs on the engine thread, the only one that moves KV state, so no swap races a drop."""
        budget = self.host_kv_budget
        by_id = {agent.id: agent for agent in agents}
        last = frozenset(agent.id for agent in agents if agent.conversation is attaching)
        held = held_states(agents, parking)
        keys = hostkv.to_drop(held, max(0, budget - reserve), last)
        dropped = self._let_go(keys, by_id, attaching, f"budget {budget} bytes", hostkv.held_bytes(held))
        if not self.config.engine.adaptive:
            return dropped
        for pooled in {id(agent.model): agent.model for agent in agents}.values():
            runtime = pooled.runtime
            if runtime is None or runtime.pool_cells < 1:
                continue
            ours = [agent for agent in agents if agent.model is pooled]
            cap = hostkv.pool_cap(pooled.spec.n_ctx, runtime.pool_cells, conversation_cells(ours),
                                  runtime.live_slots, bytes_per_token(pooled, ours))
            held = held_states(ours, parking)
            keys = hostkv.to_drop(held, max(0, cap - (reserve if pooled is model else 0)), last)
            why = f"model {pooled.key}'s share beside its {runtime.pool_cells}-cell pool: {cap} bytes"
            dropped += self._let_go(keys, by_id, attaching, why, hostkv.held_bytes(held))
        return dropped

    def _let_go(self, keys: list[str], by_id: dict[str, Agent], attaching: Conversation | None, limit: str,
                held_before: int) -> list[str]:
        """Free the host buffers of the agents ``keys`` names (:meth:`_fit_host_kv`): a reuse buffer goes, a parked
        state goes to disk or is dropped; ``limit`` says which bound they passed. Returns the dropped agents."""
        dropped: list[str] = []
        for key in keys:
            conv = by_id[key].conversation
            nbytes = buffer_bytes(conv)
            if conv.where != "host":
                conv.buffer = None  # a live conversation's reuse buffer: nothing is lost
                continue
            if conv is attaching and self.disk is not None:
                # With a disk tier the state coming back is kept for its swap (it goes into the context at once; its
                # buffer is let go right after): host RAM holds one state over the budget meanwhile, rather than
                # throwing away a state just read from disk and re-evaluating it.
                continue
            if conv is not attaching and self.spill(by_id[key]):
                log.info("host KV: agent %s's parked state (%d bytes) written to disk (%s)", key, nbytes, limit)
                continue
            forget_parked(conv)
            dropped.append(key)
            log.info("host KV: dropped agent %s's parked state (%d bytes; %s, %d held before): its next decode "
                     "re-evaluates its %d tokens", key, nbytes, limit, held_before, len(conv.tokens))
        return dropped

    def host_kv(self) -> dict[str, int]:
        """Host RAM held for KV state, next to the device ledger (STATUS, health)."""
        convs = [agent.conversation for agent in self.agents.values()]
        return {"budget_bytes": self.host_kv_budget,
                "parked_bytes": sum(buffer_bytes(conv) for conv in convs),
                "parked_agents": sum(conv.where == "host" for conv in convs),
                "drops": self.counters["host_kv_drops"], "rebuilds": self.counters["host_kv_rebuilds"],
                "spills": self.counters["disk_kv_spills"]}

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
