from __future__ import annotations

import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import llama_cpp
import pytest

from appliance.engine.chat import read_chat_template
from appliance.engine.tinymodel import (
    BOS_ID,
    CHAT_TEMPLATE_KEY,
    SPACE,
    TOKENS_KEY,
    MetadataValue,
    TokenizerFields,
    build_vocabulary,
    builtin_tokenizer,
    default_ff,
    read_tokenizer,
    with_special_tokens,
    write_tiny_model,
)
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


# -- a tokenizer taken from another GGUF (vocab_from) --------------------------------------------------------------

VT = gguf.GGUFValueType
EXTRA_WORDS = ("▁hellos", "▁worlds")  # their prefixes are pieces already


def vocab_fields() -> TokenizerFields:
    """The built-in vocabulary with two more words, an EOT id, a key llama.cpp ignores and a template of its own."""
    fields = builtin_tokenizer(build_vocabulary())
    tokens = fields[TOKENS_KEY].value
    fields[TOKENS_KEY] = MetadataValue(VT.ARRAY, [*tokens, *(w.encode() for w in EXTRA_WORDS)], VT.STRING)
    fields["tokenizer.ggml.scores"] = MetadataValue(VT.ARRAY, [*fields["tokenizer.ggml.scores"].value, 9.0, 9.0],
                                                    VT.FLOAT32)
    fields["tokenizer.ggml.token_type"] = MetadataValue(VT.ARRAY, [*fields["tokenizer.ggml.token_type"].value, 1, 1],
                                                        VT.INT32)
    fields["tokenizer.ggml.eot_token_id"] = MetadataValue(VT.UINT32, 2)
    fields["tokenizer.ggml.custom"] = MetadataValue(VT.ARRAY, [7, 8, 9], VT.UINT16)
    fields[CHAT_TEMPLATE_KEY] = MetadataValue(VT.STRING, b"{{ messages[0].content }}")
    return fields


