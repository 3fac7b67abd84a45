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
conversation continued after a KV swap produces exactly what an uninterrupted one does.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from array import array
from collections.abc import Awaitable, Callable, Hashable, Iterable
from pathlib import Path
from typing import Any

from appliance.engine.interface import (
    Conversation,
    EngineProtocol,
    Generation,
    LiveSlot,
    RuntimeProtocol,
    Sampling,
    StopReason,
    SwapReport,
    Token,
    check_prompt_size,
    tokens_to_generate,
)
from appliance.engine.streamtext import StreamText
from appliance.engine.worker import DEFAULT_QUEUE, FairWorker
from appliance.errors import ApplianceError

BOS = 1
EOS = 2
LONGEST_PIECE = 4  # bytes: a fake token is one character

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


def tokenize(text: str, *, bos: bool) -> list[int]:
    """Fake tokens: one per character (its code point), after ``BOS`` when ``bos``."""
    return ([BOS] if bos else []) + [ord(c) for c in text] if text else []


def piece(token: int) -> str:
    return "" if token in (BOS, EOS) else chr(token)


class FakeRuntime(LiveSlot):
    """A loaded fake model; implements :class:`~appliance.engine.interface.RuntimeProtocol`.

    Its "KV cache" is the list of tokens it evaluated for the live conversation; a swap copies it into the
    evicted conversation's host buffer (4 bytes a token) and back, with the real runtime's bookkeeping
    (``where``, ``n_evaluated``, ``nbytes``). Generating from a KV cache that does not match the conversation's
    tokens raises ``INTERNAL``, so a swap bug shows up as an error rather than as a plausible answer.
    """

    def __init__(self, engine: FakeEngine, path: Path, *, n_ctx: int) -> None:
        self.engine = engine
        self.path = path
        self.n_ctx = n_ctx
        self.live: Conversation | None = None
        self.kv: list[int] = []
        self.closed = False
        self.saves = 0
        self.restores = 0
        self.vocabulary_digest = engine.vocabulary_of(path)

    def vocabulary(self) -> str:
        """The digest its engine's :meth:`FakeEngine.set_vocabulary` gave this file when it was loaded."""
        self._check()
        return self.vocabulary_digest

    def _check(self) -> None:
        if self.closed:
            raise ApplianceError("INTERNAL", f"fake runtime {self.path.name} is closed")
        thread = self.engine.worker_thread
        if thread is not None and threading.current_thread() is not thread:
            raise ApplianceError("INTERNAL", "a runtime was used off the engine thread")

    def close(self) -> None:
        self._check()
        self.engine.close_gate.wait()
        self.live = None
        self.kv = []
        self.closed = True

    # -- KV swap ---------------------------------------------------------------------------------
    def save(self, conv: Conversation) -> None:
        data = array("i", self.kv).tobytes()
        if conv.buffer is None or len(conv.buffer) < len(data):
            conv.buffer = bytearray(len(data))
        conv.buffer[: len(data)] = data
        conv.nbytes = len(data)
        conv.where = "host"
        conv.n_evaluated = len(self.kv)
        self.saves += 1

    def restore(self, conv: Conversation) -> None:
        self.kv = [] if conv.buffer is None else array("i", bytes(conv.buffer[: conv.nbytes])).tolist()
        conv.n_evaluated = len(self.kv)
        self.restores += 1

    def clear(self) -> None:
        self.kv = []

    def attach(self, conv: Conversation) -> SwapReport:
        self._check()
        return super().attach(conv)

    def detach(self, conv: Conversation) -> None:
        self._check()
        super().detach(conv)


    # -- generation ------------------------------------------------------------------------------
    def generate(self, conv: Conversation, prompt: str, n_tokens: int, sampling: Sampling,
                 on_token: Callable[[Token], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Generation:
        """Like the real runtime (the same rules: the prompt's byte bound with a longest piece of
        :data:`LONGEST_PIECE` bytes, ``n_tokens`` clamped to the context with ``"length"``, stream text equal to the
        final text, a cancelled or failed request rolled back); before each token it passes the engine's
        :class:`Gate` (or stops, cancelled)."""
        self._check()
        if self.live is not conv:
            raise ApplianceError("INTERNAL", "generate on a conversation that is not live")
        check_prompt_size(self.n_ctx, conv, len(prompt.encode("utf-8", errors="surrogatepass")), LONGEST_PIECE)
        new = tokenize(prompt, bos=not conv.tokens)
        n_tokens = tokens_to_generate(self.n_ctx, conv, new, n_tokens)
        if self.kv != conv.tokens[: len(self.kv)] or len(self.kv) != conv.n_evaluated:
            raise ApplianceError("INTERNAL", "fake KV cache does not match the conversation")
        start = time.perf_counter()
        before = len(conv.tokens)
        conv.tokens.extend(new)
        stream = StreamText(sampling.stop)
        out: list[int] = []
        reason: StopReason = "length"
        ttft: float | None = None
        gate = self.engine.gate
        try:
            while len(out) < n_tokens:
                if (cancelled is not None and cancelled()) or not gate.wait(cancelled):
                    reason = "cancelled"
                    break
                self.kv.extend(conv.tokens[len(self.kv):])  # "evaluate" what is pending
                conv.n_evaluated = len(self.kv)
                tok = EOS if self.engine.eos_when(conv.tokens) else next_token(self.kv)
                if ttft is None:
                    ttft = time.perf_counter() - start
                conv.tokens.append(tok)
                out.append(tok)
                self.engine.tokens_generated += 1
                if tok == EOS:
                    reason = "eos"
                    held = stream.flush()
                    if held and on_token is not None:
                        on_token(Token(tok, held, len(out) - 1, time.time()))
                    break
                text = stream.push(piece(tok).encode("utf-8"), last=len(out) == n_tokens)
                if on_token is not None:
                    on_token(Token(tok, text, len(out) - 1, time.time()))
                if stream.stopped:
                    reason = "stop"
                    break
        except BaseException:
            self._rollback(conv, before)
            raise
        if reason == "cancelled":
            self._rollback(conv, before)
        return Generation(stream.text, tuple(out), len(new), reason, time.perf_counter() - start, ttft)

    def _rollback(self, conv: Conversation, length: int) -> None:
        """Return ``conv`` and the fake KV cache to the conversation's first ``length`` tokens."""
        del conv.tokens[length:]
        del self.kv[length:]
        conv.n_evaluated = len(self.kv)


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
        return asyncio.wrap_future(self._worker.submit(fn, queue=queue))

    async def call(self, fn: Callable[..., Any], *args: Any, queue: Hashable = DEFAULT_QUEUE, **kwargs: Any) -> Any:
        return await self.submit(functools.partial(fn, *args, **kwargs), queue=queue)

    def check(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> None:
        """No child process here: a model-free daemon has nothing to trial-load. Recorded in ``checks``."""
        self.checks.append(path)

    def load(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> FakeRuntime:
        self.loads.append(path)
        self.load_gate.wait()
        for key in (str(path), path.name, path.stem):
            if key in self._failures:
                error = self._failures[key]
                raise error if error is not None else ApplianceError(
                    "MODEL_LOAD_FAILED", f"cannot load {path.name}: fake failure", {"path": str(path)})
        runtime = FakeRuntime(self, path, n_ctx=n_ctx)
        self.runtimes.append(runtime)
        return runtime

    def close(self) -> None:
        self.closed = True
        for gate in (self.gate, self.load_gate, self.close_gate):
            gate.open()  # nothing may stay held once the engine is going away
        self._worker.close()


class GatedRuntime:
    """A runtime whose every token first passes its engine's gate and delay; everything else is delegated."""

    def __init__(self, inner: RuntimeProtocol, engine: GatedEngine) -> None:
        self.inner = inner
        self.engine = engine

    @property
    def n_ctx(self) -> int:
        return self.inner.n_ctx

    @property
    def live(self) -> Conversation | None:
        return self.inner.live

    def attach(self, conv: Conversation) -> SwapReport:
        return self.inner.attach(conv)

    def detach(self, conv: Conversation) -> None:
        self.inner.detach(conv)

    def close(self) -> None:
        self.inner.close()

    def vocabulary(self) -> str:
        return self.inner.vocabulary()

    def generate(self, conv: Conversation, prompt: str, n_tokens: int, sampling: Sampling,
                 on_token: Callable[[Token], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Generation:
        engine = self.engine
        stop = cancelled or (lambda: False)

        def held() -> bool:  # the runtime asks this before each token: hold it there, then answer
            if engine.delay_s > 0:
                deadline = time.monotonic() + engine.delay_s
                while not stop() and time.monotonic() < deadline:
                    time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
            return not engine.gate.wait(stop) or stop()

        return self.inner.generate(conv, prompt, n_tokens, sampling, on_token, held)

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

    def check(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> None:
        self.inner.check(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers)

    def load(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> GatedRuntime:
        return GatedRuntime(self.inner.load(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers), self)

    def close(self) -> None:
        self.gate.open()
        self.inner.close()
