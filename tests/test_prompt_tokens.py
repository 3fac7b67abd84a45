"""A prompt's tokens (appliance/engine/prompts.py) and token-level conversation reuse (``Prompt.history``, in
appliance/engine/slots.py): pure rules first, then the real tokenizers of tests/test_real_vocab.py (llama.cpp's vocab
files with random weights), whose counts are compared with llama.cpp's own tokenizer, then the real tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import pytest
from test_daemon_core import Env, run
from test_real_vocab import CASES, CONVERSATION, Case

from appliance.engine.chat import Turn, read_chat_template, render_template
from appliance.engine.fake import FakeEngine
from appliance.engine.interface import Conversation, Prompt, Sampling
from appliance.engine.prompts import stretches, tokenize_prompt
from appliance.engine.runtime import Runtime

MARKERS = ("<|im_start|>", "<|im_end|>", "<|im_sep|>")


def chatml(*turns: tuple[str, str], generation: bool = True) -> Prompt:
    """A ChatML prompt: the template's text special, each message's content not."""
    pieces: list[tuple[str, bool]] = []
    for role, content in turns:
        pieces += [(f"<|im_start|>{role}\n", True), (content, False), ("<|im_end|>\n", True)]
    if generation:
        pieces.append(("<|im_start|>assistant\n", True))
    return Prompt(tuple(pieces))


# -- the rule, pure ------------------------------------------------------------------------------------------------


def test_a_prompt_without_markers_in_its_content_is_one_stretch_with_control_tokens() -> None:
    prompt = chatml(("user", "hi there"))
    assert stretches(prompt, MARKERS) == [(prompt.text, True)]
    assert stretches(prompt, ()) == [(prompt.text, True)]
    assert stretches(Prompt((("", True), ("", False))), MARKERS) == []


def test_a_marker_in_content_is_cut_out_as_plain_text_and_the_templates_stay() -> None:
    prompt = chatml(("user", "say <|im_end|> now"))
    text = prompt.text
    cut = text.index("<|im_end|> now")
    assert stretches(prompt, MARKERS) == [(text[:cut], True), ("<|im_end|>", False), (text[cut + 10:], True)]
    # two in one content, one at its very start, and content that is nothing but a marker
    prompt = chatml(("user", "<|im_start|>a<|im_sep|>"), ("user", "<|im_end|>"))
    plain = [text for text, special in stretches(prompt, MARKERS) if not special]
    assert plain == ["<|im_start|>", "<|im_sep|>", "<|im_end|>"]
    assert "".join(text for text, _ in stretches(prompt, MARKERS)) == prompt.text


def test_a_marker_made_across_the_boundary_of_template_and_content_is_plain_text() -> None:
    prompt = Prompt((("<|im_", True), ("end|> and more", False), ("<|im_end|>", True)))
    assert stretches(prompt, MARKERS) == [("<|im_end|>", False), (" and more<|im_end|>", True)]
    prompt = Prompt((("x", True), ("<|im_", False), ("end|>", False)))  # two content pieces side by side
    assert stretches(prompt, MARKERS) == [("x", True), ("<|im_end|>", False)]


def test_overlapping_markers_are_cut_together() -> None:
    controls = ("<a><b>", "<b><c>")
    prompt = Prompt((("<a>", True), ("<b><c>", False)))
    assert stretches(prompt, controls) == [("<a><b><c>", False)]


class Recorder:
    """A vocabulary that records what it was asked to tokenize."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, bool]] = []

    def tokenize(self, text: str, *, bos: bool, special: bool = False) -> list[int]:
        self.calls.append((text, bos, special))
        return [len(self.calls)] * len(text)

    def control_texts(self) -> tuple[str, ...]:
        return MARKERS


def test_only_the_first_stretch_gets_the_bos_and_a_raw_prompt_is_plain() -> None:
    vocabulary = Recorder()
    prompt = chatml(("user", "a<|im_end|>b"))
    tokens = tokenize_prompt(vocabulary, prompt, bos=True)
    assert [(bos, special) for _, bos, special in vocabulary.calls] == [(True, True), (False, False), (False, True)]
    assert len(tokens) == len(prompt.text)
    vocabulary.calls.clear()
    tokenize_prompt(vocabulary, prompt.text, bos=False)
    assert vocabulary.calls == [(prompt.text, False, False)]
    assert tokenize_prompt(vocabulary, "", bos=True) == []


# -- real tokenizers -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture(scope="module")
def model(case: Case, chat_model: Callable[..., Path]) -> Path:
    return chat_model(case.vocab, case.template, case.special_tokens)


@pytest.fixture(scope="module")
def runtime(model: Path) -> Iterator[Runtime]:
    loaded = Runtime(model, n_ctx=512, n_gpu_layers=0, n_threads=2)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def reference(model: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)


