"""The engine: a thin shell over llama-cpp-python.

All llama.cpp work of a device happens on one worker thread (:class:`Engine`), so the event loop never
blocks on a model and llama.cpp contexts are never touched by two threads. A :class:`Runtime` is one loaded
GGUF with one live context; agents' conversations (:class:`Conversation`) take turns in it, the others'
KV state parked in host RAM through llama.cpp's per-sequence state API into reusable buffers.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import llama_cpp

from appliance.engine import modelcheck
from appliance.engine.interface import (  # re-exported: importers of these from here keep working
    GREEDY,
    Conversation,
    Generation,
    LiveSlot,
    Sampling,
    StopReason,
    SwapReport,
    Token,
    Where,
    check_prompt_size,
    tokens_to_generate,
)
from appliance.engine.streamtext import StreamText
from appliance.engine.worker import DEFAULT_QUEUE, FairWorker
from appliance.errors import ApplianceError

__all__ = ["GREEDY", "Conversation", "Engine", "Generation", "Runtime", "Sampling", "StopReason", "SwapReport",
           "Token", "Where"]

log = logging.getLogger(__name__)


class Runtime(LiveSlot):
    """One loaded model with one live context, shared by the conversations of every agent on it
    (implements :class:`~appliance.engine.interface.RuntimeProtocol`)."""

    def __init__(self, path: Path, *, n_ctx: int, n_gpu_layers: int, n_threads: int | None) -> None:
        self.path = path
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_gpu_layers=n_gpu_layers,
                                       n_threads=n_threads, n_batch=min(512, n_ctx), seed=0, verbose=False)
        except Exception as exc:  # llama.cpp reports a bad file as ValueError or RuntimeError
            raise ApplianceError("MODEL_LOAD_FAILED", f"cannot load {path.name}: {exc}",
                                 {"path": str(path)}) from exc
        # The configured size bounds every conversation: llama.cpp may round its context up (to 256 at least),
        # but llama-cpp-python sizes its token buffer by the n_ctx it was given.
        self.n_ctx = min(n_ctx, self.llm.n_ctx())
        self.eos = self.llm.token_eos()
        self.live: Conversation | None = None
        self._pieces: dict[int, bytes] = {}
        self._vocabulary: str | None = None
        self.longest_piece = self._longest_piece()

    def _longest_piece(self) -> int:
        """The most bytes one token of the vocabulary stands for: a prompt of B bytes is at least
        B / longest_piece tokens, so its size alone can show that it cannot fit (see :meth:`generate`)."""
        vocab = self.llm._model.vocab
        size = 256
        buf = ctypes.create_string_buffer(size)
        longest = 1
        for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
            n = llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, False)
            longest = max(longest, abs(n))  # a negative n is the size a piece too long for buf needs
        return longest

    def vocabulary(self) -> str:
        """A SHA-256 of every token's text, in id order (cached): equal digests, interchangeable token ids."""
        if self._vocabulary is None:
            vocab = self.llm._model.vocab
            digest = hashlib.sha256()
            for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
                text = llama_cpp.llama_vocab_get_text(vocab, token) or b""
                digest.update(len(text).to_bytes(4, "little"))
                digest.update(text)
            self._vocabulary = digest.hexdigest()
        return self._vocabulary

    def close(self) -> None:
        self.live = None
        self.llm.close()

    def piece(self, token: int) -> bytes:
        """The bytes of one token (cached; llama-cpp-python's own helper returns a padded buffer)."""
        cached = self._pieces.get(token)
        if cached is None:
            size = 64
            while True:
                buf = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_token_to_piece(self.llm._model.vocab, token, buf, size, 0, False)
                if n >= 0:
                    break
                size = -n
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def tokenize(self, text: str, *, bos: bool) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=bos, special=False) if text else []

    # -- KV swap ---------------------------------------------------------------------------------
    def save(self, conv: Conversation) -> None:
        """Copy the live KV of sequence 0 into the conversation's host buffer (reused across swaps)."""
        ctx = self.llm.ctx
        size = int(llama_cpp.llama_state_seq_get_size(ctx, 0))
        if conv.buffer is None or len(conv.buffer) < size:
            conv.buffer = bytearray(size)
        view = (ctypes.c_uint8 * len(conv.buffer)).from_buffer(conv.buffer)
        written = int(llama_cpp.llama_state_seq_get_data(ctx, view, size, 0))
        del view
        if written == 0 and size > 0:
            raise ApplianceError("INTERNAL", "llama.cpp could not copy the KV state")
        conv.nbytes = written
        conv.where = "host"
        conv.n_evaluated = self.llm.n_tokens

    def restore(self, conv: Conversation) -> None:
        self.clear()
        if conv.buffer is None or conv.nbytes == 0:
            conv.n_evaluated = 0
            return
        view = (ctypes.c_uint8 * len(conv.buffer)).from_buffer(conv.buffer)
        read = int(llama_cpp.llama_state_seq_set_data(self.llm.ctx, view, conv.nbytes, 0))
        del view
        if read == 0:
            raise ApplianceError("INTERNAL", "llama.cpp refused the saved KV state")
        self.llm.input_ids[: conv.n_evaluated] = conv.tokens[: conv.n_evaluated]
        self.llm.n_tokens = conv.n_evaluated

    def clear(self) -> None:
        """Forget the live KV's cell bookkeeping only: cells that hold no sequence are never attended and are
        overwritten when used, so wiping their data too (llama-cpp-python's kv_cache_clear memsets the whole
        n_ctx-cell cache) would cost a full-cache memset per swap or stateless request."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm.ctx), False)
        self.llm.n_tokens = 0

    # -- generation ------------------------------------------------------------------------------
    def generate(self, conv: Conversation, prompt: str, n_tokens: int, sampling: Sampling,
                 on_token: Callable[[Token], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Generation:
        """Continue ``conv`` with ``prompt`` and up to ``n_tokens`` new tokens. ``conv`` must be attached.

        * Context: ``n_tokens`` is clamped to the room the prompt leaves in the context (the generation then ends
          there with ``"length"``); only a prompt that leaves no room for one new token is ``CONTEXT_OVERFLOW``.
          A prompt longer in UTF-8 bytes than (room left) x (the vocabulary's longest token piece) cannot fit
          and is refused so, without being tokenized (``details["max_prompt_bytes"]``).
        * Text: the ``text`` of the tokens given to ``on_token``, joined, is always ``Generation.text``
          (:class:`~appliance.engine.streamtext.StreamText`). A UTF-8 sequence still incomplete at the end is
          dropped from both (a continuation without a prompt completes it: its bytes prime the next decoder);
          text that could begin a stop string is held back until it cannot, and a stop string and what follows
          it is in neither. Text held back when the model ends it is streamed with the end-of-generation token.
        * Cancelled (and failed): the conversation returns to what it was before the call (its tokens, the live
          KV cells, ``n_evaluated``), as if the request had never been sent: its client got CANCELLED or an
          error, not the text. The returned generation still counts the tokens made.
        """
        if self.live is not conv:
            raise ApplianceError("INTERNAL", "generate on a conversation that is not live")
        data = self._prompt_bytes(conv, prompt)
        new = self.llm.tokenize(data, add_bos=not conv.tokens, special=False) if data else []
        n_tokens = tokens_to_generate(self.n_ctx, conv, new, n_tokens)
        llm = self.llm
        start = time.perf_counter()
        before = len(conv.tokens)
        stream = StreamText(sampling.stop, b"" if new else b"".join(self.piece(t) for t in conv.tokens[-4:]))
        conv.tokens.extend(new)
        if llm.n_tokens >= len(conv.tokens):  # nothing pending: re-evaluate the last token for fresh logits
            llm._ctx.kv_cache_seq_rm(0, len(conv.tokens) - 1, -1)
            llm.n_tokens = len(conv.tokens) - 1
        llm.set_seed(sampling.seed)  # before the sampler chain is built: it takes the seed from here
        sampler = llm._init_sampler(temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                    min_p=0.0)
        out: list[int] = []
        reason: StopReason = "length"
        ttft: float | None = None
        try:
            while len(out) < n_tokens:
                if cancelled is not None and cancelled():
                    reason = "cancelled"
                    break
                self._eval(conv.tokens[llm.n_tokens:])
                conv.n_evaluated = llm.n_tokens
                tok = sampler.sample(llm._ctx, -1)
                if ttft is None:
                    ttft = time.perf_counter() - start
                conv.tokens.append(tok)
                out.append(tok)
                if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
                    reason = "eos"
                    held = stream.flush()
                    if held and on_token is not None:
                        on_token(Token(tok, held, len(out) - 1, time.time()))
                    break
                text = stream.push(self.piece(tok), last=len(out) == n_tokens)
                if on_token is not None:
                    on_token(Token(tok, text, len(out) - 1, time.time()))
                if stream.stopped:
                    reason = "stop"
                    break
        except BaseException:
            self._rollback(conv, before)
            raise
        finally:
            conv.n_evaluated = llm.n_tokens
        if reason == "cancelled":
            self._rollback(conv, before)
        return Generation(stream.text, tuple(out), len(new), reason, time.perf_counter() - start, ttft)

    def _prompt_bytes(self, conv: Conversation, prompt: str) -> bytes:
        """``prompt`` in UTF-8, refused before tokenizing when its size alone shows it cannot fit: every token
        stands for at most ``longest_piece`` bytes, and the prompt must leave room for one new token."""
        try:
            data = prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ApplianceError("BAD_REQUEST", "the prompt is not valid Unicode (it has a lone surrogate)",
                                 {"field": "prompt"}) from None
        check_prompt_size(self.n_ctx, conv, len(data), self.longest_piece)
        return data

    def _eval(self, tokens: list[int]) -> None:
        """Evaluate ``tokens``; llama.cpp's failure is logged with its text and reaches the client as a plain
        INTERNAL."""
        try:
            self.llm.eval(tokens)
        except RuntimeError as exc:
            log.error("llama.cpp decode failed on %s", self.path.name, exc_info=exc)
            raise ApplianceError("INTERNAL", "llama.cpp could not decode the request") from None

    def _rollback(self, conv: Conversation, length: int) -> None:
        """Return ``conv`` to its first ``length`` tokens: the tokens, the live KV cells past them and
        ``n_evaluated`` (an unfinished request leaves no trace)."""
        del conv.tokens[length:]
        llm = self.llm
        if llm.n_tokens > length:
            llm._ctx.kv_cache_seq_rm(0, length, -1)
            llm.n_tokens = length
        conv.n_evaluated = llm.n_tokens


class Engine:
    """The single worker thread of a device; every llama.cpp call goes through :meth:`call`
    (implements :class:`~appliance.engine.interface.EngineProtocol`; its loads are :class:`Runtime` s).

    ``n_threads`` is read once, here: a changed ``engine.threads`` takes a new engine (a restart)."""

    def __init__(self, n_threads: int | None = None) -> None:
        self.n_threads = n_threads or max(1, min(4, os.cpu_count() or 1))
        self._worker = FairWorker("engine")

    def submit(self, fn: Callable[[], Any], *, queue: Hashable = DEFAULT_QUEUE) -> asyncio.Future[Any]:
        """Queue ``fn`` on the engine thread behind the other jobs of ``queue`` (keys take turns, see
        :class:`~appliance.engine.worker.FairWorker`); the future is the loop's, no task wraps it."""
        return asyncio.wrap_future(self._worker.submit(fn, queue=queue))

    async def call(self, fn: Callable[..., Any], *args: Any, queue: Hashable = DEFAULT_QUEUE, **kwargs: Any) -> Any:
        return await self.submit(functools.partial(fn, *args, **kwargs), queue=queue)

    def check(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> None:
        """Trial-load ``path`` in a child process (cached per file); raises ``MODEL_LOAD_FAILED``. Blocking:
        call it off the event loop and off the engine thread."""
        modelcheck.check_model(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers)

    def load(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> Runtime:
        """Load on the calling thread (use through :meth:`call`)."""
        return Runtime(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, n_threads=self.n_threads)

    def close(self) -> None:
        modelcheck.stop_trials()  # a trial child still running would hold up the process's exit
        self._worker.close()
