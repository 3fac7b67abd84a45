"""A reply's text, fed in pieces, as the events every API surface answers with: its reasoning split out first
(:class:`~appliance.engine.reasoning.StreamSplitter`, when the template writes some), then its answer parsed for
tool calls (:class:`~appliance.engine.toolcalls.StreamParser`, when it may call tools)."""

from __future__ import annotations

from appliance.engine import reasoning, toolcalls

ReplyEvent = reasoning.Reasoning | toolcalls.Event


class ReplyStream:
    """Feed a reply's text (:meth:`feed`, then :meth:`finish`); without a splitter it is all answer, without a
    parser the answer is all content."""

    def __init__(self, splitter: reasoning.StreamSplitter | None, parser: toolcalls.StreamParser | None) -> None:
        self.splitter = splitter
        self.parser = parser

    def answer(self, text: str) -> list[ReplyEvent]:
        if self.parser is not None:
            return list(self.parser.feed(text))
        return [toolcalls.Content(text)] if text else []

    def split(self, events: list[reasoning.Event]) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        for event in events:
            if isinstance(event, reasoning.Reasoning):
                out.append(event)
            else:
                out += self.answer(event.text)
        return out

    def feed(self, text: str) -> list[ReplyEvent]:
        if self.splitter is None:
            return self.answer(text)
        return self.split(self.splitter.feed(text))

    def finish(self) -> list[ReplyEvent]:
        """The events of the text still held, at the reply's end."""
        tail = self.split(self.splitter.finish()) if self.splitter is not None else []
        if self.parser is not None:
            tail += self.parser.finish()
        return tail
