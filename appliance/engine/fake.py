"""Test doubles for the engine side of the daemon: no llama.cpp, no sleeping.

* :class:`Gate`: holds a thread before each step (a token, a load, a close) until a test lets it through,
  ``n`` steps at a time (:meth:`Gate.release`) or for good (:meth:`Gate.open`); tests await arrivals at it.
* :class:`FakeEngine` / :class:`FakeRuntime`: an :class:`~appliance.engine.interface.EngineProtocol` with one
  worker thread, like the real engine, whose runtimes generate deterministic tokens (a function of the KV state,
  which the runtime keeps and swaps like llama.cpp's per-sequence state), honour ``n_ctx``
  (``CONTEXT_OVERFLOW``), cancellation and stop strings, and whose loads can be made to fail or to block.
* :class:`GatedEngine`: wraps any engine (the real one in end-to-end tests) so that its runtimes' tokens pass a
  :class:`Gate` and an optional delay, without a hook in production code.
* :class:`ManualClock`: a clock for :class:`~appliance.daemon.core.Daemon` that only moves when told.

Fake tokens: ``BOS`` starts a conversation, every prompt character is one token (its code point) and every
generated token is a lowercase letter chosen by a hash of everything before it (see :func:`next_token`), so a
conversation continued after a KV swap produces exactly what an uninterrupted one does. The fake vocabulary has no
control tokens: a :class:`~appliance.engine.interface.Prompt` is its text, one token per character. Sampling
settings are checked as the real engine checks them (a grammar's bounds, not its GBNF, which the fake cannot run),
and asked-for log-probabilities are made up (:func:`fake_logprobs`); what a constrained model would write (a tool
call) is scripted with :attr:`FakeEngine.script`.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from array import array
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.engine import flash
from appliance.engine.adaptive import FIXED, Tuning
from appliance.engine.flash import FlashMode
from appliance.engine.interface import (
    GREEDY,
    Conversation,
    EngineProtocol,
    PromptText,
    RuntimeProtocol,
    Sampling,
    StopReason,
    Token,
    TokenLogprob,
    TokenLogprobs,
)
from appliance.engine.loopfuture import loop_future
from appliance.engine.sampling import check_grammar, check_sampling
from appliance.engine.schedule import SeqEvent
from appliance.engine.slots import ColdNeeded, Request, RequestRunner, SlotRuntime, Slots
from appliance.engine.tuning import check_split
from appliance.engine.worker import DEFAULT_QUEUE, FairWorker
from appliance.errors import ApplianceError

BOS = 1
EOS = 2
LONGEST_PIECE = 4  # bytes: a fake token is one character
N_VOCAB = 0x110000  # a token per code point

FAKE_VOCABULARY = "fake-vocabulary"
"""The vocabulary digest of a fake runtime unless :meth:`FakeEngine.set_vocabulary` says otherwise."""

_POLL_S = 0.005  # how often a thread held at a gate looks at its ``cancelled`` callback


class ManualClock:
    """A monotonic clock that tests advance explicitly: pass it as ``Daemon(clock=...)``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (never backwards) and return the new time."""
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        self.now += seconds
        return self.now


class Gate:
    """A thread-safe gate that threads pass one at a time (:meth:`wait`), each pass taking one permit.

    Open (the default) it holds nobody; closed, each :meth:`wait` blocks until :meth:`release` hands out a permit
    or :meth:`open` opens it, or until the waiter's ``cancelled`` callback says so. Counters: ``arrived`` (calls
    of :meth:`wait` so far), ``passed`` (of those, let through), ``held`` (waiting now).
    """

    def __init__(self, *, open: bool = True) -> None:
        self._cond = threading.Condition()
        self._open = open
        self._permits = 0
        self.arrived = 0
        self.passed = 0
        self.held = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        """Let everyone through, now and later."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def close(self) -> None:
        """Hold every later arrival (permits already given stay valid)."""
        with self._cond:
            self._open = False

    def release(self, n: int = 1) -> None:
        """Let ``n`` more arrivals through a closed gate."""
        with self._cond:
            self._permits += n
            self._cond.notify_all()

    def wait(self, cancelled: Callable[[], bool] | None = None, timeout: float | None = None) -> bool:
        """Pass the gate: True once through; False when ``cancelled()`` became true (checked on arrival too)
        or ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self.arrived += 1
            self.held += 1
            self._cond.notify_all()
            try:
                while not self._open and self._permits == 0:
                    if cancelled is not None and cancelled():
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    poll = _POLL_S if cancelled is not None else None
                    self._cond.wait(left if poll is None else poll if left is None else min(poll, left))
                if cancelled is not None and cancelled():
                    return False
                if not self._open:
                    self._permits -= 1
                self.passed += 1
                return True
            finally:
                self.held -= 1
                self._cond.notify_all()

    def wait_arrived(self, n: int, timeout: float = 10.0) -> None:
        """Block until ``n`` arrivals in all (``TimeoutError`` after ``timeout`` s): on a closed gate the ``n``-th
        arrival is then held there."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.arrived >= n, timeout):
                raise TimeoutError(f"gate: {self.arrived} arrivals, waited for {n}")

    async def arrival(self, n: int, timeout: float = 10.0) -> None:
        """:meth:`wait_arrived` for a coroutine: the event loop keeps running meanwhile."""
        await asyncio.to_thread(self.wait_arrived, n, timeout)


