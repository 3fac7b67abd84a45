"""The engine: a thin shell over llama-cpp-python's low-level API (engine v2, SPEC L8-L10).

All llama.cpp work of a device happens on one worker thread (:class:`Engine`), so the event loop never
blocks on a model and llama.cpp contexts are never touched by two threads (and one OpenMP pool serves them all).
A :class:`Runtime` is one GGUF's weights (:class:`~appliance.engine.batched.ModelWeights`, loaded once) and at
most one live multi-sequence context (:class:`~appliance.engine.batched.BatchedContext`), which the daemon opens
and closes apart from the weights (``engine.live_contexts``). Its agents' conversations hold the context's
sequences (``engine.live_slots`` of them) and are decoded together, one ``llama_decode`` per step; the others'
KV state waits in host RAM (:class:`~appliance.engine.slots.Slots`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from appliance.engine import modelcheck
from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.engine.interface import (  # re-exported: importers of these from here keep working
    GREEDY,
    Conversation,
    Generation,
    Sampling,
    StopReason,
    Token,
    Where,
)
from appliance.engine.slots import Request, SlotRuntime, Slots
from appliance.engine.worker import DEFAULT_QUEUE, FairWorker
from appliance.errors import ApplianceError

__all__ = ["GREEDY", "Conversation", "Engine", "Generation", "Runtime", "Sampling", "StopReason", "Token", "Where"]

PREFILL_LIMIT = 64
"""Prompt tokens a step may add beside running streams (:class:`~appliance.engine.batched.BatchedContext`'s
``prefill_limit``): measured on the 12-layer 768-wide model, a 448-token prompt joining a stream kept that stream's
gap under 112 ms (690 ms when prefilled in one step), for 27 ms more to the newcomer's first token."""
MAX_BATCH = 512

log = logging.getLogger(__name__)


class Runtime(SlotRuntime):
    """One loaded model: its weights, its live context (when open) and its conversations' slots
    (implements :class:`~appliance.engine.interface.RuntimeProtocol`). Engine thread only."""

    def __init__(self, path: Path, *, n_ctx: int, n_gpu_layers: int, n_threads: int | None,
                 live_slots: int = 1, flash_attention: bool = False) -> None:
        self.path = path
        self.weights = ModelWeights(path, n_gpu_layers=n_gpu_layers)
        self.n_threads = n_threads
        self.live_slots = live_slots
        self.flash_attention = flash_attention
        self.configured_ctx = n_ctx
        self.n_batch = max(live_slots, min(MAX_BATCH, n_ctx))
        self.longest_piece = self.weights.longest_piece()
        self._vocabulary: str | None = None
        self.context: BatchedContext | None = None
        self.slots = Slots(None, self, n_ctx=n_ctx)
        try:
            self.open_context()
        except BaseException:
            self.weights.close()
            raise
        # The configured size bounds every conversation (llama.cpp may round its context up, to 256 at least).
        self.n_ctx = self.slots.n_ctx = min(n_ctx, self.context.n_ctx if self.context is not None else n_ctx)

    # -- the live context ------------------------------------------------------------------------------
    @property
    def has_context(self) -> bool:
        return self.context is not None

    def open_context(self) -> None:
        """Build the live context (no-op when open): ``live_slots`` sequences sharing ``n_ctx`` KV cells."""
        if self.context is not None:
            return
        self.context = BatchedContext(self.weights, n_ctx=self.configured_ctx, n_seq_max=self.live_slots,
                                      n_batch=self.n_batch, n_threads=self.n_threads, prefill_limit=PREFILL_LIMIT,
                                      flash_attn=self.flash_attention)
        self.slots.context = self.context

    def close_context(self) -> list[Conversation]:
        """Park every live conversation in host RAM and free the context; returns the parked ones."""
        if self.context is None:
            return []
        parked = self.slots.park_all()
        self.context.close()
        self.context = None
        self.slots.context = None
        return parked

    # -- conversations ---------------------------------------------------------------------------------
    def begin(self, conv: Conversation, prompt: str, n_tokens: int, sampling: Sampling = GREEDY, *,
              on_token: Callable[[Token], None] | None = None, cancelled: Callable[[], bool] | None = None,
              on_done: Callable[[Request], None] | None = None, ephemeral: bool = False,
              before_park: Callable[[Conversation], None] | None = None) -> Request | None:
        """See :meth:`appliance.engine.slots.Slots.begin`."""
        self._need_context()
        return self.slots.begin(conv, prompt, n_tokens, sampling, on_token=on_token, cancelled=cancelled,
                                on_done=on_done, ephemeral=ephemeral, before_park=before_park)

    def step(self) -> list[Request]:
        """One batched decode of every request in flight; the requests that ended."""
        if self.context is None:
            return []
        return self.slots.step()

    def detach(self, conv: Conversation) -> None:
        self.slots.detach(conv)

    def park(self, conv: Conversation) -> None:
        """Park ``conv`` (live, no request in flight) in host RAM now."""
        self.slots.park(conv)

    def _need_context(self) -> None:
        if self.context is None:
            raise ApplianceError("INTERNAL", f"model {self.path.name} has no live context")

    # -- the model -------------------------------------------------------------------------------------
    def vocabulary(self) -> str:
        """A SHA-256 of every token's text, in id order (cached): equal digests, interchangeable token ids."""
        if self._vocabulary is None:
            self._vocabulary = self.weights.digest()
        return self._vocabulary

    def piece(self, token: int) -> bytes:
        return self.weights.piece(token)

    def tokenize(self, text: str, *, bos: bool) -> list[int]:
        return self.weights.tokenize(text, bos=bos) if text else []

    def close(self) -> None:
        if self.context is not None:
            self.slots.cancel_all(ApplianceError("SHUTTING_DOWN"))
        self.context = None
        self.slots.context = None
        self.weights.close()


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

    def load(self, path: Path, *, n_ctx: int, n_gpu_layers: int, live_slots: int = 1,
             flash_attention: bool = False) -> Runtime:
        """Load on the calling thread (use through :meth:`call`), with its live context open."""
        return Runtime(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, n_threads=self.n_threads,
                       live_slots=live_slots, flash_attention=flash_attention)

    def close(self) -> None:
        modelcheck.stop_trials()  # a trial child still running would hold up the process's exit
        self._worker.close()
