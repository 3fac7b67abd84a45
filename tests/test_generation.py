"""What a generation streams, where it stops and what it leaves behind (issue #8, "Inputs" and "Streams").

The rules (``Runtime.generate``'s docstring; the fake runtime keeps them too): the streamed tokens' texts joined are
always the final text (incomplete UTF-8 at the end and text from a stop string on are in neither), ``max_tokens``
clamps to the room left in the context with ``"length"``, a prompt whose byte size shows it cannot fit is refused
before it is tokenized, and a cancelled (or failed) generation leaves the conversation as it was before the request.

The first half runs the real llama.cpp runtime on the tiny model, the second the daemon core on a fake engine.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.config.validate import parse_config
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.engine.bindings import llama_cpp  # the C API the engine calls (patched below)
from appliance.engine.fake import BOS, EOS, LONGEST_PIECE, FakeEngine, ManualClock, next_token
from appliance.engine.runtime import GREEDY, Conversation, Engine, Generation, Runtime, Sampling, Token
from appliance.engine.streamtext import StreamText
from appliance.errors import ApplianceError

SAMPLED = 200  # seeds of the sampled-stream test; before the fix about 1 in 15 of them ended differently


@pytest.fixture(scope="module")
def runtime(tiny_model: Path) -> Iterator[Runtime]:
    rt = Engine(1).load(tiny_model, n_ctx=256, n_gpu_layers=0)
    yield rt
    rt.close()


def fresh(rt: Runtime) -> Conversation:
    """A new conversation (the live ones are dropped: nothing to borrow a prefix from)."""
    for conv in rt.live:
        rt.detach(conv)
    return Conversation()


def streamed(rt: Runtime, conv: Conversation, prompt: str, n: int, sampling: Sampling = GREEDY,
             cancelled: Callable[[], bool] | None = None) -> tuple[Generation, list[Token]]:
    tokens: list[Token] = []
    generation = rt.generate(conv, prompt, n, sampling, tokens.append, cancelled)
    return generation, tokens


def joined(tokens: list[Token]) -> str:
    return "".join(token.text for token in tokens)


def kv_end(rt: Runtime, conv: Conversation) -> int:
    """One past the last position the conversation's sequence holds in the live KV cells."""
    assert rt.context is not None and conv.seq is not None
    return int(llama_cpp.llama_memory_seq_pos_max(rt.context.memory, conv.seq)) + 1


def cells(rt: Runtime, conv: Conversation) -> int:
    assert rt.context is not None and conv.seq is not None
    return rt.context.cells(conv.seq)


def after(count: int) -> Callable[[], bool]:
    """A ``cancelled`` callback that says yes from its ``count + 1``-th question on (``count`` tokens made)."""
    asked = [0]

    def cancelled() -> bool:
        asked[0] += 1
        return asked[0] > count

    return cancelled


# -- stream text == final text -----------------------------------------------------------------------------------------

def test_sampled_streams_always_join_to_the_final_text(runtime: Runtime) -> None:
    incomplete_ends = 0
    for seed in range(SAMPLED):
        conv = fresh(runtime)
        generation, tokens = streamed(runtime, conv, "Hello", 24, Sampling(temperature=0.8, seed=seed))
        assert joined(tokens) == generation.text, f"seed {seed}"
        raw = b"".join(runtime.piece(t) for t in generation.tokens)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        assert generation.text == decoder.decode(raw), f"seed {seed}"  # everything but an incomplete end
        incomplete_ends += decoder.getstate()[0] != b""
    assert incomplete_ends >= 3  # the case the old final flush turned into a U+FFFD no token carried


def test_a_continuation_completes_the_character_the_previous_generation_left_open(runtime: Runtime) -> None:
    checked = 0
    for seed in range(SAMPLED):
        conv = fresh(runtime)
        sampling = Sampling(temperature=0.8, seed=seed)
        first = runtime.generate(conv, "Hello", 24, sampling)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(b"".join(runtime.piece(t) for t in first.tokens))
        if decoder.getstate()[0] == b"":
            continue
        second, tokens = streamed(runtime, conv, "", 12, sampling)
        assert joined(tokens) == second.text
        raw = b"".join(runtime.piece(t) for t in first.tokens + second.tokens)
        assert first.text + second.text == codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw)
        checked += 1
    assert checked >= 3


