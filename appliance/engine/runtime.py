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
import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.engine import flash, gpubuild, modelcheck, plans
from appliance.engine.adaptive import FIXED, Tuning
from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.engine.embedding import Embeddings, check_dimensions, context_size
from appliance.engine.flash import FlashMode
from appliance.engine.interface import (  # re-exported: importers of these from here keep working
    GREEDY,
    Conversation,
    Generation,
    Sampling,
    StopReason,
    Token,
    Where,
)
from appliance.engine.loopfuture import loop_future
from appliance.engine.slots import Request, SlotRuntime, Slots
from appliance.engine.worker import DEFAULT_QUEUE, FairWorker
from appliance.errors import ApplianceError

if TYPE_CHECKING:
    from appliance.engine.embedding_context import EmbeddingContext

__all__ = ["GREEDY", "Conversation", "Engine", "Generation", "Runtime", "Sampling", "StopReason", "Token", "Where"]


log = logging.getLogger(__name__)


def _libc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _libc_trim()


def return_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc ``malloc_trim``), so a freed context shows in RSS: glibc
    raises its mmap threshold after a large block is freed, and later blocks of that size come from the heap,
    which ``free`` alone does not shrink (measured: a freed 512-cell cold context left 35 MiB in RSS without it)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class Runtime(SlotRuntime):
    """One loaded model: its weights, its live context (when open), a cold context while a long request runs, and
    its conversations' slots (implements :class:`~appliance.engine.interface.RuntimeProtocol`). Engine thread
    only. ``tuning`` is the live context's hot pool, plan and threads (:mod:`appliance.engine.adaptive`); without
    one the fixed strategy: the configured ``n_ctx`` as the pool, the fixed plan, ``n_threads``."""

    def __init__(self, path: Path, *, n_ctx: int, n_gpu_layers: int, n_threads: int | None,
                 live_slots: int = 1, flash_attention: FlashMode | bool = "auto", cache_type: str = "f16",
                 tuning: Tuning | None = None) -> None:
        self.path = path
        self.flash_mode = flash.mode_of(flash_attention)
        self.weights = ModelWeights(path, n_gpu_layers=n_gpu_layers)
        self.live_slots = live_slots
        self.cache_type = cache_type
        self.n_ctx = n_ctx  # one conversation's bound: the configured n_ctx, whatever the pool's size
        self.tuning = tuning or Tuning(n_ctx, FIXED, n_threads or 1)
        self.longest_piece = self.weights.longest_piece()
        self.splits = self.weights.splits  # its contexts may be split KV streams (a plain KV cache)
        self._vocabulary: str | None = None
        self.context: BatchedContext | None = None
        self.embeddings: EmbeddingContext | None = None  # opened at the first embeddings request
        self.embedding_threads = n_threads
        self.slots = Slots(None, self, n_ctx=n_ctx)
        try:
            self.open_context()
        except BaseException:
            self.weights.close()
            raise

    def _new_context(self, n_ctx: int, n_seq_max: int, plan: str, threads: int,
                     split: bool = False) -> BatchedContext:
        chosen = plans.fixed_plan(self.n_ctx, n_seq_max) if plan == FIXED else plans.plan_for(plan, n_ctx, n_seq_max)
        return BatchedContext(self.weights, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=chosen.n_batch,
                              n_ubatch=chosen.n_ubatch, n_threads=threads, prefill_limit=chosen.prefill_limit,
                              flash_attn=self.flash_mode, cache_type=self.cache_type, split=split)

    def _free(self, context: BatchedContext) -> None:  # type: ignore[override]
        context.close()
        return_free_memory()

    @property
    def plan(self) -> plans.Plan:
        """The live context's plan as built (n_batch, n_ubatch and prefill limit read back from it)."""
        context = self.context
        if context is None:
            raise ApplianceError("INTERNAL", f"model {self.path.name} has no live context")
        return plans.Plan(self.tuning.plan, context.n_batch, context.n_ubatch, context.prefill_limit)

    @property
    def flash_attention(self) -> bool | None:
        """Whether the live context runs flash attention (llama.cpp's choice under ``auto``); None without one."""
        context = self.context
        return None if context is None else context.flash_attn

    # -- conversations ---------------------------------------------------------------------------------
    def step(self, hold: Callable[[], bool] | None = None) -> list[Request]:
        """One batched decode of every request in flight; the requests that ended."""
        if self.context is None:
            return []
        return super().step(hold)

    # -- the model -------------------------------------------------------------------------------------
    def vocabulary(self) -> str:
        """A SHA-256 of every token's text, in id order (cached): equal digests, interchangeable token ids."""
        if self._vocabulary is None:
            self._vocabulary = self.weights.digest()
        return self._vocabulary

    def piece(self, token: int) -> bytes:
        return self.weights.piece(token)

    def tokenize(self, text: str, *, bos: bool, special: bool = False) -> list[int]:
        return self.weights.tokenize(text, bos=bos, special=special) if text else []

    def control_texts(self) -> tuple[str, ...]:
        return self.weights.control_texts()

    def check_sampling(self, sampling: Sampling) -> None:
        self.weights.check_sampling(sampling)

    # -- embeddings (models[].embeddings) -------------------------------------------------------------
    @property
    def has_embeddings(self) -> bool:
        return self.embeddings is not None

    def open_embeddings(self) -> None:
        """Build the embeddings context (:mod:`appliance.engine.embedding`) if it is not open."""
        if self.embeddings is None:
            from appliance.engine.embedding_context import EmbeddingContext  # lazy: numpy, for embeddings only

            self.embeddings = EmbeddingContext(self.weights, n_ctx=context_size(self.n_ctx),
                                               n_threads=self.embedding_threads)

    def embed(self, inputs: Sequence[str | Sequence[int]], dimensions: int | None = None) -> Embeddings:
        """The normalised embedding of each input (a text, tokenized with the model's BOS, or token ids);
        ``dimensions``, when given, must be the model's."""
        context = self.embeddings
        if context is None:
            raise ApplianceError("INTERNAL", f"model {self.path.name} has no embeddings context")
        check_dimensions(dimensions, context.dimensions)
        tokens = [self.weights.tokenize(item, bos=True) if isinstance(item, str) else list(item) for item in inputs]
        return Embeddings(tuple(context.embed(tokens)), sum(len(t) for t in tokens), context.dimensions,
                          context.pooling_name)

    def close(self) -> None:
        self.cancel_all(ApplianceError("SHUTTING_DOWN"))
        self.free_contexts()
        if self.embeddings is not None:
            self.embeddings.close()
            self.embeddings = None
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
        return loop_future(self._worker.submit(fn, queue=queue))

    async def call(self, fn: Callable[..., Any], *args: Any, queue: Hashable = DEFAULT_QUEUE, **kwargs: Any) -> Any:
        return await self.submit(functools.partial(fn, *args, **kwargs), queue=queue)

    @property
    def gpu_offload(self) -> bool:
        """``llama_supports_gpu_offload()``: False for a CPU build of llama.cpp."""
        return gpubuild.offload_supported()

    def file_present(self, path: Path) -> bool:
        return path.is_file()

    def check(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> None:
        """Trial-load ``path`` in a child process (cached per file); raises ``MODEL_LOAD_FAILED``. Blocking:
        call it off the event loop and off the engine thread."""
        modelcheck.check_model(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers)

    def load(self, path: Path, *, n_ctx: int, n_gpu_layers: int, live_slots: int = 1,
             flash_attention: FlashMode | bool = "auto", cache_type: str = "f16",
             tuning: Tuning | None = None) -> Runtime:
        """Load on the calling thread (use through :meth:`call`), with its live context open (built with
        ``tuning``; without one the fixed strategy)."""
        return Runtime(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, n_threads=self.n_threads,
                       live_slots=live_slots, flash_attention=flash_attention, cache_type=cache_type, tuning=tuning)

    def close(self) -> None:
        modelcheck.stop_trials()  # a trial child still running would hold up the process's exit
        self._worker.close()
