"""Tiny random-weight models with real tokenizers and real chat templates (the pinned llama-cpp-python sdist's
``ggml-vocab-*.gguf`` and ``templates/*.jinja``, through the ``vendored`` and ``chat_model`` fixtures).

The weights babble, but what the tokenizer does is the real model's: a chat template's markers are one control
token each when text is tokenized with ``special=True`` and several plain tokens with ``special=False``, and the
template's end-of-turn token ends generation.
"""

from __future__ import annotations

import io
import re
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from vendored import (
    VendoredUnavailable,
    below_top,
    cache_folder,
    extract_sdist,
    pinned_version,
    pip_leftovers,
    sdist_name,
    template_path,
    vocab_path,
    wanted,
)

from appliance.engine.chat import Turn, read_chat_template, render_template
from appliance.engine.tinymodel import CHAT_TEMPLATE_KEY, TOKENS_KEY, read_tokenizer

DIM = 64
F16 = 2
MISTRAL_CONTROL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]")


@dataclass(frozen=True)
class Case:
    vocab: str  # ggml-vocab-<vocab>.gguf
    template: str  # templates/<template>.jinja
    markers: tuple[str, ...]  # the control tokens the template writes around turns
    end: str  # the token the template ends a turn with: generation must stop there
    special_tokens: tuple[str, ...] = ()  # what the model's fine-tune added to the base vocabulary


