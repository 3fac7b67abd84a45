"""``POST /v1/embeddings``'s request and response, as pure functions (the route is :mod:`appliance.http.embeddings`).

* :func:`embeddings_request` checks the body into an :class:`EmbeddingsRequest`: ``input`` is a string, a list of
  strings, a list of token ids or a list of token-id lists (each non-empty); ``encoding_format`` is ``float`` or
  ``base64`` (little-endian float32, as OpenAI sends it); ``dimensions`` is accepted only equal to the model's (its
  vectors are not shortened: the engine says so). A bad field is ``BAD_REQUEST`` with ``details.param``.
* :func:`embeddings_response` is OpenAI's ``list`` of ``embedding`` objects with ``usage``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from appliance.http.openai_schema import IGNORED, MAX_TOKEN_ID, bad, identifier, integer, text_field

if TYPE_CHECKING:
    import numpy as np

MAX_INPUTS = 2048
"""Inputs one request may hold (OpenAI's bound)."""
ENCODINGS = ("float", "base64")
FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"}) | IGNORED

Encoding = Literal["float", "base64"]
Input = str | tuple[int, ...]


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    inputs: tuple[Input, ...]
    encoding_format: Encoding = "float"
    dimensions: int | None = None


def token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    """A non-empty list of token ids."""
    if not value:
        raise bad(param, f"{param} must not be empty")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise bad(param, f"{param} must be a list of token ids (integers from 0 to {MAX_TOKEN_ID})")
    return tuple(value)


def text_input(value: Any, param: str) -> str:
    text = text_field(value, param)
    if not text:
        raise bad(param, f"{param} must not be an empty string")
    return text


def inputs(value: Any) -> tuple[Input, ...]:
    """``input``: a string, or a list of 1 to :data:`MAX_INPUTS` strings, a list of token ids (one input), or a
    list of token-id lists."""
    if isinstance(value, str):
        return (text_input(value, "input"),)
    if not isinstance(value, list) or not 0 < len(value) <= MAX_INPUTS:
        raise bad("input", f"input must be a string, or a list of 1 to {MAX_INPUTS} strings or token-id lists",
                  max_items=MAX_INPUTS)
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return (token_ids(value, "input"),)
    found: list[Input] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if isinstance(item, list):
            found.append(token_ids(item, where))
        else:
            found.append(text_input(item, where))
    return tuple(found)


def embeddings_request(body: dict[str, Any]) -> EmbeddingsRequest:
    """``POST /v1/embeddings``'s body, checked."""
    for key in body:
        if key not in FIELDS:
            raise bad(key, f"unknown or unsupported field {key!r}")
    if "model" not in body:
        raise bad("model", "model is required")
    if "input" not in body:
        raise bad("input", "input is required")
    encoding = "float" if body.get("encoding_format") is None else body["encoding_format"]
    if encoding not in ENCODINGS:
        raise bad("encoding_format", "encoding_format must be \"float\" or \"base64\"")
    dimensions = None if body.get("dimensions") is None else integer(body["dimensions"], "dimensions", 1, 1 << 20)
    if body.get("user") is not None:
        text_field(body["user"], "user")  # OpenAI's end-user id: nothing here is per user
    return EmbeddingsRequest(identifier(body["model"], "model"), inputs(body["input"]), encoding, dimensions)


def encoded(vector: np.ndarray, encoding: Encoding) -> list[float] | str:
    """One vector as ``float`` (a list of numbers) or ``base64`` (its little-endian float32 bytes)."""
    import numpy as np  # lazy: a serving process holds numpy only once it computes embeddings

    values = np.asarray(vector, dtype="<f4")
    if encoding == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    return [float(x) for x in values]


def embeddings_response(model: str, vectors: Sequence[np.ndarray], prompt_tokens: int,
                        encoding: Encoding) -> dict[str, Any]:
    """OpenAI's answer: each input's ``embedding`` at its ``index``, and ``usage``."""
    data = [{"object": "embedding", "index": index, "embedding": encoded(vector, encoding)}
            for index, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
