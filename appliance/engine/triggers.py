"""The trigger of a lazy grammar: when the free text a sequence generates turns into what the grammar constrains
(pure: no llama.cpp).

The rules are ``llama_grammar_accept_impl``'s (llama.cpp's lazy grammar sampler): a trigger token fires as it is
generated, and the grammar applies from that token on; a trigger pattern is looked for in the text generated so far
(matched against all of it when it is anchored ``^...$``, else searched anywhere), and the grammar applies from the
first non-empty group of the match, else from the match's start. :class:`TriggerWatch` only decides; the caller feeds
what it returns to the grammar (:mod:`appliance.engine.sampler`), checking each piece first, which llama.cpp's own
lazy sampler does not do: there, text after the trigger that the grammar refuses throws a C++ exception, which
aborts a process that calls it through ctypes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from appliance.engine.sampling import sampling_error


@dataclass(frozen=True)
class Feed:
    """One piece of the text from a trigger on: a whole generated ``token``, or (``token`` None) the ``data`` of
    part of one (a pattern's match may begin inside a token)."""

    token: int | None
    data: bytes = b""


@dataclass(frozen=True)
class TriggerPattern:
    regex: re.Pattern[str]
    anchored: bool  # written ``^...$``: the whole text must match

    def start(self, text: str) -> int | None:
        """Where in ``text`` the grammar would start (a character index), or None when it does not match."""
        match = self.regex.fullmatch(text) if self.anchored else self.regex.search(text)
        if match is None:
            return None
        for group in range(1, (match.re.groups or 0) + 1):
            if match.start(group) >= 0 and match.end(group) > match.start(group):
                return match.start(group)
        return match.start()


def compile_patterns(patterns: Iterable[str]) -> tuple[TriggerPattern, ...]:
    """The patterns compiled (Python's ``re``, close to the ECMAScript regexes llama.cpp uses); one that does not
    compile is ``BAD_REQUEST`` (``param: grammar``) naming it."""
    compiled = []
    for pattern in patterns:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise sampling_error("grammar", f"the trigger pattern {pattern!r} is not a regular expression: {exc}",
                                 trigger_pattern=pattern) from None
        compiled.append(TriggerPattern(regex, pattern.startswith("^") and pattern.endswith("$")))
    return tuple(compiled)


@dataclass
class TriggerWatch:
    """Waits for a lazy grammar's trigger in what one sequence generates (:meth:`push`, one token at a time)."""

    patterns: tuple[TriggerPattern, ...]
    tokens: frozenset[int]
    fired: bool = False
    _text: bytearray = field(default_factory=bytearray)
    _spans: list[tuple[int, int, int]] = field(default_factory=list)  # (token, start, end) in _text

    def push(self, token: int, piece: bytes) -> list[Feed] | None:
        """``token`` (whose text is ``piece``) was generated: None while the trigger has not fired, else what the
        grammar must take from the trigger on (once; later tokens go to the grammar directly)."""
        if self.fired:
            raise ValueError("the trigger has already fired")
        if token in self.tokens:
            return self._fire([Feed(token)])
        start = len(self._text)
        self._text += piece
        self._spans.append((token, start, len(self._text)))
        if not self.patterns:
            return None
        text = self._text.decode("utf-8", errors="surrogateescape")  # one character per undecodable byte
        for pattern in self.patterns:
            at = pattern.start(text)
            if at is not None:
                return self._fire(self._from(len(text[:at].encode("utf-8", errors="surrogateescape"))))
        return None

    def _from(self, offset: int) -> list[Feed]:
        """The generated tokens from byte ``offset`` of the text on: whole ones as tokens, the one it cuts as its
        bytes from there."""
        feed = []
        for token, start, end in self._spans:
            if end <= offset:
                continue
            feed.append(Feed(token) if start >= offset else Feed(None, bytes(self._text[offset:end])))
        return feed

    def _fire(self, feed: list[Feed]) -> list[Feed]:
        self.fired = True
        self._text.clear()
        self._spans.clear()
        return feed
