"""The engine: a thin shell over llama-cpp-python.

All llama.cpp work of a device happens on one worker thread (:class:`Engine`), so the event loop never
blocks on a model and llama.cpp contexts are never touched by two threads. A :class:`Runtime` is one loaded
GGUF with one live context; agents' conversations (:class:`Conversation`) take turns in it, the others'
KV state parked in host RAM through llama.cpp's per-sequence state API into reusable buffers.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import ctypes
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp

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
)
from appliance.errors import ApplianceError

__all__ = ["GREEDY", "Conversation", "Engine", "Generation", "Runtime", "Sampling", "StopReason", "SwapReport",
           "Token", "Where"]


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
        self.n_ctx = self.llm.n_ctx()
        self.eos = self.llm.token_eos()
        self.live: Conversation | None = None
        self._pieces: dict[int, bytes] = {}

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
        """Continue ``conv`` with ``prompt`` and up to ``n_tokens`` new tokens. ``conv`` must be attached."""
        if self.live is not conv:
            raise ApplianceError("INTERNAL", "generate on a conversation that is not live")
        new = self.tokenize(prompt, bos=not conv.tokens)
        if not conv.tokens and not new:
            raise ApplianceError("BAD_REQUEST", "empty prompt and no conversation to continue")
        if len(conv.tokens) + len(new) + n_tokens > self.n_ctx:
            raise ApplianceError("CONTEXT_OVERFLOW", "conversation would exceed the model's context", {
                "n_ctx": self.n_ctx, "context_tokens": len(conv.tokens), "prompt_tokens": len(new),
                "requested_tokens": n_tokens})
        llm = self.llm
        start = time.perf_counter()
        conv.tokens.extend(new)
        if llm.n_tokens >= len(conv.tokens):  # nothing pending: re-evaluate the last token for fresh logits
            llm._ctx.kv_cache_seq_rm(0, len(conv.tokens) - 1, -1)
            llm.n_tokens = len(conv.tokens) - 1
        sampler = llm._init_sampler(temp=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                    min_p=0.0)
        llm.set_seed(sampling.seed)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces: list[str] = []
        out: list[int] = []
        reason: StopReason = "length"
        ttft: float | None = None
        try:
            while len(out) < n_tokens:
                if cancelled is not None and cancelled():
                    reason = "cancelled"
                    break
                llm.eval(conv.tokens[llm.n_tokens:])
                conv.n_evaluated = llm.n_tokens
                tok = sampler.sample(llm._ctx, -1)
                if ttft is None:
                    ttft = time.perf_counter() - start
                conv.tokens.append(tok)
                out.append(tok)
                if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
                    reason = "eos"
                    break
                text = decoder.decode(self.piece(tok))
                pieces.append(text)
                if on_token is not None:
                    on_token(Token(tok, text, len(out) - 1, time.time()))
                if sampling.stop and any(s in "".join(pieces[-8:]) for s in sampling.stop):
                    reason = "stop"
                    break
        except RuntimeError as exc:
            raise ApplianceError("INTERNAL", f"llama.cpp decode failed: {exc}") from exc
        finally:
            conv.n_evaluated = llm.n_tokens
        text = "".join(pieces) + decoder.decode(b"", final=True)
        if reason == "stop":
            cut = min(i for i in (text.find(s) for s in sampling.stop) if i >= 0)
            text = text[:cut]
        return Generation(text, tuple(out), len(new), reason, time.perf_counter() - start, ttft)


class Engine:
    """The single worker thread of a device; every llama.cpp call goes through :meth:`call`
    (implements :class:`~appliance.engine.interface.EngineProtocol`; its loads are :class:`Runtime` s).

    ``n_threads`` is read once, here: a changed ``engine.threads`` takes a new engine (a restart)."""

    def __init__(self, n_threads: int | None = None) -> None:
        self.n_threads = n_threads or max(1, min(4, os.cpu_count() or 1))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Queue ``fn`` on the engine thread; the future is the loop's, no task wraps it."""
        return asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self.submit(lambda: fn(*args, **kwargs))

    def load(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> Runtime:
        """Load on the calling thread (use through :meth:`call`)."""
        return Runtime(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, n_threads=self.n_threads)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
