"""What the daemon needs from an engine, and the plain data it passes through one. Pure: no asyncio, no llama.cpp.

Two engines implement these :class:`typing.Protocol` s: the real one (:class:`appliance.engine.runtime.Engine`, whose
loads are llama.cpp :class:`~appliance.engine.runtime.Runtime` s) and the fake one for tests
(:class:`appliance.engine.fake.FakeEngine`). :class:`~appliance.daemon.core.Daemon` is typed against the Protocols
only, so a test can run the whole daemon without a model.

Threading contract: an engine runs every job on one worker thread of its own. :meth:`EngineProtocol.submit`
queues a job there and returns an awaitable for the event loop; a :class:`RuntimeProtocol` is only ever touched
from inside such a job (the daemon wraps ``begin``/``step``/``detach``/``close`` in ``submit``/``call``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from appliance.engine.adaptive import Tuning
from appliance.engine.flash import FlashMode
from appliance.errors import ApplianceError

Where = Literal["empty", "device", "host", "disk"]
"""Where a conversation's KV state is: nowhere yet, in the live context, or parked in host RAM."""
StopReason = Literal["eos", "length", "stop", "cancelled"]


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar a sequence's output must follow (llama.cpp's grammar sampler, in that sequence's own chain).

    Lazy when it has triggers: the output is free until it matches one of ``trigger_patterns`` (regexes, as
    ``llama_sampler_init_grammar_lazy_patterns`` takes them: the grammar applies from the match's first group on, or
    the whole match) or produces one of ``trigger_tokens`` (the texts of single tokens, such as ``<tool_call>``;
    the runtime resolves them to ids in its vocabulary). Tool calls with ``tool_choice: auto`` use a lazy one."""

    gbnf: str
    root: str = "root"
    trigger_patterns: tuple[str, ...] = ()
    trigger_tokens: tuple[str, ...] = ()

    @property
    def lazy(self) -> bool:
        return bool(self.trigger_patterns or self.trigger_tokens)


@dataclass(frozen=True)
class Sampling:
    """How one request samples (its own chain in a batch): llama.cpp's samplers with these settings. Defaults
    change nothing (no penalty, no bias, no grammar, no log-probabilities)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 40
    seed: int = 0
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # llama.cpp's: 1.0 = off
    frequency_penalty: float = 0.0  # OpenAI's: 0.0 = off
    presence_penalty: float = 0.0  # OpenAI's: 0.0 = off
    penalty_last_n: int = 64  # the penalties look at this many last tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: Grammar | None = None
    logprobs: int | None = None  # None: none; N >= 0: each token's log-probability and its N likeliest alternatives


GREEDY = Sampling()


@dataclass(frozen=True)
class Prompt:
    """A prompt with control tokens: ``pieces`` of (text, special) in order. ``special`` pieces are a chat
    template's own text, where the texts of control tokens (``<|im_start|>``) become those tokens; the other pieces
    (message content) never become one, whatever they hold. A plain ``str`` prompt is raw text, without control
    tokens (the line protocol's DECODE).

    ``history``: the prompt is the conversation's whole text (an OpenAI chat re-sends the history every turn): the
    conversation keeps the longest common token prefix of what it holds and this prompt, and evaluates the rest."""

    pieces: tuple[tuple[str, bool], ...]
    history: bool = False

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)


