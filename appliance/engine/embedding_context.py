"""The llama.cpp context that computes embeddings (:mod:`appliance.engine.embedding` has the pure part).

An :class:`EmbeddingContext` is one ``llama_context`` built on a model's :class:`~appliance.engine.batched.
ModelWeights` with ``embeddings`` on and the pooling the GGUF names; :meth:`EmbeddingContext.embed` evaluates each
group of :func:`~appliance.engine.embedding.pack` in one decode and reads each sequence's pooled vector
(``llama_get_embeddings_seq``). Engine thread only, like every llama.cpp call (see :mod:`appliance.engine.batched`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np

from appliance.engine.batched import ModelWeights
from appliance.engine.bindings import llama_cpp
from appliance.engine.embedding import MAX_SEQUENCES, POOLING_NAMES, check_inputs, normalised, pack, pooling_of
from appliance.errors import ApplianceError


def model_pooling(weights: ModelWeights) -> str | None:
    """The GGUF's ``<arch>.pooling_type`` as text (None when absent)."""
    arch = meta_value(weights, "general.architecture")
    return None if arch is None else meta_value(weights, f"{arch}.pooling_type")


def meta_value(weights: ModelWeights, key: str) -> str | None:
    if weights.model is None:
        raise ApplianceError("INTERNAL", "the model's weights are closed")
    size = 256
    buf = ctypes.create_string_buffer(size)
    n = int(llama_cpp.llama_model_meta_val_str(weights.model, key.encode("utf-8"), buf, size))
    if n < 0:
        return None
    return buf.value.decode("utf-8", errors="replace")


class EmbeddingContext:
    """One embeddings ``llama_context`` on ``weights`` of ``n_ctx`` cells (:func:`context_size`), up to
    :data:`MAX_SEQUENCES` inputs per decode. Single-threaded: the thread that built it is the only one that may
    call it."""

    def __init__(self, weights: ModelWeights, *, n_ctx: int, n_threads: int | None = None) -> None:
        weights._check_open()
        self.weights = weights
        self.pooling = pooling_of(model_pooling(weights))
        self._owner = threading.get_ident()
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_ctx
        params.n_ubatch = n_ctx  # a pooled sequence must be in one micro-batch
        params.n_seq_max = MAX_SEQUENCES
        params.embeddings = True
        params.pooling_type = self.pooling
        if n_threads is not None:
            params.n_threads = n_threads
            params.n_threads_batch = n_threads
        if hasattr(params, "kv_unified"):
            params.kv_unified = True  # the sequences of one decode share the n_ctx cells
        # Off whatever engine.flash_attention says (that setting is the live contexts', where decoding many
        # sequences together is what it speeds up): an input's vector stays the same within 1e-4 whether it was
        # embedded alone or in a batch, as measured without it.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(weights.model, params)
        if not ctx:
            raise ApplianceError("OOM", "llama.cpp could not create the embeddings context", {"n_ctx": n_ctx})
        self.ctx: llama_cpp.llama_context_p | None = ctx
        self.memory = llama_cpp.llama_get_memory(ctx)
        # the most tokens of one decode (llama.cpp may pad the cells, never the batch)
        self.n_ctx = min(int(llama_cpp.llama_n_ctx(ctx)), int(llama_cpp.llama_n_ubatch(ctx)))
        self.dimensions = int(llama_cpp.llama_model_n_embd(weights.model))
        self._encoder = bool(llama_cpp.llama_model_has_encoder(weights.model)) and not bool(
            llama_cpp.llama_model_has_decoder(weights.model))
        self._batch = llama_cpp.llama_batch_init(self.n_ctx, 0, MAX_SEQUENCES)

    @property
    def pooling_name(self) -> str:
        return POOLING_NAMES[self.pooling]

    def close(self) -> None:
        if self.ctx is None:
            return
        self._check_thread()
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self.ctx)
        self.ctx = None

    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise ApplianceError("INTERNAL", "an embeddings context was called from a thread other than its own")

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """The L2-normalised embedding of each input (token ids), in order; inputs that fit together are one
        decode."""
        self._check_thread()
        if self.ctx is None:
            raise ApplianceError("INTERNAL", "the embeddings context is closed")
        check_inputs(inputs, self.n_ctx, self.weights.n_vocab)
        vectors: list[np.ndarray] = [np.empty(0, dtype=np.float32)] * len(inputs)
        for group in pack([len(tokens) for tokens in inputs], self.n_ctx, MAX_SEQUENCES):
            for seq_id, vector in enumerate(self._decode([inputs[index] for index in group])):
                vectors[group[seq_id]] = vector
        return vectors

    def _decode(self, group: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One decode of ``group`` (sequence ids 0.. in order, every token an output), its pooled vectors."""
        if self.memory:
            llama_cpp.llama_memory_clear(self.memory, True)
        batch = self._batch
        n = 0
        for seq_id, tokens in enumerate(group):
            for pos, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = True
                n += 1
        batch.n_tokens = n
        run = llama_cpp.llama_encode if self._encoder else llama_cpp.llama_decode
        status = int(run(self.ctx, batch))
        if status != 0:
            raise ApplianceError("INTERNAL", f"llama.cpp failed to evaluate the embeddings batch ({status})",
                                 {"status": status, "tokens": n})
        vectors = []
        for seq_id in range(len(group)):
            pointer = llama_cpp.llama_get_embeddings_seq(self.ctx, seq_id)
            if not pointer:
                raise ApplianceError("INTERNAL", "llama.cpp gave no pooled embedding", {"seq_id": seq_id})
            values = np.ctypeslib.as_array(pointer, shape=(self.dimensions,))
            vectors.append(normalised(values))
        return vectors