def next_token(history: Iterable[int]) -> int:
    """The fake model: a lowercase letter's code point from an FNV-1a hash of every token before it."""
    h = 0x811C9DC5
    for tok in history:
        h = ((h ^ (tok & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
    return ord("a") + h % 26


def fresh_text(prompt: str, n: int) -> str:
    """What the fake model generates in ``n`` tokens for ``prompt`` in a fresh conversation (tests compare)."""
    tokens = tokenize(prompt, bos=True)
    out = ""
    for _ in range(n):
        tokens.append(next_token(tokens))
        out += chr(tokens[-1])
    return out


def unscripted(sampling: Sampling) -> str | None:
    return None


def tokenize(text: str, *, bos: bool) -> list[int]:
    """Fake tokens: one per character (its code point), after ``BOS`` when ``bos``."""
    return ([BOS] if bos else []) + [ord(c) for c in text] if text else []


def piece(token: int) -> str:
    return "" if token in (BOS, EOS) else chr(token)


def fake_logprobs(token: int, top: int) -> TokenLogprobs:
    """Made-up log-probabilities with the real ones' shape: the sampled token has probability 1/2 and is the likeliest;
    the next ``top - 1`` alternatives (the following letters) have 1/4, 1/8, ..."""
    alternatives = [token] + [ord("a") + (token - ord("a") + k) % 26 for k in range(1, top)]
    entries = tuple(TokenLogprob(t, piece(t).encode("utf-8"), -math.log(2.0) * (k + 1))
                    for k, t in enumerate(alternatives[:top]))
    return TokenLogprobs(TokenLogprob(token, piece(token).encode("utf-8"), -math.log(2.0)), entries)


@dataclass(eq=False)
class _FakeSequence:
    pending: list[int]
    max_tokens: int
    sampling: Sampling = GREEDY
    script: list[int] | None = None  # the tokens it generates instead of the fake model's, then EOS
    generated: int = 0
    done: bool = False


class FakeContext:
    """A :class:`~appliance.engine.slots.SequenceContext` without llama.cpp: each sequence's "KV cells" are the
    tokens it evaluated, its state bytes those tokens (4 bytes each, bit-inverted in a ``v_transposed`` context, so
    that a state loaded into a context of the other layout is refused, as llama.cpp refuses it); a step "evaluates"
    every pending token and samples :func:`next_token` (or ``EOS`` when the engine's ``eos_when`` says so) for every
    generating sequence."""

    def __init__(self, engine: FakeEngine, *, n_ctx: int, n_seq_max: int, plan: str = "fixed",
                 threads: int = 1, v_transposed: bool = False, split: bool = False) -> None:
        self.engine = engine
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        if split:
            check_split(n_ctx, n_seq_max)  # as BatchedContext: a stream of exactly n_ctx / n_seq_max cells
        self.split = split  # a KV stream of seq_cells cells per sequence, as llama.cpp's split context
        self.seq_cells = n_ctx // n_seq_max if split else n_ctx
        self.v_transposed = v_transposed
        self.plan = plan
        self.threads = threads
        self.kv: dict[int, list[int]] = {}  # seq id -> evaluated tokens, for every sequence holding cells
        self.running: dict[int, _FakeSequence] = {}
        self.steps = 0
        self.last_batch = 0

    def set_threads(self, n_threads: int) -> None:
        self.threads = n_threads

    def _room(self, seq_id: int, cells: int, *, continuing: bool = False) -> None:
        if self.split:
            if cells > self.seq_cells:
                raise ApplianceError("CONTEXT_OVERFLOW", "the sequence does not fit in its KV stream",
                                     {"seq_cells": self.seq_cells, "requested": cells})
            return
        claimed = self.cells_claimed() - (len(self.kv.get(seq_id, [])) if continuing else 0)
        if claimed + cells > self.n_ctx:
            raise ApplianceError("CONTEXT_OVERFLOW", "the sequence does not fit beside the others in the context",
                                 {"n_ctx": self.n_ctx, "claimed": claimed, "requested": cells})

    def add(self, seq_id: int, prompt_tokens: list[int], sampling: Sampling, max_tokens: int, *,
            n_past: int = 0, seen: list[int] | None = None) -> None:
        if seq_id in self.running:
            raise ApplianceError("BAD_REQUEST", "the sequence id is in use", {"seq_id": seq_id})
        cells = self.kv.get(seq_id, [])
        if n_past > len(cells):
            raise ApplianceError("BAD_REQUEST", "the sequence holds fewer cells than it continues",
                                 {"seq_id": seq_id, "n_past": n_past, "cells": len(cells)})
        self._room(seq_id, n_past + len(prompt_tokens) + max_tokens, continuing=True)
        scripted = self.engine.script(sampling)
        self.kv[seq_id] = cells[:n_past]
        self.running[seq_id] = _FakeSequence(list(prompt_tokens), max_tokens, sampling,
                                             None if scripted is None else [ord(c) for c in scripted])

    def has_work(self) -> bool:
        return any(not seq.done for seq in self.running.values())

    def step(self) -> list[SeqEvent]:
        events: list[SeqEvent] = []
        self.last_batch = 0
        for seq_id, seq in self.running.items():
            if seq.done:
                continue
            cells = self.kv[seq_id]
            self.last_batch += len(seq.pending)
            cells.extend(seq.pending)
            seq.pending = []
            if seq.script is not None:
                token = seq.script[seq.generated] if seq.generated < len(seq.script) else EOS
            else:
                token = EOS if self.engine.eos_when(list(cells)) else next_token(cells)
            seq.generated += 1
            seq.pending.append(token)
            reason: StopReason | None = "eos" if token == EOS else None
            if reason is None and seq.generated >= seq.max_tokens:
                reason = "length"
            seq.done = reason is not None
            self.engine.tokens_generated += 1
            top = seq.sampling.logprobs
            logprobs = None if top is None else fake_logprobs(token, top)
            events.append(SeqEvent(seq_id, token, b"" if reason == "eos" else piece(token).encode("utf-8"),
                                   seq.done, reason, logprobs))
        self.steps += 1
        return events

    def finish(self, seq_id: int, keep: int | None = None) -> int:
        del self.running[seq_id]
        cells = self.kv[seq_id]
        if keep is not None:
            del cells[keep:]
        return len(cells)

    def cancel(self, seq_id: int) -> None:
        self.running.pop(seq_id, None)
        self.kv.pop(seq_id, None)

    def cells(self, seq_id: int) -> int:
        return len(self.kv.get(seq_id, []))

    def cells_claimed(self) -> int:
        running = sum(len(seq.pending) + (0 if seq.done else seq.max_tokens - seq.generated)
                      for seq in self.running.values())
        return running + sum(len(cells) for cells in self.kv.values())

    def copy(self, source: int, target: int, n: int) -> None:
        self._room(target, n)
        self.kv[target] = self.kv[source][:n]

    def truncate(self, seq_id: int, keep: int) -> None:
        del self.kv[seq_id][keep:]

    def state_size(self, seq_id: int) -> int:
        return 4 * len(self.kv[seq_id])

    def state_into(self, seq_id: int, buffer: bytearray) -> int:
        cells = self.kv[seq_id]
        data = array("i", [~cell for cell in cells] if self.v_transposed else cells).tobytes()
        buffer[:len(data)] = data
        return len(data)

    def load_state(self, seq_id: int, state: bytes | bytearray | memoryview, n_past: int) -> None:
        self._room(seq_id, n_past)
        cells = array("i", bytes(state)).tolist()
        if len(cells) != n_past:
            raise ApplianceError("INTERNAL", "fake KV state does not match its token count")
        if any((cell < 0) != self.v_transposed for cell in cells):  # token ids are never negative
            raise ApplianceError("INTERNAL", "llama.cpp refused the saved sequence state", {"seq_id": seq_id})
        self.kv[seq_id] = [~cell for cell in cells] if self.v_transposed else cells

    def lift(self, seq_id: int) -> tuple[list[int], _FakeSequence]:
        """Take generating sequence ``seq_id`` out (its cells and its state), to :meth:`land` in another context."""
        if seq_id not in self.running:
            raise ApplianceError("BAD_REQUEST", "no such sequence in the context", {"seq_id": seq_id})
        return self.kv.pop(seq_id), self.running.pop(seq_id)

    def land(self, seq_id: int, lifted: tuple[list[int], _FakeSequence]) -> None:
        """The free id ``seq_id`` becomes the :meth:`lift`-ed sequence, as it was."""
        if seq_id in self.running or seq_id in self.kv:
            raise ApplianceError("BAD_REQUEST", "the sequence id is in use", {"seq_id": seq_id})
        cells, seq = lifted
        self._room(seq_id, len(cells) + len(seq.pending) + (0 if seq.done else seq.max_tokens - seq.generated))
        self.kv[seq_id] = cells
        self.running[seq_id] = seq


class FakeRuntime(SlotRuntime):
    """A loaded fake model; implements :class:`~appliance.engine.interface.RuntimeProtocol` with the real
    runtime's :class:`~appliance.engine.slots.Slots` over a :class:`FakeContext`.

    Before each step it passes the engine's :class:`Gate` (a cancelled request is reaped while it waits). A
    conversation whose cells do not match its tokens raises ``INTERNAL`` at its next request, so a swap bug shows
    up as an error rather than as a plausible answer.
    """

    longest_piece = LONGEST_PIECE

    def __init__(self, engine: FakeEngine, path: Path, *, n_ctx: int, live_slots: int = 1,
                 tuning: Tuning | None = None, flash_attention: FlashMode | bool = "auto") -> None:
        self.engine = engine
        self.path = path
        self.flash_mode = flash.mode_of(flash_attention)
        self.n_ctx = n_ctx
        self.live_slots = live_slots
        self.tuning = tuning or Tuning(n_ctx, FIXED, engine.n_threads)
        self.closed = False
        self.vocabulary_digest = engine.vocabulary_of(path)
        self.context: FakeContext | None = None
        self.contexts_built = 0
        self.slots = Slots(None, self, n_ctx=n_ctx)
        self.open_context()

    def _new_context(self, n_ctx: int, n_seq_max: int, plan: str, threads: int, split: bool = False) -> FakeContext:
        self.contexts_built += 1
        return FakeContext(self.engine, n_ctx=n_ctx, n_seq_max=n_seq_max, plan=plan, threads=threads,
                           v_transposed=self.v_transposed, split=split)

    def _free(self, context: FakeContext) -> None:  # type: ignore[override]
        context.running.clear()
        context.kv.clear()

    @property
    def flash_attention(self) -> bool | None:
        """The fake device runs flash attention wherever it is not ``off``; None without a live context."""
        return None if self.context is None else self.flash_mode != "off"

    @property
    def saves(self) -> int:
        return self.slots.saves

    @property
    def restores(self) -> int:
        return self.slots.restores

    def vocabulary(self) -> str:
        """The digest its engine's :meth:`FakeEngine.set_vocabulary` gave this file when it was loaded."""
        self._check()
        return self.vocabulary_digest

    def tokenize(self, text: str, *, bos: bool, special: bool = False) -> list[int]:
        return tokenize(text, bos=bos)

    def control_texts(self) -> tuple[str, ...]:
        return ()

    def check_sampling(self, sampling: Sampling) -> None:
        check_sampling(sampling, N_VOCAB)
        if sampling.grammar is not None:
            check_grammar(sampling.grammar)

    def piece(self, token: int) -> bytes:
        return piece(token).encode("utf-8")

    def _check(self) -> None:
        if self.closed:
            raise ApplianceError("INTERNAL", f"fake runtime {self.path.name} is closed")
        thread = self.engine.worker_thread
        if thread is not None and threading.current_thread() is not thread:
            raise ApplianceError("INTERNAL", "a runtime was used off the engine thread")

    def close_context(self) -> list[Conversation]:
        self._check()
        return super().close_context()

    def begin(self, conv: Conversation, prompt: PromptText, n_tokens: int, sampling: Sampling = GREEDY, *,
              on_token: Callable[[Token], None] | None = None, cancelled: Callable[[], bool] | None = None,
              on_done: Callable[[Request], None] | None = None, ephemeral: bool = False,
              before_park: Callable[[Conversation, int], None] | None = None,
              cold: bool = False) -> Request | ColdNeeded | None:
        self._check()
        holder = self.cold if self.cold is not None and self.cold.holds(conv) else self.slots
        context = holder.context
        if holder.holds(conv) and conv.seq is not None and context is not None and \
                context.kv.get(conv.seq) != conv.tokens[:context.cells(conv.seq)]:  # type: ignore[attr-defined]
            raise ApplianceError("INTERNAL", "fake KV cache does not match the conversation")
        return super().begin(conv, prompt, n_tokens, sampling, on_token=on_token, cancelled=cancelled,
                             on_done=on_done, ephemeral=ephemeral, before_park=before_park, cold=cold)

    def step(self, hold: Callable[[], bool] | None = None) -> list[Request]:
        self._check()
        if self.context is None:
            return []
        return super().step(hold or self._hold)

    def _hold(self) -> bool:
        """Wait at the engine's gate before a step; True (hold the step) when a request was cancelled meanwhile."""
        return not self.engine.gate.wait(self.any_cancelled)

    def detach(self, conv: Conversation) -> None:
        self._check()
        super().detach(conv)

    def park(self, conv: Conversation) -> None:
        self._check()
        super().park(conv)

    def close(self) -> None:
        self._check()
        self.engine.close_gate.wait()
        self.cancel_all(ApplianceError("SHUTTING_DOWN"))
        self.free_contexts()
        self.closed = True


class FakeEngine:
    """An :class:`~appliance.engine.interface.EngineProtocol` without llama.cpp: one worker thread, as the real
    engine, loading :class:`FakeRuntime` s.

    Test controls (all thread-safe to use from the test's thread or event loop):

    * ``gate``: passed before every generated token (open by default); ``load_gate`` before every load and
      ``close_gate`` before every runtime close, so a test can hold the daemon in ``loading`` or ``unloading``.
    * :meth:`fail_load`: loads of a model file fail with ``MODEL_LOAD_FAILED`` (or a given error).
    * :meth:`set_vocabulary`: the vocabulary digest the runtimes of a model file report (default
      :data:`FAKE_VOCABULARY`), read at load time: a test changes it to reload a model with another vocabulary.
    * ``eos_when``: a predicate on the conversation's tokens; when it is true the next token is ``EOS``.
    * ``script``: given a request's sampling, the text it generates instead of the fake model's (then ``EOS``), or
      None (default: always None): a test makes a request with a grammar write a tool call.
    * Records: ``loads`` (every load attempt's path, in order), ``checks`` (every :meth:`check`'s path),
      ``runtimes`` (those that succeeded), ``tokens_generated``, ``closed``.
    """

    def __init__(self, n_threads: int = 1, *, gate: Gate | None = None) -> None:
        self.n_threads = n_threads
        self.gate = gate or Gate()
        self.load_gate = Gate()
        self.close_gate = Gate()
        self.loads: list[Path] = []
        self.checks: list[Path] = []
        self.runtimes: list[FakeRuntime] = []
        self.tokens_generated = 0
        self.closed = False
        self.eos_when: Callable[[list[int]], bool] = lambda tokens: False
        self.script: Callable[[Sampling], str | None] = unscripted
        self._failures: dict[str, BaseException | None] = {}
        self._vocabularies: dict[str, str] = {}
        self._worker = FairWorker("fake-engine")
        self.worker_thread: threading.Thread | None = self._worker.thread

    def fail_load(self, name: str, error: BaseException | None = None) -> None:
        """Make loads of ``name`` (a model file's path, file name or stem) fail: with ``error``, else with the
        ``MODEL_LOAD_FAILED`` the real engine raises for a bad file."""
        self._failures[name] = error

    def heal(self, name: str | None = None) -> None:
        """Undo :meth:`fail_load` for ``name`` (every name when None)."""
        if name is None:
            self._failures.clear()
        else:
            self._failures.pop(name, None)

    def set_vocabulary(self, name: str, digest: str) -> None:
        """Runtimes of ``name`` (a model file's path, file name or stem) loaded from now on report ``digest``."""
        self._vocabularies[name] = digest

    def vocabulary_of(self, path: Path) -> str:
        for key in (str(path), path.name, path.stem):
            if key in self._vocabularies:
                return self._vocabularies[key]
        return FAKE_VOCABULARY

    @property
    def live_runtimes(self) -> list[FakeRuntime]:
        return [rt for rt in self.runtimes if not rt.closed]

    # -- EngineProtocol ----------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], *, queue: Hashable = DEFAULT_QUEUE) -> asyncio.Future[Any]:
        if self.closed:
            raise RuntimeError("the fake engine is closed")
        return loop_future(self._worker.submit(fn, queue=queue))

    async def call(self, fn: Callable[..., Any], *args: Any, queue: Hashable = DEFAULT_QUEUE, **kwargs: Any) -> Any:
        return await self.submit(functools.partial(fn, *args, **kwargs), queue=queue)

    @property
    def gpu_offload(self) -> bool:
        """No GPU here: the fake engine's models run nowhere but in memory."""
        return False

    def file_present(self, path: Path) -> bool:
        """The fake engine's models are not files (their paths need not exist): always there."""
        return True

    def check(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> None:
        """No child process here: a model-free daemon has nothing to trial-load. Recorded in ``checks``."""
        self.checks.append(path)

    def load(self, path: Path, *, n_ctx: int, n_gpu_layers: int, live_slots: int = 1,
             flash_attention: FlashMode | bool = "auto", cache_type: str = "f16",
             tuning: Tuning | None = None) -> FakeRuntime:
        self.loads.append(path)
        self.load_gate.wait()
        for key in (str(path), path.name, path.stem):
            if key in self._failures:
                error = self._failures[key]
                raise error if error is not None else ApplianceError(
                    "MODEL_LOAD_FAILED", f"cannot load {path.name}: fake failure", {"path": str(path)})
        runtime = FakeRuntime(self, path, n_ctx=n_ctx, live_slots=live_slots, tuning=tuning,
                              flash_attention=flash_attention)
        self.runtimes.append(runtime)
        return runtime

    def close(self) -> None:
        self.closed = True
        for gate in (self.gate, self.load_gate, self.close_gate):
            gate.open()  # nothing may stay held once the engine is going away
        self._worker.close()


class GatedRuntime(RequestRunner):
    """A runtime whose every step first passes its engine's gate and delay; everything else is delegated."""

    def __init__(self, inner: RuntimeProtocol, engine: GatedEngine) -> None:
        self.inner = inner
        self.engine = engine

    def step(self, hold: Callable[[], bool] | None = None) -> list[Request]:
        engine = self.engine
        inner: SlotRuntime = self.inner  # type: ignore[assignment]
        if not inner.busy:
            return []
        if engine.delay_s > 0:
            deadline = time.monotonic() + engine.delay_s
            while not inner.any_cancelled() and time.monotonic() < deadline:
                time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        passed = engine.gate.wait(inner.any_cancelled)

        def held() -> bool:
            return not passed

        return inner.step(held)

    def begin(self, *args: Any, **kwargs: Any) -> Request | ColdNeeded | None:
        return self.inner.begin(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class GatedEngine:
    """Wraps an engine (the real llama.cpp one in end-to-end tests) so that each token of its runtimes first
    waits ``delay_s`` seconds and passes ``gate``; both can change at any time, and a cancelled generation
    leaves either at once. Implements :class:`~appliance.engine.interface.EngineProtocol`."""

    def __init__(self, inner: EngineProtocol, *, gate: Gate | None = None, delay_s: float = 0.0) -> None:
        self.inner = inner
        self.gate = gate or Gate()
        self.delay_s = delay_s

    @property
    def n_threads(self) -> int:
        return self.inner.n_threads

    def submit(self, fn: Callable[[], Any], *, queue: Hashable = DEFAULT_QUEUE) -> Awaitable[Any]:
        return self.inner.submit(fn, queue=queue)

    def call(self, fn: Callable[..., Any], *args: Any, queue: Hashable = DEFAULT_QUEUE,
             **kwargs: Any) -> Awaitable[Any]:
        return self.inner.call(fn, *args, queue=queue, **kwargs)

    @property
    def gpu_offload(self) -> bool:
        return self.inner.gpu_offload

    def file_present(self, path: Path) -> bool:
        return self.inner.file_present(path)

    def check(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> None:
        self.inner.check(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers)

    def load(self, path: Path, *, n_ctx: int, n_gpu_layers: int, live_slots: int = 1,
             flash_attention: FlashMode | bool = "auto", cache_type: str = "f16",
             tuning: Tuning | None = None) -> GatedRuntime:
        return GatedRuntime(self.inner.load(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, live_slots=live_slots,
                                            flash_attention=flash_attention, cache_type=cache_type, tuning=tuning),
                            self)

    def close(self) -> None:
        self.gate.open()
        self.inner.close()