def write_vocab(path: Path, fields: TokenizerFields) -> Path:
    """A vocab-only GGUF (no tensors), as llama.cpp's ggml-vocab-*.gguf are."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("a vocabulary")
    for key, field in fields.items():
        writer.add_key_value(key, field.value, field.type, sub_type=field.item_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab(tmp_path_factory.mktemp("vocab") / "ggml-vocab-test.gguf", vocab_fields())


def test_the_default_vocabulary_is_what_the_file_holds(tiny_model: Path) -> None:
    assert read_tokenizer(tiny_model) == builtin_tokenizer(build_vocabulary())


def test_vocab_from_copies_every_tokenizer_key_and_sizes_the_embeddings(tmp_path: Path, vocab_file: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", layers=2, dim=64, vocab_from=vocab_file)
    assert read_tokenizer(model) == vocab_fields()
    n_vocab = len(build_vocabulary().tokens) + len(EXTRA_WORDS)
    default = write_tiny_model(tmp_path / "d.gguf", layers=2, dim=64).stat().st_size
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, verbose=False)
    assert llm.n_vocab() == n_vocab
    assert model.stat().st_size - default >= 2 * len(EXTRA_WORDS) * 64 * 2  # two more rows in both embeddings
    assert [llm.detokenize([t]) for t in llm.tokenize(b"hellos worlds", add_bos=False)] == [b" hellos", b" worlds"]
    assert read_chat_template(model).source == "{{ messages[0].content }}"
    assert len(greedy(llm, "Hello worlds", 4)) == 4


def test_a_given_chat_template_replaces_the_vocab_files_own(tmp_path: Path, vocab_file: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", layers=1, dim=64, vocab_from=vocab_file, chat_template="{{ 1 }}")
    fields = read_tokenizer(model)
    assert fields.pop(CHAT_TEMPLATE_KEY).value == b"{{ 1 }}"
    expected = vocab_fields()
    del expected[CHAT_TEMPLATE_KEY]
    assert fields == expected


def test_special_tokens_are_appended_as_control_tokens(tmp_path: Path, vocab_file: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", layers=1, dim=64, vocab_from=vocab_file,
                             special_tokens=["<|im_start|>", "<|im_end|>"])
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, verbose=False)
    n_vocab = len(build_vocabulary().tokens) + len(EXTRA_WORDS)
    assert llm.n_vocab() == n_vocab + 2
    assert llm.tokenize(b"<|im_start|>", add_bos=False, special=True) == [n_vocab]
    assert llm.tokenize(b"<|im_end|>", add_bos=False, special=True) == [n_vocab + 1]
    assert len(llm.tokenize(b"<|im_start|>", add_bos=False, special=False)) > 1
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    assert llama_cpp.llama_vocab_get_attr(vocab, n_vocab) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    assert llama_cpp.llama_vocab_is_eog(vocab, n_vocab + 1)  # llama.cpp's rule for a control <|im_end|>
    assert not llama_cpp.llama_vocab_is_eog(vocab, n_vocab)


@pytest.mark.parametrize(("texts", "fragment"), [
    (["</s>"], "already in the vocabulary"),
    (["<a>", "<a>"], "given twice"),
    ([""], "empty"),
])
def test_special_tokens_that_are_there_already_twice_or_empty_are_refused(texts: list[str], fragment: str) -> None:
    with pytest.raises(ApplianceError) as info:
        with_special_tokens(builtin_tokenizer(build_vocabulary()), texts)
    assert info.value.code == "BAD_REQUEST" and fragment in info.value.message


def corrupt(fields: TokenizerFields, key: str, value: MetadataValue | None) -> TokenizerFields:
    changed = dict(fields)
    if value is None:
        del changed[key]
    else:
        changed[key] = value
    return changed


def hostile_header(body: bytes, n_kv: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + body


def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def missing(folder: Path) -> Path:
    return folder / "missing.gguf"


def a_folder(folder: Path) -> Path:
    return folder


def not_gguf(folder: Path) -> Path:
    return written(folder / "x.gguf", b"not a model at all")


def without_tokens(folder: Path) -> Path:
    return write_vocab(folder / "x.gguf", corrupt(vocab_fields(), TOKENS_KEY, None))


def without_model(folder: Path) -> Path:
    return write_vocab(folder / "x.gguf", corrupt(vocab_fields(), "tokenizer.ggml.model", None))


def bos_out_of_range(folder: Path) -> Path:
    return write_vocab(folder / "x.gguf", corrupt(vocab_fields(), "tokenizer.ggml.bos_token_id",
                                                  MetadataValue(VT.UINT32, 10**6)))


def one_score(folder: Path) -> Path:
    return write_vocab(folder / "x.gguf", corrupt(vocab_fields(), "tokenizer.ggml.scores",
                                                  MetadataValue(VT.ARRAY, [1.0], VT.FLOAT32)))


def huge_token_count(folder: Path) -> Path:
    return written(folder / "x.gguf", hostile_header(gguf_string(TOKENS_KEY.encode())
                                                     + struct.pack("<IIQ", VT.ARRAY, VT.STRING, 2**62)))


def truncated_token(folder: Path) -> Path:
    tokens = struct.pack("<IIQ", VT.ARRAY, VT.STRING, 3) + gguf_string(b"a") + struct.pack("<Q", 99) + b"b"
    return written(folder / "x.gguf", hostile_header(gguf_string(TOKENS_KEY.encode()) + tokens))


def unknown_type(folder: Path) -> Path:
    return written(folder / "x.gguf", hostile_header(gguf_string(b"tokenizer.x") + struct.pack("<I", 77)))


def huge_key_count(folder: Path) -> Path:
    return written(folder / "x.gguf", hostile_header(b"", n_kv=2**40))


@pytest.mark.parametrize(("make", "fragment"), [
    (missing, "No such file"),
    (a_folder, "Is a directory"),
    (not_gguf, "not a GGUF file"),
    (without_tokens, "has no vocabulary"),
    (without_model, "does not name"),
    (bos_out_of_range, "is not a token"),
    (one_score, "values of type"),
    (huge_token_count, "entries (limit"),
    (truncated_token, "truncated"),
    (unknown_type, "unknown value type"),
    (huge_key_count, "metadata keys (limit"),
])
def test_an_invalid_vocab_file_is_refused_before_anything_is_written(tmp_path: Path, make: Callable[[Path], Path],
                                                                     fragment: str) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    vocab = make(inputs)
    out = tmp_path / "out"
    with pytest.raises(ApplianceError) as info:
        write_tiny_model(out / "m.gguf", layers=1, dim=64, vocab_from=vocab)
    assert info.value.code == "BAD_REQUEST"
    assert fragment in info.value.message and str(vocab) in info.value.message
    assert info.value.details["vocab"] == str(vocab)
    assert not out.exists()


def make_tiny(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance", "models", "make-tiny", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_make_tiny_takes_a_vocab_a_template_and_special_tokens(tmp_path: Path, vocab_file: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    out = tmp_path / "m.gguf"
    result = make_tiny(str(out), "--layers", "1", "--dim", "64", "--vocab", str(vocab_file), "--chat-template",
                       str(template), "--special-token", "<|im_start|>", "--special-token", "<|im_end|>")
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout
    fields = read_tokenizer(out)
    assert fields[CHAT_TEMPLATE_KEY].value == template.read_bytes()
    assert fields[TOKENS_KEY].value[-2:] == [b"<|im_start|>", b"<|im_end|>"]
    assert fields["tokenizer.ggml.eot_token_id"] == vocab_fields()["tokenizer.ggml.eot_token_id"]


@pytest.mark.parametrize(("which", "fragment"), [
    ("vocab", "invalid vocab file"),
    ("chat-template", "cannot read the chat template"),
])
def test_cli_make_tiny_refuses_a_missing_file_in_one_line(tmp_path: Path, vocab_file: Path, which: str,
                                                          fragment: str) -> None:
    missing = tmp_path / "missing"
    files = {"vocab": vocab_file, "chat-template": None, which: missing}
    args = [arg for name, path in files.items() if path is not None for arg in (f"--{name}", str(path))]
    result = make_tiny(str(tmp_path / "m.gguf"), *args)
    assert result.returncode == 1
    assert result.stderr.startswith(f"appliance: BAD_REQUEST: {fragment} {missing}")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "m.gguf").exists()
