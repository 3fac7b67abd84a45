"""Small random-weight llama GGUF models for tests, demos and benchmarks (SPEC S3).

The file is written with llama.cpp's own writer (``gguf.GGUFWriter``) and loads in llama-cpp-python like any
real model: a SentencePiece-style ("llama") vocabulary with byte fallback, the usual llama hyperparameters and
the usual tensor names. Weights come from ``numpy.random.default_rng(seed)``, so the same arguments always
give a byte-identical file. Tensors are generated one at a time while writing, so memory stays flat however
large the model is.

With ``vocab_from`` the tokenizer is a real one instead: every ``tokenizer.*`` key of another GGUF (such as
llama.cpp's vocab-only ``ggml-vocab-*.gguf`` files) is copied as stored, and the embedding and output tensors are
sized to its vocabulary. The weights stay random, but tokenization, special tokens, the chat template and
grammar-constrained sampling behave as with the real model. The vocab file is decoded here, within the bounds of
:mod:`appliance.engine.gguf_meta` (whose skim refuses a file without tensors): ``gguf.GGUFReader`` builds an array
per string and takes seconds for a 150k-token vocabulary, this a fraction of one.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from appliance.engine.gguf_meta import GGUF_MAGIC, GGUF_VERSIONS, MAX_ARRAY_ENTRIES, MAX_KV, MAX_STRING_BYTES
from appliance.errors import ApplianceError

ProgressFn = Callable[[int, int], None]

SPACE = "\u2581"  # SentencePiece's visible space, "▁"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
WEIGHT_SCALE = 0.02
RMS_EPS = 1e-5
ROPE_FREQ_BASE = 10000.0

VT = gguf.GGUFValueType
TOKENIZER_PREFIX = "tokenizer."
TOKENS_KEY = "tokenizer.ggml.tokens"
SCORES_KEY = "tokenizer.ggml.scores"
TOKEN_TYPE_KEY = "tokenizer.ggml.token_type"
MODEL_KEY = "tokenizer.ggml.model"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
_SCALAR_FORMATS: Mapping[VT, str] = {
    VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i", VT.FLOAT32: "f",
    VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d",
}
_LENGTH = struct.Struct("<Q")  # a string's length prefix
_INTEGER_TYPES = frozenset({VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64})

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
class MetadataValue:
    """One GGUF metadata value as the file stores it: strings as raw bytes, arrays as lists of their items."""

    type: gguf.GGUFValueType
    value: Any
    item_type: gguf.GGUFValueType | None = None


TokenizerFields = dict[str, MetadataValue]


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


def builtin_tokenizer(vocab: Vocabulary) -> TokenizerFields:
    """The ``tokenizer.*`` keys of the built-in vocabulary, typed as GGUFWriter's helpers write them."""
    def string(text: str) -> MetadataValue:
        return MetadataValue(VT.STRING, text.encode())

    def token_id(value: int) -> MetadataValue:
        return MetadataValue(VT.UINT32, value)

    def flag(value: bool) -> MetadataValue:
        return MetadataValue(VT.BOOL, value)

    keys = gguf.Keys.Tokenizer
    return {
        keys.MODEL: string("llama"),
        keys.PRE: string("default"),
        keys.LIST: MetadataValue(VT.ARRAY, [t.encode() for t in vocab.tokens], VT.STRING),
        keys.SCORES: MetadataValue(VT.ARRAY, list(vocab.scores), VT.FLOAT32),
        keys.TOKEN_TYPE: MetadataValue(VT.ARRAY, list(vocab.types), VT.INT32),
        keys.UNK_ID: token_id(UNK_ID),
        keys.BOS_ID: token_id(BOS_ID),
        keys.EOS_ID: token_id(EOS_ID),
        keys.ADD_BOS: flag(True),
        keys.ADD_EOS: flag(False),
        keys.ADD_PREFIX: flag(True),
    }


