"""The text of a generation as it is streamed, token by token (pure: used by the real and the fake runtime).

:class:`StreamText` turns each generated token's bytes into the text streamed with that token, and the final
text is by construction the streamed texts joined, whatever happens at the end:

* UTF-8: bytes are decoded incrementally; a character split over tokens is streamed with the token that completes
  it, bytes that can never be valid UTF-8 become U+FFFD where they are, and a sequence still incomplete when the
  generation ends is dropped (never flushed as U+FFFD into one text only).
* Stop strings: text that could be the beginning of a stop string is held back until it is known not to be; the
  stop string and anything after it is neither streamed nor in the text. What is held back when the generation
  ends otherwise is streamed by the runtime's last call (:meth:`StreamText.push` with ``last=True`` or
  :meth:`StreamText.flush`), or dropped with the rest when the generation is cancelled.
"""

from __future__ import annotations

import codecs


class StreamText:
    """Decodes generated token bytes into streamed text pieces; ``text`` is always the pieces joined."""

    def __init__(self, stop: tuple[str, ...] = (), primer: bytes = b"") -> None:
        """``stop``: the request's stop strings (empty ones are ignored). ``primer``: the bytes of the tokens just
        before the generation, so that a character the previous generation left incomplete is completed by this
        one's first tokens (their own text is not part of this generation)."""
        self.stops = tuple(s for s in stop if s)
        self.pieces: list[str] = []
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the first given of those found earliest)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decoder.decode(primer)
        self._held = ""

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def push(self, data: bytes, *, last: bool = False) -> str:
        """One token's bytes in, the text to stream with that token out (possibly empty). ``last``: no token
        follows, so nothing is held back. Once a stop string is found :attr:`stopped` is true and the returned
        text ends right before it."""
        text = self._held + self._decoder.decode(data)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            out, self._held = text[:cut], ""
        else:
            keep = 0 if last else self._stop_prefix(text)
            out, self._held = text[: len(text) - keep], text[len(text) - keep:]
        self.pieces.append(out)
        return out

    def flush(self) -> str:
        """The held-back text, to stream when the generation ends without a stop string (incomplete UTF-8 stays
        dropped)."""
        out, self._held = self._held, ""
        self.pieces.append(out)
        return out

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string in ``text`` begins (a stop string can only begin in text not streamed
        yet: streamed text never ends with the beginning of one)."""
        found = [(at, index) for index, at in enumerate(text.find(stop) for stop in self.stops) if at >= 0]
        if not found:
            return None
        at, index = min(found)
        self.matched = self.stops[index]
        return at

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of ``text`` that is the beginning of a stop string."""
        keep = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:size]):
                    keep = size
                    break
        return keep
