"""A sequence's candidates as a numpy buffer of ``llama_token_data``: what a draw needs that llama.cpp's
``llama_sampler_sample`` cannot do alone, a grammar's check of the chain's pick and its draw over the allowed tokens
(:class:`~appliance.engine.sampler.SequenceSampler`), and the raw logits row that log-probabilities read.

numpy is about 13 MiB of a process's memory: only a sequence with a grammar or log-probabilities imports this module
(:mod:`appliance.engine.sampler`), a plain one samples in C and a serving process that never gets such a request
never holds numpy.
"""

from __future__ import annotations

import ctypes

import numpy as np

from appliance.engine.bindings import llama_cpp

CHUNKS = (64, 1024)
"""How many of the likeliest candidates the grammar checks first, then next, before the whole vocabulary."""

CANDIDATE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
"""``llama_token_data``, as a numpy record."""
assert CANDIDATE.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


class Candidates:
    """A reusable ``llama_token_data_array`` over a numpy buffer (one per model: the engine thread samples one
    sequence at a time)."""

    def __init__(self, n_vocab: int) -> None:
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.buffer = np.zeros(n_vocab, dtype=CANDIDATE)

    def fill(self, logits: np.ndarray) -> np.ndarray:
        """Every token with its logit (the buffer, reused)."""
        self.buffer["id"] = self.ids
        self.buffer["logit"] = logits
        self.buffer["p"] = 0.0
        return self.buffer


def logits_row(ctx: llama_cpp.llama_context_p, row: int, n_vocab: int) -> np.ndarray:
    """The context's logits of output ``row`` (a view: the next decode overwrites it)."""
    pointer = llama_cpp.llama_get_logits_ith(ctx, row)
    return np.ctypeslib.as_array(pointer, shape=(n_vocab,))


def as_array(records: np.ndarray) -> llama_cpp.llama_token_data_array:
    """A ``llama_token_data_array`` over ``records`` (contiguous ``CANDIDATE`` records, kept alive by the caller)."""
    pointer = records.ctypes.data_as(llama_cpp.llama_token_data_p)
    return llama_cpp.llama_token_data_array(pointer, records.size, -1, False)


def apply(sampler: llama_cpp.llama_sampler_p, records: np.ndarray) -> llama_cpp.llama_token_data_array:
    """Run ``sampler`` over ``records`` (changed in place); the array it ran over (its ``selected``)."""
    array = as_array(records)
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    return array


def picked(sampler: llama_cpp.llama_sampler_p, records: np.ndarray) -> int | None:
    """The token ``sampler`` (a draw chain) selects among ``records``; None when it selects none."""
    array = apply(sampler, records)
    if not 0 <= array.selected < array.size:
        return None
    return int(array.data[array.selected].id)


def allowed(grammar: llama_cpp.llama_sampler_p, candidates: np.ndarray, need: int) -> np.ndarray:
    """The candidates the ``grammar`` sampler allows: the likeliest first, chunk by chunk, until ``need`` are found
    (0: all of them). Candidates already at ``-inf`` (a bias of -inf) are never allowed."""
    logits = candidates["logit"]
    checked = np.zeros(candidates.size, dtype=bool)
    found: list[np.ndarray] = []
    count = 0
    for size in (*(chunk for chunk in CHUNKS if chunk < candidates.size), candidates.size):
        if size < candidates.size:
            chosen = np.argpartition(-logits, size - 1)[:size]
            chosen = chosen[~checked[chosen]]
        else:
            chosen = np.flatnonzero(~checked)
        checked[chosen] = True
        subset = candidates[chosen]  # a copy
        apply(grammar, subset)
        valid = subset[np.isfinite(subset["logit"])]
        found.append(valid)
        count += valid.size
        if need and count >= need:
            break
    return np.concatenate(found) if found else candidates[:0]