def read_tokenizer(path: str | os.PathLike[str]) -> TokenizerFields:
    """Every ``tokenizer.*`` key of a GGUF file, as stored, checked by :func:`check_tokenizer`.

    Any unreadable, foreign, truncated or hostile file, or one without a vocabulary, raises BAD_REQUEST."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise _bad_vocab(path, f"cannot read it: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise _bad_vocab(path, "it is not a GGUF file (it does not start with the GGUF magic)", rule="magic")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            fields = _MetadataDecoder(path, view).tokenizer_fields()
    except (OSError, ValueError) as exc:  # the file changed or vanished meanwhile
        raise _bad_vocab(path, f"cannot read it: {exc}") from None
    check_tokenizer(path, fields)
    return fields


class _MetadataDecoder:
    """One pass over a mapped GGUF header, keeping the ``tokenizer.*`` values; every count and length is checked
    against the file and the bounds of :mod:`appliance.engine.gguf_meta` before it is used."""

    def __init__(self, path: Path, view: mmap.mmap) -> None:
        self.path = path
        self.view = view
        self.size = len(view)
        self.pos = 0

    def need(self, n_bytes: int, what: str) -> int:
        """The position of the next ``n_bytes``, consumed; truncated when the file ends first."""
        if n_bytes > self.size - self.pos:
            raise _bad_vocab(self.path, f"truncated: {what} runs past the end of the file", rule="truncated")
        start = self.pos
        self.pos += n_bytes
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack_from("<" + fmt, self.view, self.need(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> bytes:
        length = self.scalar("Q", what)
        if length > MAX_STRING_BYTES:
            raise _bad_vocab(self.path, f"{what} is {length} bytes long (limit {MAX_STRING_BYTES})",
                             rule="string_bytes")
        start = self.need(length, what)
        return self.view[start:self.pos]

    def strings(self, key: str, count: int) -> list[bytes]:
        """An array of ``count`` strings: a tight loop, as vocabularies hold hundreds of thousands."""
        unpack = _LENGTH.unpack_from
        view, size, pos = self.view, self.size, self.pos
        items: list[bytes] = []
        for _ in range(count):
            start = pos + _LENGTH.size
            if start <= size:
                (length,) = unpack(view, pos)
                end = start + length
                if length <= MAX_STRING_BYTES and end <= size:
                    items.append(view[start:end])
                    pos = end
                    continue
            self.pos = pos
            items.append(self.string(f"a string of {key}"))  # the checked path: raises the refusal that fits
            pos = self.pos
        self.pos = pos
        return items

    def value_type(self, what: str) -> VT:
        code = self.scalar("I", what)
        try:
            return VT(code)
        except ValueError:
            raise _bad_vocab(self.path, f"{what} is an unknown value type {code}", rule="value_type") from None

    def value(self, key: str) -> MetadataValue:
        value_type = self.value_type(f"the type of {key}")
        if value_type == VT.STRING:
            return MetadataValue(VT.STRING, self.string(key))
        if value_type != VT.ARRAY:
            return MetadataValue(value_type, self.scalar(_SCALAR_FORMATS[value_type], key))
        item_type = self.value_type(f"the item type of {key}")
        count = self.scalar("Q", f"the length of {key}")
        if count > MAX_ARRAY_ENTRIES:
            raise _bad_vocab(self.path, f"{key} has {count} entries (limit {MAX_ARRAY_ENTRIES})",
                             rule="array_entries")
        if item_type == VT.STRING:
            return MetadataValue(VT.ARRAY, self.strings(key, count), VT.STRING)
        if item_type == VT.ARRAY:
            raise _bad_vocab(self.path, f"{key} holds arrays (nested arrays are not supported)", rule="nested_array")
        fmt = f"<{count}{_SCALAR_FORMATS[item_type]}"
        items = struct.unpack_from(fmt, self.view, self.need(struct.calcsize(fmt), key))
        return MetadataValue(VT.ARRAY, list(items), item_type)

    def tokenizer_fields(self) -> TokenizerFields:
        self.need(len(GGUF_MAGIC), "the magic")
        version = self.scalar("I", "the version")
        if version not in GGUF_VERSIONS:
            raise _bad_vocab(self.path, f"unsupported GGUF version {version}", rule="version")
        self.scalar("Q", "the tensor count")
        count = self.scalar("Q", "the metadata count")
        if count > MAX_KV:
            raise _bad_vocab(self.path, f"{count} metadata keys (limit {MAX_KV})", rule="metadata_keys")
        fields: TokenizerFields = {}
        for _ in range(count):
            key = self.string("a metadata key").decode("utf-8", errors="replace")
            value = self.value(key)
            if key.startswith(TOKENIZER_PREFIX):
                fields[key] = value
        return fields


def check_tokenizer(path: Path, fields: TokenizerFields) -> int:
    """The vocabulary size, once the fields are a vocabulary llama.cpp can load; else BAD_REQUEST."""
    tokens = fields.get(TOKENS_KEY)
    if tokens is None or tokens.item_type != VT.STRING or not tokens.value:
        raise _bad_vocab(path, f"it has no vocabulary ({TOKENS_KEY}, an array of strings)", key=TOKENS_KEY)
    model = fields.get(MODEL_KEY)
    if model is None or model.type != VT.STRING:
        raise _bad_vocab(path, f"it does not name its tokenizer ({MODEL_KEY})", key=MODEL_KEY)
    n_tokens = len(tokens.value)
    for key, item_type in ((SCORES_KEY, VT.FLOAT32), (TOKEN_TYPE_KEY, VT.INT32)):
        per_token = fields.get(key)
        if per_token is None:
            continue
        if per_token.item_type != item_type or len(per_token.value) != n_tokens:
            raise _bad_vocab(path, f"{key} is not {n_tokens} values of type {item_type.name}", key=key)
    for key, value in fields.items():
        if key.endswith("_token_id") and not (value.type in _INTEGER_TYPES and 0 <= value.value < n_tokens):
            raise _bad_vocab(path, f"{key} = {value.value!r} is not a token of its {n_tokens}", key=key)
    return n_tokens


def with_special_tokens(fields: TokenizerFields, texts: Sequence[str]) -> TokenizerFields:
    """The vocabulary with ``texts`` appended as control tokens (as fine-tunes add ``<|im_start|>``): they
    tokenize to one token each with ``special=True``. A text already in the vocabulary is refused."""
    if not texts:
        return fields
    tokens = fields[TOKENS_KEY].value
    known = set(tokens)
    added = [text.encode() for text in texts]
    for text, raw in zip(texts, added, strict=True):
        if not text or raw in known or added.count(raw) > 1:
            reason = "empty" if not text else "already in the vocabulary" if raw in known else "given twice"
            raise ApplianceError("BAD_REQUEST", f"special token {text!r} is {reason}", {"special_token": text})
    if TOKEN_TYPE_KEY not in fields:
        raise ApplianceError("BAD_REQUEST", f"the vocabulary has no {TOKEN_TYPE_KEY}: special tokens cannot be "
                             "marked as control tokens", {"key": TOKEN_TYPE_KEY})
    extended = dict(fields)
    extended[TOKENS_KEY] = replace(fields[TOKENS_KEY], value=[*tokens, *added])
    control = int(gguf.TokenType.CONTROL)
    extended[TOKEN_TYPE_KEY] = replace(fields[TOKEN_TYPE_KEY],
                                       value=[*fields[TOKEN_TYPE_KEY].value, *(control,) * len(added)])
    if SCORES_KEY in fields:
        extended[SCORES_KEY] = replace(fields[SCORES_KEY], value=[*fields[SCORES_KEY].value, *(0.0,) * len(added)])
    return extended


def read_template_file(path: str | os.PathLike[str]) -> str:
    """A chat template file's text (Jinja2 source, UTF-8); BAD_REQUEST when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ApplianceError("BAD_REQUEST", f"cannot read the chat template {path}: {reason}",
                             {"chat_template": str(path)}) from None


