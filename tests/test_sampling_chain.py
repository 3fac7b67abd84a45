"""Each sequence's own sampler (appliance/engine/sampler.py): llama.cpp's chain with every ``Sampling`` setting, the
grammar (lazy too) that output must follow, log-probabilities, and the refusals of what a sampler cannot take; on the
real tiny model and on random-weight models with real tokenizers (Qwen2.5's, and the Mistral stand-in's control
tokens), whose grammar-constrained output behaves as the real model's."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from llama_cpp.llama_grammar import json_schema_to_gbnf
from test_real_vocab import MISTRAL_CONTROL

from appliance.engine.batched import BatchedContext, ModelWeights, SeqEvent
from appliance.engine.fake import FakeEngine, fake_logprobs
from appliance.engine.interface import GREEDY, Conversation, Grammar, Prompt, Sampling, Token
from appliance.engine.runtime import Runtime
from appliance.engine.sampler import SequenceSampler
from appliance.engine.sampling import MAX_GRAMMAR_NESTING, MAX_GRAMMAR_RULES, shape
from appliance.engine.triggers import Feed, TriggerWatch, compile_patterns
from appliance.errors import ApplianceError

N_CTX = 512
THREADS = 2
YES_NO = Grammar('root ::= "<" ("yes" | "no") ">"')
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def qwen_model(chat_model: Callable[..., Path]) -> Path:
    return chat_model("qwen2", "Qwen-Qwen2.5-7B-Instruct")


@pytest.fixture(scope="module")
def qwen(qwen_model: Path) -> Iterator[Runtime]:
    runtime = Runtime(qwen_model, n_ctx=N_CTX, n_gpu_layers=0, n_threads=THREADS, live_slots=4)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> Iterator[Runtime]:
    runtime = Runtime(tiny_model, n_ctx=N_CTX, n_gpu_layers=0, n_threads=THREADS)
    yield runtime
    runtime.close()


def token_of(runtime: Runtime, text: str) -> int:
    tokens = runtime.weights.tokenize(text, bos=False, special=True)
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


def ends(runtime: Runtime) -> list[int]:
    vocab = runtime.weights.vocab
    return [token for token in range(runtime.weights.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, token)]


def refusal(runtime: Runtime, sampling: Sampling, prompt: str = "Hello") -> ApplianceError:
    conv = Conversation()
    with pytest.raises(ApplianceError) as info:
        runtime.generate(conv, prompt, 4, sampling)
    assert conv.tokens == [] and not runtime.busy  # nothing changed
    return info.value


# -- the chain -----------------------------------------------------------------------------------------------------


def test_the_chain_draws_what_llama_cpps_own_sampler_draws_with_penalties_and_min_p(tiny_model: Path) -> None:
    """Penalties, top-k, top-p, min-p, temperature and the seeded draw, in ``llama_cpp.Llama``'s order (its
    penalties count only generated tokens: ``seen=[]`` here)."""
    settings = [Sampling(temperature=0.9, top_k=30, top_p=0.9, min_p=0.05, repeat_penalty=1.3,
                         frequency_penalty=0.4, presence_penalty=0.2, seed=seed) for seed in (1, 2)]
    llm = llama_cpp.Llama(str(tiny_model), n_ctx=N_CTX, n_threads=THREADS, seed=0, verbose=False)
    prompt = llm.tokenize(b"Hello world the story", add_bos=True)
    expected = []
    for sampling in settings:
        llm.set_seed(sampling.seed)
        tokens = llm.generate(prompt, temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                              min_p=sampling.min_p, repeat_penalty=sampling.repeat_penalty,
                              frequency_penalty=sampling.frequency_penalty,
                              presence_penalty=sampling.presence_penalty, reset=True)
        expected.append(list(itertools.islice(tokens, 24)))
    llm.close()
    drawn = []
    with ModelWeights(tiny_model) as weights:
        for sampling in settings:  # each alone: a batch rounds logits a little differently
            with BatchedContext(weights, n_ctx=N_CTX, n_seq_max=1, n_batch=64, n_threads=THREADS,
                                flash_attn="off") as context:  # off, as in llama_cpp.Llama by default
                context.add(0, prompt, sampling, 24, seen=[])
                while context.has_work():
                    context.step()
                drawn.append(context.generated(0))
    assert drawn == expected
    assert expected[0] != expected[1]


PLAIN_SETTINGS = [
    Sampling(repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3, logit_bias=((42, 3.0), (7, -math.inf))),
    Sampling(temperature=0.9, top_k=30, top_p=0.9, min_p=0.05, repeat_penalty=1.2, seed=5),
    Sampling(temperature=1.3, seed=11, presence_penalty=0.4, penalty_last_n=8, logit_bias=((42, 2.0),)),
    Sampling(temperature=1.0, seed=3),
]


@pytest.mark.parametrize("sampling", PLAIN_SETTINGS)
def test_a_plain_sequence_draws_in_c_the_tokens_the_numpy_draw_gives(tiny: Runtime, sampling: Sampling) -> None:
    """A plain sequence (no grammar, no log-probabilities) samples with ``llama_sampler_sample`` over its whole
    chain; asking for log-probabilities sends the same settings through the numpy draw: the same tokens (bias,
    penalties over prompt and output, the seeded random stream), each run alone so that the logits are equal."""
    weights = tiny.weights
    prompt = weights.tokenize("the story of a model and its memory", bos=True)
    drawn = []
    for settings in (sampling, dataclasses.replace(sampling, logprobs=0)):
        sampler = SequenceSampler(weights, settings, prompt)
        assert sampler.plain == (settings.logprobs is None)
        sampler.free()
        with BatchedContext(weights, n_ctx=N_CTX, n_seq_max=1, n_batch=64, n_threads=THREADS) as context:
            context.add(0, prompt, settings, 24)
            while context.has_work():
                context.step()
            drawn.append(context.generated(0))
    assert drawn[0] == drawn[1]
    assert len(drawn[0]) == 24 and len(set(drawn[0])) > 2  # a draw, not one token over and over


def test_penalties_count_the_prompt_and_the_generated_tokens(tiny: Runtime) -> None:
    plain = tiny.generate(Conversation(), "the story of the model", 16)
    assert len(set(plain.tokens)) < len(plain.tokens)  # the tiny model repeats itself greedily
    conv = Conversation()
    penalised = tiny.generate(conv, "the story of the model", 16, Sampling(presence_penalty=50.0))
    prompt = conv.tokens[:penalised.prompt_tokens]
    assert len(set(penalised.tokens)) == len(penalised.tokens)
    assert not set(penalised.tokens) & set(prompt)


def test_min_p_of_one_keeps_only_the_likeliest_token(tiny: Runtime) -> None:
    greedy = tiny.generate(Conversation(), "Hello world", 12).tokens
    for seed in (1, 2, 3):
        drawn = tiny.generate(Conversation(), "Hello world", 12, Sampling(temperature=1.5, seed=seed, min_p=1.0))
        assert drawn.tokens == greedy
    assert tiny.generate(Conversation(), "Hello world", 12, Sampling(temperature=1.5, seed=1)).tokens != greedy


def test_logit_bias_forces_and_bans_tokens(tiny: Runtime) -> None:
    greedy = tiny.generate(Conversation(), "Hello world", 8).tokens
    forced = tiny.generate(Conversation(), "Hello world", 8, Sampling(logit_bias=((42, 100.0),)))
    assert forced.tokens == (42,) * 8
    banned = tiny.generate(Conversation(), "Hello world", 8, Sampling(logit_bias=((greedy[0], -math.inf),)))
    assert greedy[0] not in banned.tokens and banned.tokens != greedy


@pytest.mark.parametrize(("sampling", "param"), [
    (Sampling(logit_bias=((10**9, 1.0),)), "logit_bias"),
    (Sampling(logit_bias=((-1, 1.0),)), "logit_bias"),
    (Sampling(logit_bias=((5, math.inf),)), "logit_bias"),
    (Sampling(logit_bias=((5, math.nan),)), "logit_bias"),
    (Sampling(min_p=1.5), "min_p"),
    (Sampling(repeat_penalty=0.0), "repeat_penalty"),
    (Sampling(frequency_penalty=math.nan), "frequency_penalty"),
    (Sampling(presence_penalty=math.inf), "presence_penalty"),
    (Sampling(penalty_last_n=-1), "penalty_last_n"),
    (Sampling(temperature=math.nan), "temperature"),
    (Sampling(logprobs=21), "logprobs"),
    (Sampling(logprobs=-1), "logprobs"),
])
def test_settings_a_sampler_cannot_take_are_refused_naming_them(tiny: Runtime, sampling: Sampling,
                                                                 param: str) -> None:
    error = refusal(tiny, sampling)
    assert error.code == "BAD_REQUEST" and error.details["param"] == param
    assert tiny.generate(Conversation(), "Hello", 2).generated_tokens == 2  # it still serves


# -- grammars ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [Sampling(grammar=YES_NO), Sampling(temperature=1.0, seed=1, grammar=YES_NO),
                                      Sampling(temperature=1.0, seed=2, top_k=0, grammar=YES_NO),
                                      Sampling(temperature=2.0, seed=3, grammar=YES_NO)])
def test_output_follows_the_grammar_greedy_or_drawn_with_a_real_vocabulary(qwen: Runtime, tiny: Runtime,
                                                                           sampling: Sampling) -> None:
    free = qwen.generate(Conversation(), "yes or no?", 8, Sampling(temperature=sampling.temperature,
                                                                   seed=sampling.seed))
    assert free.text not in ("<yes>", "<no>")  # unconstrained, the random weights babble
    for runtime in (qwen, tiny):
        generation = runtime.generate(Conversation(), "yes or no?", 8, sampling)
        assert generation.text in ("<yes>", "<no>") and generation.stop_reason == "eos"


def test_a_json_schema_grammar_gives_json_of_the_schema(qwen: Runtime) -> None:
    grammar = Grammar(json_schema_to_gbnf(json.dumps(ANSWER)))
    for sampling in (Sampling(grammar=grammar), Sampling(temperature=1.0, seed=4, grammar=grammar)):
        generation = qwen.generate(Conversation(), "Answer:", 64, sampling)
        assert generation.stop_reason == "eos"
        assert json.loads(generation.text) in ({"answer": "yes"}, {"answer": "no"})


@pytest.mark.parametrize(("gbnf", "root"), [
    ('root ::= "a" (', "root"),  # a syntax error
    ("root ::= missing", "root"),  # an undefined rule
    ('root ::= root "a" | "b"', "root"),  # left recursion
    ('start ::= "a"', "root"),  # no root rule
    ("   ", "root"),
    ('root ::= "a\x00"', "root"),
    ("root ::= " + "(" * (MAX_GRAMMAR_NESTING + 1) + '"a"' + ")" * (MAX_GRAMMAR_NESTING + 1), "root"),
    ("root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(MAX_GRAMMAR_RULES)) + 'rx ::= "b"', "root"),
])
def test_a_grammar_llama_cpp_cannot_take_is_a_bad_request_and_it_still_serves(qwen: Runtime, gbnf: str,
                                                                               root: str) -> None:
    error = refusal(qwen, Sampling(grammar=Grammar(gbnf, root)))
    assert error.code == "BAD_REQUEST" and error.details["param"] == "grammar"
    assert qwen.generate(Conversation(), "yes or no?", 8, Sampling(grammar=YES_NO)).text in ("<yes>", "<no>")


def test_a_grammars_shape_counts_groups_and_repeats_outside_literals() -> None:
    assert shape('root ::= "(((" [(] (a (b)) # (((\n') == (2, 2)
    assert shape('root ::= x{2,10} y{3} "{99}"') == (0, 13)
    assert shape("root ::= x{" + "9" * 30 + "}")[1] > MAX_GRAMMAR_RULES  # counted without an int() of 30 digits


def test_trigger_tokens_that_are_not_one_token_are_refused_naming_them(qwen: Runtime) -> None:
    error = refusal(qwen, Sampling(grammar=Grammar('root ::= "a"', trigger_tokens=("hello world",))))
    assert error.details["param"] == "grammar" and error.details["trigger_token"] == "hello world"
    error = refusal(qwen, Sampling(grammar=Grammar('root ::= "a"', trigger_patterns=("(unclosed",))))
    assert error.details["param"] == "grammar" and error.details["trigger_pattern"] == "(unclosed"


def test_a_grammar_that_can_go_no_further_ends_the_generation_with_stop(qwen: Runtime) -> None:
    """After "ab" only an end-of-generation token is allowed, and every one is banned: no token is left."""
    banned = tuple((token, -math.inf) for token in ends(qwen))
    streamed: list[Token] = []
    generation = qwen.generate(Conversation(), "Hello", 16, Sampling(grammar=Grammar('root ::= "ab"'),
                                                                      logit_bias=banned), on_token=streamed.append)
    assert (generation.text, generation.stop_reason) == ("ab", "stop")
    assert "".join(token.text for token in streamed) == "ab"
    assert qwen.generate(Conversation(), "Hello", 4).generated_tokens == 4


def test_a_lazy_grammar_applies_from_its_trigger_token(qwen: Runtime) -> None:
    start = token_of(qwen, "<|im_start|>")
    grammar = Grammar('root ::= "<|im_start|>" "yes"', trigger_tokens=("<|im_start|>",))
    generation = qwen.generate(Conversation(), "Hello", 16, Sampling(grammar=grammar, logit_bias=((start, 30.0),)))
    assert (generation.text, generation.stop_reason) == ("<|im_start|>yes", "eos")
    assert generation.tokens[0] == start
    untriggered = qwen.generate(Conversation(), "Hello", 12, Sampling(grammar=grammar))
    assert untriggered.tokens == qwen.generate(Conversation(), "Hello", 12).tokens  # free until it fires


def test_a_lazy_grammar_applies_from_a_pattern_found_inside_a_token(qwen: Runtime) -> None:
    brace = token_of(qwen, " {")  # the pattern's group starts after this token's space
    grammar = Grammar('root ::= "{" "}"', trigger_patterns=(r"[\s\S]*?(\{)[\s\S]*",))
    generation = qwen.generate(Conversation(), "Hello", 16, Sampling(grammar=grammar, logit_bias=((brace, 30.0),)))
    assert (generation.text, generation.stop_reason) == (" {}", "eos")
    refused = Grammar('root ::= "[" "]"', trigger_patterns=(r"\{",))  # its trigger's text is not the grammar's
    generation = qwen.generate(Conversation(), "Hello", 16, Sampling(grammar=refused, logit_bias=((brace, 30.0),)))
    assert (generation.text, generation.stop_reason) == (" {", "stop")


def test_a_control_trigger_token_is_streamed_with_its_text(chat_model: Callable[..., Path]) -> None:
    model = chat_model("llama-spm", "mistralai-Mistral-Nemo-Instruct-2407", MISTRAL_CONTROL)
    runtime = Runtime(model, n_ctx=N_CTX, n_gpu_layers=0, n_threads=THREADS)
    try:
        calls = token_of(runtime, "[TOOL_CALLS]")
        assert runtime.weights.piece(calls) == b""  # a control token: plain text does not show it
        grammar = Grammar('root ::= "[TOOL_CALLS]" "[]"', trigger_tokens=("[TOOL_CALLS]",))
        generation = runtime.generate(Conversation(), "Hello", 8, Sampling(grammar=grammar,
                                                                            logit_bias=((calls, 30.0),)))
        assert (generation.text, generation.stop_reason) == ("[TOOL_CALLS][]", "eos")
    finally:
        runtime.close()


def test_one_sequences_grammar_leaves_the_others_in_the_batch_as_they_are_alone(qwen: Runtime) -> None:
    weights = qwen.weights
    prompts = [weights.tokenize(text, bos=True) for text in ("yes or no?", "Hello world", "once upon a", "the sea")]
    samplings = [Sampling(grammar=YES_NO), GREEDY, Sampling(temperature=1.0, seed=7),
                 Sampling(grammar=Grammar('root ::= "ab"'), logit_bias=tuple((t, -math.inf) for t in ends(qwen)))]

    def solo(index: int) -> list[int]:  # flash attention off on both sides: the texts are compared byte for byte
        with BatchedContext(weights, n_ctx=N_CTX, n_seq_max=1, n_batch=64, n_threads=THREADS,
                            flash_attn="off") as context:
            context.add(0, prompts[index], samplings[index], 12)
            while context.has_work():
                context.step()
            return context.generated(0)

    alone = [solo(index) for index in range(4)]
    ended: dict[int, int] = {}
    with BatchedContext(weights, n_ctx=N_CTX, n_seq_max=4, n_batch=64, n_threads=THREADS,
                        flash_attn="off") as context:
        for seq_id, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
            context.add(seq_id, prompt, sampling, 12)
        for step in itertools.count(1):
            if not context.has_work():
                break
            ended.update((event.seq_id, step) for event in context.step() if event.done)
        together = [context.generated(seq_id) for seq_id in range(4)]
    assert together == alone
    assert ended[1] == ended[2] == 12  # a token every step: they never waited for the grammars' draws
    assert ended[0] >= len(alone[0]) and ended[3] >= len(alone[3])
    texts = [b"".join(weights.special_piece(token) for token in tokens if token not in ends(qwen)) for tokens in alone]
    assert texts[0] in (b"<yes>", b"<no>") and texts[3] == b"ab"  # the grammars held, the dead one ended


def test_a_restored_sequence_keeps_following_its_grammar(qwen: Runtime) -> None:
    weights = qwen.weights
    grammar = Grammar(json_schema_to_gbnf(json.dumps(ANSWER)))
    prompt = weights.tokenize("Answer:", bos=True)
    with BatchedContext(weights, n_ctx=N_CTX, n_seq_max=2, n_batch=64, n_threads=THREADS) as context:
        context.add(0, prompt, Sampling(grammar=grammar), 64)
        for _ in range(4):
            context.step()
        saved = context.save(0)
        context.cancel(0)
        context.restore(1, saved)
        while context.has_work():
            context.step()
        text = b"".join(weights.special_piece(token) for token in context.generated(1)[:-1]).decode()
    assert json.loads(text) in ({"answer": "yes"}, {"answer": "no"})


# -- lazy triggers, pure -------------------------------------------------------------------------------------------


def test_a_trigger_pattern_fires_from_its_first_group_and_cuts_the_token_it_starts_in() -> None:
    watch = TriggerWatch(compile_patterns([r"[\s\S]*?(<call>)[\s\S]*"]), frozenset())
    assert watch.push(1, b"Hi ") is None and watch.push(2, b"the") is None
    assert watch.push(3, b"re<ca") is None
    assert watch.push(4, b"ll>{") == [Feed(None, b"<ca"), Feed(4)]
    assert watch.fired


def test_a_trigger_token_fires_at_once_and_an_anchored_pattern_must_match_all() -> None:
    watch = TriggerWatch(compile_patterns([r"^\{$"]), frozenset({99}))
    assert watch.push(1, b" {") is None  # anchored: " {" is not "{"
    assert watch.push(99, b"<t>") == [Feed(99)]
    anchored = TriggerWatch(compile_patterns([r"^\{$"]), frozenset())
    assert anchored.push(5, b"{") == [Feed(5)]
    plain = TriggerWatch(compile_patterns([r"\{"]), frozenset())
    assert plain.push(1, b"ab") is None and plain.push(2, b"c{d") == [Feed(None, b"{d")]


def test_a_trigger_pattern_over_broken_utf8_counts_bytes() -> None:
    watch = TriggerWatch(compile_patterns([r"x"]), frozenset())
    assert watch.push(1, "é".encode()[:1]) is None  # half a character
    assert watch.push(2, "é".encode()[1:] + b"ax") == [Feed(None, b"x")]


# -- log-probabilities ---------------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_rows_log_softmax_most_likely_first(tiny: Runtime) -> None:
    weights = tiny.weights
    prompt = weights.tokenize("Hello world", bos=True)
    with BatchedContext(weights, n_ctx=N_CTX, n_seq_max=2, n_batch=64, n_threads=THREADS) as context:
        context.add(0, prompt, Sampling(logprobs=5), 6)
        context.add(1, prompt, Sampling(temperature=1.0, seed=3, logprobs=0, logit_bias=((42, 5.0),)), 6)
        events: list[tuple[SeqEvent, np.ndarray]] = []
        while context.has_work():
            events += [(event, context.logits(event.seq_id)) for event in context.step()]
    for event, row in events:
        logprobs = event.logprobs
        assert logprobs is not None and logprobs.token.id == event.token
        expected = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64) - row.max()).sum()) - row.max()
        assert logprobs.token.logprob == pytest.approx(expected[event.token], abs=1e-6)
        if event.seq_id == 0:
            assert [entry.id for entry in logprobs.top] == list(np.argsort(-row, kind="stable")[:5])
            assert logprobs.top[0].id == event.token  # greedy: the sampled token is the likeliest
            assert sum(math.exp(entry.logprob) for entry in logprobs.top) <= 1.0
            assert [entry.piece for entry in logprobs.top] == [weights.special_piece(e.id) for e in logprobs.top]
        else:
            assert logprobs.top == ()


def test_logprobs_reach_the_stream_and_the_generation_and_stay_off_unasked(qwen: Runtime) -> None:
    streamed: list[Token] = []
    generation = qwen.generate(Conversation(), "Hello", 6, Sampling(logprobs=3), on_token=streamed.append)
    assert len(generation.logprobs) == len(generation.tokens) == 6
    assert [token.logprobs for token in streamed] == list(generation.logprobs)
    assert all(len(entry.top) == 3 for entry in generation.logprobs)
    plain = qwen.generate(Conversation(), "Hello", 3)
    assert plain.logprobs == () and plain.tokens == generation.tokens[:3]


# -- the fake engine -----------------------------------------------------------------------------------------------


def test_the_fake_engine_checks_settings_makes_logprobs_and_plays_a_script(tmp_path: Path) -> None:
    engine = FakeEngine()
    try:
        runtime = engine.load(tmp_path / "m.gguf", n_ctx=256, n_gpu_layers=0)

        def generate(prompt: str | Prompt, sampling: Sampling) -> object:
            return asyncio.run(engine.call(runtime.generate, Conversation(), prompt, 8, sampling))

        with_logprobs = generate("abc", Sampling(logprobs=2))
        assert [entry.token.id for entry in with_logprobs.logprobs] == list(with_logprobs.tokens)
        assert with_logprobs.logprobs[0] == fake_logprobs(with_logprobs.tokens[0], 2)
        assert sum(math.exp(entry.logprob) for entry in with_logprobs.logprobs[0].top) <= 1.0
        with pytest.raises(ApplianceError) as info:
            generate("abc", Sampling(grammar=Grammar("  ")))
        assert info.value.details["param"] == "grammar"

        def script(sampling: Sampling) -> str | None:
            return '{"name": "f"}' if sampling.grammar is not None else None

        engine.script = script
        scripted = generate(Prompt((("<|im_start|>", True), ("abc", False))), Sampling(grammar=YES_NO))
        assert (scripted.text, scripted.stop_reason) == ('{"name":', "length")
        assert generate("abc", GREEDY).tokens == with_logprobs.tokens
    finally:
        engine.close()
