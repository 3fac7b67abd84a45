"""A request's sampling settings checked against a model's vocabulary, and the log-probabilities of a logits row
(pure: no llama.cpp; numpy, imported with the first request for log-probabilities).
:mod:`appliance.engine.sampler` runs the settings on llama.cpp's samplers.

Every setting a sampler would take badly (a NaN that poisons every logit, a penalty llama.cpp asserts on, a token id
outside the vocabulary, a grammar with a NUL byte that C would cut short) is refused here, before anything changes,
as ``BAD_REQUEST`` with ``details.param`` naming the :class:`~appliance.engine.interface.Sampling` field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from appliance.engine.interface import Grammar, Sampling, TokenLogprob, TokenLogprobs
from appliance.errors import ApplianceError

if TYPE_CHECKING:
    import numpy as np

MAX_LOGPROBS = 20
"""The most alternatives a token's log-probabilities may list (OpenAI's ``top_logprobs`` bound)."""
MAX_GRAMMAR_BYTES = 1 << 20
"""A grammar longer than this is refused: a request's tools or schema make a few kilobytes."""
MAX_GRAMMAR_NESTING = 64
"""Parentheses nested deeper than this are refused: llama.cpp's GBNF parser recurses once per level, on the engine
thread's stack."""
MAX_GRAMMAR_RULES = 4096
"""Rules and groups (each group is a rule to llama.cpp) beyond this are refused: llama.cpp follows a chain of rules
recursively, and a chain of 20000 overflowed a 2 MiB thread stack here (10000 did not; a 10-tool request's grammar
has a few hundred)."""
MAX_TRIGGERS = 64
"""A lazy grammar's trigger patterns and tokens, each: a tool-call format has a handful."""


def sampling_error(param: str, message: str, **details: object) -> ApplianceError:
    return ApplianceError("BAD_REQUEST", message, {"param": param, **details})


def check_sampling(sampling: Sampling, n_vocab: int) -> None:
    """Refuse (``BAD_REQUEST``, ``details.param``) settings that llama.cpp's samplers cannot take; the grammar is
    checked (:func:`check_grammar`) where it is parsed, once per grammar (:mod:`appliance.engine.batched`)."""
    for name in ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty"):
        value = getattr(sampling, name)
        if not math.isfinite(value):
            raise sampling_error(name, f"{name} must be a finite number", value=str(value))
    if not 0.0 <= sampling.min_p <= 1.0:
        raise sampling_error("min_p", "min_p must be from 0 to 1", value=sampling.min_p)
    if sampling.repeat_penalty <= 0.0:
        raise sampling_error("repeat_penalty", "repeat_penalty must be above 0 (1 is off)",
                             value=sampling.repeat_penalty)
    if sampling.penalty_last_n < 0:
        raise sampling_error("penalty_last_n", "penalty_last_n must be 0 or more", value=sampling.penalty_last_n)
    for token, bias in sampling.logit_bias:
        if not 0 <= token < n_vocab:
            raise sampling_error("logit_bias", f"token {token} is not in the model's vocabulary",
                                 token=token, n_vocab=n_vocab)
        if math.isnan(bias) or bias == math.inf:
            raise sampling_error("logit_bias", f"the bias of token {token} must be a number or -inf (never)",
                                 token=token, bias=str(bias))
    if sampling.logprobs is not None and not 0 <= sampling.logprobs <= MAX_LOGPROBS:
        raise sampling_error("logprobs", f"logprobs must be from 0 to {MAX_LOGPROBS}", value=sampling.logprobs,
                             max=MAX_LOGPROBS)