PromptText = str | Prompt
"""What a request's prompt may be: raw text, or a :class:`Prompt`."""


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its log-probability (natural log, from the model's raw logits before any sampler)."""

    id: int
    piece: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and its likeliest alternatives (most likely first), when the request
    asked for them (``Sampling.logprobs``)."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Generation:
    text: str
    tokens: tuple[int, ...]
    prompt_tokens: int
    stop_reason: StopReason
    elapsed_s: float
    ttft_s: float | None
    prompt_evaluated: int | None = None  # tokens evaluated before the first new one (shared prefixes skip some)
    reused: int = 0  # prompt cells borrowed from another conversation (a shared prefix)
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per generated token, when the request asked for them
    stop_sequence: str | None = None  # the request's stop string that ended it

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def stopped_on_eos(self) -> bool:
        return self.stop_reason == "eos"


@dataclass(frozen=True)
class Token:
    """One generated token as streamed to a client."""

    id: int
    text: str
    index: int
    timestamp: float
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass(eq=False)
class Conversation:
    """An agent's conversation: its tokens and, while suspended, its KV state in host RAM."""

    tokens: list[int] = field(default_factory=list)
    n_evaluated: int = 0
    where: Where = "empty"
    buffer: bytearray | None = field(default=None, repr=False)
    nbytes: int = 0
    seq: int | None = None  # the context sequence whose cells it holds while ``where`` is "device"
    v_transposed: bool = False  # the V layout its saved state was made in (flash attention off); llama.cpp loads a
    #                             state only into a context of the same layout


def check_prompt_size(n_ctx: int, conv: Conversation, size: int, longest_piece: int) -> None:
    """Refuse, before tokenizing, a prompt of ``size`` UTF-8 bytes that cannot fit: every token stands for at most
    ``longest_piece`` bytes, and the prompt must leave room for one new token (``CONTEXT_OVERFLOW``)."""
    limit = max(0, n_ctx - len(conv.tokens) - 1) * longest_piece
    if size > limit:
        raise ApplianceError("CONTEXT_OVERFLOW", "the prompt is too long for the room left in the model's context",
                             {"n_ctx": n_ctx, "context_tokens": len(conv.tokens), "prompt_bytes": size,
                              "max_prompt_bytes": limit})


def tokens_to_generate(n_ctx: int, conv: Conversation, new: list[int], n_tokens: int) -> int:
    """How many tokens a request may generate: ``n_tokens`` clamped to the room the context leaves after the
    conversation and its ``new`` prompt tokens. An empty prompt with no conversation is ``BAD_REQUEST``, a prompt
    that leaves no room is ``CONTEXT_OVERFLOW``."""
    if not conv.tokens and not new:
        raise ApplianceError("BAD_REQUEST", "empty prompt and no conversation to continue")
    room = n_ctx - len(conv.tokens) - len(new)
    if room < 1:
        raise ApplianceError("CONTEXT_OVERFLOW", "the prompt leaves no room in the model's context", {
            "n_ctx": n_ctx, "context_tokens": len(conv.tokens), "prompt_tokens": len(new),
            "requested_tokens": n_tokens})
    return min(n_tokens, room)


class RuntimeProtocol(Protocol):
    """One loaded model: its weights, at most one live multi-sequence context, and the conversations of its agents
    in that context's sequences (:class:`~appliance.engine.slots.Slots`).

    Every method runs on the engine's worker thread.
    """

    @property
    def n_ctx(self) -> int:
        """One conversation's bound in tokens; a generation that would exceed it raises ``CONTEXT_OVERFLOW``."""
        ...

    @property
    def live_slots(self) -> int:
        """Sequences its context holds: conversations decoded together."""
        ...

    @property
    def has_context(self) -> bool:
        """Its live context exists (the daemon opens and closes it apart from the weights, SPEC L8)."""
        ...

    @property
    def busy(self) -> bool:
        """A request is in flight: :meth:`step` has work."""
        ...

    @property
    def live(self) -> list[Conversation]:
        """The conversations whose KV cells are in the context now."""
        ...

    @property
    def tuning(self) -> Tuning:
        """The :class:`~appliance.engine.adaptive.Tuning` its live context runs with (pool cells, plan, threads)."""
        ...

    @property
    def flash_attention(self) -> bool | None:
        """Whether its live context runs flash attention (llama.cpp's choice under ``auto``); None without one."""
        ...

    @property
    def v_transposed(self) -> bool:
        """Its contexts store the V cache transposed (``engine.flash_attention`` was off when it was loaded): the
        layout of every state it saves, and the only one it can load."""
        ...

    @property
    def pool_cells(self) -> int:
        """The live context's KV cells (0 without one)."""
        ...

    @property
    def cold_cells(self) -> int:
        """The cold context's KV cells while a request longer than the hot pool runs (else 0)."""
        ...

    @property
    def prepared(self) -> Tuning | None:
        """The tuning of a context built beside the live one by :meth:`prepare`, not switched in yet (or None)."""
        ...

    def open_context(self) -> None:
        """Build the live context (no-op when it exists)."""
        ...

    def prepare(self, tuning: Tuning) -> None:
        """Build a context for ``tuning`` beside the live one (nothing without a live context)."""
        ...

    def switch(self) -> list[Conversation] | None:
        """Swap the prepared context in, live conversations carried over; the ones parked to fit. None (nothing
        changed) while a request is in flight or with nothing prepared."""
        ...

    def retune(self, tuning: Tuning) -> list[Conversation] | None:
        """:meth:`prepare` and :meth:`switch` at once."""
        ...

    def drop_prepared(self) -> None:
        """Free a prepared context that will not be switched in."""
        ...

    def set_threads(self, n_threads: int) -> None:
        """Decode with ``n_threads`` from the next step on."""
        ...

    def open_cold(self, cells: int) -> None:
        """Build a one-sequence cold context of at least ``cells`` cells for a request longer than the hot pool
        (:meth:`begin` answered :class:`~appliance.engine.slots.ColdNeeded`)."""
        ...

    def close_cold(self) -> list[Conversation]:
        """Free an idle cold context (its step frees it when its request ends)."""
        ...

    def warm_up(self, prompt: str, n_tokens: int, sampling: Sampling = ...) -> Any:
        """A warm-up generation on a throwaway conversation, run now; None when it would wait or park anyone."""
        ...

    def close_context(self) -> list[Conversation]:
        """Park every live conversation in host RAM and free the context (no request may be in flight)."""
        ...

    def begin(self, conv: Conversation, prompt: PromptText, n_tokens: int, sampling: Sampling = ..., *,
              on_token: Callable[[Token], None] | None = None, cancelled: Callable[[], bool] | None = None,
              on_done: Callable[[Any], None] | None = None, ephemeral: bool = False,
              before_park: Callable[[Conversation, int], None] | None = None, cold: bool = False) -> Any:
        """Start a request (:meth:`appliance.engine.slots.SlotRuntime.begin`): the request, None when it must wait
        for a sequence, or :class:`~appliance.engine.slots.ColdNeeded` when it is longer than the hot pool (then
        begin it again with ``cold`` once :meth:`open_cold` made room)."""
        ...

    def step(self) -> list[Any]:
        """One batched decode of every request in flight; the requests that ended."""
        ...

    def detach(self, conv: Conversation) -> None:
        """Forget ``conv`` (its agent left, or a stateless request ended); its host buffer is dropped."""
        ...

    def generate(self, conv: Conversation, prompt: PromptText, n_tokens: int, sampling: Sampling = ...,
                 on_token: Callable[[Token], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Generation:
        """One request run to its end alone (tests, benchmarks)."""
        ...

    def vocabulary(self) -> str:
        """A digest of the model's token list (every id's piece): two runtimes with the same digest read and
        write the same token ids, so a conversation's tokens carry over from one to the other (hot reload)."""
        ...

    def close(self) -> None:
        """Free the model and its context."""
        ...


class EngineProtocol(Protocol):
    """The worker thread of a device and the loader of models onto it."""

    @property
    def n_threads(self) -> int:
        """CPU threads the models it loads use (fixed at construction: a change needs a new engine)."""
        ...

    def submit(self, fn: Callable[[], Any], *, queue: Hashable = ...) -> Awaitable[Any]:
        """Queue ``fn`` on the worker thread (call from the event loop); awaiting the result gives its value.
        Jobs wait in one FIFO queue per ``queue`` key (a connection, an agent; a default key for the rest) and the
        keys take turns, one job each (:class:`~appliance.engine.worker.FairWorker`). Cancelling the awaitable
        before its job starts skips the job; it does not stop a job that already runs."""
        ...

    def call(self, fn: Callable[..., Any], *args: Any, queue: Hashable = ..., **kwargs: Any) -> Awaitable[Any]:
        """``submit`` of ``fn(*args, **kwargs)`` on ``queue``."""
        ...

    @property
    def gpu_offload(self) -> bool:
        """Whether the models it loads can put layers on a GPU (llama.cpp built with GPU support)."""
        ...

    def file_present(self, path: Path) -> bool:
        """Whether the model file ``path`` is there to load (a configured model whose file is not is ``missing``).
        Looked at on every use: a stat, never remembered."""
        ...

    def check(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> None:
        """Make sure :meth:`load` of ``path`` cannot take the process down: the real engine trial-loads it in a
        child process (:mod:`appliance.engine.modelcheck`). Blocking: call it off the event loop and off the
        worker thread. Raises ``MODEL_LOAD_FAILED`` with the reason."""
        ...

    def load(self, path: Path, *, n_ctx: int, n_gpu_layers: int, live_slots: int = 1,
             flash_attention: FlashMode | bool = "auto", cache_type: str = "f16",
             tuning: Tuning | None = None) -> RuntimeProtocol:
        """Load a model with its live context (built with ``tuning``; None: the fixed strategy) on the calling
        thread (use through :meth:`call`); raises ``MODEL_LOAD_FAILED``. ``flash_attention``: ``auto``, ``on`` or
        ``off`` (:mod:`appliance.engine.flash`; a boolean is ``on`` / ``off``)."""
        ...

    def close(self) -> None:
        """Stop the worker thread once its queued jobs ran (loaded runtimes must be closed before)."""
        ...