def test_a_stop_string_is_neither_streamed_nor_in_the_text(runtime: Runtime) -> None:
    conv = fresh(runtime)
    full = runtime.generate(conv, "Hello", 40, GREEDY).text
    assert len(full) > 30
    for start, size in ((3, 2), (10, 4), (20, 6), (len(full) - 3, 3)):
        stop = full[start:start + size]
        generation, tokens = streamed(runtime, fresh(runtime), "Hello", 40, Sampling(stop=("\x00never", stop)))
        assert generation.stop_reason == "stop"
        assert joined(tokens) == generation.text == full[:full.find(stop)]
    # The beginning of a stop string that never completes is held back only until it cannot be one, and text
    # held back when the length limit comes is streamed with the last token.
    for stop in (full[5:9] + "\x00", full[-4:] + "\x00"):
        generation, tokens = streamed(runtime, fresh(runtime), "Hello", 40, Sampling(stop=(stop,)))
        assert generation.stop_reason == "length"
        assert joined(tokens) == generation.text == full


# -- the context ---------------------------------------------------------------------------------------------------

def test_max_tokens_clamps_to_the_room_left_in_the_context(runtime: Runtime) -> None:
    n_ctx = runtime.n_ctx
    conv = fresh(runtime)
    prompt = len(runtime.tokenize("Hello world", bos=True))
    generation = runtime.generate(conv, "Hello world", n_ctx + 1000, GREEDY)
    assert generation.stop_reason == "length"  # not CONTEXT_OVERFLOW
    assert generation.generated_tokens == n_ctx - prompt and len(conv.tokens) == n_ctx
    with pytest.raises(ApplianceError) as info:
        runtime.generate(conv, "", 1, GREEDY)
    assert info.value.code == "CONTEXT_OVERFLOW"
    assert info.value.details == {"n_ctx": n_ctx, "context_tokens": n_ctx, "prompt_tokens": 0, "requested_tokens": 1}
    conv = fresh(runtime)
    runtime.generate(conv, "Hello", 10, GREEDY)
    before = list(conv.tokens)
    with pytest.raises(ApplianceError) as info:  # a prompt that leaves no room for one new token
        runtime.generate(conv, " the" * n_ctx, 1, GREEDY)
    assert info.value.code == "CONTEXT_OVERFLOW" and info.value.details["prompt_tokens"] >= n_ctx - len(before)
    assert conv.tokens == before  # refused before anything changed
    assert runtime.generate(conv, " the" * (n_ctx - len(before) - 4), 100, GREEDY).stop_reason == "length"
    assert len(conv.tokens) == n_ctx


def test_a_context_below_llama_cpps_minimum_is_bounded_by_the_configured_size(tiny_model: Path) -> None:
    """llama.cpp rounds a 64-token context up to 256; the conversation is still bounded by the 64 configured
    (a longer prompt is CONTEXT_OVERFLOW, not a crash in the token buffer)."""
    small = Engine(1).load(tiny_model, n_ctx=64, n_gpu_layers=0)
    try:
        assert small.n_ctx == 64
        with pytest.raises(ApplianceError) as info:
            small.generate(fresh(small), " the" * 100, 4, GREEDY)
        assert info.value.code == "CONTEXT_OVERFLOW" and info.value.details["n_ctx"] == 64
        conv = fresh(small)
        assert small.generate(conv, " the" * 40, 100, GREEDY).stop_reason == "length"
        assert len(conv.tokens) == 64
    finally:
        small.close()


def test_the_longest_piece_bounds_the_prompt_bytes(runtime: Runtime) -> None:
    vocab = runtime.weights.n_vocab
    assert runtime.longest_piece == max(len(runtime.piece(t)) for t in range(vocab))
    for text in ("Hello world", " the" * 50, "thethethe" * 20, "éü€😀 " * 20, "Hello" * 40):
        tokens = runtime.tokenize(text, bos=False)
        assert len(tokens) * runtime.longest_piece >= len(text.encode())


