from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from appliance.engine.gguf_meta import (
    CACHE_TYPE_BYTES,
    MAX_ARRAY_ENTRIES,
    MAX_BLOCKS,
    MAX_CONTEXT,
    MAX_DIMS,
    MAX_ELEMENTS,
    MAX_EMBEDDING,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_KEY_BYTES,
    MAX_KV,
    MAX_STRING_BYTES,
    MAX_TENSORS,
    Estimate,
    ModelShape,
    estimate,
    is_gguf,
    kv_bytes,
    kv_cells,
    read_header,
    read_model_shape,
)
from appliance.engine.tinymodel import build_vocabulary, write_tiny_model
from appliance.errors import ApplianceError

MIB = 1024 * 1024
GIB = 1024 * MIB

# Llama-3-8B: 32 layers, 32 query heads, 8 KV heads of 128
LLAMA3_8B = ModelShape("llama", 32, 4096, 32, 8, 128, 128, 8192, weight_bytes=16 * GIB, file_bytes=16 * GIB)


def small_shape(weight_bytes: int = 10 * MIB) -> ModelShape:
    return ModelShape("llama", 4, 256, 4, 4, 64, 64, 2048, weight_bytes=weight_bytes, file_bytes=weight_bytes)


def write_custom_gguf(path: Path, *, blocks_written: int | None = None, **arch_keys: int | list[int]) -> Path:
    """A minimal hand-made GGUF: only the keys given, one small tensor and one norm per block (or per block of
    ``blocks_written``)."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in arch_keys.items():
        name = f"llama.{key.replace('__', '.')}"
        if isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_uint32(name, value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    blocks = arch_keys.get("block_count", 0) if blocks_written is None else blocks_written
    for block in range(blocks if isinstance(blocks, int) else 0):
        writer.add_tensor(f"blk.{block}.attn_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_load_failed(path: Path) -> ApplianceError:
    with pytest.raises(ApplianceError) as info:
        read_model_shape(path)
    assert info.value.code == "MODEL_LOAD_FAILED"
    assert info.value.details["path"] == str(path)
    assert str(path) in info.value.message
    return info.value


def test_shape_of_the_fixture_model(tiny_model: Path) -> None:
    shape = read_model_shape(tiny_model)
    n_vocab, dim, ff, layers = len(build_vocabulary().tokens), 256, 704, 4
    per_block = 2 * dim * 4 + 4 * dim * dim * 2 + 3 * dim * ff * 2
    expected_weights = 2 * n_vocab * dim * 2 + layers * per_block + dim * 4
    assert shape == ModelShape(
        architecture="llama",
        layers=4,
        n_embd=256,
        n_head=4,
        n_head_kv=4,
        head_dim_k=64,
        head_dim_v=64,
        n_ctx_train=2048,
        weight_bytes=expected_weights,
        file_bytes=tiny_model.stat().st_size,
        block_bytes=(per_block,) * layers,
    )
    # everything that is not weights is the header (vocabulary) and alignment padding
    assert 0 < shape.file_bytes - shape.weight_bytes < 64 * 1024


def test_gqa_model_reads_back_its_kv_heads(tmp_path: Path, tiny_model_b: Path) -> None:
    path = write_tiny_model(tmp_path / "gqa.gguf", layers=3, dim=256, heads=8, kv_heads=2, n_ctx_train=4096)
    shape = read_model_shape(path)
    assert (shape.layers, shape.n_embd, shape.n_head, shape.n_head_kv) == (3, 256, 8, 2)
    assert (shape.head_dim_k, shape.head_dim_v, shape.n_ctx_train) == (32, 32, 4096)
    other = read_model_shape(tiny_model_b)
    assert (other.layers, other.n_embd, other.n_head, other.n_head_kv) == (2, 128, 2, 2)


def test_explicit_key_and_value_lengths_win(tmp_path: Path) -> None:
    path = write_custom_gguf(
        tmp_path / "kl.gguf",
        block_count=2,
        embedding_length=512,
        context_length=1024,
        attention__head_count=4,
        attention__head_count_kv=2,
        attention__key_length=192,
        attention__value_length=128,
    )
    shape = read_model_shape(path)
    assert (shape.head_dim_k, shape.head_dim_v, shape.n_head_kv) == (192, 128, 2)
    assert shape.weight_bytes == 8 * 16 * 4 + 2 * 16 * 4


def test_per_layer_head_counts_use_the_largest(tmp_path: Path) -> None:
    path = write_custom_gguf(
        tmp_path / "arr.gguf",
        block_count=3,
        embedding_length=256,
        context_length=1024,
        attention__head_count=4,
        attention__head_count_kv=[0, 2, 4],
    )
    assert read_model_shape(path).n_head_kv == 4


def test_missing_metadata_is_a_load_failure(tmp_path: Path) -> None:
    path = write_custom_gguf(tmp_path / "nokeys.gguf", block_count=2, context_length=1024)
    assert "llama.embedding_length" in assert_load_failed(path).message


def test_is_gguf(tmp_path: Path, tiny_model: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("just some text, long enough")
    short = tmp_path / "short"
    short.write_bytes(b"GG")
    assert is_gguf(tiny_model)
    assert not is_gguf(text)
    assert not is_gguf(short)
    assert not is_gguf(tmp_path / "missing.gguf")
    assert not is_gguf(tmp_path)


def test_non_gguf_missing_and_directory_paths_fail_cleanly(tmp_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("this is not a model")
    assert "not a GGUF file" in assert_load_failed(text).message
    assert_load_failed(tmp_path / "absent.gguf")
    assert_load_failed(tmp_path)


@pytest.mark.parametrize("keep", [4, 24, 100, 5000, 0.5, 0.999])
def test_truncated_gguf_fails_cleanly(tmp_path: Path, tiny_model: Path, keep: float) -> None:
    data = tiny_model.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    assert_load_failed(cut)


def test_garbage_after_the_magic_fails_cleanly(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for i in range(5):
        junk = tmp_path / f"junk{i}.gguf"
        junk.write_bytes(b"GGUF" + rng.bytes(4096))
        assert_load_failed(junk)
    # a valid version number with absurd counts behind it
    absurd = tmp_path / "absurd.gguf"
    absurd.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") * 2 + b"\0" * 64)
    assert_load_failed(absurd)


def test_cache_type_table() -> None:
    assert CACHE_TYPE_BYTES["f16"] == 2 and CACHE_TYPE_BYTES["f32"] == 4 and CACHE_TYPE_BYTES["bf16"] == 2
    assert CACHE_TYPE_BYTES["q8_0"] * 32 == 34 and CACHE_TYPE_BYTES["q4_0"] * 32 == 18
    assert CACHE_TYPE_BYTES["q4_1"] * 32 == 20 and CACHE_TYPE_BYTES["q5_0"] * 32 == 22
    assert CACHE_TYPE_BYTES["q5_1"] * 32 == 24


@pytest.mark.parametrize(
    ("cache_type", "expected"),
    [
        # 32 layers x 8192 cells x (K + V) rows of 8 x 128 = 1024 elements
        ("f16", 32 * 8192 * 2 * 1024 * 2),  # the well-known 1 GiB
        ("f32", 2 * GIB),
        ("bf16", GIB),
        ("q8_0", 32 * 8192 * 2 * 1088),  # 1024 / 32 blocks of 34 bytes
        ("q4_0", 32 * 8192 * 2 * 576),
        ("q5_1", 32 * 8192 * 2 * 768),
    ],
)
def test_kv_bytes_hand_computed(cache_type: str, expected: int) -> None:
    assert kv_bytes(LLAMA3_8B, 8192, cache_type) == expected


def test_kv_bytes_with_different_k_and_v_head_sizes() -> None:
    shape = ModelShape("x", 2, 512, 4, 2, 192, 128, 1024, weight_bytes=0, file_bytes=0)
    assert kv_bytes(shape, 100) == 2 * 100 * (2 * 192 * 2 + 2 * 128 * 2)
    assert kv_bytes(shape, 100, "q8_0") == 2 * 100 * (384 * 34 // 32 + 256 * 34 // 32)


def test_kv_bytes_matches_what_llama_cpp_allocated_for_the_fixture(tiny_model: Path) -> None:
    # llama.cpp logs "512 cells, 4 layers ... size = 2.00 MiB" for this model at n_ctx=512, f16
    assert kv_bytes(read_model_shape(tiny_model), 512) == 2 * MIB


def test_bad_cache_type_and_context_are_refused() -> None:
    for call in (
        lambda: kv_bytes(LLAMA3_8B, 512, "q3_k"),
        lambda: kv_bytes(LLAMA3_8B, 0),
        lambda: estimate(LLAMA3_8B, -1),
        lambda: estimate(LLAMA3_8B, 512, "F16"),
    ):
        with pytest.raises(ApplianceError) as info:
            call()
        assert info.value.code == "BAD_REQUEST"


def test_kv_cells_pad_like_llama_cpp() -> None:
    assert [kv_cells(n) for n in (1, 256, 257, 300, 512, 8192)] == [256, 256, 512, 512, 512, 8192]


def test_estimate_adds_weights_kv_and_a_compute_margin() -> None:
    big = estimate(LLAMA3_8B, 8192)
    assert big == Estimate(weights=16 * GIB, kv=GIB, compute=(17 * GIB + 19) // 20, total=big.total)
    assert big.total == big.weights + big.kv + big.compute
    small = estimate(small_shape(), 512)
    assert small.compute == 32 * MIB  # the floor
    assert small.kv == kv_bytes(small_shape(), 512)
    assert estimate(small_shape(), 300).kv == kv_bytes(small_shape(), 512)  # padded cells


def test_estimate_is_monotone_in_context_and_cache_width() -> None:
    for shape in (small_shape(), LLAMA3_8B):
        totals = [estimate(shape, n).total for n in (1, 255, 256, 257, 1000, 4096, 8192, 32768, 131072)]
        assert totals == sorted(totals)
        assert totals[-1] > totals[0]
        assert (
            estimate(shape, 8192, "q4_0").total
            < estimate(shape, 8192, "q8_0").total
            < estimate(shape, 8192, "f16").total
            < estimate(shape, 8192, "f32").total
        )


# -- the bounded skim: hostile headers are refused fast, before anything is built for them ---------------------------

U32, STRING, ARRAY = 4, 8, 9


def raw_string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def raw_kv(key: str, value_type: int, payload: bytes) -> bytes:
    return raw_string(key.encode()) + struct.pack("<I", value_type) + payload


def raw_u32(key: str, value: int) -> bytes:
    return raw_kv(key, U32, struct.pack("<I", value))


def raw_tensor(name: str, dims: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    packed_dims = b"".join(struct.pack("<Q", d) for d in dims)
    tail = struct.pack("<IQ", ggml_type, offset)
    return raw_string(name.encode()) + struct.pack("<I", len(dims)) + packed_dims + tail


BASE_KVS = (
    raw_kv("general.architecture", STRING, raw_string(b"llama")),
    raw_u32("llama.block_count", 1),
    raw_u32("llama.embedding_length", 16),
    raw_u32("llama.attention.head_count", 2),
    raw_u32("llama.context_length", 256),
)
BASE_TENSORS = (raw_tensor("blk.0.attn_norm.weight", (16,)),)


def raw_gguf(path: Path, kvs: tuple[bytes, ...] = BASE_KVS, tensors: tuple[bytes, ...] = BASE_TENSORS, *,
             version: int = 3, n_kv: int | None = None, n_tensors: int | None = None, data_bytes: int = 64) -> Path:
    """A GGUF written byte by byte (what ``gguf.GGUFWriter`` refuses to write): header, KVs, tensor infos, data."""
    counts = struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                         len(kvs) if n_kv is None else n_kv)
    head = b"GGUF" + counts + b"".join(kvs) + b"".join(tensors)
    path.write_bytes(head + b"\0" * (-len(head) % 32) + b"\1" * data_bytes)
    return path


def refusal(path: Path, rule: str | None = None) -> ApplianceError:
    error = assert_load_failed(path)
    if rule is not None:
        assert error.details.get("rule") == rule, error.details
    return error


def test_the_raw_base_file_is_accepted(tmp_path: Path) -> None:
    """Each refusal below changes one thing of this file."""
    shape = read_model_shape(raw_gguf(tmp_path / "base.gguf"))
    assert (shape.layers, shape.n_embd, shape.n_head, shape.n_head_kv, shape.n_ctx_train) == (1, 16, 2, 2, 256)
    assert shape.weight_bytes == 64


@pytest.mark.parametrize(("case", "rule", "limit"), [
    ("version 1", "version", None),
    ("too many keys", "metadata_keys", MAX_KV),
    ("too many tensors", "tensors", MAX_TENSORS),
    ("long key", "string_bytes", MAX_KEY_BYTES),
    ("long string", "string_bytes", MAX_STRING_BYTES),
    ("unknown value type", "value_type", None),
    ("unknown array item type", "value_type", None),
    ("long array", "array_entries", MAX_ARRAY_ENTRIES),
    ("long per-layer array", "array_entries", MAX_BLOCKS),
    ("duplicate key", "duplicate_key", None),
    ("duplicate tensor", "duplicate_tensor", None),
    ("five dimensions", "tensor_dims", MAX_DIMS),
    ("zero dimension", "tensor_shape", MAX_ELEMENTS),
    ("unknown tensor type", "tensor_type", None),
    ("partial quant block", "tensor_shape", None),
    ("offset past the end", "truncated", None),
    ("misaligned offset", "alignment", None),
    ("bad alignment", "alignment", None),
    ("string past the end", "truncated", None),
])
def test_hostile_headers_are_refused_with_their_rule(tmp_path: Path, case: str, rule: str, limit: int | None) -> None:
    kvs, tensors = list(BASE_KVS), list(BASE_TENSORS)
    options: dict[str, int] = {}
    if case == "version 1":
        options["version"] = 1
    elif case == "too many keys":
        options["n_kv"] = MAX_KV + 1
    elif case == "too many tensors":
        options["n_tensors"] = MAX_TENSORS + 1
    elif case == "long key":
        kvs.append(raw_u32("x" * (MAX_KEY_BYTES + 1), 1))
    elif case == "long string":
        kvs.append(raw_kv("general.description", STRING, struct.pack("<Q", MAX_STRING_BYTES + 1)))
    elif case == "unknown value type":
        kvs.append(raw_kv("general.odd", 13, b"\0" * 8))
    elif case == "unknown array item type":
        kvs.append(raw_kv("general.odd", ARRAY, struct.pack("<IQ", 99, 1) + b"\0" * 8))
    elif case == "long array":  # only its header: the count alone is refused, nothing is read or skipped
        kvs.append(raw_kv("general.odd", ARRAY, struct.pack("<IQ", U32, MAX_ARRAY_ENTRIES + 1)))
    elif case == "long per-layer array":
        kvs[3] = raw_kv("llama.attention.head_count", ARRAY,
                        struct.pack("<IQ", U32, MAX_BLOCKS + 1) + struct.pack("<I", 2) * (MAX_BLOCKS + 1))
    elif case == "duplicate key":
        kvs.append(BASE_KVS[1])
    elif case == "duplicate tensor":
        tensors.append(raw_tensor("blk.0.attn_norm.weight", (16,), offset=0))
    elif case == "five dimensions":
        tensors[0] = raw_tensor("blk.0.attn_norm.weight", (1, 1, 1, 1, 16))
    elif case == "zero dimension":
        tensors[0] = raw_tensor("blk.0.attn_norm.weight", (16, 0))
    elif case == "unknown tensor type":
        tensors[0] = raw_tensor("blk.0.attn_norm.weight", (16,), ggml_type=4)  # Q4_2: removed from ggml long ago
    elif case == "partial quant block":
        tensors[0] = raw_tensor("blk.0.attn_norm.weight", (16,), ggml_type=int(gguf.GGMLQuantizationType.Q8_0))
    elif case == "offset past the end":
        tensors[0] = raw_tensor("blk.0.attn_norm.weight", (16,), offset=2**40)
    elif case == "misaligned offset":
        tensors[0] = raw_tensor("blk.0.attn_norm.weight", (4,), offset=4)
    elif case == "bad alignment":
        kvs.append(raw_u32("general.alignment", 24))
    elif case == "string past the end":
        kvs.append(raw_kv("general.description", STRING, struct.pack("<Q", 1000)))
        tensors = []
        options.update(data_bytes=0)
    error = refusal(raw_gguf(tmp_path / "hostile.gguf", tuple(kvs), tuple(tensors), **options), rule)
    if limit is not None:
        assert error.details["limit"] == limit
        assert str(limit) in error.message


def test_nested_arrays_are_refused(tmp_path: Path) -> None:
    path = write_custom_gguf(tmp_path / "nested.gguf", block_count=1, embedding_length=16, attention__head_count=2)
    writer = gguf.GGUFWriter(tmp_path / "nested2.gguf", "llama")
    writer.add_array("general.nested", [[1, 2], [3]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read_model_shape(path)  # the same without the nested array is fine
    refusal(tmp_path / "nested2.gguf", "nested_array")


@pytest.fixture(scope="module")
def two_million_strings(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small valid model with a 2,000,000-entry string array in its metadata (REGISTER of it took 55 s)."""
    path = tmp_path_factory.mktemp("big") / "two_million.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("embedding_length", 16), ("attention.head_count", 2)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_array("junk.strings", ["x"] * 2_000_000)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_two_million_entry_array_is_refused_in_well_under_a_second(two_million_strings: Path) -> None:
    start = time.perf_counter()
    error = refusal(two_million_strings, "array_entries")
    elapsed = time.perf_counter() - start
    assert error.details["found"] == 2_000_000 and error.details["limit"] == MAX_ARRAY_ENTRIES
    assert "junk.strings" in error.message
    assert elapsed < 0.5, f"took {elapsed:.3f} s"


