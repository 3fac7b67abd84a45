"""One sequence's sampler on llama.cpp's samplers, chained as llama-server chains them (``common/sampling.cpp``):
its own settings, grammar and log-probabilities, apart from every other sequence of the batch.

* **The chain**: logit bias, penalties (repeat, frequency and presence, over the last ``penalty_last_n`` tokens, the
  prompt's included, as llama-server counts them), then top-k, top-p, min-p, temperature and a seeded draw; at
  temperature 0 greedy (the likeliest token after bias and penalties). A setting at its default adds no sampler, so
  a plain request samples exactly as before.
* **The grammar** is apart from the chain, as in llama-server: the chain draws a token and the grammar checks that
  one token (cheap: :meth:`SequenceSampler.draw`); only when it refuses is the draw made again over the tokens the
  grammar allows (:meth:`SequenceSampler.draw_constrained`). That second draw asks the grammar about the candidates
  in order of their logits, a chunk at a time, until it holds as many as the chain can use (greedy: one, top-k: k;
  else all): the same draw as over the whole vocabulary with the grammar's ``-inf`` applied, mostly without checking
  every token's text (which takes about 10 ms for a 150k-token vocabulary). It touches nothing but its own sequence's
  samplers, so the batch runs it beside the next decode (:class:`~appliance.engine.batched.BatchedContext`). No token
  reaches llama.cpp's grammar ``accept`` that the grammar did not allow first: accepting a refused token throws a C++
  exception, which aborts a process calling through ctypes. When the grammar allows no token (its text cannot go on
  and no end-of-generation token is left), the generation ends with ``"stop"``.
* **A lazy grammar** waits for its trigger in :class:`~appliance.engine.triggers.TriggerWatch` (llama.cpp's rules),
  and the text from the trigger on is fed to a plain grammar sampler one piece at a time, each checked first: a
  trigger whose text the grammar refuses ends the generation (``"stop"``) instead of aborting the process, as
  llama.cpp's own lazy sampler would.
* **Log-probabilities** come from the raw logits row, before any sampler
  (:func:`~appliance.engine.sampling.token_logprobs`).
* **A plain sequence** (no grammar, no log-probabilities) samples in C: ``llama_sampler_sample`` fills the candidates
  from the context's logits row, runs the whole chain (the pre samplers, then the draw) and accepts the token, the
  same samplers in the same order over the same candidates as the draw through numpy, so the same token and the same
  random stream (:meth:`SequenceSampler.sample`). Only a grammar or log-probabilities need the numpy buffer of
  :mod:`appliance.engine.candidates`, imported with the first such draw.

Everything here runs on the engine thread (the thread of the sequence's context), but for
:meth:`SequenceSampler.draw_constrained`, which runs on one other thread while the engine thread leaves that sequence
alone.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from appliance.engine.bindings import llama_cpp
from appliance.engine.interface import Grammar, Sampling, TokenLogprobs
from appliance.engine.sampling import token_logprobs
from appliance.engine.triggers import Feed, TriggerPattern, TriggerWatch

if TYPE_CHECKING:
    import numpy as np

    from appliance.engine.candidates import Candidates

NO_TOKEN = -1
"""The token of a draw that found none: the grammar allows nothing."""


class SamplerVocabulary(Protocol):
    """What a sampler needs of its model (:class:`~appliance.engine.batched.ModelWeights`)."""

    n_vocab: int
    vocab: llama_cpp.llama_vocab_p

    def special_piece(self, token: int) -> bytes: ...

    def byte_token(self, value: int) -> int | None: ...

    def grammar_parts(self, grammar: Grammar) -> GrammarParts: ...

    def candidates(self) -> Candidates: ...


@dataclass(frozen=True)
class GrammarParts:
    """A grammar made ready for a model: its parsed sampler (cloned for each sequence) and its triggers."""

    prototype: llama_cpp.llama_sampler_p
    patterns: tuple[TriggerPattern, ...]
    tokens: frozenset[int]

    @property
    def lazy(self) -> bool:
        return bool(self.patterns or self.tokens)


def chain_of(samplers: Sequence[llama_cpp.llama_sampler_p]) -> llama_cpp.llama_sampler_p:
    params = llama_cpp.llama_sampler_chain_default_params()
    params.no_perf = True
    chain = llama_cpp.llama_sampler_chain_init(params)
    for sampler in samplers:
        llama_cpp.llama_sampler_chain_add(chain, sampler)  # the chain owns it now
    return chain


def pre_samplers(sampling: Sampling, n_vocab: int) -> list[llama_cpp.llama_sampler_p]:
    """The samplers that change logits before the grammar and the draw: logit bias, then penalties."""
    samplers = []
    if sampling.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(sampling.logit_bias))(
            *(llama_cpp.llama_logit_bias(token, bias) for token, bias in sampling.logit_bias))
        samplers.append(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(sampling.logit_bias), biases))
    penalised = (sampling.repeat_penalty != 1.0 or sampling.frequency_penalty != 0.0
                 or sampling.presence_penalty != 0.0)
    if penalised and sampling.penalty_last_n > 0:
        samplers.append(llama_cpp.llama_sampler_init_penalties(
            n_vocab, sampling.penalty_last_n, sampling.repeat_penalty, sampling.frequency_penalty,
            sampling.presence_penalty))
    return samplers


def draw_samplers(sampling: Sampling) -> list[llama_cpp.llama_sampler_p]:
    """The samplers that pick the token: greedy at temperature 0, else top-k, top-p, min-p, temperature, a seeded
    draw (llama-server's order)."""
    if sampling.temperature <= 0.0:
        return [llama_cpp.llama_sampler_init_greedy()]
    samplers = []
    if sampling.top_k > 0:
        samplers.append(llama_cpp.llama_sampler_init_top_k(sampling.top_k))
    samplers.append(llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1))
    if sampling.min_p > 0.0:
        samplers.append(llama_cpp.llama_sampler_init_min_p(sampling.min_p, 1))
    samplers.append(llama_cpp.llama_sampler_init_temp(sampling.temperature))
    samplers.append(llama_cpp.llama_sampler_init_dist(sampling.seed & 0xFFFFFFFF))
    return samplers


