"""Small random-weight llama GGUF models for tests, demos and benchmarks (SPEC S3).

The file is written with llama.cpp's own writer (``gguf.GGUFWriter``) and loads in llama-cpp-python like any
real model: a SentencePiece-style ("llama") vocabulary with byte fallback, the usual llama hyperparameters and
the usual tensor names. Weights come from ``numpy.random.default_rng(seed)``, so the same arguments always
give a byte-identical file. Tensors are generated one at a time while writing, so memory stays flat however
large the model is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from appliance.errors import ApplianceError

ProgressFn = Callable[[int, int], None]

SPACE = "\u2581"  # SentencePiece's visible space, "▁"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
WEIGHT_SCALE = 0.02
RMS_EPS = 1e-5
ROPE_FREQ_BASE = 10000.0

_WORD_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had by
hot word but what some we can out other were all there when up use your how said an each she which do their
time if will way about many then them write would like so these her long make thing see him two has look
more day could go come did number sound no most people my over know water than call first who may down side
been now find any new work part take get place made live where after back little only round man year came
show every good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air well also play
small end put home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build self earth
father Hello hello World The It This We You He She They In What How Why Yes No OK model token agent memory
story once upon answer question test data text yes
"""
_WORDS = tuple(_WORD_TEXT.split())
_SUFFIX_TEXT = "s es ed er ing ly tion ment ness able est ful"
_SUFFIXES = tuple(_SUFFIX_TEXT.split())
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"()[]{}-+*/=<>_@#$%&|~`^\\"


@dataclass(frozen=True)
class Vocabulary:
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]


@dataclass(frozen=True)
class Hyperparams:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ff: int
    n_ctx_train: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order (rows, cols); GGUF stores it reversed
    is_norm: bool


def build_vocabulary() -> Vocabulary:
    """Specials, the 256 byte tokens, then word pieces closed under prefixes.

    llama.cpp's SentencePiece tokenizer only merges adjacent symbols into pieces that are themselves in the
    vocabulary, so every prefix of a piece is a piece too. A piece's score is its length in characters, so
    the longest available merge wins and words come out whole.
    """
    pieces = {SPACE, *_CHARS, *(SPACE + c for c in _CHARS)}
    for whole in (*(SPACE + w for w in _WORDS), *_SUFFIXES):
        pieces.update(whole[:end] for end in range(1, len(whole) + 1))
    ordered = sorted(pieces, key=lambda p: (len(p), p))
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = (*SPECIAL_TOKENS, *byte_tokens, *ordered)
    scores = (0.0,) * (len(SPECIAL_TOKENS) + 256) + tuple(float(len(p)) for p in ordered)
    types = (
        int(gguf.TokenType.UNKNOWN),
        int(gguf.TokenType.CONTROL),
        int(gguf.TokenType.CONTROL),
        *(int(gguf.TokenType.BYTE),) * 256,
        *(int(gguf.TokenType.NORMAL),) * len(ordered),
    )
    return Vocabulary(tokens, scores, types)


def default_ff(dim: int) -> int:
    """About 2.75 x dim, rounded to a multiple of 32 (at least 32)."""
    return max(32, round(dim * 2.75 / 32) * 32)


