"""A model's live conversations on one multi-sequence context: which conversation holds which sequence, who is
parked in host RAM, which prefix is reused, and each request's stream (SPEC L5, L9, L10).

:class:`Slots` is the part of a runtime that is the same for llama.cpp and for the fake engine: it drives a
:class:`SequenceContext` (llama.cpp's :class:`~appliance.engine.batched.BatchedContext`, or the fake one) and a
:class:`Vocabulary`. Every method runs on the engine thread.

* **Slots.** A conversation that decodes holds one of the context's ``n_seq_max`` sequences and keeps it (its KV
  cells stay) after its request, until another conversation needs the sequence or its cells: then the least
  recently used conversation without a request in flight is parked (its cells copied to its host buffer, the
  sequence freed). A request that finds every sequence, or the cells it needs, held by requests in flight waits
  (:meth:`Slots.begin` returns None) until one finishes.
* **Batched steps.** :meth:`Slots.step` is one decode of the context for every request with work (continuous
  batching, chunked prefill: :func:`~appliance.engine.schedule.plan_step`); each sampled token goes through its
  request's :class:`~appliance.engine.streamtext.StreamText` (stop strings held back) to its ``on_token``.
* **Shared prefixes.** A conversation that holds no cells starts from the longest prefix of its tokens that a
  live sequence (llama.cpp shares the cells: ``llama_memory_seq_cp``; a split context copies them) or a parked
  conversation (its state is loaded, then cut) already holds; ``Generation.prompt_evaluated`` says how many tokens
  were really evaluated.
* **Rollback.** A cancelled or failed request leaves its conversation as it was before (tokens and cells).
* **Prompts** are raw text or a :class:`~appliance.engine.interface.Prompt` with control tokens
  (:mod:`appliance.engine.prompts`); a ``Prompt`` with ``history`` is the conversation's whole text, of which the
  conversation keeps its longest common token prefix (:meth:`Slots.begin`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from appliance.engine import flash
from appliance.engine.adaptive import Tuning
from appliance.engine.flash import FlashMode
from appliance.engine.interface import (
    GREEDY,
    Conversation,
    Generation,
    Prompt,
    PromptText,
    Sampling,
    StopReason,
    Token,
    TokenLogprobs,
    check_prompt_size,
    tokens_to_generate,
)
from appliance.engine.pace import Pace
from appliance.engine.prompts import prompt_text, tokenize_prompt
from appliance.engine.streamtext import StreamText
from appliance.errors import ApplianceError

log = logging.getLogger(__name__)

MIN_SHARED_PREFIX = 16
"""Tokens a borrowed prefix must have at least: a few shared tokens (the BOS, a chat template's first words) save
nothing worth reporting."""


class PoolTooSmall(Exception):
    """A request needs more KV cells than the whole hot pool has (:meth:`Slots.begin`): it must run in a larger
    ("cold") context. Nothing was changed."""

    def __init__(self, cells: int) -> None:
        super().__init__(f"the request needs {cells} KV cells, more than the hot pool holds")
        self.cells = cells


class SampledToken(Protocol):
    seq_id: int
    token: int  # negative: none (the sequence's grammar allowed no token; ``stop_reason`` is "stop")
    piece: bytes
    done: bool
    stop_reason: StopReason | None
    logprobs: TokenLogprobs | None


class SequenceContext(Protocol):
    """What :class:`Slots` needs of a multi-sequence context (see :class:`~appliance.engine.batched.BatchedContext`
    for the meaning of each call)."""

    n_ctx: int
    n_seq_max: int
    split: bool  # each sequence has a KV stream of its own (of seq_cells cells), not a share of one pool
    seq_cells: int  # the most cells one sequence may hold (n_ctx when not split)
    v_transposed: bool  # its V cache is transposed (flash attention off): the layout of the states it saves and loads
    last_batch: int  # tokens in the last step's batch

    def add(self, seq_id: int, prompt_tokens: list[int], sampling: Sampling, max_tokens: int, *,
            n_past: int = 0, seen: list[int] | None = None) -> None: ...

    def step(self) -> list[SampledToken]: ...

    def has_work(self) -> bool: ...

    def finish(self, seq_id: int, keep: int | None = None) -> int: ...

    def cancel(self, seq_id: int) -> None: ...

    def cells(self, seq_id: int) -> int: ...

    def cells_claimed(self) -> int: ...

    def copy(self, source: int, target: int, n: int) -> None: ...

    def state_size(self, seq_id: int) -> int: ...

    def state_into(self, seq_id: int, buffer: bytearray) -> int: ...

    def load_state(self, seq_id: int, state: bytes | bytearray | memoryview, n_past: int) -> None: ...

    def truncate(self, seq_id: int, keep: int) -> None: ...

    def lift(self, seq_id: int) -> Any: ...

    def land(self, seq_id: int, lifted: Any) -> None: ...

    @property
    def threads(self) -> int: ...

    def set_threads(self, n_threads: int) -> None: ...


class Vocabulary(Protocol):
    longest_piece: int

    def tokenize(self, text: str, *, bos: bool, special: bool = False) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def control_texts(self) -> tuple[str, ...]: ...

    def check_sampling(self, sampling: Sampling) -> None: ...


@dataclass(eq=False)
class Request:
    """One generation on a conversation, from :meth:`Slots.begin` to its end (``done`` with ``generation`` or
    ``error``). ``on_done`` is called once, on the engine thread, when it ends."""

    conv: Conversation
    prompt_tokens: int
    n_tokens: int
    sampling: Sampling
    on_token: Callable[[Token], None] | None
    cancelled: Callable[[], bool] | None
    on_done: Callable[[Request], None] | None
    ephemeral: bool
    before: int  # the conversation's token count before this request (a rollback goes back there)
    stream: StreamText
    started: float
    evicted: list[Conversation] = field(default_factory=list)
    restored: bool = False
    reused: int = 0  # prompt cells borrowed from another sequence or a parked conversation
    evaluated: int = 0  # tokens evaluated before the first sampled token
    out: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token of ``out``, when asked for
    ttft: float | None = None
    need: int = 0  # cells its conversation may hold by its end (conversation + prompt + n_tokens)
    demand: int = 0  # cells the context had to hold for it to run: its need + the other requests' in flight
    live_sequences: int = 0  # requests in flight in its context when it started, itself included
    burst_tokens: int = 0  # the tokens of the step that ended its prompt, when that step ended other prompts too
    plan: str = ""  # the plan and threads of the context it ran in (set by its runtime)
    threads: int = 0
    cold: bool = False  # it ran in a temporary cold context
    memory_bytes: int = 0  # what its caller's ledger held for the model when it ended (the daemon sets it)
    seq_id: int | None = None
    done: bool = False
    generation: Generation | None = None
    error: BaseException | None = None


class Slots:
    """The conversations of one model in one multi-sequence context (module docstring)."""

    def __init__(self, context: SequenceContext | None, vocabulary: Vocabulary, *, n_ctx: int) -> None:
        self.context: SequenceContext = context  # type: ignore[assignment]  # None only while the runtime has none
        self.vocabulary = vocabulary
        self.n_ctx = n_ctx  # one conversation's bound (the configured n_ctx; the pool may be larger)
        self.holders: dict[int, Conversation] = {}  # seq id -> the conversation whose cells it holds
        self.requests: dict[int, Request] = {}  # seq id -> its request in flight
        self._used: dict[int, int] = {}  # seq id -> tick of its last use (least recently used parks first)
        self._tick = 0
        self._parked: list[Conversation] = []  # conversations parked here (a prefix may be borrowed from them)
        self.saves = 0
        self.restores = 0
        self.refused_need = 0  # the cells the last request :meth:`begin` refused needed (the queue's pool demand)
        self.layout_discards = 0  # parked states dropped for being in the other V layout (:meth:`_place`)
        self.keep_buffers = True  # a restored conversation keeps its host buffer (False: an adaptive pool's do not)
        self.pace = Pace()  # seconds per prompt token of its steps (what a prompt's first step is expected to cost)

    # -- reading ---------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A request is in flight (:meth:`step` has work, or a cancellation to reap)."""
        return bool(self.requests)

    @property
    def live(self) -> list[Conversation]:
        return list(self.holders.values())

    def holds(self, conv: Conversation) -> bool:
        return conv.seq is not None and self.holders.get(conv.seq) is conv

    def host_cells(self) -> tuple[int, int]:
        """The cells held in host buffers: the states of the conversations parked here, and (at their cells now: the
        state a buffer was sized for is at most that, unless the conversation was cut since) the live ones that keep
        a buffer for their next park. A snapshot, safe to take off the engine thread."""
        unique = {id(conv): conv for conv in list(self._parked)}  # one parked twice is listed twice
        parked = sum(conv.n_evaluated for conv in unique.values() if conv.where == "host" and conv.buffer is not None)
        reused = sum(conv.n_evaluated for conv in list(self.holders.values()) if conv.buffer is not None)
        return parked, reused

    # -- requests --------------------------------------------------------------------------------------
    def begin(self, conv: Conversation, prompt: PromptText, n_tokens: int, sampling: Sampling, *,
              on_token: Callable[[Token], None] | None = None, cancelled: Callable[[], bool] | None = None,
              on_done: Callable[[Request], None] | None = None, ephemeral: bool = False,
              before_park: Callable[[Conversation, int], None] | None = None) -> Request | None:
        """Start a request: ``conv`` continues with ``prompt`` and up to ``n_tokens`` tokens. None when every
        sequence or the cells it needs are held by requests in flight (ask again after a :meth:`step` ended one).
        ``before_park`` is told of each conversation about to be parked for it and the bytes its state will take
        (to make room in host RAM first).
        Refusals (``BAD_REQUEST``, ``CONTEXT_OVERFLOW``) change nothing.

        A :class:`~appliance.engine.interface.Prompt` with ``history`` is the conversation's whole text: the
        conversation keeps the longest common token prefix of its tokens and the prompt's (at least one prompt
        token is left to evaluate, for the logits of the first new token), its cells past it go (a parked
        conversation's state is restored, then cut), and the rest of the prompt is evaluated. The cut stays when
        the request is cancelled or fails (the conversation then ends at the common prefix)."""
        if self.holds(conv) and conv.seq in self.requests:
            raise ApplianceError("INTERNAL", "a conversation with a request in flight got another")
        text = prompt_text(prompt)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApplianceError("BAD_REQUEST", "the prompt is not valid Unicode (it has a lone surrogate)",
                                 {"field": "prompt"}) from None
        history = isinstance(prompt, Prompt) and prompt.history
        check_prompt_size(self.n_ctx, Conversation() if history else conv, len(data), self.vocabulary.longest_piece)
        self.vocabulary.check_sampling(sampling)
        if history:
            whole = tokenize_prompt(self.vocabulary, prompt, bos=True)
            keep = common_prefix(conv.tokens, whole, max(0, len(whole) - 1))
            new = whole[keep:]
            prompt_tokens = len(whole)
        else:
            new = tokenize_prompt(self.vocabulary, prompt, bos=not conv.tokens) if data else []
            keep = len(conv.tokens)
            prompt_tokens = len(new)
        kept = conv if keep == len(conv.tokens) else Conversation(tokens=conv.tokens[:keep])
        n_tokens = tokens_to_generate(self.n_ctx, kept, new, n_tokens)
        need = keep + len(new) + n_tokens
        if need > self.context.seq_cells:
            raise PoolTooSmall(need)
        request = Request(conv, prompt_tokens, n_tokens, sampling, on_token, cancelled, on_done, ephemeral,
                          keep, StreamText(sampling.stop, b"" if new else self._primer(conv)),
                          time.perf_counter())
        request.need = need
        request.demand = need + sum(other.need for other in self.requests.values())
        request.live_sequences = len(self.requests) + 1
        seq_id = self._seat(conv, need, request.evicted, before_park)
        if seq_id is None:
            self.refused_need = need
            return None
        if not self.holds(conv):
            request.restored = self._place(conv, seq_id)
        tokens = conv.tokens[:keep] + new
        cells = min(self.context.cells(seq_id), keep)  # its own cells hold its tokens: those past the prefix go
        if cells == 0:
            cells = self._borrow(seq_id, tokens, request)
        cells = min(cells, len(tokens) - 1)  # at least one token is evaluated: its logits give the first token
        try:
            self.context.add(seq_id, tokens[cells:], sampling, n_tokens, n_past=cells, seen=tokens)
        except BaseException:
            if request.reused:  # borrowed cells hold this prompt's tokens, which the conversation does not take
                self.context.truncate(seq_id, 0)
            raise
        del conv.tokens[keep:]
        conv.tokens.extend(new)
        conv.n_evaluated = cells
        request.evaluated = len(tokens) - cells
        request.seq_id = seq_id
        self.requests[seq_id] = request
        self._touch(seq_id)
        return request

    def _primer(self, conv: Conversation) -> bytes:
        """A continuation without a prompt completes a UTF-8 sequence its last tokens began."""
        return b"".join(self.vocabulary.piece(t) for t in conv.tokens[-4:])

    def _seat(self, conv: Conversation, need: int, evicted: list[Conversation],
              before_park: Callable[[Conversation, int], None] | None) -> int | None:
        """The sequence ``conv`` holds, or a free one for it, with room for ``need`` cells: idle conversations are
        parked (least recently used first, added to ``evicted``) as needed. None when requests in flight hold what
        it needs."""
        own = conv.seq if self.holds(conv) else None
        while (own is None and self._free_seq() is None) or not self._fits(need, own):
            victim = self._idle_victim(exclude=own)
            if victim is None:
                return None
            if before_park is not None:
                before_park(self.holders[victim], self.context.state_size(victim))
            evicted.append(self._park(victim))
        return own if own is not None else self._free_seq()

    def _fits(self, need: int, own: int | None) -> bool:
        if self.context.split:  # a stream of its own: the others' cells do not matter
            return need <= self.context.seq_cells
        held = self.context.cells(own) if own is not None else 0
        return self.context.cells_claimed() - held + need <= self.context.n_ctx

    def can_take(self, cells: int) -> bool:
        """A free sequence and room for ``cells`` more cells, without parking anyone."""
        return self._free_seq() is not None and self._fits(cells, None)

    def share_parked(self, other: Slots) -> None:
        """Keep one list of parked conversations with ``other`` (a cold context borrows prefixes from the hot
        pool's parked conversations, and they from what it parks)."""
        self._parked = other._parked

    def _free_seq(self) -> int | None:
        for seq_id in range(self.context.n_seq_max):
            if seq_id not in self.holders:
                return seq_id
        return None

    def _idle_victim(self, exclude: int | None) -> int | None:
        """The least recently used sequence without a request in flight (None when every one has one)."""
        idle = [seq_id for seq_id in self.holders if seq_id not in self.requests and seq_id != exclude]
        if not idle:
            return None
        return min(idle, key=self._used.__getitem__)

    def _place(self, conv: Conversation, seq_id: int) -> bool:
        """``conv`` takes the free ``seq_id``: its parked state comes back (True), or it starts with no cells.

        A restored conversation keeps its host buffer for its next park (a swap back and forth allocates nothing),
        but at most one live conversation keeps one: the other live conversations' buffers go (a conversation and
        its copy in host RAM would otherwise hold its cells twice); with ``keep_buffers`` false (an adaptive pool,
        whose memory must stay within the fixed strategy's) none keeps one."""
        restored = conv.where == "host" and conv.buffer is not None and conv.nbytes > 0
        if restored and conv.v_transposed != self.context.v_transposed:
            self._discard_other_layout(conv)
            restored = False
        if restored:
            assert conv.buffer is not None
            self.context.load_state(seq_id, memoryview(conv.buffer)[:conv.nbytes], conv.n_evaluated)
            self.restores += 1
            for other in self.holders.values():
                other.buffer = None
            if not self.keep_buffers:
                conv.buffer = None
        else:
            conv.n_evaluated = 0
        conv.where = "device"
        conv.seq = seq_id
        self.holders[seq_id] = conv
        self._touch(seq_id)
        return restored

    def _discard_other_layout(self, conv: Conversation) -> None:
        """``conv``'s parked state was saved in the other V layout (``engine.flash_attention`` changed between its
        save and now): llama.cpp would refuse it, so it goes, and the conversation's tokens are evaluated again."""
        log.warning("a parked conversation's KV state (%d cells) was saved with the V cache %s, this context stores "
                    "it %s (engine.flash_attention changed): its tokens are re-evaluated", conv.n_evaluated,
                    layout_name(conv.v_transposed), layout_name(self.context.v_transposed))
        conv.buffer = None
        conv.nbytes = 0
        conv.where = "empty"
        self.layout_discards += 1

    def _park(self, seq_id: int) -> Conversation:
        """Copy a resting sequence's cells to its conversation's host buffer and free the sequence."""
        conv = self.holders.pop(seq_id)
        size = self.context.state_size(seq_id)
        if conv.buffer is None or len(conv.buffer) < size:
            conv.buffer = None  # the smaller one goes before the larger one is allocated
            conv.buffer = bytearray(size)  # reused by its later parks: no allocation per swap
        conv.nbytes = self.context.state_into(seq_id, conv.buffer)
        conv.n_evaluated = self.context.cells(seq_id)
        conv.v_transposed = self.context.v_transposed
        conv.where = "host"
        conv.seq = None
        self.context.cancel(seq_id)
        self._used.pop(seq_id, None)
        self._parked.append(conv)
        self.saves += 1
        return conv

    def park(self, conv: Conversation) -> None:
        """Park ``conv`` (live, no request in flight) in host RAM now."""
        if not self.holds(conv) or conv.seq in self.requests:
            raise ApplianceError("INTERNAL", "park of a conversation that is not resting in the context")
        assert conv.seq is not None
        self._park(conv.seq)

    def restore(self, conv: Conversation) -> bool:
        """Bring the parked ``conv`` back into a free sequence now, without a request (benchmarks); False when
        every sequence is held by requests in flight."""
        if self.holds(conv):
            return True
        seq_id = self._seat(conv, max(conv.n_evaluated, 1), [], None)
        if seq_id is None:
            return False
        self._place(conv, seq_id)
        return True

    def park_all(self) -> list[Conversation]:
        """Park every live conversation (none may have a request in flight): the context is about to go."""
        if self.requests:
            raise ApplianceError("INTERNAL", "the context still has requests in flight")
        return self.park_idle()

    def park_idle(self) -> list[Conversation]:
        """Park every live conversation without a request in flight."""
        return [self._park(seq_id) for seq_id in list(self.holders) if seq_id not in self.requests]

    def lift_requests(self) -> dict[int, Any]:
        """Take the sequence of every request in flight out of the context as it is (``SequenceContext.lift``):
        the context is about to be replaced while they run; :meth:`land_requests` puts them in the next one."""
        return {seq_id: self.context.lift(seq_id) for seq_id in list(self.requests)}

    def land_requests(self, lifted: dict[int, Any]) -> None:
        """The :meth:`lift_requests` sequences go on in the (new) context, in the same sequence ids; a request whose
        sequence the context refuses ends with that error (:meth:`abandon`)."""
        for seq_id, sequence in lifted.items():
            try:
                self.context.land(seq_id, sequence)
            except Exception as exc:
                self.abandon({seq_id: sequence}, exc)

    def abandon(self, lifted: dict[int, Any], error: BaseException) -> list[Request]:
        """The lifted requests cannot go on (no context takes their sequences): each ends with ``error``, rolled
        back to before it; its conversation holds no cells (its tokens are evaluated again at its next request)."""
        ended = []
        for seq_id in lifted:
            request = self.requests.pop(seq_id)
            conv = request.conv
            del conv.tokens[request.before:]
            self.holders.pop(seq_id, None)
            self._used.pop(seq_id, None)
            conv.seq = None
            conv.where = "empty"
            conv.n_evaluated = 0
            ended.append(self._ended(request, "cancelled", error))
        return ended

    def move_to(self, context: SequenceContext, *, carry: bool = False) -> list[Conversation]:
        """Carry every live conversation over to ``context``, in the same sequence ids; the least recently used
        idle ones that would not fit are parked first. No request may be in flight, or with ``carry`` those in
        flight go on in ``context`` from where they are (their sequences lifted and landed: sampler, pending
        token, cells). The old context is the caller's to close. Returns the parked conversations."""
        if self.requests and not carry:
            raise ApplianceError("INTERNAL", "the context still has requests in flight")
        if any(seq_id >= context.n_seq_max for seq_id in self.requests):
            raise ApplianceError("INTERNAL", "a request in flight holds a sequence the new context lacks")
        needs = [request.need for request in self.requests.values()]
        if not claims_fit(needs, split=context.split, seq_cells=context.seq_cells, n_ctx=context.n_ctx):
            raise ApplianceError("INTERNAL", "the requests in flight do not fit in the new context",
                                 {"n_ctx": context.n_ctx, "seq_cells": context.seq_cells})
        parked: list[Conversation] = []
        for seq_id in list(self.holders):  # an idle one without its sequence there, or too long for its stream
            if seq_id in self.requests:
                continue
            if seq_id >= context.n_seq_max or (context.split and self.context.cells(seq_id) > context.seq_cells):
                parked.append(self._park(seq_id))
        while self.context.cells_claimed() > context.n_ctx:
            victim = self._idle_victim(exclude=None)
            assert victim is not None  # the requests' claims fit (checked above): an idle holder is left
            parked.append(self._park(victim))
        buffer = bytearray()
        for seq_id in list(self.holders):
            if seq_id in self.requests:
                continue
            size = self.context.state_size(seq_id)
            if len(buffer) < size:
                buffer = bytearray()  # the smaller one goes before the larger one is allocated
                buffer = bytearray(size)
            written = self.context.state_into(seq_id, buffer)
            context.load_state(seq_id, memoryview(buffer)[:written], self.context.cells(seq_id))
        del buffer  # before a lifted request's state takes its place in host RAM
        old, self.context = self.context, context
        for seq_id in list(self.requests):  # one at a time: host RAM holds one sequence's state at once
            self._carry(old, seq_id)
        return parked

    def _carry(self, old: SequenceContext, seq_id: int) -> None:
        """Lift request ``seq_id``'s sequence out of ``old`` and land it in the live context (:meth:`move_to`). Its
        host copy goes when this returns, before the next one is lifted."""
        try:
            lifted = old.lift(seq_id)
        except Exception as exc:
            self.abandon({seq_id: None}, exc)
            return
        self.land_requests({seq_id: lifted})

    def _borrow(self, seq_id: int, tokens: list[int], request: Request) -> int:
        """Fill the empty ``seq_id`` with the longest prefix of ``tokens`` that another live sequence or a parked
        conversation holds (shared prefixes); returns the cells it got."""
        best = 0
        source: int | Conversation | None = None
        for other, holder in self.holders.items():
            if other == seq_id:
                continue
            n = common_prefix(tokens, holder.tokens, self.context.cells(other))
            if n > best:
                best, source = n, other
        for conv in self.parked_candidates():
            n = common_prefix(tokens, conv.tokens, conv.n_evaluated)
            if n > best and 2 * n >= conv.n_evaluated:  # its whole state is loaded: use at least half of it
                best, source = n, conv
        best = min(best, len(tokens) - 1)
        if best < MIN_SHARED_PREFIX or source is None:
            return 0
        if isinstance(source, int):
            self.context.copy(source, seq_id, best)
        else:
            if not self._fits(source.n_evaluated, None):
                return 0
            self.context.load_state(seq_id, memoryview(source.buffer or b"")[:source.nbytes], source.n_evaluated)
            self.context.truncate(seq_id, best)
        request.reused = best
        return best

    def parked_candidates(self) -> list[Conversation]:
        """The conversations this runtime parked that still hold their state in host RAM (in this context's V
        layout: only those can be loaded)."""
        alive = [conv for conv in self._parked if conv.where == "host" and conv.buffer is not None]
        self._parked[:] = alive  # in place: a cold context shares the list
        return [conv for conv in alive if conv.v_transposed == self.context.v_transposed]

    # -- steps -----------------------------------------------------------------------------------------
    def step(self, hold: Callable[[], bool] | None = None) -> list[Request]:
        """Reap cancelled requests, then (unless ``hold()`` says to wait) decode one batch and deliver its
        tokens. Returns the requests that ended."""
        ended = self._reap()
        if not self.context.has_work():
            return ended
        if hold is not None and hold():
            return ended + self._reap()
        started = time.perf_counter()
        try:
            events = self.context.step()
        except BaseException as exc:
            for seq_id in list(self.requests):
                ended.append(self._end(seq_id, "cancelled", error=exc))
            return ended
        now = time.perf_counter()
        self.pace.observe(now - started, self.context.last_batch)
        self._mark_burst(events)
        for event in events:
            request = self.requests.get(event.seq_id)
            if request is None:
                continue
            try:
                finished = self._deliver(request, event, now)
            except Exception as exc:  # its client's sink failed: that request ends, rolled back; no other
                ended.append(self._end(event.seq_id, "cancelled", error=exc))
                continue
            if finished is not None:
                ended.append(self._end(event.seq_id, finished))
        return ended

    def _mark_burst(self, events: list[SampledToken]) -> None:
        """The requests whose prompts this step ended (their first token), when there are two or more: each is told
        the step's tokens (``burst_tokens``: the plan's micro-batch should hold such a step)."""
        first: list[Request] = []
        for event in events:
            request = self.requests.get(event.seq_id)
            if request is not None and request.ttft is None:
                first.append(request)
        if len(first) < 2:
            return
        for request in first:
            request.burst_tokens = self.context.last_batch

    def _deliver(self, request: Request, event: SampledToken, now: float) -> StopReason | None:
        conv = request.conv
        if request.ttft is None:
            request.ttft = now - request.started
        if event.token < 0:  # its grammar allowed no token: it ends here, what was held back streamed
            held = request.stream.flush()
            if held and request.on_token is not None:
                request.on_token(Token(request.out[-1], held, len(request.out) - 1, time.time()))
            return "stop"
        conv.tokens.append(event.token)
        request.out.append(event.token)
        if event.logprobs is not None:
            request.logprobs.append(event.logprobs)
        index = len(request.out) - 1
        if event.stop_reason == "eos":
            held = request.stream.flush()
            if held and request.on_token is not None:
                request.on_token(Token(event.token, held, index, time.time(), event.logprobs))
            return "eos"
        last = len(request.out) >= request.n_tokens or event.stop_reason == "stop"
        text = request.stream.push(event.piece, last=last)
        if request.on_token is not None:
            request.on_token(Token(event.token, text, index, time.time(), event.logprobs))
        if request.stream.stopped or event.stop_reason == "stop":
            return "stop"
        if event.done or last:
            return "length"
        return None

    def any_cancelled(self) -> bool:
        """Some request in flight was cancelled (a step held at a gate lets it go)."""
        return any(r.cancelled is not None and r.cancelled() for r in self.requests.values())

    def _reap(self) -> list[Request]:
        ended: list[Request] = []
        for seq_id, request in list(self.requests.items()):
            if request.cancelled is not None and request.cancelled():
                ended.append(self._end(seq_id, "cancelled"))
        return ended

    def _end(self, seq_id: int, reason: StopReason, error: BaseException | None = None) -> Request:
        request = self.requests.pop(seq_id)
        conv = request.conv
        rollback = reason == "cancelled" or error is not None
        keep = request.before if rollback else None
        conv.n_evaluated = self.context.finish(seq_id, keep)
        if rollback:
            del conv.tokens[request.before:]
        if request.ephemeral:
            self.detach(conv)
        self._touch(seq_id)
        return self._ended(request, reason, error)

    def _ended(self, request: Request, reason: StopReason, error: BaseException | None) -> Request:
        """``request`` is over: its generation (or ``error``), then its ``on_done``."""
        request.done = True
        request.error = error
        request.generation = Generation(request.stream.text, tuple(request.out), request.prompt_tokens, reason,
                                        time.perf_counter() - request.started, request.ttft,
                                        prompt_evaluated=request.evaluated, reused=request.reused,
                                        logprobs=tuple(request.logprobs), stop_sequence=request.stream.matched)
        if request.on_done is not None:
            request.on_done(request)
        return request

    def cancel_all(self, error: BaseException) -> list[Request]:
        """End every request in flight with ``error`` (the context is going away); one that was cancelled already
        (its step had not reaped it yet) ends cancelled, as its step would have ended it."""
        ended = []
        for seq_id, request in list(self.requests.items()):
            reaped = request.cancelled is not None and request.cancelled()
            ended.append(self._end(seq_id, "cancelled", error=None if reaped else error))
        return ended

    # -- conversations ---------------------------------------------------------------------------------
    def detach(self, conv: Conversation) -> None:
        """Forget ``conv``: its cells (if it holds a sequence) and its host buffer."""
        if self.holds(conv):
            seq_id = conv.seq
            assert seq_id is not None
            if seq_id in self.requests:
                raise ApplianceError("INTERNAL", "detach of a conversation with a request in flight")
            self.context.cancel(seq_id)
            del self.holders[seq_id]
            self._used.pop(seq_id, None)
        conv.seq = None
        conv.buffer = None
        conv.nbytes = 0
        conv.where = "empty"
        conv.n_evaluated = 0

    def _touch(self, seq_id: int) -> None:
        self._tick += 1
        self._used[seq_id] = self._tick


def claims_fit(needs: list[int], *, split: bool, seq_cells: int, n_ctx: int) -> bool:
    """Whether requests claiming ``needs`` cells each fit a context of ``n_ctx`` cells: each in a KV stream of its
    own of ``seq_cells`` cells (``split``), or all in one pool. A built context (:meth:`Slots.move_to`) and a tuning
    not built yet (:meth:`SlotRuntime.carries`) are asked the same question."""
    if split:
        return all(need <= seq_cells for need in needs)
    return sum(needs) <= n_ctx


def layout_name(v_transposed: bool) -> str:
    return "transposed (flash attention off)" if v_transposed else "as flash attention stores it"


def common_prefix(tokens: list[int], other: list[int], limit: int) -> int:
    """How many leading tokens ``tokens`` and ``other`` share, at most ``limit``."""
    n = min(len(tokens), len(other), limit)
    for index in range(n):
        if tokens[index] != other[index]:
            return index
    return n


def never_hold() -> bool:
    return False


@dataclass(frozen=True)
class ColdNeeded:
    """:meth:`SlotRuntime.begin`'s answer to a request longer than the hot pool: open a cold context of ``cells``
    (:meth:`SlotRuntime.open_cold`), then begin it again with ``cold=True``."""

    cells: int


class RequestRunner:
    """A request run to its end alone, for any runtime with ``begin``, ``step`` and ``open_cold`` (tests,
    benchmarks)."""

    def generate(self, conv: Conversation, prompt: PromptText, n_tokens: int, sampling: Sampling = GREEDY,
                 on_token: Callable[[Token], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Generation:
        """One request run to its end alone (tests, benchmarks): :meth:`begin` (in a cold context when it
        is longer than the hot pool), then :meth:`step` until it ends."""
        request = self.begin(conv, prompt, n_tokens, sampling, on_token=on_token, cancelled=cancelled)
        if isinstance(request, ColdNeeded):
            self.open_cold(request.cells)
            request = self.begin(conv, prompt, n_tokens, sampling, on_token=on_token, cancelled=cancelled, cold=True)
        if request is None or isinstance(request, ColdNeeded):
            raise ApplianceError("INTERNAL", "every sequence of the context is busy")
        while not request.done:
            self.step()
        if request.error is not None:
            raise request.error
        assert request.generation is not None
        return request.generation


class SlotRuntime(RequestRunner):
    """What every runtime built on :class:`Slots` shares (the llama.cpp one, the fake one): the live context and
    its tuning (hot pool size, plan, threads: SPEC E2-E4), the cold context of a request longer than the hot pool,
    and a request run alone. A subclass builds and frees contexts (:meth:`_new_context`, :meth:`_free`) and sets
    ``slots``, ``context``, ``tuning``, ``n_ctx`` and ``live_slots``.

    * **Retuning** happens between requests: :meth:`prepare` builds the next context beside the live one (the
      daemon runs it as its own engine job, between steps: ``async_switch``), :meth:`switch` carries the live
      conversations over to it once no request is in flight (or between two steps, the requests in flight with
      them: ``carry``, for a larger pool); :meth:`retune` does both at once. Threads change in
      place (:meth:`set_threads`).
    * **Cold path**: a request needing more cells than the whole hot pool gets :class:`ColdNeeded`; the caller opens
      a one-sequence context of that size (:meth:`open_cold`) and begins it there. When it ends the cold context
      is freed in the same step, and its conversation goes back into the hot pool if it fits without parking
      anyone, else stays parked in host RAM.
    """

    slots: Slots
    context: SequenceContext | None
    tuning: Tuning
    n_ctx: int
    live_slots: int
    flash_mode: FlashMode
    splits = True  # its contexts may be split KV streams (False: a model whose KV cache is not a plain one)
    cold: Slots | None = None
    _next: tuple[SequenceContext, Tuning] | None = None
    _rebuilding = False

    def _new_context(self, n_ctx: int, n_seq_max: int, plan: str, threads: int,
                     split: bool = False) -> SequenceContext:
        raise NotImplementedError

    def _free(self, context: SequenceContext) -> None:
        raise NotImplementedError

    # -- reading ---------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.slots.busy or (self.cold is not None and self.cold.busy)

    @property
    def v_transposed(self) -> bool:
        return flash.v_transposed(self.flash_mode)

    @property
    def live(self) -> list[Conversation]:
        return self.slots.live + (self.cold.live if self.cold is not None else [])

    @property
    def has_context(self) -> bool:
        """Whether the live context exists, or is being rebuilt (:meth:`rebuild`, on the engine thread): the event
        loop, reading this meanwhile, must not claim a context (and its ledger key) that the rebuild holds."""
        return self.context is not None or self._rebuilding

    @property
    def pool_cells(self) -> int:
        """The hot pool's KV cells (0 without a live context)."""
        return self.context.n_ctx if self.context is not None else 0

    @property
    def sequences(self) -> int:
        """The live context's sequences (``live_slots``, or its streams when split; ``live_slots`` without one)."""
        return self.context.n_seq_max if self.context is not None else self.live_slots

    @property
    def seq_cells(self) -> int:
        """The most cells one request may claim in the hot pool (its stream in a split context; 0 without one)."""
        return self.context.seq_cells if self.context is not None else 0

    def carries(self, tuning: Tuning) -> bool:
        """Whether a context built for ``tuning`` holds the requests in flight (they may be carried over to it: each
        keeps its sequence id)."""
        requests = self.slots.requests
        if any(seq_id >= tuning.sequences(self.live_slots) for seq_id in requests):
            return False
        needs = [request.need for request in requests.values()]
        return claims_fit(needs, split=tuning.split, seq_cells=tuning.seq_cells(), n_ctx=tuning.pool_cells)

    @property
    def cold_cells(self) -> int:
        """The cold context's KV cells (0 without one)."""
        return self.cold.context.n_ctx if self.cold is not None else 0

    @property
    def threads(self) -> int:
        """The live context's threads, read back from it (the tuning's without a context)."""
        return self.context.threads if self.context is not None else self.tuning.threads

    def any_cancelled(self) -> bool:
        return self.slots.any_cancelled() or (self.cold is not None and self.cold.any_cancelled())

    # -- the live context --------------------------------------------------------------------------------
    def open_context(self) -> None:
        """Build the live context with the current tuning (no-op when open)."""
        if self.context is not None:
            return
        self.context = self._new_context(self.tuning.pool_cells, self.tuning.sequences(self.live_slots),
                                         self.tuning.plan, self.tuning.threads, self.tuning.split)
        self.slots.context = self.context

    def close_context(self) -> list[Conversation]:
        """Park every live conversation in host RAM and free the context (and a prepared or cold one); returns the
        parked ones. No request may be in flight."""
        if self.context is None:
            return []
        if self.busy:
            raise ApplianceError("INTERNAL", "the context still has requests in flight")
        parked = self.close_cold()
        parked += self.slots.park_all()
        self._drop_next()
        self._free(self.context)
        self.context = None
        self.slots.context = None  # type: ignore[assignment]
        return parked

    # -- tuning (SPEC E2-E4) ---------------------------------------------------------------------------
    def prepare(self, tuning: Tuning) -> None:
        """Build the context ``tuning`` asks for beside the live one; :meth:`switch` puts it in place. Nothing
        without a live context (it was freed meanwhile)."""
        self._drop_next()
        if self.context is None:
            return
        self._next = (self._new_context(tuning.pool_cells, tuning.sequences(self.live_slots), tuning.plan,
                                        tuning.threads, tuning.split), tuning)

    @property
    def prepared(self) -> Tuning | None:
        return self._next[1] if self._next is not None else None

    def switch(self, *, carry: bool = False) -> list[Conversation] | None:
        """Put the prepared context in place of the live one, the live conversations carried over (the least
        recently used parked if they do not all fit); returns the parked ones. None (nothing changes) while a
        request is in flight, or with nothing prepared; with ``carry`` the requests in flight go on in the prepared
        context (:meth:`Slots.move_to`: it must hold their claims)."""
        if self._next is None or self.context is None:
            return None
        if self.slots.busy and not (carry and self.carries(self._next[1])):
            return None
        context, tuning = self._next
        self._next = None
        parked = self.slots.move_to(context, carry=carry)
        old, self.context = self.context, context
        self._free(old)
        self.tuning = tuning
        return parked

    def retune(self, tuning: Tuning) -> list[Conversation] | None:
        """:meth:`prepare` and :meth:`switch` now (None, nothing built, while a request is in flight)."""
        if self.context is None or self.slots.busy:
            return None
        self.prepare(tuning)
        return self.switch()

    def rebuild(self, tuning: Tuning, *, carry: bool = False) -> list[Conversation] | None:
        """Replace the live context with one for ``tuning`` without the two ever existing at once: every live
        conversation is parked in host RAM and the live context freed before the new one is built (a prepared one
        too). Returns the parked conversations; None (nothing changes) while a request is in flight in it. With
        ``carry`` the requests in flight go on in the new context from where they are (their sequences lifted to
        host RAM meanwhile: :meth:`Slots.lift_requests`); when it cannot be built, they go on in one of the old
        size and the error is raised (or end with it, when that cannot be built either)."""
        if self.context is None or (self.slots.busy and not (carry and self.carries(tuning))):
            return None
        self._rebuilding = True  # has_context stays true for the loop meanwhile: its ledger key is being replaced
        try:
            self._drop_next()
            lifted = self.slots.lift_requests()
            parked = self.slots.park_idle()
            self._free(self.context)
            self.context = None
            self.slots.context = None  # type: ignore[assignment]
            old, self.tuning = self.tuning, tuning
            try:
                self.open_context()
            except BaseException as exc:
                if not lifted:
                    raise
                self.tuning = old
                try:
                    self.open_context()  # it held them a moment ago
                except BaseException:
                    self.slots.abandon(lifted, exc)
                    raise
                self.slots.land_requests(lifted)
                raise
            self.slots.land_requests(lifted)
        finally:
            self._rebuilding = False
        return parked

    def set_threads(self, n_threads: int) -> None:
        """Decode with ``n_threads`` from the next step on, in every context of the model."""
        for context in (self.context, self._next[0] if self._next else None,
                        self.cold.context if self.cold else None):
            if context is not None:
                context.set_threads(n_threads)
        self.tuning = replace(self.tuning, threads=n_threads)
        if self._next is not None:
            self._next = (self._next[0], replace(self._next[1], threads=n_threads))

    def drop_prepared(self) -> None:
        """Free a prepared context that will not be switched in."""
        self._drop_next()

    def _drop_next(self) -> None:
        if self._next is not None:
            context, self._next = self._next[0], None
            self._free(context)

    # -- the cold path ---------------------------------------------------------------------------------
    def open_cold(self, cells: int) -> None:
        """Build a one-sequence cold context of at least ``cells`` cells (no-op when an idle one is as large)."""
        if self.cold is not None:
            if self.cold.busy:
                raise ApplianceError("INTERNAL", "the cold context is in use")
            if self.cold.context.n_ctx >= cells:
                return
            self.close_cold()
        context = self._new_context(cells, 1, "L", self.tuning.threads)
        self.cold = Slots(context, self.slots.vocabulary, n_ctx=self.n_ctx)
        self.cold.share_parked(self.slots)

    def close_cold(self) -> list[Conversation]:
        """Free an idle cold context; its conversation goes back into the hot pool when it fits without parking
        anyone, else stays parked. Returns the conversations left parked."""
        if self.cold is None or self.cold.busy:
            return []
        cold, self.cold = self.cold, None
        parked = cold.park_all()
        self._free(cold.context)
        left: list[Conversation] = []
        for conv in parked:
            if self.context is not None and self.slots.can_take(max(conv.n_evaluated, 1)):
                self.slots.restore(conv)
            else:
                left.append(conv)  # still in the parked list it shares with the hot pool (share_parked)
        return left

    # -- requests --------------------------------------------------------------------------------------
    def begin(self, conv: Conversation, prompt: PromptText, n_tokens: int, sampling: Sampling = GREEDY, *,
              on_token: Callable[[Token], None] | None = None, cancelled: Callable[[], bool] | None = None,
              on_done: Callable[[Request], None] | None = None, ephemeral: bool = False,
              before_park: Callable[[Conversation, int], None] | None = None,
              cold: bool = False) -> Request | ColdNeeded | None:
        """Start a request (:meth:`Slots.begin`) in the hot pool, or with ``cold`` in the cold context (opened
        before). :class:`ColdNeeded` when it is longer than the hot pool; None when it must wait."""
        if self.context is None:
            raise ApplianceError("INTERNAL", "the model has no live context")
        slots = self.slots
        if cold:
            if self.cold is None:
                raise ApplianceError("INTERNAL", "no cold context was opened")
            if self.cold.busy:
                return None
            if slots.holds(conv):
                slots.park(conv)
            slots = self.cold
        try:
            request = slots.begin(conv, prompt, n_tokens, sampling, on_token=on_token, cancelled=cancelled,
                                  on_done=on_done, ephemeral=ephemeral, before_park=before_park)
        except PoolTooSmall as exc:
            if cold:
                raise ApplianceError("INTERNAL", "the cold context is smaller than its request") from None
            return ColdNeeded(exc.cells)
        if request is not None:
            request.cold = cold
            request.plan = "L" if cold else self.tuning.plan
            request.threads = slots.context.threads
        return request

    def step(self, hold: Callable[[], bool] | None = None) -> list[Request]:
        """One batched decode of every request in flight (the hot context's, then the cold one's); the requests
        that ended. A cold context whose request ended is freed here."""
        ended: list[Request] = []
        if self.context is not None:
            ended += self.slots.step(hold)
        if self.cold is not None and self.cold.busy:
            ended += self.cold.step(hold)
            if not self.cold.busy:
                self.close_cold()
        return ended

    def detach(self, conv: Conversation) -> None:
        if self.cold is not None and self.cold.holds(conv):
            self.cold.detach(conv)
        else:
            self.slots.detach(conv)

    def park(self, conv: Conversation) -> None:
        """Park ``conv`` (live, no request in flight) in host RAM now."""
        if self.cold is not None and self.cold.holds(conv):
            self.cold.park(conv)
        else:
            self.slots.park(conv)

    def cancel_all(self, error: BaseException) -> None:
        if self.context is not None:
            self.slots.cancel_all(error)
        if self.cold is not None:
            self.cold.cancel_all(error)

    def free_contexts(self) -> None:
        """Free every context (the model is closing; requests were cancelled)."""
        self._drop_next()
        if self.cold is not None:
            self._free(self.cold.context)
            self.cold = None
        if self.context is not None:
            self._free(self.context)
        self.context = None
        self.slots.context = None  # type: ignore[assignment]

    def warm_up(self, prompt: str, n_tokens: int, sampling: Sampling = GREEDY) -> Request | None:
        """A warm-up generation (SPEC E5) on a throwaway conversation, run to its end now, never held at a test
        gate; None (nothing run) while a request is in flight, without a live context, or when it would park a
        conversation to make room (a prompt has at most one token per byte, plus the BOS)."""
        if self.context is None or self.busy:
            return None
        if not self.slots.can_take(len(prompt.encode("utf-8")) + 1 + n_tokens):
            return None
        request = self.begin(Conversation(), prompt, n_tokens, sampling, ephemeral=True)
        if not isinstance(request, Request):
            return None
        while not request.done:
            self.step(never_hold)
        return request