class GrammarGate:
    """A sequence's grammar: a plain llama.cpp grammar sampler that only ever accepts what it allowed, and, for a
    lazy grammar, the trigger it waits for."""

    def __init__(self, parts: GrammarParts, vocabulary: SamplerVocabulary) -> None:
        self.sampler = llama_cpp.llama_sampler_clone(parts.prototype)
        if not self.sampler:
            raise MemoryError("llama.cpp could not copy a grammar sampler")
        self.vocabulary = vocabulary
        self.watch = TriggerWatch(parts.patterns, parts.tokens) if parts.lazy else None
        self._one = llama_cpp.llama_token_data(0, 0.0, 0.0)
        self._one_array = llama_cpp.llama_token_data_array(ctypes.pointer(self._one), 1, -1, False)

    @property
    def active(self) -> bool:
        """The grammar constrains the next token (a lazy one once its trigger fired)."""
        return self.watch is None or self.watch.fired

    def allows(self, token: int) -> bool:
        """The grammar would take ``token`` now (checked on that one candidate)."""
        if not 0 <= token < self.vocabulary.n_vocab:
            return False
        self._one.id = token
        self._one.logit = 0.0
        self._one.p = 0.0
        self._one_array.size = 1
        self._one_array.selected = -1
        self._one_array.sorted = False
        llama_cpp.llama_sampler_apply(self.sampler, ctypes.byref(self._one_array))
        return math.isfinite(self._one.logit)

    def take(self, token: int) -> bool:
        """Accept ``token`` if the grammar allows it; False (nothing accepted) when it does not."""
        if not self.allows(token):
            return False
        llama_cpp.llama_sampler_accept(self.sampler, token)
        return True

    def feed(self, pieces: list[Feed]) -> bool:
        """Give the grammar the text from its trigger on; False at the first piece it refuses."""
        for piece in pieces:
            if piece.token is not None:
                if not self.take(piece.token):
                    return False
                continue
            for value in piece.data:  # part of a token: its bytes, one single-byte token each
                token = self.vocabulary.byte_token(value)
                if token is None or not self.take(token):
                    return False
        return True

    def allowed(self, records: np.ndarray, need: int) -> np.ndarray:
        """The candidates the grammar allows among ``records``, at least ``need`` of them when there are (0:
        all; :func:`~appliance.engine.candidates.allowed`)."""
        from appliance.engine import candidates  # lazy: numpy, for grammars only

        return candidates.allowed(self.sampler, records, need)

    def free(self) -> None:
        if self.sampler is not None:
            llama_cpp.llama_sampler_free(self.sampler)
            self.sampler = None


@dataclass(frozen=True)
class Draw:
    """One sampled token (``NO_TOKEN`` when the grammar allowed none); ``stop``: the generation ends after it (the
    grammar cannot go on); ``special``: its text is the grammar's (control tokens with their text)."""

    token: int
    stop: bool = False
    special: bool = False
    logprobs: TokenLogprobs | None = None


