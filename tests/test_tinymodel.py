from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest

from appliance.engine.tinymodel import BOS_ID, SPACE, build_vocabulary, default_ff, write_tiny_model
from appliance.errors import ApplianceError

MB = 1_000_000


def load(path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False)


def greedy(llm: llama_cpp.Llama, prompt: str, n: int) -> list[int]:
    out: list[int] = []
    for token in llm.generate(llm.tokenize(prompt.encode()), temp=0.0):
        out.append(token)
        if len(out) == n:
            return out
    raise AssertionError("generation stopped early")


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> llama_cpp.Llama:
    return load(tiny_model)


def test_fixture_models_are_gguf_files_of_bounded_size(tiny_model: Path, tiny_model_b: Path) -> None:
    assert tiny_model.read_bytes()[:4] == b"GGUF"
    assert 4 * MB < tiny_model.stat().st_size <= 12 * MB
    assert 0.5 * MB < tiny_model_b.stat().st_size < tiny_model.stat().st_size
    assert not list(tiny_model.parent.glob("*.partial"))


def test_same_arguments_give_identical_bytes_and_seed_changes_them(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", layers=2, dim=128, seed=5)
    b = write_tiny_model(tmp_path / "b.gguf", layers=2, dim=128, seed=5)
    c = write_tiny_model(tmp_path / "c.gguf", layers=2, dim=128, seed=6)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size == c.stat().st_size


def test_f32_matrices_double_the_weights(tmp_path: Path) -> None:
    f16 = write_tiny_model(tmp_path / "h.gguf", layers=1, dim=64).stat().st_size
    f32 = write_tiny_model(tmp_path / "f.gguf", layers=1, dim=64, dtype="f32").stat().st_size
    assert 1.8 < f32 / f16 < 2.1


def test_progress_reports_bytes_up_to_the_total(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    write_tiny_model(tmp_path / "p.gguf", layers=2, dim=64, progress=lambda d, t: calls.append((d, t)))
    done = [d for d, _ in calls]
    total = calls[-1][1]
    assert len(calls) == 2 * 9 + 3  # nine tensors per block, plus embeddings, output norm, output
    assert done == sorted(done) and done[-1] == total
    assert {t for _, t in calls} == {total}


def test_writes_into_missing_directories(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "deep" / "er" / "m.gguf", layers=1, dim=64)
    assert path.is_file() and path.parent.name == "er"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"dim": 100, "heads": 3}, "multiple of heads"),
        ({"dim": 128, "heads": 4, "kv_heads": 3}, "kv_heads"),
        ({"dim": 96, "heads": 32}, "even"),
        ({"layers": 0}, "positive"),
        ({"dtype": "q4_0"}, "dtype"),
    ],
)
def test_invalid_shapes_are_refused_before_writing(tmp_path: Path, kwargs: dict, fragment: str) -> None:
    target = tmp_path / "bad.gguf"
    with pytest.raises(ApplianceError) as info:
        write_tiny_model(target, **kwargs)
    assert info.value.code == "BAD_REQUEST"
    assert fragment in info.value.message
    assert list(tmp_path.iterdir()) == []


def test_default_ff_is_a_multiple_of_32_near_275_percent() -> None:
    assert default_ff(256) == 704
    assert default_ff(768) == 2112
    assert default_ff(100) % 32 == 0 and abs(default_ff(100) - 275) <= 16


def test_vocabulary_layout() -> None:
    vocab = build_vocabulary()
    tokens = vocab.tokens
    assert tokens[:3] == ("<unk>", "<s>", "</s>")
    assert tokens[3] == "<0x00>" and tokens[3 + 0x41] == "<0x41>" and tokens[258] == "<0xFF>"
    assert set(vocab.types[3:259]) == {6}
    assert len(set(tokens)) == len(tokens) == len(vocab.scores) == len(vocab.types)
    assert 300 < len(tokens) < 2000
    pieces = set(tokens[259:])
    assert {SPACE + "the", SPACE + "Hello", "ing", "a", "Z", "7", "?"} <= pieces
    # SentencePiece merges only reach pieces whose prefixes are pieces too
    assert all(p[:-1] in pieces for p in pieces if len(p) > 1)
    # longer pieces score higher, so the longest available merge wins
    score = dict(zip(tokens, vocab.scores, strict=True))
    assert score[SPACE + "Hello"] > score[SPACE + "Hell"] > score[SPACE + "H"] > score["H"]


def test_hello_world_tokenizes_to_whole_words_and_round_trips(llm: llama_cpp.Llama) -> None:
    tokens = llm.tokenize(b"Hello world")
    assert tokens[0] == BOS_ID
    assert [llm.detokenize([t]) for t in tokens[1:]] == [b" Hello", b" world"]
    assert llm.detokenize(tokens) == b"Hello world"


def test_unknown_characters_fall_back_to_bytes(llm: llama_cpp.Llama) -> None:
    text = "h\u00e9llo w\u00f6rld\n42!"
    tokens = llm.tokenize(text.encode())
    assert llm.detokenize(tokens).decode() == text
    assert 0 not in tokens  # never <unk>


def test_greedy_generation_is_deterministic_across_fresh_models(tiny_model: Path) -> None:
    first = greedy(load(tiny_model), "Hello world", 16)
    second = greedy(load(tiny_model), "Hello world", 16)
    assert first == second
    assert len(first) == 16
    assert all(0 <= t < len(build_vocabulary().tokens) for t in first)


def test_completion_text_detokenizes(llm: llama_cpp.Llama) -> None:
    out = llm.create_completion("Once upon a time", max_tokens=8, temperature=0.0)
    assert isinstance(out["choices"][0]["text"], str)
    assert out["usage"]["prompt_tokens"] > 1


def test_other_seeds_and_gqa_models_load_and_generate(tiny_model_b: Path, tmp_path: Path) -> None:
    gqa = write_tiny_model(tmp_path / "gqa.gguf", layers=2, dim=128, heads=4, kv_heads=2, seed=3)
    out_b = greedy(load(tiny_model_b), "Hello world", 8)
    out_gqa = greedy(load(gqa), "Hello world", 8)
    assert len(out_b) == len(out_gqa) == 8
    assert out_b != out_gqa
