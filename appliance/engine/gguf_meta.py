"""GGUF metadata for the VRAM table's ``auto`` estimate (SPEC L2).

:func:`read_model_shape` is the only IO here: it reads a GGUF header with ``gguf.GGUFReader`` and returns a
:class:`ModelShape`. Everything else is pure arithmetic on that shape: KV cache bytes by llama.cpp's formula
and the weights + KV + compute-margin estimate.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from appliance.errors import ApplianceError

GGUF_MAGIC = b"GGUF"
MIB = 1024 * 1024
COMPUTE_FLOOR_BYTES = 32 * MIB
COMPUTE_FRACTION = Fraction(5, 100)
KV_CELL_PADDING = 256  # llama.cpp rounds a context's n_ctx up to a multiple of this many cells

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


@dataclass(frozen=True)
class Estimate:
    weights: int
    kv: int
    compute: int
    total: int


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when the file starts with the GGUF magic; False for anything unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _load_failed(path: Path, message: str) -> ApplianceError:
    return ApplianceError("MODEL_LOAD_FAILED", message, {"path": str(path)})


def read_model_shape(path: str | os.PathLike[str]) -> ModelShape:
    """Read the shape of a GGUF model; any unreadable, foreign or corrupt file raises MODEL_LOAD_FAILED.

    Per-layer head counts (arrays) are reduced to their maximum, which keeps the KV estimate an upper bound.
    """
    path = Path(path)
    try:
        file_bytes = path.stat().st_size
    except OSError as exc:
        raise _load_failed(path, f"cannot read model file {path}: {exc.strerror or exc}") from exc
    if not path.is_file():
        raise _load_failed(path, f"model path {path} is not a regular file")
    if not is_gguf(path):
        raise _load_failed(path, f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = GGUFReader(path)
        fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
        extents = [(t.name, t.data_offset + t.n_bytes) for t in reader.tensors]
        weight_bytes = sum(int(t.n_bytes) for t in reader.tensors)
        del reader
    except Exception as exc:
        raise _load_failed(path, f"{path} is a corrupt or truncated GGUF file: {exc}") from exc
    beyond = [name for name, end in extents if end > file_bytes]
    if beyond:
        raise _load_failed(path, f"{path} is truncated: tensor {beyond[0]} ends past the end of the file")
    return _shape_from_fields(path, fields, weight_bytes, file_bytes)


def _shape_from_fields(path: Path, fields: dict[str, Any], weight_bytes: int, file_bytes: int) -> ModelShape:
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise _load_failed(path, f"{path} has no general.architecture in its GGUF metadata")

    def number(key: str, default: int | None = None) -> int:
        value = fields.get(f"{arch}.{key}", default)
        if isinstance(value, list):
            value = max(value, default=None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            if value is None:
                raise _load_failed(path, f"{path} lacks the GGUF metadata key {arch}.{key}")
            raise _load_failed(path, f"{path} has an invalid {arch}.{key}: {value!r}")
        return value

    layers = number("block_count")
    n_embd = number("embedding_length")
    n_head = number("attention.head_count")
    if n_head == 0:
        raise _load_failed(path, f"{path} has {arch}.attention.head_count = 0")
    n_head_kv = number("attention.head_count_kv", n_head)
    return ModelShape(
        architecture=arch,
        layers=layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=number("attention.key_length", n_embd // n_head),
        head_dim_v=number("attention.value_length", n_embd // n_head),
        n_ctx_train=number("context_length", 0),
        weight_bytes=weight_bytes,
        file_bytes=file_bytes,
    )


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


def estimate(shape: ModelShape, n_ctx: int, cache_type: str = "f16") -> Estimate:
    """Device bytes for the model at ``n_ctx``: weights + KV cache + compute margin.

    The KV part is :func:`kv_bytes` for :func:`kv_cells` (n_ctx padded as llama.cpp pads it). The compute
    margin covers llama.cpp's compute buffers (activations, logits, scratch) and is
    max(32 MiB, 5 % of weights + KV), rounded up to whole bytes.
    """
    _check_n_ctx(n_ctx)
    kv = kv_bytes(shape, kv_cells(n_ctx), cache_type)
    compute = max(COMPUTE_FLOOR_BYTES, math.ceil((shape.weight_bytes + kv) * COMPUTE_FRACTION))
    return Estimate(weights=shape.weight_bytes, kv=kv, compute=compute, total=shape.weight_bytes + kv + compute)
