"""Embeddings (``models[].embeddings``), the pure part: the pooling a model's GGUF asks for, how a request's inputs
are packed into decodes, their checks and the normalisation. The llama.cpp context that computes them is
:class:`appliance.engine.embedding_context.EmbeddingContext`.

A model serving embeddings gets a context of its own beside its live one, with the pooling its GGUF names
(``<arch>.pooling_type``; mean pooling when it names none, as a generative model's file does). A request's inputs are
packed into as few decodes as fit (:func:`pack`: several sequences in one batch, at most :data:`MAX_SEQUENCES` of
them and the context's size in tokens), each sequence's pooled vector is returned L2-normalised (:func:`normalised`).
An input longer than the context is refused (``CONTEXT_OVERFLOW``), never truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.errors import ApplianceError

if TYPE_CHECKING:
    import numpy as np

POOLING_NONE = 0  # GGUF's (and llama.cpp's) pooling type values
POOLING_MEAN = 1
POOLING_CLS = 2
POOLING_LAST = 3

MAX_EMBEDDING_TOKENS = 2048
"""The most tokens one embeddings decode holds (its context's size is this or the model's ``n_ctx``, the smaller):
a pooled sequence must be in one micro-batch, and llama.cpp's attention buffer grows with its square."""
MAX_SEQUENCES = 32
"""Inputs one decode holds at most (the context's ``n_seq_max``)."""
POOLING_NAMES: dict[int, str] = {POOLING_MEAN: "mean", POOLING_CLS: "cls", POOLING_LAST: "last"}
"""The poolings that give an embedding (``rank`` is a reranker's score, ``none`` one vector per token)."""


@dataclass(frozen=True)
class Embeddings:
    """One request's embeddings: a unit vector per input, in order, and the tokens they were made of."""

    vectors: tuple[np.ndarray, ...]
    prompt_tokens: int
    dimensions: int
    pooling: str


def context_size(n_ctx: int) -> int:
    """The embeddings context's size for a model of ``n_ctx``: the most tokens one input may have."""
    return min(n_ctx, MAX_EMBEDDING_TOKENS)


def pooling_of(value: str | None) -> int:
    """The pooling to build the context with, from the GGUF's ``<arch>.pooling_type`` value (None: absent): the
    file's own when it names one that gives an embedding, mean pooling when it names none (or ``none``); a
    reranker's ``rank`` pooling is ``BAD_REQUEST``."""
    if value is None:
        return POOLING_MEAN
    try:
        pooling = int(value)
    except ValueError:
        raise ApplianceError("BAD_REQUEST", f"the model's pooling_type {value!r} is not a number",
                             {"pooling_type": value}) from None
    if pooling == POOLING_NONE:
        return POOLING_MEAN
    if pooling not in POOLING_NAMES:
        raise ApplianceError("BAD_REQUEST", f"the model's pooling type {pooling} does not give embeddings (rank "
                                            "pooling is a reranker's)", {"pooling_type": pooling})
    return pooling


def normalised(vector: np.ndarray) -> np.ndarray:
    """``vector`` scaled to L2 norm 1 (float32); a zero vector is refused (``INTERNAL``: it has no direction)."""
    import numpy as np  # lazy: a serving process holds numpy only once it computes embeddings

    values = np.asarray(vector, dtype=np.float64)
    norm = float(np.linalg.norm(values))
    if not np.isfinite(norm) or norm == 0.0:
        raise ApplianceError("INTERNAL", "the model gave an embedding of norm 0 or not finite", {"norm": str(norm)})
    return (values / norm).astype(np.float32)


def pack(lengths: Sequence[int], max_tokens: int, max_sequences: int) -> list[list[int]]:
    """The inputs (by index, in order) of each decode: as many in a row as fit ``max_tokens`` tokens and
    ``max_sequences`` sequences. Each length must be 1 to ``max_tokens`` (:func:`check_lengths`)."""
    groups: list[list[int]] = []
    used = 0
    for index, length in enumerate(lengths):
        if not groups or used + length > max_tokens or len(groups[-1]) >= max_sequences:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += length
    return groups


def check_inputs(inputs: Sequence[Sequence[int]], max_tokens: int, n_vocab: int) -> None:
    """Refuse an empty input (``BAD_REQUEST``), one longer than ``max_tokens`` (``CONTEXT_OVERFLOW``: never
    truncated) and a token id outside the vocabulary (``BAD_REQUEST``), naming the input's index."""
    for index, tokens in enumerate(inputs):
        if not tokens:
            raise ApplianceError("BAD_REQUEST", f"input[{index}] has no tokens", {"param": "input", "index": index})
        if len(tokens) > max_tokens:
            raise ApplianceError("CONTEXT_OVERFLOW", f"input[{index}] is {len(tokens)} tokens, over the {max_tokens} "
                                                     "the embeddings context holds (inputs are not truncated)",
                                 {"param": "input", "index": index, "tokens": len(tokens), "n_ctx": max_tokens})
        for token in tokens:
            if not 0 <= token < n_vocab:
                raise ApplianceError("BAD_REQUEST", f"input[{index}] has token id {token}, outside the model's "
                                                    f"vocabulary (0 to {n_vocab - 1})",
                                     {"param": "input", "index": index, "token": token, "n_vocab": n_vocab})


def check_dimensions(requested: int | None, dimensions: int) -> None:
    """A request's ``dimensions`` must be the model's own (or absent): its vectors are not shortened (a model
    trained for shortened embeddings, Matryoshka-style, is not told apart from one that is not)."""
    if requested is not None and requested != dimensions:
        raise ApplianceError("BAD_REQUEST", f"dimensions must be {dimensions}, this model's embedding size (or left "
                                            "out): embeddings are not shortened, since a shortened vector means "
                                            "something only for a model trained for it",
                             {"param": "dimensions", "dimensions": dimensions, "requested": requested})