def test_arrays_are_skipped_not_built(tmp_path: Path) -> None:
    """A vocabulary-sized string array within the limit is skipped by seeking and keeps nothing."""
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("embedding_length", 16), ("attention.head_count", 2)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(200_000)])
    writer.add_array("tokenizer.ggml.scores", [0.5] * 200_000)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    start = time.perf_counter()
    header = read_header(path)
    elapsed = time.perf_counter() - start
    assert set(header.fields) == {"general.architecture", "llama.block_count", "llama.embedding_length",
                                  "llama.attention.head_count"}
    assert [t.name for t in header.tensors] == ["blk.0.attn_norm.weight"]
    assert elapsed < 1.0, f"took {elapsed:.3f} s"


def test_the_skim_agrees_with_gguf_reader(tmp_path: Path, tiny_model: Path, tiny_model_b: Path) -> None:
    """Tensor offsets, shapes, types and byte sizes as gguf.GGUFReader sees them, quantised tensors included."""
    quantised = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(quantised, "llama")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("attention.head_count", 2)):
        writer.add_uint32(f"llama.{key}", value)
    weights = np.random.default_rng(0).standard_normal((8, 64), dtype=np.float32)
    for name, qtype in (("blk.0.attn_q.weight", gguf.GGMLQuantizationType.Q8_0),
                        ("blk.0.attn_k.weight", gguf.GGMLQuantizationType.Q4_0)):
        writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (tiny_model, tiny_model_b, quantised):
        header = read_header(path)
        reader = gguf.GGUFReader(path)
        expected = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
                    for t in reader.tensors]
        assert [(t.name, t.dims, t.type, header.data_offset + t.offset, t.n_bytes) for t in header.tensors] == expected
        assert read_model_shape(path).weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)