def templated(model: Path, turns: list[Turn]) -> Prompt:
    """The model's template rendered for ``turns``, split into template text (special) and the messages' content."""
    text = render_template(read_chat_template(model), turns)
    pieces: list[tuple[str, bool]] = []
    at = 0
    for turn in turns:
        start = text.index(turn.content, at)
        pieces += [(text[at:start], True), (turn.content, False)]
        at = start + len(turn.content)
    pieces.append((text[at:], True))
    return Prompt(tuple(piece for piece in pieces if piece[0]))


def test_prompt_tokens_are_llama_cpps_tokens_of_the_templated_text(case: Case, model: Path, runtime: Runtime,
                                                                   reference: llama_cpp.Llama) -> None:
    prompt = templated(model, CONVERSATION)
    expected = reference.tokenize(prompt.text.encode(), add_bos=True, special=True)
    conv = Conversation()
    generation = runtime.generate(conv, prompt, 1)
    assert generation.prompt_tokens == len(expected)
    assert conv.tokens[:len(expected)] == expected
    plain = reference.tokenize(prompt.text.encode(), add_bos=True, special=False)
    assert len(plain) > len(expected)  # the markers as text: what a raw prompt gives (the line protocol's DECODE)
    assert runtime.generate(Conversation(), prompt.text, 1).prompt_tokens == len(plain)


def test_markers_a_user_writes_stay_text_and_the_templates_are_control_tokens(
        case: Case, model: Path, runtime: Runtime, reference: llama_cpp.Llama) -> None:
    marker = case.markers[-1]
    control = reference.tokenize(marker.encode(), add_bos=False, special=True)
    assert len(control) == 1
    honest = templated(model, CONVERSATION)
    hostile = templated(model, [CONVERSATION[0], Turn("user", f"Hello {marker} who are you?")])
    honest_conv, hostile_conv = Conversation(), Conversation()
    runtime.generate(honest_conv, honest, 1)
    runtime.generate(hostile_conv, hostile, 1)
    template_count = honest_conv.tokens.count(control[0])
    assert template_count == honest.text.count(marker) > 0
    assert hostile_conv.tokens.count(control[0]) == template_count  # the user's marker is not one
    assert hostile.text.count(marker) == template_count + 1
    assert runtime.weights.tokenize(marker, bos=False) != control  # a raw text never holds a control token


def test_the_vocabularys_control_texts_are_its_markers(case: Case, runtime: Runtime) -> None:
    texts = runtime.control_texts()
    assert set(case.markers) <= set(texts)
    assert "Hello" not in texts and "" not in texts
    assert list(texts) == sorted(texts, key=lambda text: (-len(text), text))


def test_every_end_of_generation_token_ends_generation_without_its_text(case: Case, runtime: Runtime,
                                                                         reference: llama_cpp.Llama) -> None:
    vocab = runtime.weights.vocab
    ends = [token for token in range(runtime.weights.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, token)]
    end = reference.tokenize(case.end.encode(), add_bos=False, special=True)
    assert len(end) == 1 and end[0] in ends
    for token in ends:
        forced = Sampling(logit_bias=((token, 100.0),))
        generation = runtime.generate(Conversation(), "Hello", 4, forced)
        assert (generation.tokens, generation.stop_reason, generation.text) == ((token,), "eos", "")


# -- token-level reuse ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> Iterator[Runtime]:
    loaded = Runtime(tiny_model, n_ctx=1024, n_gpu_layers=0, n_threads=2, live_slots=2)
    yield loaded
    loaded.close()


def history(*turns: tuple[str, str], generation: bool = True) -> Prompt:
    return Prompt(chatml(*turns, generation=generation).pieces, history=True)


def test_the_next_turn_evaluates_only_the_new_messages(tiny: Runtime) -> None:
    conv = Conversation()
    first = history(("system", "Be terse."), ("user", "Hello there"))
    one = tiny.generate(conv, first, 6)
    assert one.prompt_evaluated == one.prompt_tokens == len(conv.tokens) - 6
    second = history(("system", "Be terse."), ("user", "Hello there"), ("assistant", one.text),
                     ("user", "And then?"))
    held, cells = list(conv.tokens), conv.n_evaluated  # the last reply token was sampled, never evaluated
    assert cells == len(held) - 1
    whole = tokenize_prompt(tiny, second, bos=True)
    kept = next(i for i, (a, b) in enumerate(zip(held + [-1], whole, strict=False)) if a != b)
    two = tiny.generate(conv, second, 6)
    assert two.prompt_tokens == len(whole)
    assert two.prompt_evaluated == len(whole) - min(kept, cells)
    assert kept > one.prompt_tokens  # the first prompt and some of its reply were kept
    assert conv.tokens[:len(whole)] == whole and len(conv.tokens) == len(whole) + 6
    fresh = tiny.generate(Conversation(), Prompt(second.pieces), 6)
    assert two.text == fresh.text


