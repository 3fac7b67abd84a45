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
  live sequence (llama.cpp shares the cells: ``llama_memory_seq_cp``) or a parked conversation (its state is
  loaded, then cut) already holds; ``Generation.prompt_evaluated`` says how many tokens were really evaluated.
* **Rollback.** A cancelled or failed request leaves its conversation as it was before (tokens and cells).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from appliance.engine.interface import (
    GREEDY,
    Conversation,
    Generation,
    Sampling,
    StopReason,
    Token,
    check_prompt_size,
    tokens_to_generate,
)
from appliance.engine.streamtext import StreamText
from appliance.errors import ApplianceError

MIN_SHARED_PREFIX = 16
"""Tokens a borrowed prefix must have at least: a few shared tokens (the BOS, a chat template's first words) save
nothing worth reporting."""


class SampledToken(Protocol):
    seq_id: int
    token: int
    piece: bytes
    done: bool
    stop_reason: StopReason | None


class SequenceContext(Protocol):
    """What :class:`Slots` needs of a multi-sequence context (see :class:`~appliance.engine.batched.BatchedContext`
    for the meaning of each call)."""

    n_ctx: int
    n_seq_max: int

    def add(self, seq_id: int, prompt_tokens: list[int], sampling: Sampling, max_tokens: int, *,
            n_past: int = 0) -> None: ...

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


class Vocabulary(Protocol):
    longest_piece: int

    def tokenize(self, text: str, *, bos: bool) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...


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
    ttft: float | None = None
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

    # -- requests --------------------------------------------------------------------------------------
    def begin(self, conv: Conversation, prompt: str, n_tokens: int, sampling: Sampling, *,
              on_token: Callable[[Token], None] | None = None, cancelled: Callable[[], bool] | None = None,
              on_done: Callable[[Request], None] | None = None, ephemeral: bool = False,
              before_park: Callable[[Conversation], None] | None = None) -> Request | None:
        """Start a request: ``conv`` continues with ``prompt`` and up to ``n_tokens`` tokens. None when every
        sequence or the cells it needs are held by requests in flight (ask again after a :meth:`step` ended one).
        ``before_park`` is told of each conversation about to be parked for it (to make room in host RAM first).
        Refusals (``BAD_REQUEST``, ``CONTEXT_OVERFLOW``) change nothing."""
        if self.holds(conv) and conv.seq in self.requests:
            raise ApplianceError("INTERNAL", "a conversation with a request in flight got another")
        try:
            data = prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ApplianceError("BAD_REQUEST", "the prompt is not valid Unicode (it has a lone surrogate)",
                                 {"field": "prompt"}) from None
        check_prompt_size(self.n_ctx, conv, len(data), self.vocabulary.longest_piece)
        new = self.vocabulary.tokenize(prompt, bos=not conv.tokens) if data else []
        n_tokens = tokens_to_generate(self.n_ctx, conv, new, n_tokens)
        need = len(conv.tokens) + len(new) + n_tokens
        request = Request(conv, len(new), n_tokens, sampling, on_token, cancelled, on_done, ephemeral,
                          len(conv.tokens), StreamText(sampling.stop, b"" if new else self._primer(conv)),
                          time.perf_counter())
        seq_id = self._seat(conv, need, request.evicted, before_park)
        if seq_id is None:
            return None
        if not self.holds(conv):
            request.restored = self._place(conv, seq_id)
        tokens = conv.tokens + new
        cells = self.context.cells(seq_id)
        if cells == 0:
            cells = self._borrow(seq_id, tokens, request)
        cells = min(cells, len(tokens) - 1)  # at least one token is evaluated: its logits give the first token
        conv.tokens.extend(new)
        try:
            self.context.add(seq_id, tokens[cells:], sampling, n_tokens, n_past=cells)
        except BaseException:
            del conv.tokens[request.before:]
            raise
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
              before_park: Callable[[Conversation], None] | None) -> int | None:
        """The sequence ``conv`` holds, or a free one for it, with room for ``need`` cells: idle conversations are
        parked (least recently used first, added to ``evicted``) as needed. None when requests in flight hold what
        it needs."""
        own = conv.seq if self.holds(conv) else None
        while (own is None and self._free_seq() is None) or not self._fits(need, own):
            victim = self._idle_victim(exclude=own)
            if victim is None:
                return None
            if before_park is not None:
                before_park(self.holders[victim])
            evicted.append(self._park(victim))
        return own if own is not None else self._free_seq()

    def _fits(self, need: int, own: int | None) -> bool:
        held = self.context.cells(own) if own is not None else 0
        return self.context.cells_claimed() - held + need <= self.context.n_ctx

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
        """``conv`` takes the free ``seq_id``: its parked state comes back (True), or it starts with no cells."""
        restored = conv.where == "host" and conv.buffer is not None and conv.nbytes > 0
        if restored:
            assert conv.buffer is not None
            self.context.load_state(seq_id, memoryview(conv.buffer)[:conv.nbytes], conv.n_evaluated)
            self.restores += 1
        else:
            conv.n_evaluated = 0
        conv.where = "device"
        conv.seq = seq_id
        self.holders[seq_id] = conv
        self._touch(seq_id)
        return restored

    def _park(self, seq_id: int) -> Conversation:
        """Copy a resting sequence's cells to its conversation's host buffer and free the sequence."""
        conv = self.holders.pop(seq_id)
        size = self.context.state_size(seq_id)
        if conv.buffer is None or len(conv.buffer) < size:
            conv.buffer = bytearray(size)  # reused by its later parks: no allocation per swap
        conv.nbytes = self.context.state_into(seq_id, conv.buffer)
        conv.n_evaluated = self.context.cells(seq_id)
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
        return [self._park(seq_id) for seq_id in list(self.holders)]

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
        """The conversations this runtime parked that still hold their state in host RAM."""
        alive = [conv for conv in self._parked if conv.where == "host" and conv.buffer is not None]
        self._parked = alive
        return list(alive)

    # -- steps -----------------------------------------------------------------------------------------
    def step(self, hold: Callable[[], bool] | None = None) -> list[Request]:
        """Reap cancelled requests, then (unless ``hold()`` says to wait) decode one batch and deliver its
        tokens. Returns the requests that ended."""
        ended = self._reap()
        if not self.context.has_work():
            return ended
        if hold is not None and hold():
            return ended + self._reap()
        try:
            events = self.context.step()
        except BaseException as exc:
            for seq_id in list(self.requests):
                ended.append(self._end(seq_id, "cancelled", error=exc))
            return ended
        now = time.perf_counter()
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

    def _deliver(self, request: Request, event: SampledToken, now: float) -> StopReason | None:
        conv = request.conv
        if request.ttft is None:
            request.ttft = now - request.started
        conv.tokens.append(event.token)
        request.out.append(event.token)
        index = len(request.out) - 1
        if event.stop_reason == "eos":
            held = request.stream.flush()
            if held and request.on_token is not None:
                request.on_token(Token(event.token, held, index, time.time()))
            return "eos"
        last = len(request.out) >= request.n_tokens
        text = request.stream.push(event.piece, last=last)
        if request.on_token is not None:
            request.on_token(Token(event.token, text, index, time.time()))
        if request.stream.stopped:
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
        request.done = True
        request.error = error
        request.generation = Generation(request.stream.text, tuple(request.out), request.prompt_tokens, reason,
                                        time.perf_counter() - request.started, request.ttft,
                                        prompt_evaluated=request.evaluated, reused=request.reused)
        if request.ephemeral:
            self.detach(conv)
        self._touch(seq_id)
        if request.on_done is not None:
            request.on_done(request)
        return request

    def cancel_all(self, error: BaseException) -> list[Request]:
        """End every request in flight with ``error`` (the context is going away)."""
        return [self._end(seq_id, "cancelled", error=error) for seq_id in list(self.requests)]

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