# -- the sanity rules: metadata that llama.cpp aborts on, or that no real model has ------------------------------

@pytest.mark.parametrize(("keys", "rule", "limit", "words"), [
    ({"block_count": 1000}, "limit", MAX_BLOCKS, "block_count = 1000"),
    ({"block_count": 0}, "consistency", None, "block_count is 0"),
    ({"block_count": 3, "blocks_written": 2}, "consistency", None, "no tensors for block 2"),
    ({"expert_count": 100_000, "expert_used_count": 2}, "limit", MAX_EXPERTS, "expert_count = 100000"),
    ({"expert_count": 4, "expert_used_count": 1000}, "limit", MAX_EXPERTS, "expert_used_count = 1000"),
    ({"expert_count": 4, "expert_used_count": 8}, "consistency", 4, "expert_used_count 8"),
    ({"expert_count": 1, "expert_used_count": 0}, "consistency", 1, "expert_used_count 0"),
    ({"expert_count": 0, "expert_used_count": 2}, "consistency", 0, "expert_used_count 2"),
    ({"context_length": 2**32 - 1}, "limit", MAX_CONTEXT, "context_length = 4294967295"),
    ({"attention__head_count": 3}, "consistency", None, "not a multiple of the 3 heads"),
    ({"attention__head_count_kv": 3}, "consistency", None, "not a multiple of 3 KV heads"),
    ({"attention__head_count_kv": 8}, "consistency", None, "not a multiple of 8 KV heads"),
    ({"attention__head_count_kv": [4, 4]}, "consistency", 3, "2 values"),
    ({"attention__head_count": 2**13}, "limit", MAX_HEADS, "head_count = 8192"),
    ({"attention__head_count": 0}, "consistency", None, "head_count is 0"),
    ({"embedding_length": 2**21}, "limit", MAX_EMBEDDING, "embedding_length = 2097152"),
])
def test_implausible_metadata_is_refused(tmp_path: Path, keys: dict[str, Any], rule: str, limit: int | None,
                                         words: str) -> None:
    claims: dict[str, Any] = {"block_count": 3, "embedding_length": 256, "context_length": 1024,
                              "attention__head_count": 4, **keys}
    path = write_custom_gguf(tmp_path / "odd.gguf", **claims)
    error = refusal(path, rule)
    assert words in error.message
    if limit is not None:
        assert error.details["limit"] == limit


def test_a_shape_key_of_the_wrong_type_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "floats.gguf", "llama")
    for key, value in (("block_count", 1), ("embedding_length", 16), ("attention.head_count", 2)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_array("llama.attention.head_count_kv", [1.5])
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "non-integers" in refusal(tmp_path / "floats.gguf", "value_type").message


def test_plausible_moe_and_long_context_metadata_is_accepted(tmp_path: Path) -> None:
    path = write_custom_gguf(tmp_path / "moe.gguf", block_count=2, embedding_length=256, attention__head_count=4,
                             attention__head_count_kv=1, context_length=MAX_CONTEXT, expert_count=MAX_EXPERTS,
                             expert_used_count=8)
    shape = read_model_shape(path)
    assert (shape.n_head_kv, shape.n_ctx_train) == (1, MAX_CONTEXT)