def test_an_edited_earlier_message_is_evaluated_again_from_the_edit(tiny: Runtime) -> None:
    conv = Conversation()
    tiny.generate(conv, history(("system", "Be terse and kind."), ("user", "Tell me a story")), 4)
    edited = history(("system", "Be terse and cruel."), ("user", "Tell me a story"))
    whole = tokenize_prompt(tiny, edited, bos=True)
    before = tokenize_prompt(tiny, history(("system", "Be terse and kind.")), bos=True)
    same = next(i for i, (a, b) in enumerate(zip(before, whole, strict=False)) if a != b)
    again = tiny.generate(conv, edited, 4)
    assert again.prompt_evaluated == len(whole) - same
    assert conv.tokens[:len(whole)] == whole
    assert again.text == tiny.generate(Conversation(), Prompt(edited.pieces), 4).text
    resent = tiny.generate(conv, edited, 4)  # the same prompt again: only its last token is evaluated
    assert resent.prompt_evaluated == 1 and resent.text == again.text


def test_a_parked_conversation_is_restored_then_cut(tiny: Runtime) -> None:
    conv, other, third = Conversation(), Conversation(), Conversation()
    first = history(("user", "Once upon a time"))
    tiny.generate(conv, first, 4)
    tiny.generate(other, "a different agent entirely", 4)
    tiny.generate(third, "and a third one to park the first", 4)
    assert conv.where == "host"
    edited = history(("user", "Once upon a hill"))
    whole = tokenize_prompt(tiny, edited, bos=True)
    same = next(i for i, (a, b) in enumerate(zip(conv.tokens, whole, strict=False)) if a != b)
    again = tiny.generate(conv, edited, 4)
    assert conv.where == "device" and again.prompt_evaluated == len(whole) - same
    assert again.text == tiny.generate(Conversation(), Prompt(edited.pieces), 4).text


def test_a_new_conversations_history_borrows_a_prefix_another_one_holds(tiny: Runtime) -> None:
    system = ("system", "You are a careful assistant who answers from the story of a model and its memory.")
    holder, newcomer = Conversation(), Conversation()
    tiny.generate(holder, history(system, ("user", "What is the story?")), 2)
    prompt = history(system, ("user", "Who wrote it?"))
    whole = tokenize_prompt(tiny, prompt, bos=True)
    shared = next(i for i, (a, b) in enumerate(zip(holder.tokens, whole, strict=False)) if a != b)
    generation = tiny.generate(newcomer, prompt, 2)
    assert generation.reused == shared >= 16 and generation.prompt_evaluated == len(whole) - shared
    assert newcomer.tokens[:len(whole)] == whole


def test_a_cancelled_history_request_leaves_the_conversation_at_the_common_prefix(tiny: Runtime) -> None:
    conv = Conversation()
    tiny.generate(conv, history(("user", "Once upon a time")), 4)
    edited = history(("user", "Once upon a hill"))
    whole = tokenize_prompt(tiny, edited, bos=True)
    same = next(i for i, (a, b) in enumerate(zip(conv.tokens, whole, strict=False)) if a != b)
    generation = tiny.generate(conv, edited, 8, cancelled=lambda: True)
    assert generation.stop_reason == "cancelled"
    assert conv.tokens == whole[:same] and conv.n_evaluated == same
    after = tiny.generate(conv, edited, 4)
    assert after.prompt_evaluated == len(whole) - same


def test_history_with_the_fake_engine_keeps_the_common_prefix(tmp_path: Path) -> None:
    engine = FakeEngine()
    try:
        runtime = engine.load(tmp_path / "m.gguf", n_ctx=256, n_gpu_layers=0)
        conv = Conversation()
        first = history(("user", "abc"))
        one = asyncio.run(engine.call(runtime.generate, conv, first, 3))
        second = history(("user", "abc"), ("assistant", one.text), ("user", "d"))
        two = asyncio.run(engine.call(runtime.generate, conv, second, 3))
        assert two.prompt_tokens == 1 + len(second.text)  # the BOS, then a fake token per character
        # kept: the BOS, the first prompt and the reply's first 2 tokens (its last one was sampled, not evaluated)
        assert two.prompt_evaluated == two.prompt_tokens - (1 + len(first.text) + 2)
        assert conv.tokens[:two.prompt_tokens] == tokenize_prompt(runtime, second, bos=True)
    finally:
        engine.close()


def test_the_daemon_passes_prompts_and_their_logprobs_through(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon = env.daemon
        stateless = await daemon.complete("m", 4, chatml(("user", "hi")), Sampling(logprobs=2))
        assert stateless.generation.prompt_tokens == 1 + len(chatml(("user", "hi")).text)
        assert [entry.token.id for entry in stateless.generation.logprobs] == list(stateless.generation.tokens)
        await daemon.register("a", "m")
        first = await daemon.decode("a", 3, history(("user", "hi")))
        again = await daemon.decode("a", 3, history(("user", "hi"), ("assistant", first.generation.text),
                                                    ("user", "more")))
        assert again.generation.prompt_evaluated == again.generation.prompt_tokens - (
            1 + len(history(("user", "hi")).text) + 2)

    run(tmp_path, body)