def check_grammar(grammar: Grammar) -> None:
    """The bounds of a grammar that can be handed to llama.cpp's parser at all."""
    if not grammar.gbnf.strip():
        raise sampling_error("grammar", "the grammar is empty")
    if not grammar.root:
        raise sampling_error("grammar", "the grammar's root rule has no name")
    size = len(grammar.gbnf.encode("utf-8", errors="surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise sampling_error("grammar", f"the grammar is over {MAX_GRAMMAR_BYTES} bytes", bytes=size,
                             max_bytes=MAX_GRAMMAR_BYTES)
    texts = (grammar.gbnf, grammar.root, *grammar.trigger_patterns, *grammar.trigger_tokens)
    if any("\x00" in text for text in texts):
        raise sampling_error("grammar", "the grammar holds a NUL character")
    depth, groups = shape(grammar.gbnf)
    if depth > MAX_GRAMMAR_NESTING:
        raise sampling_error("grammar", f"the grammar nests groups {depth} deep, over {MAX_GRAMMAR_NESTING}",
                             nesting=depth, max_nesting=MAX_GRAMMAR_NESTING)
    rules = grammar.gbnf.count("::=") + groups
    if rules > MAX_GRAMMAR_RULES:
        raise sampling_error("grammar", f"the grammar has {rules} rules and groups, over {MAX_GRAMMAR_RULES}",
                             rules=rules, max_rules=MAX_GRAMMAR_RULES)
    for kind, triggers in (("trigger_patterns", grammar.trigger_patterns), ("trigger_tokens", grammar.trigger_tokens)):
        if len(triggers) > MAX_TRIGGERS:
            raise sampling_error("grammar", f"the grammar has {len(triggers)} {kind}, over {MAX_TRIGGERS}",
                                 count=len(triggers), max=MAX_TRIGGERS)
        if any(not trigger for trigger in triggers):
            raise sampling_error("grammar", f"the grammar has an empty entry in {kind}")


_QUOTED = re.compile(r'"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|#[^\r\n]*')
"""A GBNF string literal, character class or comment (whose parentheses and braces are not the grammar's)."""
_SHAPING = re.compile(r"[()]|\{([^{}]{0,40})\}")  # a repetition's bounds are short: no rescans of long text


def shape(gbnf: str) -> tuple[int, int]:
    """How deep parentheses nest in a GBNF text, and how many rules its groups and repetitions make (a group one, a
    repetition ``{m,n}`` one per repeat), outside its string literals, character classes and comments."""
    depth = deepest = groups = 0
    for match in _SHAPING.finditer(_QUOTED.sub(" ", gbnf)):
        text = match.group()
        if text == "(":
            depth += 1
            groups += 1
            deepest = max(deepest, depth)
        elif text == ")":
            depth = max(0, depth - 1)
        else:
            groups += max((repeats(part) for part in match.group(1).split(",")), default=0)
    return deepest, groups


def repeats(count: str) -> int:
    """A repetition bound's number (0 when it is not one; past :data:`MAX_GRAMMAR_RULES` when it is too long)."""
    count = count.strip()
    if not (count.isascii() and count.isdigit()):
        return 0
    return int(count) if len(count) <= 9 else MAX_GRAMMAR_RULES + 1


def token_logprobs(row: np.ndarray, token: int, top: int, piece: Callable[[int], bytes]) -> TokenLogprobs:
    """``token``'s natural-log probability under the raw logits ``row`` (a log-softmax in float64) and the ``top``
    likeliest tokens with theirs, most likely first (ties: the lower id first)."""
    import numpy as np  # lazy: a serving process holds numpy only once a request asks for log-probabilities

    values = row.astype(np.float64)
    peak = float(values.max())
    total = peak + math.log(float(np.exp(values - peak).sum()))
    best: list[int] = []
    if top > 0:
        count = min(top, values.size)
        chosen = np.argpartition(-values, count - 1)[:count]
        best = [int(i) for i in chosen[np.lexsort((chosen, -values[chosen]))]]
    return TokenLogprobs(TokenLogprob(token, piece(token), float(values[token]) - total),
                         tuple(TokenLogprob(i, piece(i), float(values[i]) - total) for i in best))
