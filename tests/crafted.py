"""Crafted model files for the model-check tests: a small loadable llama GGUF (2 layers, 64 wide, written with
``gguf.GGUFWriter`` from the tiny model's vocabulary and tensors) with one thing wrong."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from appliance.engine.tinymodel import build_vocabulary, resolve_hyperparams, tensor_specs


def write_llama(path: Path, *, claims: dict[str, int] | None = None, duplicate_token: bool = False,
                drop_tensor: str | None = None, junk_strings: int = 0) -> Path:
    """``claims`` override its metadata, ``duplicate_token`` gives two vocabulary entries the same text,
    ``drop_tensor`` leaves one tensor out, ``junk_strings`` adds a metadata array of that many strings."""
    hp = resolve_hyperparams(2, 64, None, None, None, 256)
    vocab = build_vocabulary()
    tokens = list(vocab.tokens)
    if duplicate_token:
        tokens[300] = tokens[301]
    values = {"context_length": 256, "embedding_length": hp.dim, "block_count": hp.layers,
              "feed_forward_length": hp.ff, "attention.head_count": hp.heads, "attention.head_count_kv": hp.kv_heads,
              "rope.dimension_count": hp.head_dim, **(claims or {})}
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in values.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if junk_strings:
        writer.add_array("general.junk", ["x"] * junk_strings)
    rng = np.random.default_rng(0)
    for spec in tensor_specs(hp, len(tokens)):
        if spec.name == drop_tensor:
            continue
        data = np.ones(spec.shape, np.float32) if spec.is_norm else rng.standard_normal(spec.shape, np.float32) * 0.02
        writer.add_tensor(spec.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