def common_prefix(tokens: list[int], other: list[int], limit: int) -> int:
    """How many leading tokens ``tokens`` and ``other`` share, at most ``limit``."""
    n = min(len(tokens), len(other), limit)
    for index in range(n):
        if tokens[index] != other[index]:
            return index
    return n


class SlotRuntime:
    """What every runtime built on :class:`Slots` shares (the llama.cpp one, the fake one, the gated wrapper): the
    reading of its conversations and a request run alone. A subclass provides ``slots``, ``begin`` and ``step``."""

    slots: Slots

    @property
    def busy(self) -> bool:
        return self.slots.busy

    @property
    def live(self) -> list[Conversation]:
        return self.slots.live

    def begin(self, conv: Conversation, prompt: str, n_tokens: int, sampling: Sampling, *,
              on_token: Callable[[Token], None] | None = None,
              cancelled: Callable[[], bool] | None = None) -> Request | None:
        raise NotImplementedError

    def step(self) -> list[Request]:
        raise NotImplementedError

    def generate(self, conv: Conversation, prompt: str, n_tokens: int, sampling: Sampling = GREEDY,
                 on_token: Callable[[Token], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Generation:
        """One request run to its end alone (tests, benchmarks): :meth:`begin`, then :meth:`step` until it ends."""
        request = self.begin(conv, prompt, n_tokens, sampling, on_token=on_token, cancelled=cancelled)
        if request is None:
            raise ApplianceError("INTERNAL", "every sequence of the context is busy")
        while not request.done:
            self.step()
        if request.error is not None:
            raise request.error
        assert request.generation is not None
        return request.generation
