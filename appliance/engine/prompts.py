"""A prompt's tokens: raw text, or a :class:`~appliance.engine.interface.Prompt` whose template text may hold control
tokens and whose message content never does (pure: the vocabulary's tokenizer is passed in).

The rule, in one line: **the whole text is tokenized with control tokens on (``special=True``), except the stretches
where a control token's text touches message content, which are tokenized as plain text.**

* A raw ``str`` prompt (the line protocol's DECODE) is plain text: ``<|im_start|>`` in it is a few ordinary tokens.
* A :class:`Prompt` whose content pieces hold no control token's text (the usual case) is tokenized whole with
  ``special=True``: exactly llama.cpp's tokens for that text (so ``usage.prompt_tokens`` is llama.cpp's count).
* When some control token's text overlaps a content piece (a user who writes ``<|im_end|>`` into a message), that
  occurrence (with any occurrence overlapping it) is cut out and tokenized with ``special=False``; the stretches
  around it keep ``special=True``. The template's own markers stay control tokens, the user's become text; only the
  token boundaries at the cuts may differ from a whole-text tokenization (a SentencePiece vocabulary puts its space
  prefix at the start of each stretch).

A vocabulary's user-defined tokens (added words such as a model's ``<tool_call>``) are matched by llama.cpp in any
text, plain or not, as Hugging Face's tokenizers match added tokens; only control tokens are switched by ``special``.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Sequence
from typing import Protocol

from appliance.engine.interface import Prompt, PromptText

_FAR = 1 << 62  # past the end of any text

Stretch = tuple[str, bool]
"""(text, special): a part of a prompt tokenized on its own, control tokens on or off."""


class PromptVocabulary(Protocol):
    def tokenize(self, text: str, *, bos: bool, special: bool = False) -> list[int]: ...

    def control_texts(self) -> tuple[str, ...]: ...


def prompt_text(prompt: PromptText) -> str:
    return prompt if isinstance(prompt, str) else prompt.text


def tokenize_prompt(vocabulary: PromptVocabulary, prompt: PromptText, *, bos: bool) -> list[int]:
    """``prompt``'s tokens (module docstring), after the BOS token when ``bos`` (and the vocabulary adds one)."""
    if isinstance(prompt, str):
        return vocabulary.tokenize(prompt, bos=bos) if prompt else []
    tokens: list[int] = []
    for index, (text, special) in enumerate(stretches(prompt, vocabulary.control_texts())):
        tokens += vocabulary.tokenize(text, bos=bos and index == 0, special=special)
    return tokens


def stretches(prompt: Prompt, controls: Sequence[str]) -> list[Stretch]:
    """The parts ``prompt`` is tokenized in: all of it with control tokens on, unless a control text in
    ``controls`` overlaps message content (module docstring). Empty parts are left out."""
    text = prompt.text
    pattern = control_pattern(tuple(controls))
    if pattern is None or not text:
        return [(text, True)] if text else []
    found = [(match.start(), match.start() + len(match.group(1))) for match in pattern.finditer(text)]
    cuts = cut_spans(found, content_spans(prompt))
    if not cuts:
        return [(text, True)]
    parts: list[Stretch] = []
    at = 0
    for start, end in cuts:
        if start > at:
            parts.append((text[at:start], True))
        parts.append((text[start:end], False))
        at = end
    if at < len(text):
        parts.append((text[at:], True))
    return parts


@functools.lru_cache(maxsize=8)
def control_pattern(controls: tuple[str, ...]) -> re.Pattern[str] | None:
    """Finds every position where a control text starts (overlapping ones too), the longest text at each."""
    if not controls:
        return None
    ordered = sorted(controls, key=len, reverse=True)
    return re.compile("(?=(" + "|".join(re.escape(text) for text in ordered) + "))")


def content_spans(prompt: Prompt) -> list[tuple[int, int]]:
    """Where the content (not special) pieces lie in ``prompt.text``."""
    spans = []
    at = 0
    for text, special in prompt.pieces:
        if not special and text:
            spans.append((at, at + len(text)))
        at += len(text)
    return spans


def cut_spans(found: list[tuple[int, int]], content: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The stretches to tokenize as plain text: each run of overlapping occurrences (``found``, in order of their
    starts) that touches a ``content`` span (in order, apart), as one span."""
    cuts = []
    run_start, run_end, touches = -1, -1, False
    for start, end in found:
        if start >= run_end:  # a new run of overlapping occurrences
            if touches:
                cuts.append((run_start, run_end))
            run_start, run_end, touches = start, end, False
        run_end = max(run_end, end)
        touches = touches or in_content(start, end, content)
    if touches:
        cuts.append((run_start, run_end))
    return cuts


def in_content(start: int, end: int, content: list[tuple[int, int]]) -> bool:
    """``[start, end)`` overlaps one of the ``content`` spans (sorted, apart)."""
    index = bisect.bisect_right(content, (start, _FAR)) - 1  # the last span starting at or before ``start``
    near = content[max(index, 0):index + 2]
    return any(start < span_end and span_start < end for span_start, span_end in near)

