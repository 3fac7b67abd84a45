"""The request every path runs, and what a path is: the model name, the two prompts, the MAGN and HTTP request
bodies, :class:`Sample` (one timed request) and :class:`Contender` (one way of running the request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL_NAME = "bench"
PROMPTS = ("Once upon a time", "Hello world, this is a test")  # 8 tokens each (BOS included), tiny vocabulary


@dataclass(frozen=True)
class Sample:
    """One request: its time (request sent to last token), text, completion tokens and time to first token."""

    elapsed_s: float
    text: str
    tokens: int
    ttft_s: float | None = None


def magn_request(prompt: str, max_tokens: int) -> dict[str, Any]:
    """The INFER_REQUEST fields every MAGN path sends (stateless: a model, no session)."""
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}


def http_request(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    # llama_cpp.server defaults repeat_penalty to 1.1 (the library to 1.0): ask for the library's greedy request.
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "repeat_penalty": 1.0,
            "stream": stream}


class Contender:
    """One way of running the request: ``one`` (max_tokens=1) and ``stream`` (n tokens, token by token)."""

    name = ""
    label = ""
    kind = ""  # in-process | magn | http

    def one(self, prompt: str) -> Sample:
        raise NotImplementedError

    def stream(self, prompt: str, n: int) -> Sample:
        raise NotImplementedError

    def close(self) -> None:
        pass