CASES = {
    "qwen2.5": Case("qwen2", "Qwen-Qwen2.5-7B-Instruct", ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    "llama3.1": Case("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct",
                     ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>"),
    # Hermes 3 is Llama 3.1 with ChatML: its fine-tune added <|im_start|> and <|im_end|> (the sdist has its tool-use
    # template only)
    "hermes3": Case("llama-bpe", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", ("<|im_start|>", "<|im_end|>"),
                    "<|im_end|>", ("<|im_start|>", "<|im_end|>")),
    # the sdist has no Tekken vocabulary (Mistral Nemo's): Mistral's SentencePiece one (llama-spm) with the control
    # tokens Mistral added to it stands in
    "mistral-nemo": Case("llama-spm", "mistralai-Mistral-Nemo-Instruct-2407", ("[INST]", "[/INST]"), "</s>",
                         MISTRAL_CONTROL),
    "phi3.5": Case("phi-3", "microsoft-Phi-3.5-mini-instruct", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                   "<|end|>"),
}
CONVERSATION = [Turn("system", "Be terse."), Turn("user", "Hello, who are you?")]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture(scope="module")
def model(case: Case, chat_model: Callable[..., Path]) -> Path:
    return chat_model(case.vocab, case.template, case.special_tokens)


@dataclass(frozen=True)
class Loaded:
    llm: llama_cpp.Llama
    seconds: float


@pytest.fixture(scope="module")
def loaded(model: Path) -> Loaded:
    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=512, verbose=False)
    return Loaded(llm, time.perf_counter() - started)


@pytest.fixture(scope="module")
def llm(loaded: Loaded) -> llama_cpp.Llama:
    return loaded.llm


def vocab_of(llm: llama_cpp.Llama) -> Any:
    return llama_cpp.llama_model_get_vocab(llm._model.model)


def one_token(llm: llama_cpp.Llama, text: str) -> int:
    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    assert len(tokens) == 1, f"{text!r} is {len(tokens)} tokens with special=True: {tokens}"
    return tokens[0]


def spelled(llm: llama_cpp.Llama, tokens: list[int], *, special: bool = False) -> str:
    """The text of ``tokens``, without the space a SentencePiece vocabulary puts before the first word."""
    text = llm.detokenize(tokens, special=special).decode()
    return text.removeprefix(" ") if llm.metadata["tokenizer.ggml.model"] == "llama" else text


def is_control(llm: llama_cpp.Llama, token: int) -> bool:
    return bool(llama_cpp.llama_vocab_get_attr(vocab_of(llm), token) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL)


def test_the_model_loads_with_its_vocabulary_and_embeddings_sized_to_it(case: Case, vendored: Path, model: Path,
                                                                        loaded: Loaded) -> None:
    llm = loaded.llm
    n_vocab = len(read_tokenizer(vocab_path(vendored, case.vocab))[TOKENS_KEY].value) + len(case.special_tokens)
    assert llm.n_vocab() == n_vocab
    assert llm.metadata["llama.block_count"] == "2" and llm.metadata["llama.embedding_length"] == str(DIM)
    embeddings = 2 * n_vocab * DIM * F16  # token_embd and output, f16
    size = model.stat().st_size
    # the rest: the vocab file's metadata, and two 64-wide blocks of well under 1 MB
    assert embeddings < size < embeddings + vocab_path(vendored, case.vocab).stat().st_size + 1_000_000
    print(f"{case.vocab} + {case.template}: {size / 1e6:.1f} MB, loads in {loaded.seconds:.2f} s")


def test_markers_are_one_control_token_with_special_and_plain_text_without(case: Case,
                                                                          llm: llama_cpp.Llama) -> None:
    for marker in case.markers:
        token = one_token(llm, marker)
        assert is_control(llm, token), f"{marker!r} ({token}) is not a control token"
        plain = llm.tokenize(marker.encode(), add_bos=False, special=False)
        assert len(plain) > 1 and token not in plain, f"{marker!r} without special: {plain}"
        assert not any(is_control(llm, t) for t in plain)
        assert spelled(llm, plain) == marker


def test_the_templates_end_token_ends_generation(case: Case, llm: llama_cpp.Llama) -> None:
    vocab = vocab_of(llm)
    assert llama_cpp.llama_vocab_is_eog(vocab, one_token(llm, case.end))
    assert llama_cpp.llama_vocab_is_eog(vocab, llama_cpp.llama_vocab_eos(vocab))
    words = llm.tokenize(b"Hello world", add_bos=False, special=True)
    assert not any(llama_cpp.llama_vocab_is_eog(vocab, t) for t in words)


def test_the_gguf_holds_the_template_file(case: Case, vendored: Path, model: Path, llm: llama_cpp.Llama) -> None:
    text = template_path(vendored, case.template).read_text(encoding="utf-8")
    assert llm.metadata[CHAT_TEMPLATE_KEY] == text
    template = read_chat_template(model)  # the appliance's own bounded reader
    assert template.source == text
    vocab = vocab_of(llm)
    assert template.bos_token.encode() == llm.detokenize([llama_cpp.llama_vocab_bos(vocab)], special=True)
    assert template.eos_token.encode() == llm.detokenize([llama_cpp.llama_vocab_eos(vocab)], special=True)


def test_a_rendered_conversation_tokenizes_its_markers_only_with_special(case: Case, model: Path,
                                                                         llm: llama_cpp.Llama) -> None:
    prompt = render_template(read_chat_template(model), CONVERSATION)
    with_special = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    without = llm.tokenize(prompt.encode(), add_bos=False, special=False)
    for marker in case.markers:
        assert with_special.count(one_token(llm, marker)) == prompt.count(marker) > 0
    assert not any(is_control(llm, t) for t in without)
    assert len(without) > len(with_special)
    assert spelled(llm, without) == prompt
    assert spelled(llm, with_special, special=True) == as_split_by_llama_cpp(llm, prompt, case.markers)


def as_split_by_llama_cpp(llm: llama_cpp.Llama, prompt: str, markers: tuple[str, ...]) -> str:
    """The prompt as its ``special=True`` tokens spell it: llama.cpp gives a SentencePiece vocabulary that adds a
    space prefix (the default) one more space before each piece of text that follows a special token, as it does
    for the real models (a BPE vocabulary spells the prompt exactly)."""
    sentencepiece = llm.metadata["tokenizer.ggml.model"] == "llama"
    if not sentencepiece or llm.metadata.get("tokenizer.ggml.add_space_prefix") == "false":
        return prompt
    marker = "|".join(map(re.escape, markers))
    return re.sub(f"({marker})(?=.)(?!{marker})", r"\1 ", prompt, flags=re.DOTALL)


def test_a_template_file_replaces_the_vocab_files_own_and_every_tokenizer_key_is_copied(
        vendored: Path, chat_model: Callable[..., Path]) -> None:
    source = read_tokenizer(vocab_path(vendored, "phi-3"))
    assert CHAT_TEMPLATE_KEY in source  # ggml-vocab-phi-3.gguf carries a template of its own
    own = read_tokenizer(chat_model("phi-3", None))
    replaced = read_tokenizer(chat_model("phi-3", "microsoft-Phi-3.5-mini-instruct"))
    assert own == source
    assert {k: v for k, v in replaced.items() if k != CHAT_TEMPLATE_KEY} == {
        k: v for k, v in source.items() if k != CHAT_TEMPLATE_KEY}
    text = template_path(vendored, "microsoft-Phi-3.5-mini-instruct").read_text(encoding="utf-8")
    assert replaced[CHAT_TEMPLATE_KEY].value == text.encode() != source[CHAT_TEMPLATE_KEY].value


def test_grammar_constrained_output_follows_the_grammar(chat_model: Callable[..., Path]) -> None:
    llm = llama_cpp.Llama(model_path=str(chat_model("qwen2", "Qwen-Qwen2.5-7B-Instruct")), n_ctx=256, verbose=False)
    grammar = llama_cpp.LlamaGrammar.from_string('root ::= "<" ("yes" | "no") ">"', verbose=False)
    for seed in range(3):
        out = llm.create_completion("yes or no?", max_tokens=8, temperature=1.0, seed=seed, grammar=grammar)
        assert out["choices"][0]["text"] in ("<yes>", "<no>")


# -- the fetcher's pure parts ----------------------------------------------------------------------------------------


def test_only_vocab_files_and_templates_are_wanted() -> None:
    assert wanted("vendor/llama.cpp/models/ggml-vocab-qwen2.gguf") == "ggml-vocab-qwen2.gguf"
    assert wanted("vendor/llama.cpp/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja") == (
        "templates/Qwen-Qwen2.5-7B-Instruct.jinja")
    for other in ("vendor/llama.cpp/models/ggml-vocab-qwen2.gguf.inp", "vendor/llama.cpp/models/templates/README.md",
                  "vendor/llama.cpp/models/ggml-vocab-../../x.gguf", "vendor/llama.cpp/models/x/ggml-vocab-a.gguf",
                  "vendor/llama.cpp/ggml-vocab-a.gguf", "llama_cpp/ggml-vocab-a.gguf", ""):
        assert wanted(other) is None, other
    assert below_top("llama_cpp_python-0.3.36/vendor/llama.cpp/models/x") == "vendor/llama.cpp/models/x"


def test_the_pinned_version_is_read_from_the_dependencies() -> None:
    assert pinned_version(["numpy>=1.26", "llama-cpp-python==0.3.36", "gguf>=0.10"]) == "0.3.36"
    assert pinned_version(["llama_cpp_python == 1.2.3"]) == "1.2.3"
    with pytest.raises(VendoredUnavailable, match="does not pin"):
        pinned_version(["llama-cpp-python>=0.3"])


def test_the_cache_folder_follows_xdg_cache_home(tmp_path: Path) -> None:
    assert cache_folder("0.3.36", {"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "appliance/vendored/0.3.36"
    assert cache_folder("9", {}).parts[-4:] == (".cache", "appliance", "vendored", "9")


def test_pip_leftovers_of_the_version_are_found(tmp_path: Path) -> None:
    found = []
    for folder, version in (("pip-unpack-abc", "0.3.36"), ("pip-unpack-def", "0.3.35"), ("pip-install-x", "0.3.36")):
        sdist = tmp_path / folder / sdist_name(version)
        sdist.parent.mkdir()
        sdist.write_bytes(b"")
        found.append(sdist)
    assert pip_leftovers("0.3.36", tmp_path) == [found[0]]
    assert pip_leftovers("0.3.35", tmp_path) == [found[1]]
    assert pip_leftovers("0.3.34", tmp_path) == []


def test_a_partial_sdist_is_refused_and_a_whole_one_gives_only_the_wanted_files(tmp_path: Path) -> None:
    sdist = tmp_path / sdist_name("9.9")
    with tarfile.open(sdist, "w:gz") as archive:
        for name in ("vendor/llama.cpp/models/ggml-vocab-a.gguf", "vendor/llama.cpp/models/templates/b.jinja",
                     "vendor/llama.cpp/models/templates/README.md", "llama_cpp/llama.py"):
            data = name.encode() * 2000
            info = tarfile.TarInfo(f"llama_cpp_python-9.9/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    whole = tmp_path / "whole"
    (whole / "templates").mkdir(parents=True)
    assert extract_sdist(sdist, whole) == 2
    assert sorted(p.relative_to(whole).as_posix() for p in whole.rglob("*") if p.is_file()) == [
        "ggml-vocab-a.gguf", "templates/b.jinja"]
    assert (whole / "ggml-vocab-a.gguf").read_bytes() == b"vendor/llama.cpp/models/ggml-vocab-a.gguf" * 2000
    partial = tmp_path / "partial.tar.gz"
    partial.write_bytes(sdist.read_bytes()[: sdist.stat().st_size // 2])
    (tmp_path / "cut" / "templates").mkdir(parents=True)
    with pytest.raises(VendoredUnavailable, match="cannot read"):
        extract_sdist(partial, tmp_path / "cut")
