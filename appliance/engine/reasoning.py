"""A reply's reasoning (``<think>…</think>``, as Qwen3 and DeepSeek R1 templates write it) apart from its answer:
one pure parser for every API surface (``models[].reasoning: split``; ``inline`` leaves the text as it is).

* :func:`detect`: the markers of a template that writes reasoning (None: it does not).
* :func:`starts_inside`: the rendered prompt ends inside an open ``<think>`` (DeepSeek R1's and some Qwen3
  templates' generation prompt ends with ``<think>\\n``): the reply then has only the closing tag.
* :class:`StreamSplitter`: fed the reply's text in pieces, it gives :class:`Reasoning` and :class:`Content` events;
  a piece of a marker is held until it is known to be one. :func:`split` is the same on a finished text, so a plain
  answer and a stream agree.

The reasoning is the text between the markers without the whitespace around it; the answer is the text after the
closing marker without its leading whitespace. A reply that does not start with the opening marker (outside one)
is all answer, as it is; a reply whose reasoning never closes (``max_tokens``) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OPEN = "<think>"
CLOSE = "</think>"


@dataclass(frozen=True)
class Markers:
    open: str = OPEN
    close: str = CLOSE


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


Event = Reasoning | Content


@dataclass(frozen=True)
class Split:
    """A finished reply: its reasoning (None when it had none, or an empty one) and its answer."""

    reasoning: str | None
    content: str


def detect(template_source: str | None) -> Markers | None:
    """The reasoning markers of a chat template that writes both (None: it writes no reasoning)."""
    if template_source is None or OPEN not in template_source or CLOSE not in template_source:
        return None
    return Markers()


def starts_inside(prompt_text: str, markers: Markers) -> bool:
    """The generation starts inside the reasoning: the prompt's last opening marker is not closed after it."""
    opened = prompt_text.rfind(markers.open)
    return opened >= 0 and prompt_text.rfind(markers.close) < opened


State = Literal["start", "reasoning", "after", "content"]


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker`` (held until the next piece says)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class StreamSplitter:
    """Split a reply fed in pieces (:meth:`feed`, then :meth:`finish`) into reasoning and answer events."""

    def __init__(self, markers: Markers, *, inside: bool = False) -> None:
        self.markers = markers
        self.state: State = "reasoning" if inside else "start"
        self.pending = ""  # text not given out yet: a possible marker's start, whitespace that may be trimmed
        self.reasoned = False  # reasoning text was given out (whitespace before the close is then kept, if inner)

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while True:
            progressed = self._advance(events)
            if not progressed:
                return [event for event in events if event.text]

    def _advance(self, events: list[Event]) -> bool:
        """One move of the state machine over :attr:`pending`; False when it must wait for more text."""
        text = self.pending
        if self.state == "start":
            stripped = text.lstrip()
            if not stripped:
                return False
            if stripped.startswith(self.markers.open):
                self.pending = stripped[len(self.markers.open):]
                self.state = "reasoning"
                return True
            if self.markers.open.startswith(stripped):
                return False  # maybe the opening marker
            self.state = "content"
            return True
        if self.state == "reasoning":
            if not self.reasoned:
                text = self.pending = text.lstrip()
            at = text.find(self.markers.close)
            if at >= 0:
                events.append(Reasoning(text[:at].rstrip()))
                self.pending = text[at + len(self.markers.close):]
                self.state = "after"
                return True
            hold = held_prefix(text, self.markers.close)
            body = text[:len(text) - hold]
            kept = body.rstrip()  # trailing whitespace waits: it goes if the close follows
            if kept:
                events.append(Reasoning(kept))
                self.reasoned = True
            self.pending = body[len(kept):] + text[len(text) - hold:]
            return False
        if self.state == "after":
            stripped = text.lstrip()
            if not stripped:
                self.pending = ""
                return False
            self.pending = stripped
            self.state = "content"
            return True
        if text:
            events.append(Content(text))
            self.pending = ""
        return False

    def finish(self) -> list[Event]:
        """The text still held, at the reply's end."""
        text, self.pending = self.pending, ""
        if self.state == "reasoning":
            return [Reasoning(text.rstrip())] if text.strip() else []
        if self.state == "after":
            return []
        return [Content(text)] if text else []


def split(text: str, markers: Markers, *, inside: bool = False) -> Split:
    """A finished reply split as :class:`StreamSplitter` splits it streamed."""
    splitter = StreamSplitter(markers, inside=inside)
    events = [*splitter.feed(text), *splitter.finish()]
    reasoning = "".join(event.text for event in events if isinstance(event, Reasoning))
    content = "".join(event.text for event in events if isinstance(event, Content))
    return Split(reasoning or None, content)