def test_a_huge_prompt_is_refused_by_its_size_without_being_tokenized(runtime: Runtime,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    conv = fresh(runtime)
    runtime.generate(conv, "Hello", 4, GREEDY)
    calls: list[int] = []
    real = runtime.weights.tokenize

    def counting(text: str, *args: Any, **kwargs: Any) -> list[int]:
        calls.append(len(text.encode()))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(runtime.weights, "tokenize", counting)
    huge = "hello world " * 1_000_000  # 12 MB: 2 million tokens, 4 s and 500 MB to tokenize on this model
    start = time.perf_counter()
    with pytest.raises(ApplianceError) as info:
        runtime.generate(conv, huge, 4, GREEDY)
    assert time.perf_counter() - start < 0.5
    limit = (256 - len(conv.tokens) - 1) * runtime.longest_piece
    assert info.value.code == "CONTEXT_OVERFLOW" and calls == []
    assert info.value.details == {"n_ctx": 256, "context_tokens": len(conv.tokens), "prompt_bytes": 12_000_000,
                                  "max_prompt_bytes": limit}
    with pytest.raises(ApplianceError) as info:  # at the bound: tokenized, and refused by its tokens
        runtime.generate(conv, "x" * limit, 4, GREEDY)
    assert info.value.code == "CONTEXT_OVERFLOW" and "prompt_tokens" in info.value.details and calls == [limit]
    assert runtime.generate(conv, " world", 2, GREEDY).generated_tokens == 2  # the conversation is intact


# -- cancelled means never sent ------------------------------------------------------------------------------------

def test_a_cancelled_generation_leaves_the_conversation_as_before(runtime: Runtime) -> None:
    reference = fresh(runtime)
    runtime.generate(reference, "Hello", 8, GREEDY)
    expected = runtime.generate(reference, " world", 12, GREEDY)
    expected_tokens = list(reference.tokens)

    for prompt in (" story", ""):
        conv = fresh(runtime)
        runtime.generate(conv, "Hello", 8, GREEDY)
        before = list(conv.tokens)
        cancelled = runtime.generate(conv, prompt, 40, Sampling(temperature=0.8, seed=3), cancelled=after(5))
        assert cancelled.stop_reason == "cancelled" and cancelled.generated_tokens == 5
        assert conv.tokens == before and conv.n_evaluated == cells(runtime, conv) <= len(before)
        assert kv_end(runtime, conv) == cells(runtime, conv)  # no KV cell of the cancelled request is left
        again = runtime.generate(conv, " world", 12, GREEDY)
        assert (again.text, again.tokens, conv.tokens) == (expected.text, expected.tokens, expected_tokens)

    conv = fresh(runtime)  # cancelled before its first token (the prompt itself is taken back too)
    runtime.generate(conv, "Hello", 8, GREEDY)
    before = list(conv.tokens)
    nothing = runtime.generate(conv, " world", 12, GREEDY, cancelled=after(0))
    assert nothing.generated_tokens == 0 and conv.tokens == before
    assert runtime.generate(conv, " world", 12, GREEDY).tokens == expected.tokens


def test_a_failed_generation_leaves_the_conversation_as_before(runtime: Runtime) -> None:
    conv = fresh(runtime)
    runtime.generate(conv, "Hello", 8, GREEDY)
    before = list(conv.tokens)

    def broken(token: Token) -> None:
        if token.index == 3:
            raise OSError("the sink broke")

    with pytest.raises(OSError):
        runtime.generate(conv, " world", 12, GREEDY, on_token=broken)
    assert conv.tokens == before and kv_end(runtime, conv) == cells(runtime, conv) == conv.n_evaluated


def test_a_decode_failure_is_internal_without_its_text(runtime: Runtime, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    conv = fresh(runtime)
    runtime.generate(conv, "Hello", 4, GREEDY)
    before = list(conv.tokens)

    def failing(ctx: Any, batch: Any) -> int:
        return -3

    monkeypatch.setattr(llama_cpp, "llama_decode", failing)
    with pytest.raises(ApplianceError) as info:
        runtime.generate(conv, " world", 4, GREEDY)
    error = info.value.to_dict()
    assert error["code"] == "INTERNAL" and error["retryable"] is False and "secret" not in str(error)
    assert "llama_decode returned -3" in caplog.text  # the operator's log has it
    assert conv.tokens == before


def test_stream_text_holds_back_only_what_could_begin_a_stop_string() -> None:
    text = StreamText(("END", "xyz"))
    assert [text.push(piece.encode()) for piece in ("ab", "cE", "N", "x", "D!")] == ["ab", "c", "", "EN", "xD!"]
    assert [text.push(b"xy"), text.flush()] == ["", "xy"] and not text.stopped and text.text == "abcENxD!xy"
    text = StreamText(("END",))
    assert [text.push(piece.encode()) for piece in ("aE", "NDb")] == ["a", ""] and text.stopped
    assert text.text == "a"
    text = StreamText()  # "é" split over two tokens, then an end in the middle of "€"
    assert [text.push(b) for b in (b"a\xc3", b"\xa9", b"\xe2\x82")] == ["a", "é", ""] and text.flush() == ""
    assert text.text == "aé"
    assert StreamText(primer=b"x\xe2\x82").push(b"\xac") == "€"
    assert StreamText(("",)).push(b"ab") == "ab"  # an empty stop string means nothing


# -- the fake runtime, through the daemon core ---------------------------------------------------------------------

@dataclass
class Env:
    daemon: Daemon
    engine: FakeEngine


def run(tmp_path: Path, body: Callable[[Env], Awaitable[None]], n_ctx: int = 64) -> None:
    doc = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tmp_path)],
           "resync_interval_s": 0,
           "models": [{"name": "m", "path": str(tmp_path / "m.gguf"), "vram_bytes": "1GiB", "n_ctx": n_ctx}]}
    config = parse_config(yaml.safe_dump(doc), base_dir=tmp_path, check_files=False)
    engine = FakeEngine()
    env = Env(Daemon(config, FakeDevice("8GiB", process_used=0), engine, clock=ManualClock()), engine)

    async def main() -> None:
        try:
            await body(env)
        finally:
            engine.gate.open()
            await env.daemon.close()

    asyncio.run(asyncio.wait_for(main(), 30))