class SequenceSampler:
    """The sampler of one sequence (module docstring): ``seen`` are the tokens before its first generated one (its
    conversation and prompt), which its penalties count. A :attr:`plain` one samples with :meth:`sample`, any other
    with :meth:`draw` (and :meth:`draw_constrained` when its grammar refuses)."""

    def __init__(self, vocabulary: SamplerVocabulary, sampling: Sampling, seen: Sequence[int] = ()) -> None:
        self.vocabulary = vocabulary
        self.own: Candidates | None = None  # its own, for draws beside the next decode
        self.sampling = sampling
        self.gate: GrammarGate | None = None
        pre = pre_samplers(sampling, vocabulary.n_vocab)
        self.pre = chain_of(pre) if pre else None
        self.draw_chain = chain_of(draw_samplers(sampling))
        self.chain = chain_of([self.pre, self.draw_chain]) if self.pre is not None else self.draw_chain
        """The whole chain, which owns ``pre`` and ``draw_chain``: every token is accepted in it."""
        if sampling.temperature <= 0.0:
            self.need = 1
        else:
            self.need = sampling.top_k if sampling.top_k > 0 else 0
        try:
            if sampling.grammar is not None:
                self.gate = GrammarGate(vocabulary.grammar_parts(sampling.grammar), vocabulary)
        except BaseException:
            self.free()
            raise
        self.plain = self.gate is None and sampling.logprobs is None
        """No grammar, no log-probabilities: :meth:`sample` draws its tokens in C."""
        if self.pre is not None and sampling.penalty_last_n > 0:
            for token in list(seen)[-sampling.penalty_last_n:]:
                llama_cpp.llama_sampler_accept(self.pre, token)
        self.dead = False

    def sample(self, ctx: llama_cpp.llama_context_p, row: int) -> Draw:
        """The next token of a :attr:`plain` sequence from output ``row`` of ``ctx``, accepted by every sampler:
        ``llama_sampler_sample`` over the whole chain, as :meth:`draw` would draw it (no grammar: a token always)."""
        return Draw(int(llama_cpp.llama_sampler_sample(self.chain, ctx, row)))

    def draw(self, logits: np.ndarray) -> Draw | None:
        """The next token from ``logits`` (the sequence's raw logits row), accepted by every sampler; None when its
        grammar refused the chain's pick: then :meth:`draw_constrained` draws it (on any one thread)."""
        first = self._draw_from(self._biased(logits, self.vocabulary.candidates()))
        if first == NO_TOKEN:
            return Draw(NO_TOKEN, stop=True)
        gate = self.gate
        if gate is not None and gate.active and not gate.allows(first):
            return None
        return self._drawn(first, logits)

    def draw_constrained(self, logits: np.ndarray) -> Draw:
        """The draw again over the tokens the grammar allows (after :meth:`draw` gave None). It touches only this
        sampler and ``logits`` (a copy of the row the caller keeps), so it may run beside the next decode."""
        from appliance.engine.candidates import Candidates  # lazy: numpy, for grammars only

        gate = self.gate
        assert gate is not None
        if self.own is None:
            self.own = Candidates(self.vocabulary.n_vocab)
        allowed = gate.allowed(self._biased(logits, self.own), self.need)
        if allowed.size == 0:
            return Draw(NO_TOKEN, stop=True)
        token = self._draw_from(allowed)
        if not gate.allows(token):
            return Draw(NO_TOKEN, stop=True)
        return self._drawn(token, logits)

    def _drawn(self, token: int, logits: np.ndarray) -> Draw:
        logprobs = None
        if self.sampling.logprobs is not None:
            logprobs = token_logprobs(logits, token, self.sampling.logprobs, self.vocabulary.special_piece)
        stop, special = self._accept(token)
        return Draw(token, stop, special, logprobs)

    def replay(self, tokens: Sequence[int]) -> None:
        """Accept ``tokens`` (generated before a save) as if drawn; the draw's random stream restarts from its
        seed."""
        for token in tokens:
            if self.dead:
                return
            self.dead = self._accept(token)[0]

    def _accept(self, token: int) -> tuple[bool, bool]:
        """Accept ``token`` in the chain and the grammar: (the generation must stop, its text is the grammar's)."""
        llama_cpp.llama_sampler_accept(self.chain, token)
        gate = self.gate
        if gate is None:
            return False, False
        if gate.active:
            return not gate.take(token), True
        assert gate.watch is not None
        feed = gate.watch.push(token, self.vocabulary.special_piece(token))
        if feed is None:
            return False, False
        return not gate.feed(feed), True

    def _biased(self, logits: np.ndarray, candidates: Candidates) -> np.ndarray:
        """Every token with its logit after bias and penalties (in ``candidates``' buffer)."""
        from appliance.engine.candidates import apply  # lazy: numpy, for grammars and log-probabilities only

        records = candidates.fill(logits)
        if self.pre is not None:
            apply(self.pre, records)
        return records

    def _draw_from(self, records: np.ndarray) -> int:
        from appliance.engine.candidates import picked  # lazy: numpy, for grammars and log-probabilities only

        token = picked(self.draw_chain, records)
        return NO_TOKEN if token is None else token

    def free(self) -> None:
        chain = getattr(self, "chain", None)
        if chain is not None:
            llama_cpp.llama_sampler_free(chain)  # with pre and draw_chain, which it owns
        self.chain = self.pre = self.draw_chain = None
        if getattr(self, "gate", None) is not None:
            self.gate.free()
            self.gate = None
