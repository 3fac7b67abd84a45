"""GGUF metadata for the VRAM table's ``auto`` estimate (SPEC L2), read within bounds.

:func:`read_model_shape` is the only IO here: a bounded skim of the GGUF header (:func:`read_header`) that refuses
a hostile file fast and before allocating for it (too many keys or tensors, an over-long array or string, nested
arrays, unknown types, offsets past the end of the file), skips arrays without building them and keeps only the
fields a shape needs. :func:`shape_from_header` then checks that the metadata is plausible and consistent with the
tensors (llama.cpp aborts the whole process on some inconsistent files) and returns a :class:`ModelShape`.
Everything else is pure arithmetic on that shape: KV cache bytes by llama.cpp's formula and the weights + KV +
compute-margin estimate, split between the device and host RAM by the layers offloaded to the GPU.

Every refusal is ``MODEL_LOAD_FAILED`` whose details name the ``rule`` broken and, for a limit, the ``limit``.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError

GGUF_MAGIC = b"GGUF"
MIB = 1024 * 1024
COMPUTE_FLOOR_BYTES = 32 * MIB
COMPUTE_FRACTION = Fraction(5, 100)
KV_CELL_PADDING = 256  # llama.cpp rounds a context's n_ctx up to a multiple of this many cells

# Bounds of the header skim: real models stay far below each.
GGUF_VERSIONS = (2, 3)
MAX_KV = 65_536  # metadata keys (real models: under 100)
MAX_TENSORS = 65_536  # tensors (real models: a few thousand at most)
MAX_ARRAY_ENTRIES = 1 << 20  # entries of one metadata array (real vocabularies: 256k at most)
MAX_STRING_BYTES = 1 << 20  # one metadata string (chat templates are the longest: tens of KiB)
MAX_KEY_BYTES = 1024  # one metadata key
MAX_TENSOR_NAME_BYTES = 63  # GGML_MAX_NAME is 64 with its NUL
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 48  # elements of one tensor
KEPT_STRING_BYTES = 256  # longer kept strings (general.architecture) are refused

# Bounds of the shape's sanity rules.
MAX_BLOCKS = 512  # LLAMA_MAX_LAYERS: llama.cpp aborts above it
MAX_EXPERTS = 512  # LLAMA_MAX_EXPERTS: llama.cpp aborts above it
MAX_CONTEXT = 1 << 24  # a claimed training context above 16M tokens is not a real model
MAX_EMBEDDING = 1 << 20
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 14

SHAPE_KEYS = frozenset({
    "block_count", "embedding_length", "context_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "expert_count", "expert_used_count",
})
"""The architecture keys (``{arch}.{key}``) the reader keeps; every other field is skipped."""
KEPT_GENERAL = frozenset({"general.architecture", "general.alignment"})

CACHE_TYPE_BYTES: Mapping[str, Fraction] = {
    "f32": Fraction(4),
    "f16": Fraction(2),
    "bf16": Fraction(2),
    "q8_0": Fraction(34, 32),
    "q4_0": Fraction(18, 32),
    "q4_1": Fraction(20, 32),
    "q5_0": Fraction(22, 32),
    "q5_1": Fraction(24, 32),
}
"""Bytes per cached element for each llama.cpp KV cache type (block size / block bytes for quantised ones)."""

GGML_BLOCK_SIZES: Mapping[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}
"""(elements per block, bytes per block) of each ggml tensor type, by type number: gguf-py's ``GGML_QUANT_SIZES``
(a test checks they are equal), kept here because importing the ``gguf`` package costs a serving process about
2.5 MiB of memory for this one table."""

# GGUF value types: fixed-size scalars (struct format) and the two variable-size ones.
_SCALARS: Mapping[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                               10: "<Q", 11: "<q", 12: "<d"}
_STRING = 8
_ARRAY = 9
_LENGTH = struct.Struct("<Q")  # a string's length prefix
_INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_BLOCK = re.compile(r"(?:^|\.)blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    weight_bytes: int  # sum of the tensors' data bytes
    file_bytes: int
    block_bytes: tuple[int, ...] = ()  # each block's (layer's) tensor bytes, block 0 first; the rest is non-block

    @property
    def offload_layers(self) -> int:
        """The layers llama.cpp can offload (what ``n_gpu_layers`` counts): every block, then the output layer."""
        return self.layers + 1


@dataclass(frozen=True)
class Estimate:
    """A model's bytes at a context size, split between the device and host RAM by its offloaded layers: the
    device's ``weights``, ``kv`` and ``compute`` margin (``total`` is their sum, the ledger's figure on a GPU), and
    what stays in host RAM (``host_weights``, ``host_kv``: 0 when every layer is offloaded)."""

    weights: int
    kv: int
    compute: int
    total: int
    host_weights: int = 0
    host_kv: int = 0

    @property
    def host(self) -> int:
        return self.host_weights + self.host_kv


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the innermost (row) dimension first
    type: int  # a ggml type (gguf.GGMLQuantizationType)
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What the bounded skim keeps of a GGUF header: the shape's fields and every tensor's info."""

    version: int
    fields: dict[str, Any]  # scalars, and integer tuples for per-layer shape keys
    tensors: tuple[TensorInfo, ...]
    data_offset: int
    file_bytes: int

    @property
    def weight_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when the file starts with the GGUF magic; False for anything unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _load_failed(path: Path, message: str, **details: Any) -> ApplianceError:
    return ApplianceError("MODEL_LOAD_FAILED", message, {"path": str(path), **details})


