"""llama.cpp's own grammar parser and sampler, on a vocab-only model, to check the grammars the appliance builds
(tests/test_structured.py, tests/test_toolcalls.py).

:meth:`GrammarCheck.accepts` feeds a text's tokens to a grammar sampler, each one only after the sampler allowed it
(llama.cpp aborts the process when a grammar is made to accept a token it refused), and tells whether the whole text
was allowed and, with ``complete``, whether the grammar may end there (the end-of-generation token is allowed).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import llama_cpp

from appliance.engine.interface import Grammar


class GrammarCheck:
    def __init__(self, vocab_file: Path) -> None:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(vocab_file).encode(), params)
        assert self.model, f"cannot load {vocab_file}"
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.eos = llama_cpp.llama_vocab_eos(self.vocab)

    def close(self) -> None:
        llama_cpp.llama_model_free(self.model)

    def tokens(self, text: str, *, special: bool = False) -> list[int]:
        raw = text.encode()
        size = len(raw) + 16
        buffer = (llama_cpp.llama_token * size)()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buffer, size, False, special)
        assert n >= 0, f"cannot tokenize {text[:40]!r}"
        return list(buffer[:n])

    def piece(self, token: int) -> str:
        buffer = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buffer, 256, 0, True)
        return buffer.raw[:n].decode("utf-8", errors="replace")

    @contextmanager
    def sampler(self, grammar: Grammar, *, lazy: bool | None = None) -> Iterator[Any]:
        """A grammar sampler for ``grammar`` (lazy with its triggers unless ``lazy`` is False); fails the test when
        llama.cpp cannot parse it."""
        use_lazy = grammar.lazy if lazy is None else lazy
        gbnf = grammar.gbnf.encode()
        if use_lazy:
            texts = [pattern.encode() for pattern in grammar.trigger_patterns]
            patterns = (ctypes.c_char_p * len(texts))(*texts)
            sampler = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
                self.vocab, gbnf, grammar.root.encode(), patterns, len(grammar.trigger_patterns), None, 0)
        else:
            sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, gbnf, grammar.root.encode())
        assert sampler, f"llama.cpp refused the grammar:\n{grammar.gbnf[:2000]}"
        try:
            yield sampler
        finally:
            llama_cpp.llama_sampler_free(sampler)

    def allowed(self, sampler: Any, token: int) -> bool:
        data = (llama_cpp.llama_token_data * 1)()
        data[0].id = token
        data[0].logit = 0.0
        data[0].p = 0.0
        candidates = llama_cpp.llama_token_data_array(data, 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
        return data[0].logit != float("-inf")

    def feed(self, sampler: Any, tokens: list[int]) -> bool:
        """Accept ``tokens`` one by one while the sampler allows each; False at the first it refuses."""
        for token in tokens:
            if not self.allowed(sampler, token):
                return False
            llama_cpp.llama_sampler_accept(sampler, token)
        return True

    def accepts(self, grammar: Grammar, text: str, *, complete: bool = True, lazy: bool | None = None,
                special: bool = False) -> bool:
        with self.sampler(grammar, lazy=lazy) as sampler:
            if not self.feed(sampler, self.tokens(text, special=special)):
                return False
            return not complete or self.allowed(sampler, self.eos)


def triggered_at(patterns: tuple[str, ...], buffer: str) -> int | None:
    """Where llama.cpp's lazy grammar starts in ``buffer`` (what the model wrote so far): a pattern written ``^...$``
    must match it whole, another is searched; the grammar starts at the first non-empty group (else the match)."""
    for pattern in patterns:
        regex = re.compile(pattern)
        match = regex.fullmatch(buffer) if pattern.startswith("^") and pattern.endswith("$") else regex.search(buffer)
        if match is None:
            continue
        for group in range(1, (regex.groups or 0) + 1):
            if match.group(group):
                return match.start(group)
        return match.start()
    return None
