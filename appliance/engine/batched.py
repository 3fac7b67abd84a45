"""Batched multi-sequence decoding on llama.cpp's low-level API: a building block of engine v2 (issue #11).

The daemon's runtime (:mod:`appliance.engine.runtime`) is one :class:`ModelWeights` and one
:class:`BatchedContext`, whose sequences :class:`~appliance.engine.slots.Slots` hands to conversations.

* :class:`ModelWeights` is one ``llama_model``, loaded once; any number of contexts are built on it.
* :class:`BatchedContext` is one ``llama_context`` holding up to ``n_seq_max`` sequences in a unified KV cache (or,
  split, in a KV stream each).
  Sequences join (:meth:`~BatchedContext.add`) and leave (:meth:`~BatchedContext.cancel`) between steps; each
  :meth:`~BatchedContext.step` is ONE ``llama_decode`` of a batch made by
  :func:`appliance.engine.schedule.plan_step`: one decode token for every generating sequence, then prompt
  chunks (continuous batching, chunked prefill). Every sequence samples with its own sampler
  (:class:`~appliance.engine.sampler.SequenceSampler`: its bias, penalties, grammar, top-k, top-p, min-p,
  temperature, seed and log-probabilities) from its own output row. A sequence's KV cells and bookkeeping can be
  copied to host bytes (:meth:`~BatchedContext.save`) and restored into any free sequence id.
* Greedy output of a sequence equals the same prompt run alone (tests/test_batched.py compares tokens, and
  logits within a tolerance), whatever the others sample with (tests/test_sampling_chain.py).

Threading: nothing here locks. Every call on a weights object and its contexts must come from ONE thread; in
the daemon that is the device's engine thread (:class:`appliance.engine.worker.FairWorker`), which already owns
every llama.cpp call (llama.cpp contexts are not thread-safe, and one OpenMP pool per process). A context
remembers the thread that built it and refuses calls from any other. The one exception is a grammar's second draw
(:meth:`~appliance.engine.sampler.SequenceSampler.draw_constrained`), which a context runs on a thread of its own
beside the next decode: it touches only that sequence's samplers and a copy of its logits, and the engine thread
leaves that sequence alone (out of the batch, never freed or saved) until it is waited for.

Measured (03:47 UTC, this 2-core box, lightly shared; 2 threads; N sequences, each a 64-token prompt and 64 greedy
tokens; aggregate tokens/s = all generated tokens / wall time including the prefill; "one at a time" runs the same
N sequences one after another in a one-sequence context; best of two runs):

==============================  ======  ======  ======  ======
tokens/s                        N=1     N=2     N=4     N=8
==============================  ======  ======  ======  ======
tiny (4 layers, 256 wide)       3270    4220    5030    4600
  one at a time                 3180    3160    3290    3370
12 layers, 768 wide, f16        146     158     230     256
  one at a time                 146     150     144     146
  decode steps only (batched)   179     185     294     368
==============================  ======  ======  ======  ======

So on the 768-wide model 4 sequences give 1.6x and 8 give 1.8x the one-at-a-time figure (decode steps alone,
against one sequence's: 1.6x and 2.1x); the tiny model is bound by per-step overhead. Two sequences gain
little: llama.cpp's CPU matmul of two rows costs nearly two of one.

Batched logits against the same prompt run alone (tiny model, four sequences): bit-identical on the first step
(the prefill), at most 4.8e-4 apart over 20 steps, greedy tokens equal. Flash attention is off (see
:class:`BatchedContext`): with llama.cpp's default (on, on the CPU) one of the four drifted to 3e-2 by step 27
and its greedy tokens parted from the solo run's.

A 448-token prompt joining beside a stream (768-wide model, ``n_batch`` 512): with no ``prefill_limit`` the
stream waits 690 ms for its next token (one step prefills it all); ``prefill_limit`` 128 / 64 / 32 bounds that gap
to 210 / 112 / 61 ms, for the newcomer's first token at 705 / 719 / 788 ms instead of 692.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.engine import flash, kvstreams, llamalog
from appliance.engine.bindings import llama_cpp
from appliance.engine.flash import FlashMode
from appliance.engine.interface import GREEDY, Grammar, Sampling, StopReason
from appliance.engine.sampler import NO_TOKEN, Draw, GrammarParts, SequenceSampler
from appliance.engine.sampling import check_grammar, sampling_error
from appliance.engine.sampling import check_sampling as check_settings
from appliance.engine.schedule import SeqEvent, Work, plan_step
from appliance.engine.triggers import compile_patterns
from appliance.engine.tuning import check_split
from appliance.errors import ApplianceError

if TYPE_CHECKING:
    import numpy as np

    from appliance.engine.candidates import Candidates

GGML_TYPES: dict[str, int] = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30,
}
"""ggml's type ids of the KV cache types ``models[].cache_type`` allows (``ggml.h``'s ``enum ggml_type``)."""

__all__ = ["NO_TOKEN", "BatchedContext", "LiftedSequence", "ModelWeights", "SavedSequence", "SeqEvent"]

log = logging.getLogger(__name__)

GRAMMARS_KEPT = 16
"""Parsed grammars a model keeps (an agent's tools give the same grammar every turn): each sequence gets a copy."""
CONTROL_ATTRS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
"""The tokens whose texts llama.cpp's tokenizer matches only with ``parse_special`` (user-defined ones it matches in
any text, as Hugging Face's tokenizers match added tokens)."""

_backend_ready = False


EXTRA_BUFFERS = False
"""Whether llama.cpp may load weights into its CPU "extra" buffer types (repacked layouts such as ``CPU_REPACK``,
Intel AMX): llama.cpp's default is yes. Measured on a 2-core Xeon VM whose CPU reports AMX (12x768 model, 2
threads, 8 sequences, interleaved runs): with them a Q4_0 or Q8_0 model crashes llama.cpp in its first batched
decode (SIGSEGV; ``llama-batched-bench`` of the same build too, and the model check's trial load, which then
refused every quantized file), and an f16 one ran slower (8 x 64-token prefill ~1990 against ~1750 ms, a decode
step of 8 ~128 against ~95 ms) and held a second copy of its weights (6.1 MiB more resident for the 4x256 demo
model). Off: every weight stays in the plain CPU buffer, the one the ledger's estimate counts."""


def _init_backend() -> None:
    """``llama_backend_init`` once per process, and llama.cpp's own log chatter off unless asked for (as
    ``llama_cpp.Llama(verbose=False)`` does)."""
    global _backend_ready
    if _backend_ready:
        return
    llama_cpp.llama_backend_init()
    chatter = logging.getLogger("llama-cpp-python")
    if chatter.level == logging.NOTSET:
        chatter.setLevel(logging.ERROR)
    _backend_ready = True


class ModelWeights:
    """One GGUF's weights (a ``llama_model``), loaded once and shared by every :class:`BatchedContext` built on
    them; also the vocabulary helpers (tokenize, token pieces, end-of-generation)."""

    def __init__(self, path: Path, *, n_gpu_layers: int = 0) -> None:
        _init_backend()
        self.path = Path(path)
        if not self.path.is_file():
            raise ApplianceError("MODEL_LOAD_FAILED", f"no model file {self.path.name}", {"path": str(self.path)})
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = EXTRA_BUFFERS
        model = llama_cpp.llama_model_load_from_file(str(self.path).encode("utf-8"), params)
        if not model:
            raise ApplianceError("MODEL_LOAD_FAILED", f"cannot load {self.path.name}", {"path": str(self.path)})
        self.model: llama_cpp.llama_model_p | None = model
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self._pieces: dict[int, bytes] = {}
        self._special_pieces: dict[int, bytes] = {}
        self._control_texts: tuple[str, ...] | None = None
        self._byte_tokens: list[int | None] | None = None
        self._grammars: dict[Grammar, GrammarParts] = {}
        self._candidates: Candidates | None = None
        self._contexts: list[BatchedContext] = []
        # Split KV streams need a plain KV cache: a sliding-window model keeps two (and its state two stream counts),
        # a recurrent or hybrid one keeps states of another kind.
        self.splits = not (llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
                           or llama_cpp.llama_model_n_swa(model) > 0)

    def __enter__(self) -> ModelWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the weights, after closing every context still open on them."""
        for context in list(self._contexts):
            context.close()
        for parts in self._grammars.values():
            llama_cpp.llama_sampler_free(parts.prototype)
        self._grammars.clear()
        if self.model is not None:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    def _check_open(self) -> None:
        if self.model is None:
            raise ApplianceError("INTERNAL", "the model's weights are closed")

    def tokenize(self, text: str, *, bos: bool, special: bool = False) -> list[int]:
        """``text``'s tokens, after the BOS token when ``bos`` (and the vocabulary adds one); with ``special`` the
        texts of control tokens (``<|im_start|>``) become those tokens, else they are plain text
        (``llama_tokenize``'s ``parse_special``)."""
        self._check_open()
        data = text.encode("utf-8")
        size = len(data) + 2
        while True:
            buf = (llama_cpp.llama_token * size)()
            n = int(llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, size, bos, special))
            if n >= 0:
                return list(buf[:n])
            size = -n  # a negative n is the count the text needs

    def piece(self, token: int) -> bytes:
        """The bytes of one token as generated text shows it (a control token's are empty; cached)."""
        cached = self._pieces.get(token)
        if cached is None:
            cached = self._pieces[token] = self._render(token, special=False)
        return cached

    def special_piece(self, token: int) -> bytes:
        """The bytes of one token with control tokens spelled out (``<|im_end|>``), as a grammar reads them."""
        cached = self._special_pieces.get(token)
        if cached is None:
            cached = self._special_pieces[token] = self._render(token, special=True)
        return cached

    def _render(self, token: int, *, special: bool) -> bytes:
        self._check_open()
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = int(llama_cpp.llama_token_to_piece(self.vocab, token, buf, size, 0, special))
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def control_texts(self) -> tuple[str, ...]:
        """The texts of the vocabulary's control (and unknown) tokens, longest first (cached): what
        ``tokenize(special=True)`` turns into those tokens."""
        if self._control_texts is None:
            self._check_open()
            texts = set()
            for token in range(self.n_vocab):
                if int(llama_cpp.llama_vocab_get_attr(self.vocab, token)) & CONTROL_ATTRS:
                    text = (llama_cpp.llama_vocab_get_text(self.vocab, token) or b"").decode("utf-8", "replace")
                    if text:
                        texts.add(text)
            self._control_texts = tuple(sorted(texts, key=longest_first))
        return self._control_texts

    def byte_token(self, value: int) -> int | None:
        """A token whose text is the one byte ``value`` (None when the vocabulary has none; cached)."""
        if self._byte_tokens is None:
            found: list[int | None] = [None] * 256
            for token in range(self.n_vocab):
                piece = self.special_piece(token)
                if len(piece) == 1 and found[piece[0]] is None:
                    found[piece[0]] = token
            self._byte_tokens = found
        return self._byte_tokens[value]

    def check_sampling(self, sampling: Sampling) -> None:
        """Refuse (``BAD_REQUEST``) settings this model cannot sample with, its grammar parsed (and kept) now."""
        check_settings(sampling, self.n_vocab)
        if sampling.grammar is not None:
            self.grammar_parts(sampling.grammar)

    def grammar_parts(self, grammar: Grammar) -> GrammarParts:
        """``grammar`` parsed by llama.cpp for this vocabulary, its trigger tokens resolved to ids (the last
        :data:`GRAMMARS_KEPT` kept). A grammar llama.cpp cannot parse, a trigger pattern that is not a regex and a
        trigger token that is not exactly one token are ``BAD_REQUEST`` (``param: grammar``)."""
        cached = self._grammars.pop(grammar, None)
        if cached is None:
            cached = self._parse_grammar(grammar)
            while len(self._grammars) >= GRAMMARS_KEPT:
                oldest = next(iter(self._grammars))
                llama_cpp.llama_sampler_free(self._grammars.pop(oldest).prototype)
        self._grammars[grammar] = cached  # the most recently used last
        return cached

    def _parse_grammar(self, grammar: Grammar) -> GrammarParts:
        self._check_open()
        check_grammar(grammar)
        patterns = compile_patterns(grammar.trigger_patterns)
        tokens = []
        for text in grammar.trigger_tokens:
            ids = self.tokenize(text, bos=False, special=True)
            if len(ids) != 1:
                raise sampling_error("grammar", f"the trigger token {text!r} is {len(ids)} tokens in this model's "
                                     "vocabulary, not one", trigger_token=text, tokens=len(ids))
            tokens.append(ids[0])
        prototype = llama_cpp.llama_sampler_init_grammar(self.vocab, grammar.gbnf.encode("utf-8"),
                                                         grammar.root.encode("utf-8"))
        if not prototype:  # llama.cpp logs the parser's reason
            raise sampling_error("grammar", "llama.cpp cannot parse the grammar (a syntax error, an undefined or "
                                 "left-recursive rule, or no rule named as its root)", root=grammar.root)
        return GrammarParts(prototype, patterns, frozenset(tokens))

    def candidates(self) -> Candidates:
        """The buffer every sequence of this model with a grammar or log-probabilities samples in (one at a time,
        on the engine thread); made at the first such draw."""
        if self._candidates is None:
            from appliance.engine.candidates import Candidates  # lazy: numpy, which plain sequences never need

            self._candidates = Candidates(self.n_vocab)
        return self._candidates

    def is_end(self, token: int) -> bool:
        self._check_open()
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def longest_piece(self) -> int:
        """The most bytes one token stands for: a prompt of B bytes is at least B / longest_piece tokens, so its
        size alone can show that it cannot fit (:func:`~appliance.engine.interface.check_prompt_size`)."""
        self._check_open()
        size = 256
        buf = ctypes.create_string_buffer(size)
        longest = 1
        for token in range(self.n_vocab):
            n = int(llama_cpp.llama_token_to_piece(self.vocab, token, buf, size, 0, False))
            longest = max(longest, abs(n))  # a negative n is the size a piece too long for buf needs
        return longest

    def digest(self) -> str:
        """A SHA-256 of every token's text in id order: equal digests, interchangeable token ids (hot reload)."""
        self._check_open()
        digest = hashlib.sha256()
        for token in range(self.n_vocab):
            text = llama_cpp.llama_vocab_get_text(self.vocab, token) or b""
            digest.update(len(text).to_bytes(4, "little"))
            digest.update(text)
        return digest.hexdigest()


def longest_first(text: str) -> tuple[int, str]:
    return -len(text), text


@dataclass(frozen=True)
class SavedSequence:
    """A sequence parked in host RAM: its KV cells (``state``, llama.cpp's per-sequence state bytes, positions
    ``0..n_past-1``), the tokens still to evaluate (the prompt's rest, or the last sampled token), what it has
    generated and its budget. Restoring it continues exactly where it was (greedy; a seeded sampler restarts
    its random stream from its seed)."""

    state: bytes
    n_past: int
    pending: tuple[int, ...]
    generated: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    done: bool
    seen: tuple[int, ...] = ()  # the tokens before the generated ones that its penalties count


@dataclass(eq=False)
class _Sequence:
    seq_id: int
    n_past: int
    pending: list[int]
    max_tokens: int
    sampling: Sampling
    sampler: SequenceSampler
    seen: tuple[int, ...] = ()
    generated: list[int] = field(default_factory=list)
    done: bool = False
    drawing: Future[Draw] | None = None  # its grammar's draw, running beside the decode
    drawn_from: np.ndarray | None = None  # the logits row that draw reads (a copy)

    def cells(self) -> int:
        """KV cells this sequence holds now or may still claim: what it has, what is pending, what it may yet
        generate."""
        left = 0 if self.done else self.max_tokens - len(self.generated)
        return self.n_past + len(self.pending) + left


@dataclass(eq=False)
class LiftedSequence:
    """A generating sequence taken out of its context (:meth:`BatchedContext.lift`) to go on in another context of
    the same weights (:meth:`BatchedContext.land`): its KV cells (``state``, positions ``0..n_past-1``), the
    sequence itself with its sampler (random stream, penalties and grammar as they are: nothing replayed) and
    the events of its draws settled but not delivered yet."""

    state: bytearray  # the only host copy: landed in place, without another
    sequence: _Sequence
    ready: list[tuple[SeqEvent, np.ndarray]]


class BatchedContext:
    """One ``llama_context`` on ``weights`` holding up to ``n_seq_max`` sequences (ids ``0..n_seq_max-1``) in one
    unified KV cache of ``n_ctx`` cells, all advanced together by :meth:`step`.

    A sequence claims, when it joins, the cells its prompt and ``max_tokens`` may need; one that would not fit
    beside the others' claims is refused (``CONTEXT_OVERFLOW``), so a step never runs out of cells.

    With ``split`` every sequence has a KV stream of its own of ``seq_cells = n_ctx / n_seq_max`` cells (llama.cpp's
    ``kv_unified = false``; ``n_ctx`` must be a multiple of ``256 * n_seq_max``): a sequence's claim must fit its
    stream, whatever the others hold. A decode step attends each sequence over its own stream only, where the
    unified cache walks every sequence's cells for each (measured in the appliance, 12x768 f16, 2 threads: the
    decode step of 4 sequences 5-10 % shorter, of 2 the same; README "Split KV streams"). llama.cpp then splits a
    batch into micro-batches of consecutive sequence ids with as many tokens each, so a step puts its tokens in
    sequence-id order; a step that mixes a prompt's chunk with other sequences' decode tokens, or skips an id between
    two, costs one graph more. :meth:`copy` between streams
    goes through host memory (the source's state, loaded and cut). A finished
    sequence keeps its cells (it may be saved) until :meth:`cancel` removes it. ``prefill_limit`` (default: none
    but ``n_batch``) bounds each prompt's chunk in a step in which other sequences stream, so their gap between two
    tokens stays short (:func:`~appliance.engine.schedule.plan_step`). Single-threaded: see the module docstring.
    """

    def __init__(self, weights: ModelWeights, *, n_ctx: int, n_seq_max: int, n_batch: int,
                 n_threads: int | None = None, prefill_limit: int | None = None,
                 flash_attn: FlashMode | bool = "auto", n_ubatch: int | None = None, cache_type: str = "f16",
                 split: bool = False) -> None:
        weights._check_open()
        if n_seq_max < 1:
            raise ApplianceError("BAD_REQUEST", "n_seq_max must be at least 1", {"n_seq_max": n_seq_max})
        if n_batch < n_seq_max:
            raise ApplianceError("BAD_REQUEST", "n_batch must hold one token of every sequence",
                                 {"n_batch": n_batch, "n_seq_max": n_seq_max})
        if n_ctx < 1:
            raise ApplianceError("BAD_REQUEST", "n_ctx must be at least 1", {"n_ctx": n_ctx})
        if prefill_limit is not None and prefill_limit < 1:
            raise ApplianceError("BAD_REQUEST", "prefill_limit must be at least 1", {"prefill_limit": prefill_limit})
        if split and not weights.splits:
            raise ApplianceError("BAD_REQUEST", "split KV streams need a model with a plain KV cache (no sliding "
                                 "window, not recurrent)", {"path": str(weights.path)})
        if split:
            check_split(n_ctx, n_seq_max)
        n_ubatch = n_batch if n_ubatch is None else n_ubatch
        if not 1 <= n_ubatch <= n_batch:
            raise ApplianceError("BAD_REQUEST", "n_ubatch must be from 1 to n_batch",
                                 {"n_ubatch": n_ubatch, "n_batch": n_batch})
        if cache_type not in GGML_TYPES:
            raise ApplianceError("BAD_REQUEST", f"unknown KV cache type {cache_type!r}",
                                 {"cache_type": cache_type, "known": sorted(GGML_TYPES)})
        mode = flash.mode_of(flash_attn)
        flash.check_cache_type(mode, cache_type)
        self.weights = weights
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        self.prefill_limit = prefill_limit
        self._owner = threading.get_ident()
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch  # n_batch: one step is one compute graph; less: a smaller compute buffer
        params.n_seq_max = n_seq_max
        if n_threads is not None:
            params.n_threads = n_threads
            params.n_threads_batch = n_threads
        params.kv_unified = not split  # True: the sequences share one pool of n_ctx cells
        # Flash attention (:mod:`appliance.engine.flash`): with it a decode of N rows rounds differently from a
        # decode of one (the tiny model's logits differ from a solo run's by up to 1e-3, 5e-4 without it, and a
        # near-tie greedy token may part); "off" keeps a sequence's text byte-equal to its solo run's.
        params.flash_attn_type = flash.LLAMA_TYPES[mode]
        params.type_k = GGML_TYPES[cache_type]
        params.type_v = GGML_TYPES[cache_type]
        params.no_perf = True
        with llamalog.llama_log_lines() as logged:
            ctx = llama_cpp.llama_init_from_model(weights.model, params)
        if not ctx:
            raise ApplianceError("OOM", "llama.cpp could not create the context",
                                 {"n_ctx": n_ctx, "n_seq_max": n_seq_max, "n_batch": n_batch})
        try:
            chosen = flash.resolved(mode, logged)
        except ApplianceError:
            llama_cpp.llama_free(ctx)
            raise
        self.ctx: llama_cpp.llama_context_p | None = ctx
        self.memory = llama_cpp.llama_get_memory(ctx)
        self.n_ctx = int(llama_cpp.llama_n_ctx(ctx))
        self.split = split
        self.n_stream = n_seq_max if split else 1  # the stream count its states are saved with (kvstreams)
        self.seq_cells = int(llama_cpp.llama_n_ctx_seq(ctx))  # the most cells one sequence may hold
        self.n_ubatch = int(llama_cpp.llama_n_ubatch(ctx))
        self.cache_type = cache_type
        self.flash_mode = mode
        self.flash_attn = chosen  # what llama.cpp chose: True = flash attention runs
        self.v_transposed = flash.v_transposed(mode)  # the layout of its saved states (what was asked, not chosen)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._seqs: dict[int, _Sequence] = {}  # generating, in join order
        self._resting: dict[int, int] = {}  # seq id -> cells, for sequences between two generations
        self._outputs: dict[int, int] = {}  # seq id -> its output row in the last step's batch
        self._drawn: dict[int, np.ndarray] = {}  # seq id -> the row its draw beside a decode read (last step)
        self._ready: list[tuple[SeqEvent, np.ndarray]] = []  # draws settled between two steps (their rows)
        self._drawer: ThreadPoolExecutor | None = None  # where grammar draws run beside the decode
        self.last_batch = 0  # tokens in the last step's batch (at most n_batch)
        weights._contexts.append(self)

    def __enter__(self) -> BatchedContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.ctx is None:
            return
        self._check_thread()
        for seq in self._seqs.values():
            self._settle(seq, keep=False)
            seq.sampler.free()
        if self._drawer is not None:
            self._drawer.shutdown(wait=True)
            self._drawer = None
        self._seqs.clear()
        self._resting.clear()
        self._outputs.clear()
        self._drawn.clear()
        self._ready.clear()
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self.ctx)
        self.ctx = None
        if self in self.weights._contexts:
            self.weights._contexts.remove(self)

    # -- threads --------------------------------------------------------------------------------------
    @property
    def threads(self) -> int:
        """The threads llama.cpp decodes with (read back from the context)."""
        self._check_thread()
        return int(llama_cpp.llama_n_threads(self.ctx))

    def set_threads(self, n_threads: int) -> None:
        """Decode (and prefill) with ``n_threads`` threads from the next step on (``llama_set_n_threads``)."""
        self._check_thread()
        if n_threads < 1:
            raise ApplianceError("BAD_REQUEST", "n_threads must be at least 1", {"n_threads": n_threads})
        llama_cpp.llama_set_n_threads(self.ctx, n_threads, n_threads)

    # -- sequences ------------------------------------------------------------------------------------
    @property
    def sequences(self) -> list[int]:
        """The ids of the generating sequences (finished ones too, until :meth:`finish` or :meth:`cancel`), in
        join order."""
        return list(self._seqs)

    def has_work(self) -> bool:
        return any(not seq.done for seq in self._seqs.values())

    def generated(self, seq_id: int) -> list[int]:
        return list(self._sequence(seq_id).generated)

    def cells_claimed(self) -> int:
        """Cells the generating sequences hold or may still claim, plus the resting sequences' cells (cells one
        sequence shares with another through :meth:`copy` count for each: an upper bound)."""
        return sum(seq.cells() for seq in self._seqs.values()) + sum(self._resting.values())

    def add(self, seq_id: int, prompt_tokens: Sequence[int], sampling: Sampling = GREEDY,
            max_tokens: int = 16, *, n_past: int = 0, seen: Sequence[int] | None = None) -> None:
        """Sequence ``seq_id`` joins with ``prompt_tokens`` (prefilled over the next steps, in chunks) and will
        generate up to ``max_tokens`` tokens with ``sampling`` (its own sampler: :mod:`appliance.engine.sampler`;
        settings it cannot take are ``BAD_REQUEST``, nothing changed). With ``n_past``, the id is a resting sequence
        (:meth:`finish`, :meth:`copy`, :meth:`load_state`) whose first ``n_past`` cells the prompt continues (its
        cells past them are dropped). ``seen``: the tokens its penalties count before its first generated one
        (default: ``prompt_tokens``; the daemon passes the whole conversation)."""
        self._check_thread()
        self._check_free(seq_id, resting_ok=True)
        if not prompt_tokens:
            raise ApplianceError("BAD_REQUEST", "a sequence needs at least one prompt token", {"seq_id": seq_id})
        if max_tokens < 1:
            raise ApplianceError("BAD_REQUEST", "max_tokens must be at least 1", {"max_tokens": max_tokens})
        resting = self._resting.get(seq_id, 0)
        if not 0 <= n_past <= resting:
            raise ApplianceError("BAD_REQUEST", "the sequence holds fewer cells than it continues",
                                 {"seq_id": seq_id, "n_past": n_past, "cells": resting})
        self._check_tokens(prompt_tokens)
        self._check_room(seq_id, n_past + len(prompt_tokens) + max_tokens, continuing=True)
        sampler, kept = self._sampler(sampling, prompt_tokens if seen is None else seen)
        if resting > n_past:
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, n_past, -1)
        self._resting.pop(seq_id, None)
        self._seqs[seq_id] = _Sequence(seq_id, n_past, list(prompt_tokens), max_tokens, sampling, sampler, kept)

    def _sampler(self, sampling: Sampling, seen: Sequence[int]) -> tuple[SequenceSampler, tuple[int, ...]]:
        """A sequence's own sampler, and the tokens it was told of (those its penalties look at)."""
        self.weights.check_sampling(sampling)
        kept = tuple(seen[len(seen) - sampling.penalty_last_n:]) if sampling.penalty_last_n > 0 else ()
        return SequenceSampler(self.weights, sampling, kept), kept

    def cancel(self, seq_id: int) -> None:
        """Remove sequence ``seq_id`` (generating or resting): its KV cells, its sampler, its state. No other
        sequence changes."""
        self._check_thread()
        if seq_id in self._resting:
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            del self._resting[seq_id]
            return
        seq = self._sequence(seq_id)
        self._drop(seq)
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    # -- resting sequences -----------------------------------------------------------------------------
    # A conversation between two requests: its KV cells stay in the cache, without a sampler or pending work.
    def finish(self, seq_id: int, keep: int | None = None) -> int:
        """End sequence ``seq_id``'s generation: it rests with its evaluated cells (the first ``keep`` of them
        when given: a cancelled request's cells go); its tokens not evaluated yet are the caller's. Returns the
        cells it keeps."""
        self._check_thread()
        seq = self._sequence(seq_id)
        self._drop(seq)
        cells = seq.n_past if keep is None else max(0, min(keep, seq.n_past))
        if cells < seq.n_past:
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, cells, -1)
        self._resting[seq_id] = cells
        return cells

    def _drop(self, seq: _Sequence) -> None:
        """Forget a generating sequence: its draw in flight (waited for), its sampler, its undelivered events."""
        self._settle(seq, keep=False)
        seq.sampler.free()
        del self._seqs[seq.seq_id]
        self._outputs.pop(seq.seq_id, None)
        self._drawn.pop(seq.seq_id, None)
        self._ready = [(event, row) for event, row in self._ready if event.seq_id != seq.seq_id]

    def cells(self, seq_id: int) -> int:
        """The KV cells sequence ``seq_id`` holds now (0 for a free id)."""
        seq = self._seqs.get(seq_id)
        return seq.n_past if seq is not None else self._resting.get(seq_id, 0)

    def copy(self, source: int, target: int, n: int) -> None:
        """The free id ``target`` rests with the first ``n`` cells of ``source`` (llama.cpp's
        ``llama_memory_seq_cp``: the cells are shared, not recomputed nor copied; in a split context copied, through
        host memory)."""
        self._check_thread()
        self._check_free(target)
        if not 0 < n <= self.cells(source):
            raise ApplianceError("BAD_REQUEST", "the source sequence does not hold that many cells",
                                 {"seq_id": source, "n": n, "cells": self.cells(source)})
        self._check_room(target, n)
        if self.split:  # llama.cpp copies between streams only whole streams: through host memory, then cut
            self.load_state(target, self._state_bytes(source), self.cells(source))
            self.truncate(target, n)
            return
        llama_cpp.llama_memory_seq_cp(self.memory, source, target, 0, n)
        self._resting[target] = n

    def truncate(self, seq_id: int, keep: int) -> None:
        """A resting sequence keeps only its first ``keep`` cells."""
        self._check_thread()
        cells = self._resting.get(seq_id)
        if cells is None:
            raise ApplianceError("BAD_REQUEST", "no resting sequence with that id", {"seq_id": seq_id})
        if keep < cells:
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, max(0, keep), -1)
            self._resting[seq_id] = max(0, keep)

    def state(self, seq_id: int) -> bytes:
        """A resting sequence's KV cells as llama.cpp's per-sequence state bytes (see :meth:`load_state`)."""
        buffer = bytearray(self.state_size(seq_id))
        return bytes(buffer[:self.state_into(seq_id, buffer)])

    def _state_bytes(self, seq_id: int) -> bytearray:
        """Any sequence's KV cells (generating or resting) as llama.cpp's per-sequence state bytes, in a buffer of
        their size (the one host copy)."""
        size = int(llama_cpp.llama_state_seq_get_size(self.ctx, seq_id))
        buffer = bytearray(max(size, 1))
        del buffer[self._write_state(seq_id, buffer, size):]  # in place: no second buffer
        return buffer

    def _write_state(self, seq_id: int, buffer: bytearray, size: int) -> int:
        """llama.cpp writes sequence ``seq_id``'s state (``size`` bytes) straight into ``buffer``; the bytes
        written."""
        view = (ctypes.c_uint8 * len(buffer)).from_buffer(buffer)
        try:
            written = int(llama_cpp.llama_state_seq_get_data(self.ctx, view, size, seq_id))
        finally:
            del view
        if written == 0 and size > 0:
            raise ApplianceError("INTERNAL", "llama.cpp could not copy the sequence's state", {"seq_id": seq_id})
        return written

    def state_size(self, seq_id: int) -> int:
        """The bytes :meth:`state_into` writes for a resting sequence."""
        self._check_thread()
        if seq_id not in self._resting:
            raise ApplianceError("BAD_REQUEST", "no resting sequence with that id", {"seq_id": seq_id})
        return int(llama_cpp.llama_state_seq_get_size(self.ctx, seq_id))

    def state_into(self, seq_id: int, buffer: bytearray) -> int:
        """Copy a resting sequence's state straight into ``buffer`` (at least :meth:`state_size` bytes: one copy,
        at memory bandwidth); returns the bytes written."""
        size = self.state_size(seq_id)
        if len(buffer) < size:
            raise ApplianceError("INTERNAL", "the state buffer is too small", {"size": size, "buffer": len(buffer)})
        return self._write_state(seq_id, buffer, size)

    def load_state(self, seq_id: int, state: bytes | bytearray | memoryview, n_past: int) -> None:
        """The free id ``seq_id`` rests with the ``n_past`` cells of ``state`` (from :meth:`state`); a bytearray
        (or a view of one) is read in place, without a copy."""
        self._check_thread()
        self._check_free(seq_id)
        self._check_room(seq_id, n_past)
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        if n_past > 0:
            state = self._restreamed(state, seq_id)
            size = len(state)
            if isinstance(state, bytes) or (isinstance(state, memoryview) and state.readonly):
                buffer = (ctypes.c_uint8 * size).from_buffer_copy(state)
            else:
                buffer = (ctypes.c_uint8 * size).from_buffer(state)
            try:
                read = int(llama_cpp.llama_state_seq_set_data(self.ctx, buffer, size, seq_id))
            finally:
                del buffer
            if read == 0:
                llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
                raise ApplianceError("INTERNAL", "llama.cpp refused the saved sequence state", {"seq_id": seq_id})
        self._resting[seq_id] = n_past

    def _restreamed(self, state: kvstreams.State, seq_id: int) -> kvstreams.State:
        """``state`` as this context's stream count has it (saved in a split context and loaded into one pool, or
        the other way round: :func:`~appliance.engine.kvstreams.restream`); the bytes as they are when it has it."""
        try:
            return kvstreams.restream(state, self.n_stream)
        except ValueError as exc:
            raise ApplianceError("INTERNAL", f"llama.cpp refused the saved sequence state: {exc}",
                                 {"seq_id": seq_id}) from None

    # -- parking ---------------------------------------------------------------------------------------
    def save(self, seq_id: int) -> SavedSequence:
        """Copy sequence ``seq_id``'s KV cells and bookkeeping to host bytes; the sequence stays (cancel it to
        free its cells)."""
        self._check_thread()
        seq = self._sequence(seq_id)
        self._settle(seq, keep=True)  # its token drawn beside the decode is part of what it saves
        size = int(llama_cpp.llama_state_seq_get_size(self.ctx, seq_id))
        buffer = (ctypes.c_uint8 * max(size, 1))()
        written = int(llama_cpp.llama_state_seq_get_data(self.ctx, buffer, size, seq_id))
        if written == 0 and size > 0:
            raise ApplianceError("INTERNAL", "llama.cpp could not copy the sequence's state", {"seq_id": seq_id})
        return SavedSequence(bytes(buffer)[:written], seq.n_past, tuple(seq.pending), tuple(seq.generated),
                             seq.max_tokens, seq.sampling, seq.done, seq.seen)

    def restore(self, seq_id: int, saved: SavedSequence) -> None:
        """Sequence ``seq_id`` (free) becomes the saved one: its KV cells back in the cache, its pending tokens,
        its budget, its sampler told of what it generated (penalties, grammar); it continues at the next step."""
        self._check_thread()
        self._check_free(seq_id)
        self._check_tokens(saved.pending)
        left = 0 if saved.done else saved.max_tokens - len(saved.generated)
        self._check_room(seq_id, saved.n_past + len(saved.pending) + left)
        sampler, kept = self._sampler(saved.sampling, saved.seen)
        sampler.replay(saved.generated)
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        if saved.state:
            state = self._restreamed(saved.state, seq_id)
            buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
            read = int(llama_cpp.llama_state_seq_set_data(self.ctx, buffer, len(state), seq_id))
            if read == 0:
                llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
                sampler.free()
                raise ApplianceError("INTERNAL", "llama.cpp refused the saved sequence state", {"seq_id": seq_id})
        seq = _Sequence(seq_id, saved.n_past, list(saved.pending), saved.max_tokens, saved.sampling, sampler,
                        kept, list(saved.generated), saved.done)
        self._seqs[seq_id] = seq

    def lift(self, seq_id: int) -> LiftedSequence:
        """Take generating sequence ``seq_id`` out of this context, to :meth:`land` in another one of the same
        weights (a pool grown while requests are in flight): its draw in flight is waited for, its cells copied to
        host bytes and removed here. Its sampler goes with it, not freed."""
        self._check_thread()
        seq = self._sequence(seq_id)
        self._settle(seq, keep=True)  # its token drawn beside the decode goes with it
        state = self._state_bytes(seq_id)  # the one host copy of its cells: land reads it in place
        ready = [(event, row) for event, row in self._ready if event.seq_id == seq_id]
        self._ready = [(event, row) for event, row in self._ready if event.seq_id != seq_id]
        del self._seqs[seq_id]
        self._outputs.pop(seq_id, None)
        self._drawn.pop(seq_id, None)
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        return LiftedSequence(state, seq, ready)

    def land(self, seq_id: int, lifted: LiftedSequence) -> None:
        """The free id ``seq_id`` becomes the :meth:`lift`-ed sequence: its cells back, its sampler and pending
        tokens as they were; it goes on at the next step (its undelivered events come with it)."""
        self._check_thread()
        self._check_free(seq_id)
        seq = lifted.sequence
        if seq.seq_id != seq_id:
            raise ApplianceError("INTERNAL", "a lifted sequence lands in another sequence id",
                                 {"seq_id": seq_id, "lifted": seq.seq_id})
        self._check_room(seq_id, seq.cells())
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        if lifted.state:
            lifted.state = self._restreamed(lifted.state, seq_id)  # type: ignore[assignment]  # a bytearray
            buffer = (ctypes.c_uint8 * len(lifted.state)).from_buffer(lifted.state)  # read in place, no copy
            try:
                read = int(llama_cpp.llama_state_seq_set_data(self.ctx, buffer, len(lifted.state), seq_id))
            finally:
                del buffer
            if read == 0:
                llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
                raise ApplianceError("INTERNAL", "llama.cpp refused the lifted sequence state", {"seq_id": seq_id})
        self._seqs[seq_id] = seq
        self._ready.extend(lifted.ready)

    # -- decoding --------------------------------------------------------------------------------------
    def step(self) -> list[SeqEvent]:
        """ONE ``llama_decode`` for every sequence with work, then one sampled token for every sequence whose
        pending tokens are all in: its event. No work: no decode, no events.

        A sequence whose grammar refused the chain's pick draws again over what the grammar allows on another
        thread, beside the next decode (:meth:`~appliance.engine.sampler.SequenceSampler.draw_constrained`), and
        sits the steps out until its token is drawn: the other sequences' steps never wait for a grammar. Its event
        comes with the step during which the draw ended (the step waits for it only when nothing else has work).

        A decode llama.cpp refuses raises ``INTERNAL`` and advances no sequence (a retry decodes the same batch);
        it stops the step for all, so the caller cancels the sequence at fault. Bad input is refused before it
        joins (:meth:`add`, :meth:`restore`) so that this does not happen."""
        self._check_thread()
        self._outputs.clear()
        self._drawn = {event.seq_id: row for event, row in self._ready}
        self.last_batch = 0
        events = [event for event, _ in self._ready] + self._collect(wait=False, failed=True)
        self._ready = []
        work = [Work(seq.seq_id, len(seq.pending), bool(seq.generated))
                for seq in self._seqs.values() if not seq.done and seq.drawing is None]
        takes = plan_step(work, self.n_batch, self.prefill_limit)
        if self.split:
            takes.sort(key=attrgetter("seq_id"))  # llama.cpp's micro-batches hold consecutive ids (class docstring)
        if not takes:
            if not events and any(seq.drawing is not None for seq in self._seqs.values()):
                events = self._collect(wait=True, failed=True)  # only draws left: wait for one
            return events
        batch = self._batch
        index = 0
        rows: dict[int, int] = {}
        for take in takes:
            seq = self._seqs[take.seq_id]
            for offset in range(take.count):
                batch.token[index] = seq.pending[offset]
                batch.pos[index] = seq.n_past + offset
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = take.seq_id
                batch.logits[index] = 0
                index += 1
            if take.last:
                batch.logits[index - 1] = 1
                rows[take.seq_id] = index - 1
        batch.n_tokens = index
        self.last_batch = index
        code = int(llama_cpp.llama_decode(self.ctx, batch))
        if code != 0:
            # Nothing advanced: drop whatever cells the failed batch may have left, so every sequence is as it
            # was before the step (its pending tokens still pending) and the caller may retry or cancel.
            for take in takes:
                llama_cpp.llama_memory_seq_rm(self.memory, take.seq_id, self._seqs[take.seq_id].n_past, -1)
            log.error("llama_decode returned %d for a batch of %d tokens", code, index)
            raise ApplianceError("INTERNAL", "llama.cpp could not decode the batch", {"n_tokens": index})
        for take in takes:
            seq = self._seqs[take.seq_id]
            seq.n_past += take.count
            del seq.pending[:take.count]
        self._outputs = rows
        for seq_id, row in rows.items():
            event = self._sample(self._seqs[seq_id], row)
            if event is not None:
                events.append(event)
        return events + self._collect(wait=False, failed=False)

    def logits(self, seq_id: int) -> np.ndarray:
        """A copy of the logits sequence ``seq_id``'s event of the last step was sampled from."""
        self._check_thread()
        drawn = self._drawn.get(seq_id)
        if drawn is not None:
            return drawn.copy()
        row = self._outputs.get(seq_id)
        if row is None:
            raise ApplianceError("BAD_REQUEST", "the sequence sampled nothing in the last step", {"seq_id": seq_id})
        from appliance.engine.candidates import logits_row  # lazy: numpy, which serving needs only for some draws

        return logits_row(self.ctx, row, self.weights.n_vocab).copy()

    def _sample(self, seq: _Sequence, row: int) -> SeqEvent | None:
        """The sequence's next token from its output ``row``; None when its grammar's draw goes on beside the
        next decode (its event comes later). A plain sequence samples in C, without numpy."""
        sampler = seq.sampler
        if sampler.plain:
            return self._event(seq, sampler.sample(self.ctx, row))
        from appliance.engine.candidates import logits_row  # lazy: numpy, for grammars and log-probabilities only

        logits = logits_row(self.ctx, row, self.weights.n_vocab)
        draw = sampler.draw(logits)
        if draw is not None:
            return self._event(seq, draw)
        if self._drawer is None:
            self._drawer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-draw")
        seq.drawn_from = logits.copy()  # the next decode overwrites the context's rows
        seq.drawing = self._drawer.submit(seq.sampler.draw_constrained, seq.drawn_from)
        return None

    def _collect(self, *, wait: bool, failed: bool) -> list[SeqEvent]:
        """The events of the draws beside the decode that have ended (``wait``: at least one, waited for). A draw
        that raised raises here when ``failed`` (before a decode: then no sequence has advanced), else waits for
        the next step."""
        drawing = [seq for seq in self._seqs.values() if seq.drawing is not None]
        if wait and drawing:
            futures.wait([seq.drawing for seq in drawing if seq.drawing is not None],
                         return_when=futures.FIRST_COMPLETED)
        events = []
        for seq in drawing:
            future = seq.drawing
            if future is not None and future.done() and (failed or future.exception() is None):
                events.append(self._finish_draw(seq))
        return events

    def _settle(self, seq: _Sequence, *, keep: bool) -> None:
        """Wait for ``seq``'s draw in flight (if any): with ``keep`` it takes its token, whose event the next
        :meth:`step` delivers; else the draw is dropped."""
        future = seq.drawing
        if future is None:
            return
        futures.wait([future])
        if keep:
            row = seq.drawn_from
            event = self._finish_draw(seq)
            assert row is not None
            self._ready.append((event, row))
        else:
            seq.drawing = None
            seq.drawn_from = None

    def _finish_draw(self, seq: _Sequence) -> SeqEvent:
        assert seq.drawing is not None and seq.drawn_from is not None
        future, row = seq.drawing, seq.drawn_from
        seq.drawing = None
        seq.drawn_from = None
        draw = future.result()  # what it raised, it raises here, on the engine thread
        self._drawn[seq.seq_id] = row
        return self._event(seq, draw)

    def _event(self, seq: _Sequence, draw: Draw) -> SeqEvent:
        """The sequence takes its drawn token. Every end-of-generation token of the vocabulary
        (``llama_vocab_is_eog``: ``<|im_end|>``, ``<|eot_id|>``, ...) ends it without its text; a grammar that
        allows no token ends it with ``"stop"`` and no token (:data:`NO_TOKEN`)."""
        if draw.token == NO_TOKEN:
            seq.done = True
            return SeqEvent(seq.seq_id, NO_TOKEN, b"", True, "stop")
        token = draw.token
        seq.generated.append(token)
        seq.pending.append(token)
        reason: StopReason | None = None
        if self.weights.is_end(token):
            reason = "eos"
        elif draw.stop:
            reason = "stop"
        elif len(seq.generated) >= seq.max_tokens:
            reason = "length"
        seq.done = reason is not None
        if reason == "eos":
            piece = b""
        elif draw.special:
            piece = self.weights.special_piece(token)
        else:
            piece = self.weights.piece(token)
        return SeqEvent(seq.seq_id, token, piece, seq.done, reason, draw.logprobs)

    # -- checks ----------------------------------------------------------------------------------------
    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise ApplianceError("INTERNAL", "a batched context was used from a thread that does not own it")
        if self.ctx is None:
            raise ApplianceError("INTERNAL", "the batched context is closed")

    def _sequence(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ApplianceError("BAD_REQUEST", "no such sequence in the context", {"seq_id": seq_id})
        return seq

    def _check_free(self, seq_id: int, *, resting_ok: bool = False) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ApplianceError("BAD_REQUEST", "the sequence id is out of range",
                                 {"seq_id": seq_id, "n_seq_max": self.n_seq_max})
        if seq_id in self._seqs or (seq_id in self._resting and not resting_ok):
            raise ApplianceError("BAD_REQUEST", "the sequence id is in use", {"seq_id": seq_id})

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [token for token in tokens if not 0 <= token < self.weights.n_vocab]
        if bad:
            raise ApplianceError("BAD_REQUEST", "a prompt token is not in the vocabulary",
                                 {"token": bad[0], "n_vocab": self.weights.n_vocab})

    def _check_room(self, seq_id: int, cells: int, *, continuing: bool = False) -> None:
        """``cells`` more claimed by sequence ``seq_id`` (``continuing``: its resting cells are among them) fit."""
        if self.split:
            if cells > self.seq_cells:
                raise ApplianceError("CONTEXT_OVERFLOW", "the sequence does not fit in its KV stream",
                                     {"seq_cells": self.seq_cells, "requested": cells})
            return
        claimed = self.cells_claimed() - (self._resting.get(seq_id, 0) if continuing else 0)
        if claimed + cells > self.n_ctx:
            raise ApplianceError("CONTEXT_OVERFLOW", "the sequence does not fit beside the others in the context",
                                 {"n_ctx": self.n_ctx, "claimed": claimed, "requested": cells})
