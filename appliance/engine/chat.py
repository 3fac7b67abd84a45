"""Turning chat messages into one prompt (pure). The tiny demo models carry no chat template, so the
appliance uses a plain, documented one: ``<role>: <content>`` lines, then ``assistant:``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class ChatTurn(Protocol):
    role: str
    content: str


def render_chat(messages: Iterable[ChatTurn]) -> str:
    lines = [f"{message.role}: {message.content}" for message in messages]
    return "\n".join([*lines, "assistant:"])