def resolve_hyperparams(
    layers: int, dim: int, heads: int | None, kv_heads: int | None, ff: int | None, n_ctx_train: int
) -> Hyperparams:
    n_head = heads if heads is not None else max(1, dim // 64)
    n_head_kv = kv_heads if kv_heads is not None else n_head
    n_ff = ff if ff is not None else default_ff(dim)
    problems = []
    if min(layers, dim, n_head, n_head_kv, n_ff, n_ctx_train) < 1:
        problems.append("layers, dim, heads, kv_heads, ff and n_ctx_train must all be positive")
    elif dim % n_head:
        problems.append(f"dim {dim} is not a multiple of heads {n_head}")
    elif (dim // n_head) % 2:
        problems.append(f"head size {dim // n_head} must be even for RoPE")
    elif n_head % n_head_kv:
        problems.append(f"heads {n_head} is not a multiple of kv_heads {n_head_kv}")
    if problems:
        raise ApplianceError(
            "BAD_REQUEST",
            f"invalid tiny model shape: {problems[0]}",
            {"layers": layers, "dim": dim, "heads": n_head, "kv_heads": n_head_kv, "ff": n_ff},
        )
    return Hyperparams(layers, dim, n_head, n_head_kv, n_ff, n_ctx_train)


def tensor_specs(hp: Hyperparams, n_vocab: int) -> Iterator[TensorSpec]:
    """Every tensor of a llama model, in file order, with numpy-order shapes."""
    kv_dim = hp.kv_heads * hp.head_dim
    yield TensorSpec("token_embd.weight", (n_vocab, hp.dim), False)
    for i in range(hp.layers):
        blk = f"blk.{i}"
        yield TensorSpec(f"{blk}.attn_norm.weight", (hp.dim,), True)
        yield TensorSpec(f"{blk}.attn_q.weight", (hp.dim, hp.dim), False)
        yield TensorSpec(f"{blk}.attn_k.weight", (kv_dim, hp.dim), False)
        yield TensorSpec(f"{blk}.attn_v.weight", (kv_dim, hp.dim), False)
        yield TensorSpec(f"{blk}.attn_output.weight", (hp.dim, hp.dim), False)
        yield TensorSpec(f"{blk}.ffn_norm.weight", (hp.dim,), True)
        yield TensorSpec(f"{blk}.ffn_gate.weight", (hp.ff, hp.dim), False)
        yield TensorSpec(f"{blk}.ffn_up.weight", (hp.ff, hp.dim), False)
        yield TensorSpec(f"{blk}.ffn_down.weight", (hp.dim, hp.ff), False)
    yield TensorSpec("output_norm.weight", (hp.dim,), True)
    yield TensorSpec("output.weight", (n_vocab, hp.dim), False)


def _add_metadata(writer: gguf.GGUFWriter, hp: Hyperparams, vocab: Vocabulary, dtype: str) -> None:
    writer.add_name(f"appliance-tiny-{hp.layers}x{hp.dim}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_context_length(hp.n_ctx_train)
    writer.add_embedding_length(hp.dim)
    writer.add_block_count(hp.layers)
    writer.add_feed_forward_length(hp.ff)
    writer.add_head_count(hp.heads)
    writer.add_head_count_kv(hp.kv_heads)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_dimension_count(hp.head_dim)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)


def _tensor_data(spec: TensorSpec, rng: np.random.Generator, dtype: type[np.floating]) -> np.ndarray:
    if spec.is_norm:
        return np.ones(spec.shape, dtype=np.float32)
    values = rng.standard_normal(spec.shape, dtype=np.float32)
    values *= WEIGHT_SCALE
    return values.astype(dtype, copy=False)


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    layers: int = 4,
    dim: int = 256,
    heads: int | None = None,
    kv_heads: int | None = None,
    ff: int | None = None,
    n_ctx_train: int = 2048,
    seed: int = 0,
    dtype: str = "f16",
    progress: ProgressFn | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a random-weight llama GGUF to ``path`` and return the path.

    ``heads`` defaults to dim // 64 (at least 1), ``kv_heads`` to ``heads`` (give fewer for GQA), ``ff`` to
    about 2.75 x dim. ``dtype`` ("f16" or "f32") applies to the matrices; norms are always f32.
    ``progress(done_bytes, total_bytes)`` is called after each tensor. ``chat_template`` (a Jinja2 source) is
    written as ``tokenizer.chat_template``. The file appears atomically.
    """
    if dtype not in ("f16", "f32"):
        raise ApplianceError("BAD_REQUEST", f"dtype must be f16 or f32, not {dtype!r}", {"dtype": dtype})
    hp = resolve_hyperparams(layers, dim, heads, kv_heads, ff, n_ctx_train)
    vocab = build_vocabulary()
    matrix_type = np.float16 if dtype == "f16" else np.float32
    specs = list(tensor_specs(hp, len(vocab.tokens)))

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, "llama")
    try:
        _add_metadata(writer, hp, vocab, dtype)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
        sizes = []
        for spec in specs:
            np_dtype = np.dtype(np.float32 if spec.is_norm else matrix_type)
            nbytes = int(np.prod(spec.shape)) * np_dtype.itemsize
            writer.add_tensor_info(spec.name, spec.shape, np_dtype, nbytes)
            sizes.append(nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        total, done = sum(sizes), 0
        for spec, nbytes in zip(specs, sizes, strict=True):
            writer.write_tensor_data(_tensor_data(spec, rng, matrix_type))
            done += nbytes
            if progress is not None:
                progress(done, total)
        writer.close()
        os.replace(partial, target)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return target
