"""The request log: one :class:`RequestRecord` per request on any surface (a generation, or embeddings), the last
:data:`KEEP` kept for the admin page's recent requests and tokens/s, and handed to observers (the metrics, the access
log). Pure."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

KEEP = 200

Surface = Literal["magn", "lines", "openai", "responses", "anthropic"]
"""Who asked: a socket protocol, or an HTTP API (OpenAI chat and completions, OpenAI Responses, Anthropic Messages)."""
Outcome = Literal["ok", "error", "cancelled"]
Task = Literal["generate", "embed"]
"""What was asked: tokens generated after a prompt, or the embeddings of texts (EMBED_REQUEST, /v1/embeddings)."""


@dataclass(frozen=True)
class RequestRecord:
    at: float  # wall-clock time the request ended
    surface: Surface
    model: str
    agent: str | None  # None: a stateless request
    prompt_tokens: int  # the request's prompt tokens (embeddings: every input's)
    generated_tokens: int
    ttft_s: float | None  # time to the first token (None: none was generated)
    elapsed_s: float  # the whole request, as the surface saw it (queueing included)
    outcome: Outcome
    error: str | None = None  # the P4 code of a failed request
    stop_reason: str | None = None
    plan: str | None = None  # the plan of the context it ran in (S, M, L, fixed; None: it never ran)
    prompt_evaluated: int | None = None  # tokens really evaluated before the first new one: a shared prefix or the
    #                                      agent's KV state skips some, a dropped state re-evaluates (None: never ran)
    generation_s: float | None = None  # the generation's time on the engine, its start to its end (None: never ran)
    task: Task = "generate"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Observer = Callable[[RequestRecord], None]


class RequestLog:
    """The last :data:`KEEP` request records, oldest first, and the observers told of each new one."""

    def __init__(self, keep: int = KEEP) -> None:
        self._records: collections.deque[RequestRecord] = collections.deque(maxlen=keep)
        self.observers: list[Observer] = []

    def add(self, record: RequestRecord) -> None:
        self._records.append(record)
        for observer in list(self.observers):
            observer(record)

    def recent(self, n: int = 20) -> list[RequestRecord]:
        """The ``n`` most recent records, newest first."""
        records = list(self._records)
        records.reverse()
        return records[:n]

    def tokens_per_second(self, now: float, window_s: float = 60.0) -> float:
        """Generated tokens per second over the last ``window_s`` seconds (records that ended in it)."""
        tokens = 0
        for record in self._records:
            if now - record.at <= window_s:
                tokens += record.generated_tokens
        return tokens / window_s

    def __len__(self) -> int:
        return len(self._records)