def _bad_vocab(path: Path, reason: str, **details: Any) -> ApplianceError:
    return ApplianceError("BAD_REQUEST", f"invalid vocab file {path}: {reason}", {**details, "vocab": str(path)})


def _add_metadata(writer: gguf.GGUFWriter, hp: Hyperparams, tokenizer: TokenizerFields, dtype: str) -> None:
    writer.add_name(f"appliance-tiny-{hp.layers}x{hp.dim}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(len(tokenizer[TOKENS_KEY].value))
    writer.add_context_length(hp.n_ctx_train)
    writer.add_embedding_length(hp.dim)
    writer.add_block_count(hp.layers)
    writer.add_feed_forward_length(hp.ff)
    writer.add_head_count(hp.heads)
    writer.add_head_count_kv(hp.kv_heads)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_dimension_count(hp.head_dim)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    for key, field in tokenizer.items():
        writer.add_key_value(key, field.value, field.type, sub_type=field.item_type)


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
    vocab_from: str | os.PathLike[str] | None = None,
    special_tokens: Sequence[str] = (),
) -> Path:
    """Write a random-weight llama GGUF to ``path`` and return the path.

    ``heads`` defaults to dim // 64 (at least 1), ``kv_heads`` to ``heads`` (give fewer for GQA), ``ff`` to
    about 2.75 x dim. ``dtype`` ("f16" or "f32") applies to the matrices; norms are always f32.
    ``progress(done_bytes, total_bytes)`` is called after each tensor. ``vocab_from`` (a GGUF path) replaces the
    built-in vocabulary with that file's tokenizer (every ``tokenizer.*`` key, its chat template included).
    ``chat_template`` (a Jinja2 source) is written as ``tokenizer.chat_template``, over the vocab file's.
    ``special_tokens`` are appended to the vocabulary as control tokens (:func:`with_special_tokens`).
    The file appears atomically.
    """
    if dtype not in ("f16", "f32"):
        raise ApplianceError("BAD_REQUEST", f"dtype must be f16 or f32, not {dtype!r}", {"dtype": dtype})
    hp = resolve_hyperparams(layers, dim, heads, kv_heads, ff, n_ctx_train)
    tokenizer = builtin_tokenizer(build_vocabulary()) if vocab_from is None else read_tokenizer(vocab_from)
    tokenizer = with_special_tokens(tokenizer, special_tokens)
    if chat_template is not None:
        tokenizer.pop(CHAT_TEMPLATE_KEY, None)  # written last, where the built-in vocabulary always had it
        tokenizer[CHAT_TEMPLATE_KEY] = MetadataValue(VT.STRING, chat_template.encode())
    matrix_type = np.float16 if dtype == "f16" else np.float32
    specs = list(tensor_specs(hp, len(tokenizer[TOKENS_KEY].value)))

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, "llama")
    try:
        _add_metadata(writer, hp, tokenizer, dtype)
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