def read_model_shape(path: str | os.PathLike[str]) -> ModelShape:
    """Read the shape of a GGUF model; any unreadable, foreign, corrupt, hostile or implausible file raises
    MODEL_LOAD_FAILED.

    Per-layer head counts (arrays) are reduced to their maximum, which keeps the KV estimate an upper bound.
    """
    path = Path(path)
    return shape_from_header(path, read_header(path))


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The bounded skim of a GGUF file's header (see the module docstring); raises MODEL_LOAD_FAILED."""
    path = Path(path)
    try:
        path.stat()
    except OSError as exc:
        raise _load_failed(path, f"cannot read model file {path}: {exc.strerror or exc}") from exc
    if not path.is_file():
        raise _load_failed(path, f"model path {path} is not a regular file")
    if not is_gguf(path):
        raise _load_failed(path, f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return _Skim(path, view).header()
    except (OSError, ValueError) as exc:  # the file changed or vanished meanwhile
        raise _load_failed(path, f"cannot read model file {path}: {exc}") from exc


class _Skim:
    """One pass over a mapped GGUF header; every count and length is checked before it is used."""

    def __init__(self, path: Path, view: mmap.mmap) -> None:
        self.path = path
        self.view = view
        self.size = len(view)
        self.pos = 0

    def refuse(self, message: str, **details: Any) -> ApplianceError:
        return _load_failed(self.path, f"{self.path}: {message}", **details)

    def truncated(self, what: str) -> ApplianceError:
        return self.refuse(f"truncated or corrupt GGUF file: {what} runs past the end of the file",
                           rule="truncated", file_bytes=self.size)

    def scalar(self, fmt: str, what: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.view, self.pos)
        except struct.error:
            raise self.truncated(what) from None
        self.pos += struct.calcsize(fmt)
        return value

    def skip(self, n_bytes: int, what: str) -> None:
        if n_bytes > self.size - self.pos:
            raise self.truncated(what)
        self.pos += n_bytes

    def string(self, limit: int, what: str) -> bytes:
        length = self.scalar("<Q", what)
        if length > limit:
            raise self.refuse(f"{what} is {length} bytes long (limit {limit})", rule="string_bytes",
                              limit=limit, found=length)
        start = self.pos
        self.skip(length, what)
        return self.view[start:self.pos]

    def skip_strings(self, key: str, count: int) -> None:
        """Skip an array of ``count`` strings: a tight loop, as vocabularies hold hundreds of thousands."""
        unpack = _LENGTH.unpack_from
        view = self.view
        pos = self.pos
        end = self.size - _LENGTH.size
        for _ in range(count):
            if pos > end:
                raise self.truncated(f"the strings of {key}")
            (length,) = unpack(view, pos)
            if length > MAX_STRING_BYTES:
                raise self.refuse(f"a string of {key} is {length} bytes long (limit {MAX_STRING_BYTES})",
                                  key=key, rule="string_bytes", limit=MAX_STRING_BYTES, found=length)
            pos += _LENGTH.size + length
        if pos > self.size:
            raise self.truncated(f"the strings of {key}")
        self.pos = pos

    def header(self) -> GGUFHeader:
        self.skip(4, "the magic")
        version = self.scalar("<I", "the version")
        if version not in GGUF_VERSIONS:
            raise self.refuse(f"unsupported GGUF version {version}", rule="version", found=version,
                              supported=list(GGUF_VERSIONS))
        n_tensors = self.scalar("<Q", "the tensor count")
        n_kv = self.scalar("<Q", "the metadata count")
        if n_tensors > MAX_TENSORS:
            raise self.refuse(f"{n_tensors} tensors (limit {MAX_TENSORS})", rule="tensors", limit=MAX_TENSORS,
                              found=n_tensors)
        if n_kv > MAX_KV:
            raise self.refuse(f"{n_kv} metadata keys (limit {MAX_KV})", rule="metadata_keys", limit=MAX_KV,
                              found=n_kv)
        fields: dict[str, Any] = {}
        seen: set[bytes] = set()
        for _ in range(n_kv):
            raw_key = self.string(MAX_KEY_BYTES, "a metadata key")
            if raw_key in seen:
                raise self.refuse(f"duplicate metadata key {_printable(raw_key)}", rule="duplicate_key")
            seen.add(raw_key)
            key = raw_key.decode("utf-8", errors="replace")
            value = self.value(key, keep=_kept(key))
            if value is not None:
                fields[key] = value
        alignment = fields.get("general.alignment", 32)
        if not _is_int(alignment) or alignment < 1 or alignment & (alignment - 1) or alignment > 1 << 20:
            raise self.refuse(f"invalid general.alignment {alignment!r}", rule="alignment")
        tensors = [self.tensor_info() for _ in range(n_tensors)]
        data_offset = -(-self.pos // alignment) * alignment
        if data_offset > self.size:
            raise self.truncated("the tensor data section")
        names: set[str] = set()
        for tensor in tensors:
            if tensor.name in names:
                raise self.refuse(f"duplicate tensor {tensor.name}", rule="duplicate_tensor")
            names.add(tensor.name)
            if tensor.offset % alignment:
                raise self.refuse(f"tensor {tensor.name} is not aligned to {alignment} bytes", rule="alignment")
            if data_offset + tensor.offset + tensor.n_bytes > self.size:
                raise self.refuse(f"truncated: tensor {tensor.name} ends past the end of the file",
                                  rule="truncated", file_bytes=self.size)
        return GGUFHeader(version, fields, tuple(tensors), data_offset, self.size)

    def value(self, key: str, *, keep: bool) -> Any:
        """One metadata value: returned when ``keep`` (scalars, short strings, integer arrays), else skipped."""
        value_type = self.scalar("<I", f"the type of {key}")
        if value_type == _ARRAY:
            return self.array(key, keep=keep)
        if value_type == _STRING:
            raw = self.string(MAX_STRING_BYTES, f"the string {key}")
            if not keep:
                return None
            if len(raw) > KEPT_STRING_BYTES:
                raise self.refuse(f"{key} is {len(raw)} bytes long (limit {KEPT_STRING_BYTES})",
                                  key=key, rule="string_bytes", limit=KEPT_STRING_BYTES, found=len(raw))
            return raw.decode("utf-8", errors="replace")
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise self.refuse(f"{key} has unknown value type {value_type}", key=key, rule="value_type",
                              found=value_type)
        value = self.scalar(fmt, key)
        return value if keep else None

    def array(self, key: str, *, keep: bool) -> tuple[int, ...] | None:
        item_type = self.scalar("<I", f"the item type of {key}")
        count = self.scalar("<Q", f"the length of {key}")
        if count > MAX_ARRAY_ENTRIES:
            raise self.refuse(f"metadata array {key} has {count} entries (limit {MAX_ARRAY_ENTRIES})",
                              key=key, rule="array_entries", limit=MAX_ARRAY_ENTRIES, found=count)
        if item_type == _ARRAY:
            raise self.refuse(f"metadata array {key} holds arrays (nested arrays are not supported)",
                              key=key, rule="nested_array")
        if item_type == _STRING:
            self.skip_strings(key, count)
            return None
        fmt = _SCALARS.get(item_type)
        if fmt is None:
            raise self.refuse(f"metadata array {key} has unknown item type {item_type}", key=key,
                              rule="value_type", found=item_type)
        start = self.pos
        self.skip(count * struct.calcsize(fmt), key)
        if not keep:
            return None
        if item_type not in _INTEGER_TYPES:
            raise self.refuse(f"{key} holds non-integers", key=key, rule="value_type", found=item_type)
        if count > MAX_BLOCKS:
            raise self.refuse(f"per-layer array {key} has {count} entries (limit {MAX_BLOCKS})",
                              key=key, rule="array_entries", limit=MAX_BLOCKS, found=count)
        return tuple(item[0] for item in struct.iter_unpack(fmt, self.view[start:self.pos]))

    def tensor_info(self) -> TensorInfo:
        raw_name = self.string(MAX_TENSOR_NAME_BYTES, "a tensor name")
        name = raw_name.decode("utf-8", errors="replace")
        n_dims = self.scalar("<I", f"the dimensions of tensor {name}")
        if n_dims < 1 or n_dims > MAX_DIMS:
            raise self.refuse(f"tensor {name} has {n_dims} dimensions (limit {MAX_DIMS})", rule="tensor_dims",
                              limit=MAX_DIMS, found=n_dims)
        dims = tuple(self.scalar("<Q", f"the shape of tensor {name}") for _ in range(n_dims))
        ggml_type = self.scalar("<I", f"the type of tensor {name}")
        offset = self.scalar("<Q", f"the offset of tensor {name}")
        block = GGML_BLOCK_SIZES.get(ggml_type)
        if block is None:
            raise self.refuse(f"tensor {name} has unknown type {ggml_type}", rule="tensor_type", found=ggml_type)
        elements = math.prod(dims)
        if min(dims) < 1 or elements > MAX_ELEMENTS:
            raise self.refuse(f"tensor {name} has an invalid shape {list(dims)} (dimensions of at least 1, at most "
                              f"{MAX_ELEMENTS} elements)", rule="tensor_shape", limit=MAX_ELEMENTS)
        block_size, type_size = block
        if dims[0] % block_size:
            raise self.refuse(f"tensor {name}'s rows of {dims[0]} are not whole blocks of {block_size}",
                              rule="tensor_shape")
        return TensorInfo(name, dims, ggml_type, offset, elements // block_size * type_size)


def _kept(key: str) -> bool:
    return key in KEPT_GENERAL or key.partition(".")[2] in SHAPE_KEYS


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _printable(raw: bytes) -> str:
    return raw[:64].decode("utf-8", errors="replace")


def shape_from_header(path: Path, header: GGUFHeader) -> ModelShape:
    """The model's shape from its skimmed header, once the metadata passed the sanity rules."""
    return _shape_from_fields(path, header.fields, header.tensors, header.file_bytes)


def _shape_from_fields(path: Path, fields: dict[str, Any], tensors: tuple[TensorInfo, ...],
                       file_bytes: int) -> ModelShape:
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise _load_failed(path, f"{path} has no general.architecture in its GGUF metadata",
                           key="general.architecture", rule="missing_key")

    def per_layer(key: str, default: int | None = None) -> tuple[int, ...]:
        """A key's value for every layer (a scalar applies to all of them)."""
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise _load_failed(path, f"{path} lacks the GGUF metadata key {arch}.{key}", key=f"{arch}.{key}",
                               rule="missing_key")
        values = value if isinstance(value, tuple) else (value,)
        if not values or not all(_is_int(v) and v >= 0 for v in values):
            raise _load_failed(path, f"{path} has an invalid {arch}.{key}: {_shown(value)}", key=f"{arch}.{key}",
                               rule="value_type")
        return values

    def number(key: str, default: int | None = None, *, limit: int) -> int:
        value = max(per_layer(key, default))
        if value > limit:
            raise _load_failed(path, f"{path} has {arch}.{key} = {value} (limit {limit})", key=f"{arch}.{key}",
                               rule="limit", limit=limit, found=value)
        return value

    def inconsistent(message: str, key: str, **details: Any) -> ApplianceError:
        return _load_failed(path, f"{path} has inconsistent metadata: {message}", key=f"{arch}.{key}",
                            rule="consistency", **details)

    layers = number("block_count", limit=MAX_BLOCKS)
    if layers < 1:
        raise inconsistent(f"{arch}.block_count is 0", "block_count")
    blocks = {int(match.group(1)) for match in map(_BLOCK.search, (t.name for t in tensors)) if match}
    missing = next((n for n in range(layers) if n not in blocks), None)
    if missing is not None:
        raise inconsistent(f"{arch}.block_count is {layers} but there are no tensors for block {missing}",
                           "block_count", found=layers, missing_block=missing)
    n_embd = number("embedding_length", limit=MAX_EMBEDDING)
    n_head = number("attention.head_count", limit=MAX_HEADS)
    if n_head == 0:
        raise inconsistent(f"{arch}.attention.head_count is 0", "attention.head_count")
    n_head_kv = number("attention.head_count_kv", n_head, limit=MAX_HEADS)
    _check_heads(path, arch, layers, per_layer("attention.head_count"), per_layer("attention.head_count_kv", n_head))
    has_key_length = f"{arch}.attention.key_length" in fields
    if not has_key_length and n_embd % n_head:
        raise inconsistent(f"{arch}.embedding_length {n_embd} is not a multiple of the {n_head} heads",
                           "attention.head_count")
    head_dim_k = number("attention.key_length", n_embd // n_head, limit=MAX_HEAD_DIM)
    head_dim_v = number("attention.value_length", n_embd // n_head, limit=MAX_HEAD_DIM)
    n_ctx_train = number("context_length", 0, limit=MAX_CONTEXT)
    n_expert = number("expert_count", 0, limit=MAX_EXPERTS)
    n_expert_used = number("expert_used_count", 0, limit=MAX_EXPERTS)
    if n_expert_used > n_expert or (n_expert > 0 and n_expert_used == 0):
        raise inconsistent(f"{arch}.expert_used_count {n_expert_used} does not fit {arch}.expert_count {n_expert}",
                           "expert_used_count", limit=n_expert, found=n_expert_used)
    block_bytes = [0] * layers
    for tensor in tensors:
        match = _BLOCK.search(tensor.name)
        if match and int(match.group(1)) < layers:
            block_bytes[int(match.group(1))] += tensor.n_bytes
    return ModelShape(
        architecture=arch,
        layers=layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_ctx_train=n_ctx_train,
        weight_bytes=sum(t.n_bytes for t in tensors),
        file_bytes=file_bytes,
        block_bytes=tuple(block_bytes),
    )


def _check_heads(path: Path, arch: str, layers: int, heads: tuple[int, ...], kv_heads: tuple[int, ...]) -> None:
    """Per layer, the query heads are a multiple of the KV heads (llama.cpp aborts otherwise)."""
    for key, values in (("attention.head_count", heads), ("attention.head_count_kv", kv_heads)):
        if len(values) not in (1, layers):
            raise _load_failed(path, f"{path} has {len(values)} values of {arch}.{key} for {layers} layers",
                               key=f"{arch}.{key}", rule="consistency", limit=layers, found=len(values))
    for layer in range(layers):
        n_head = heads[layer % len(heads)]
        n_head_kv = kv_heads[layer % len(kv_heads)]
        if n_head_kv and (n_head_kv > n_head or n_head % n_head_kv):
            raise _load_failed(
                path, f"{path} has inconsistent metadata: {n_head} heads are not a multiple of {n_head_kv} KV heads "
                f"(layer {layer})", key=f"{arch}.attention.head_count_kv", rule="consistency", layer=layer)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bytes_per_element(cache_type: str) -> Fraction:
    try:
        return CACHE_TYPE_BYTES[cache_type]
    except KeyError:
        raise ApplianceError(
            "BAD_REQUEST",
            f"unknown KV cache type {cache_type!r}",
            {"cache_type": cache_type, "known": sorted(CACHE_TYPE_BYTES)},
        ) from None


def _check_n_ctx(n_ctx: int) -> None:
    if n_ctx < 1:
        raise ApplianceError("BAD_REQUEST", f"n_ctx must be positive, not {n_ctx}", {"n_ctx": n_ctx})


def kv_bytes(shape: ModelShape, n_ctx: int, cache_type: str = "f16") -> int:
    """KV cache bytes for ``n_ctx`` cells, as llama.cpp sizes it.

    Per layer and cell: one K row of n_head_kv * head_dim_k elements plus one V row of n_head_kv * head_dim_v
    elements, each row rounded up to whole bytes of ``cache_type``.
    """
    _check_n_ctx(n_ctx)
    per_element = _bytes_per_element(cache_type)
    row_k = math.ceil(shape.n_head_kv * shape.head_dim_k * per_element)
    row_v = math.ceil(shape.n_head_kv * shape.head_dim_v * per_element)
    return shape.layers * n_ctx * (row_k + row_v)


def kv_cells(n_ctx: int) -> int:
    """The number of KV cells llama.cpp allocates for a requested ``n_ctx`` (padded up to 256)."""
    return -(-n_ctx // KV_CELL_PADDING) * KV_CELL_PADDING


def estimate(shape: ModelShape, n_ctx: int, cache_type: str = "f16", gpu_layers: int | None = None) -> Estimate:
    """The model's bytes at ``n_ctx`` with ``gpu_layers`` of its :attr:`~ModelShape.offload_layers` offloaded
    (None or a negative count: all of them), as llama.cpp places them: the last ``gpu_layers`` blocks' weights and
    KV cache on the device, the output layer too once every block is there; the other blocks and the token
    embeddings in host RAM. With every layer offloaded all the weights count against the device (the token
    embeddings too, which llama.cpp keeps on the CPU: an upper bound).

    The KV part is :func:`kv_bytes` for :func:`kv_cells` (n_ctx padded as llama.cpp pads it), split by layer. The
    compute margin covers llama.cpp's compute buffers on the device (activations, logits, scratch) and is
    max(32 MiB, 5 % of the device's weights + KV), rounded up to whole bytes.
    """
    _check_n_ctx(n_ctx)
    kv = kv_bytes(shape, kv_cells(n_ctx), cache_type)
    weights, host_weights, host_kv = shape.weight_bytes, 0, 0
    if gpu_layers is not None and 0 <= gpu_layers < shape.offload_layers:
        if len(shape.block_bytes) != shape.layers:
            raise ValueError(f"a split of {gpu_layers} layers needs each block's bytes ({len(shape.block_bytes)} known "
                             f"of {shape.layers})")
        weights = sum(shape.block_bytes[shape.layers - gpu_layers:])  # llama.cpp offloads the last blocks
        host_weights = shape.weight_bytes - weights
        host_kv = kv // shape.layers * (shape.layers - gpu_layers)  # kv_bytes is a whole multiple of the layers
        kv -= host_kv
    compute = max(COMPUTE_FLOOR_BYTES, math.ceil((weights + kv) * COMPUTE_FRACTION))
    return Estimate(weights=weights, kv=kv, compute=compute, total=weights + kv + compute,
                    host_weights=host_weights, host_kv=host_kv)


def device_bytes_by_layers(shape: ModelShape, n_ctx: int, cache_type: str = "f16") -> tuple[int, ...]:
    """The device's part of :func:`estimate` for each count of offloaded layers, 0 to every one (non-decreasing)."""
    return tuple(estimate(shape, n_ctx, cache_type, layers).total for layers in range(shape.offload_layers + 1))
