from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from appliance.engine.gguf_meta import (
    CACHE_TYPE_BYTES,
    Estimate,
    ModelShape,
    estimate,
    is_gguf,
    kv_bytes,
    kv_cells,
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


def write_custom_gguf(path: Path, **arch_keys: int | list[int]) -> Path:
    """A minimal hand-made GGUF: only the keys given, one small tensor."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in arch_keys.items():
        name = f"llama.{key.replace('__', '.')}"
        if isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_uint32(name, value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_load_failed(path: Path) -> ApplianceError:
    with pytest.raises(ApplianceError) as info:
        read_model_shape(path)
    assert info.value.code == "MODEL_LOAD_FAILED"
    assert info.value.details == {"path": str(path)}
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
    assert shape.weight_bytes == 8 * 16 * 4


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