async def error_of(awaitable: Awaitable[Any]) -> ApplianceError:
    with pytest.raises(ApplianceError) as info:
        await awaitable
    return info.value


def fake_tokens(tokens: list[int], n: int) -> list[int]:
    """The fake model's next ``n`` tokens after ``tokens``."""
    out = list(tokens)
    for _ in range(n):
        out.append(next_token(out))
    return out[len(tokens):]


def test_fake_max_tokens_clamps_and_huge_prompts_are_refused_by_size(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon = env.daemon
        agent = await daemon.register("a", "m")
        result = await daemon.decode("a", 1000, "Hello")
        assert result.generation.stop_reason == "length" and result.generation.generated_tokens == 64 - 6
        assert len(agent.conversation.tokens) == 64
        error = await error_of(daemon.decode("a", 1, ""))
        assert error.code == "CONTEXT_OVERFLOW" and error.details["context_tokens"] == 64
        error = await error_of(daemon.complete("m", 5, "x" * 10_000_000))
        assert error.code == "CONTEXT_OVERFLOW" and error.details == {
            "n_ctx": 64, "context_tokens": 0, "prompt_bytes": 10_000_000, "max_prompt_bytes": 63 * LONGEST_PIECE}
        error = await error_of(daemon.complete("m", 5, "x" * 63))  # fits the byte bound, not the tokens
        assert error.code == "CONTEXT_OVERFLOW" and error.details["prompt_tokens"] == 64
        assert (await daemon.complete("m", 5, "x" * 62)).generation.generated_tokens == 1

    run(tmp_path, body)


def test_fake_cancel_rolls_the_conversation_back(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, gate = env.daemon, env.engine.gate
        agent = await daemon.register("a", "m")
        await daemon.decode("a", 4, "Hello")
        before = list(agent.conversation.tokens)
        gate.close()
        gate.release(3)
        cancel = threading.Event()
        job = asyncio.create_task(daemon.decode("a", 40, " more", cancel=cancel))
        await gate.arrival(4 + 4)  # (after the first decode's 4) three tokens made, the fourth held
        cancel.set()
        result = await job
        assert result.generation.stop_reason == "cancelled" and result.generation.generated_tokens == 3
        assert agent.conversation.tokens == before and agent.conversation.n_evaluated <= len(before)
        gate.open()
        again = await daemon.decode("a", 5, "")  # continues as if the cancelled request had never been sent
        assert list(again.generation.tokens) == fake_tokens(before, 5)
        assert agent.conversation.tokens == before + fake_tokens(before, 5)

    run(tmp_path, body, n_ctx=256)


def test_fake_streams_equal_the_text_with_stop_strings_and_eos(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        full = "".join(chr(t) for t in fake_tokens([BOS, *map(ord, "Hello")], 30))
        cases = [((full[4:7],), 30, "stop", full[:full.find(full[4:7])]),
                 ((full[10:12] + "\x00",), 30, "length", full),
                 ((full[-2:] + "\x00",), 30, "length", full)]
        for stop, n, reason, text in cases:
            tokens: list[Token] = []
            result = await daemon.complete("m", n, "Hello", Sampling(stop=stop), tokens.append)
            assert result.generation.stop_reason == reason and joined(tokens) == result.generation.text == text
        # The model ends while the beginning of a stop string is held back: it is streamed with the EOS token.
        engine.eos_when = lambda tokens: len(tokens) >= 1 + len("Hello") + 12
        tokens = []
        result = await daemon.complete("m", 30, "Hello", Sampling(stop=(full[10:12] + "\x00",)), tokens.append)
        assert result.generation.stop_reason == "eos" and joined(tokens) == result.generation.text == full[:12]
        assert tokens[-1].id == EOS and tokens[-1].text == full[10:12]

    run(tmp_path, body)
