"""Batched multi-sequence decoding (issue #11's core, appliance/engine/batched.py) on the real tiny model, and its
pure step planner (appliance/engine/schedule.py).

The tiny random model's greedy tokens soon repeat, so tokens alone would show little: every comparison with a
solo run also compares the logits each sampled token came from, at every step, within the tolerances below.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine.batched import BatchedContext, ModelWeights, SeqEvent
from appliance.engine.interface import GREEDY, Sampling
from appliance.engine.schedule import Take, Work, plan_step
from appliance.errors import ApplianceError

# Batched logits against solo: the first sampled token's (from the prefill) within FIRST_TOLERANCE (measured: 0,
# bit-identical); later ones within STEP_TOLERANCE (measured up to 4.8e-4: a decode of N rows rounds a little
# differently from a decode of one). Greedy tokens must be equal throughout.
FIRST_TOLERANCE = 1e-3
STEP_TOLERANCE = 2e-3
N_CTX = 1024
N_BATCH = 64
THREADS = 2
PROMPTS = ("Hello world the story", "once upon a time there was a model", "the water is hot",
           "What is this question about the data", "my mother said yes to the animal")
LONG_PROMPT = " ".join(["the story of a model and its memory"] * 8)  # 73 tokens


def flash_off(weights: ModelWeights, **params: Any) -> BatchedContext:
    """A context with flash attention off (not the engine's default, ``auto``): the tolerances above and equal
    greedy tokens are this module's point, and hold without it (with it: tests/test_flash_attention.py)."""
    return BatchedContext(weights, flash_attn="off", **params)


@dataclass
class Run:
    """What one sequence produced: its tokens and the logits each was sampled from."""

    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    done: bool = False


def record(context: BatchedContext, events: list[SeqEvent], runs: dict[int, Run]) -> None:
    for event in events:
        run = runs.setdefault(event.seq_id, Run())
        assert not run.done, "an event after the sequence's last"
        run.tokens.append(event.token)
        run.logits.append(context.logits(event.seq_id))
        run.done = event.done


def finish(context: BatchedContext, runs: dict[int, Run], max_steps: int = 500) -> int:
    """Step until no sequence has work; the number of steps."""
    steps = 0
    while context.has_work():
        assert steps < max_steps
        record(context, context.step(), runs)
        steps += 1
    return steps


_solo_cache: dict[tuple[tuple[int, ...], int, int], Run] = {}


def solo(weights: ModelWeights, tokens: Sequence[int], max_tokens: int, n_batch: int = N_BATCH) -> Run:
    """The same prompt run alone in a fresh one-sequence context."""
    key = (tuple(tokens), max_tokens, n_batch)
    if key not in _solo_cache:
        with flash_off(weights, n_ctx=N_CTX, n_seq_max=1, n_batch=n_batch, n_threads=THREADS) as context:
            context.add(0, tokens, GREEDY, max_tokens)
            runs: dict[int, Run] = {}
            finish(context, runs)
            _solo_cache[key] = runs[0]
    return _solo_cache[key]


def assert_matches(run: Run, reference: Run) -> float:
    """``run`` made ``reference``'s tokens from logits within the tolerances; the largest difference."""
    assert run.tokens == reference.tokens
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(run.logits, reference.logits, strict=True)]
    assert diffs[0] < FIRST_TOLERANCE
    assert max(diffs) < STEP_TOLERANCE
    return max(diffs)


def tokenize_all(weights: ModelWeights, prompts: Sequence[str]) -> list[list[int]]:
    return [weights.tokenize(prompt, bos=True) for prompt in prompts]


# -- batched decoding -------------------------------------------------------------------------------------
def test_four_sequences_decoded_together_each_match_their_solo_run(weights: ModelWeights) -> None:
    prompts = tokenize_all(weights, PROMPTS[:4])
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=4, n_batch=N_BATCH, n_threads=THREADS) as context:
        for seq_id, tokens in enumerate(prompts):
            context.add(seq_id, tokens, GREEDY, 20)
        runs: dict[int, Run] = {}
        record(context, context.step(), runs)
        assert sorted(runs) == [0, 1, 2, 3]  # one decode prefilled all four prompts and each sampled
        assert context.last_batch == sum(len(tokens) for tokens in prompts)
        record(context, context.step(), runs)
        assert context.last_batch == 4  # then one decode token per sequence
        steps = 2 + finish(context, runs)
    assert steps == 20
    first = max(float(np.max(np.abs(runs[i].logits[0] - solo(weights, prompts[i], 20).logits[0]))) for i in range(4))
    worst = max(assert_matches(runs[i], solo(weights, prompts[i], 20)) for i in range(4))
    print(f"batched vs solo logits: max abs diff {first:.3g} on the first step, {worst:.3g} over all steps")
    assert all(runs[i].done and len(runs[i].tokens) == 20 for i in range(4))


def test_cancelling_one_sequence_leaves_the_others_unchanged(weights: ModelWeights) -> None:
    prompts = tokenize_all(weights, PROMPTS[:4])
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=4, n_batch=N_BATCH, n_threads=THREADS) as context:
        for seq_id, tokens in enumerate(prompts):
            context.add(seq_id, tokens, GREEDY, 16)
        runs: dict[int, Run] = {}
        for _ in range(6):
            record(context, context.step(), runs)
        context.cancel(1)
        assert context.sequences == [0, 2, 3]
        cancelled = list(runs[1].tokens)
        finish(context, runs)
        assert runs[1].tokens == cancelled  # no event for it after its cancel
        for seq_id in (0, 2, 3):
            assert_matches(runs[seq_id], solo(weights, prompts[seq_id], 16))
        # its cells went with it: the id is reusable and a new prompt there runs as if alone
        for seq_id in (0, 2, 3):
            context.cancel(seq_id)
        context.add(1, prompts[3], GREEDY, 8)
        again: dict[int, Run] = {}
        finish(context, again)
        assert_matches(again[1], solo(weights, prompts[3], 8))


def test_a_sequence_joining_mid_generation_gets_its_solo_output(weights: ModelWeights) -> None:
    prompts = tokenize_all(weights, PROMPTS[:4])
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=4, n_batch=N_BATCH, n_threads=THREADS) as context:
        for seq_id in range(3):
            context.add(seq_id, prompts[seq_id], GREEDY, 16)
        runs: dict[int, Run] = {}
        for _ in range(5):
            record(context, context.step(), runs)
        context.add(3, prompts[3], GREEDY, 16)
        record(context, context.step(), runs)
        assert context.last_batch == 3 + len(prompts[3])  # the newcomer's prompt rode with the others' tokens
        assert len(runs[3].tokens) == 1
        finish(context, runs)
    for seq_id in range(4):
        assert_matches(runs[seq_id], solo(weights, prompts[seq_id], 16))


def test_a_long_prompt_is_prefilled_in_chunks_while_another_sequence_streams(weights: ModelWeights) -> None:
    n_batch = 16
    short = weights.tokenize(PROMPTS[0], bos=True)
    long = weights.tokenize(LONG_PROMPT, bos=True)
    assert len(long) > 4 * n_batch
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=2, n_batch=n_batch, n_threads=THREADS) as context:
        context.add(0, short, GREEDY, 24)
        runs: dict[int, Run] = {}
        for _ in range(2):
            record(context, context.step(), runs)
        context.add(1, long, GREEDY, 8)
        steps_to_first = 0
        while 1 not in runs:
            before = len(runs[0].tokens)
            record(context, context.step(), runs)
            steps_to_first += 1
            assert context.last_batch <= n_batch
            assert len(runs[0].tokens) == before + 1  # the streaming sequence got its token in every step
        assert steps_to_first == -(-len(long) // (n_batch - 1))  # chunks of what the decode token leaves
        finish(context, runs)
    assert_matches(runs[0], solo(weights, short, 24, n_batch))
    assert_matches(runs[1], solo(weights, long, 8, n_batch))


def test_a_prefill_limit_makes_smaller_chunks_beside_a_stream(weights: ModelWeights) -> None:
    short = weights.tokenize(PROMPTS[0], bos=True)
    long = weights.tokenize(LONG_PROMPT, bos=True)
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=2, n_batch=N_BATCH, n_threads=THREADS,
                        prefill_limit=8) as context:
        context.add(0, short, GREEDY, 24)
        runs: dict[int, Run] = {}
        record(context, context.step(), runs)
        assert context.last_batch == len(short)
        context.add(1, long, GREEDY, 8)
        sizes: list[int] = []
        while 1 not in runs:
            record(context, context.step(), runs)
            sizes.append(context.last_batch)
        assert sizes[:-1] == [1 + 8] * (len(sizes) - 1)
        assert sizes[-1] == 1 + len(long) - 8 * (len(sizes) - 1)
        finish(context, runs)
    assert_matches(runs[0], solo(weights, short, 24))
    assert_matches(runs[1], solo(weights, long, 8))


def test_prompts_joining_together_beside_a_stream_are_evaluated_in_one_step(weights: ModelWeights) -> None:
    """The first burst of agents: one streams already, three more join at once. Their prompts (each shorter than
    ``prefill_limit``) go into the next step together, not one prompt per step behind each other (the old
    planner's step held the stream's token and ONE prompt), so all three sample their first token after that one
    step; every output still matches its solo run."""
    first = weights.tokenize(PROMPTS[0], bos=True)
    joining = [weights.tokenize(text, bos=True) for text in PROMPTS[1:4]]
    limit = max(len(tokens) for tokens in joining)
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=4, n_batch=N_BATCH, n_threads=THREADS,
                   prefill_limit=limit) as context:
        context.add(0, first, GREEDY, 12)
        runs: dict[int, Run] = {}
        record(context, context.step(), runs)
        for seq_id, tokens in enumerate(joining, start=1):
            context.add(seq_id, tokens, GREEDY, 8)
        events = context.step()
        record(context, events, runs)
        assert context.last_batch == 1 + sum(len(tokens) for tokens in joining)
        assert sorted(event.seq_id for event in events) == [0, 1, 2, 3]  # every joiner's first token now
        finish(context, runs)
    assert_matches(runs[0], solo(weights, first, 12))
    for seq_id, tokens in enumerate(joining, start=1):
        assert_matches(runs[seq_id], solo(weights, tokens, 8))


def test_each_sequence_samples_with_its_own_seed(weights: ModelWeights) -> None:
    prompt = weights.tokenize(PROMPTS[0], bos=True)
    seeds = (1, 2, 1)
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=4, n_batch=N_BATCH, n_threads=THREADS) as context:
        for seq_id, seed in enumerate(seeds):
            context.add(seq_id, prompt, Sampling(temperature=1.0, seed=seed), 16)
        context.add(3, prompt, GREEDY, 16)
        runs: dict[int, Run] = {}
        finish(context, runs)
    assert runs[0].tokens != runs[1].tokens
    assert runs[0].tokens == runs[2].tokens
    assert runs[0].tokens != runs[3].tokens
    assert_matches(runs[3], solo(weights, prompt, 16))  # sampling beside it changes nothing


def test_greedy_and_seeded_sequences_equal_todays_engine(weights: ModelWeights, tiny_model: Path) -> None:
    """Beside each other in one batch, each sequence makes what ``llama_cpp.Llama`` (the engine of today's
    runtime) makes with the same prompt, parameters and seed."""
    prompt = weights.tokenize(PROMPTS[0], bos=True)
    samplings = (GREEDY, Sampling(temperature=0.8, top_p=0.9, top_k=40, seed=1),
                 Sampling(temperature=0.8, top_p=0.9, top_k=40, seed=2))
    llm = llama_cpp.Llama(str(tiny_model), n_ctx=N_CTX, n_threads=THREADS, seed=0, verbose=False)
    expected = []
    for sampling in samplings:
        llm.set_seed(sampling.seed)
        tokens = llm.generate(prompt, temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                              min_p=0.0, repeat_penalty=1.0, reset=True)
        expected.append(list(itertools.islice(tokens, 16)))
    llm.close()
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=3, n_batch=N_BATCH, n_threads=THREADS) as context:
        for seq_id, sampling in enumerate(samplings):
            context.add(seq_id, prompt, sampling, 16)
        finish(context, {})
        assert [context.generated(seq_id) for seq_id in range(3)] == expected
    assert expected[1] != expected[2]


def test_a_saved_sequence_restored_under_a_new_id_continues_exactly(weights: ModelWeights) -> None:
    prompts = tokenize_all(weights, PROMPTS[:2])
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=3, n_batch=N_BATCH, n_threads=THREADS) as context:
        context.add(0, prompts[0], GREEDY, 20)
        context.add(1, prompts[1], GREEDY, 20)
        runs: dict[int, Run] = {}
        for _ in range(7):
            record(context, context.step(), runs)
        saved = context.save(0)
        assert len(saved.state) > 0
        assert saved.generated == tuple(runs[0].tokens)
        context.cancel(0)
        for _ in range(3):
            record(context, context.step(), runs)  # the other one moves on meanwhile
        context.restore(2, saved)
        assert context.generated(2) == runs[0].tokens
        finish(context, runs)
    resumed = Run(runs[0].tokens + runs[2].tokens, runs[0].logits + runs[2].logits)
    assert len(resumed.tokens) == 20
    assert_matches(resumed, solo(weights, prompts[0], 20))
    assert_matches(runs[1], solo(weights, prompts[1], 20))


def test_each_sequence_stops_at_its_own_budget(weights: ModelWeights) -> None:
    prompts = tokenize_all(weights, PROMPTS[:2])
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=2, n_batch=N_BATCH, n_threads=THREADS) as context:
        context.add(0, prompts[0], GREEDY, 3)
        context.add(1, prompts[1], GREEDY, 6)
        runs: dict[int, Run] = {}
        events: list[SeqEvent] = []
        while context.has_work():
            batch = context.step()
            events.extend(batch)
            record(context, batch, runs)
        assert context.step() == []  # no work: no decode
        assert context.last_batch == 0
    last = {event.seq_id: event for event in events if event.done}
    assert last[0].stop_reason == "length" and len(runs[0].tokens) == 3
    assert last[1].stop_reason == "length" and len(runs[1].tokens) == 6
    assert all(event.piece == weights.piece(event.token) for event in events)
    assert weights.is_end(2) and not weights.is_end(runs[0].tokens[0])  # the tiny model's </s> is id 2


def test_a_failed_decode_leaves_every_sequence_as_it_was(weights: ModelWeights) -> None:
    """A forged parked state (its cells run past the position it claims) makes llama.cpp refuse the batch: the
    step raises, nothing advances, and once the bad sequence is cancelled the other goes on as if alone."""
    prompts = tokenize_all(weights, PROMPTS[:2])
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=3, n_batch=N_BATCH, n_threads=THREADS) as context:
        context.add(0, prompts[0], GREEDY, 12)
        context.add(1, prompts[1], GREEDY, 12)
        runs: dict[int, Run] = {}
        for _ in range(4):
            record(context, context.step(), runs)
        forged = dataclasses.replace(context.save(0), n_past=2)
        context.cancel(0)
        context.restore(2, forged)
        with pytest.raises(ApplianceError) as info:
            context.step()
        assert info.value.code == "INTERNAL"
        assert context.generated(1) == runs[1].tokens
        context.cancel(2)
        finish(context, runs)
    assert_matches(runs[1], solo(weights, prompts[1], 12))


def test_a_damaged_saved_state_is_refused_and_the_id_stays_free(weights: ModelWeights) -> None:
    prompt = weights.tokenize(PROMPTS[0], bos=True)
    with flash_off(weights, n_ctx=N_CTX, n_seq_max=2, n_batch=N_BATCH, n_threads=THREADS) as context:
        context.add(0, prompt, GREEDY, 8)
        context.step()
        saved = context.save(0)
        for damaged in (b"\x01\x02\x03", saved.state[: len(saved.state) // 2]):
            with pytest.raises(ApplianceError) as info:
                context.restore(1, dataclasses.replace(saved, state=damaged))
            assert info.value.code == "INTERNAL"
            assert context.sequences == [0]
        context.restore(1, saved)
        assert context.sequences == [0, 1]


# -- refusals -------------------------------------------------------------------------------------------
def test_bad_sequences_are_refused_with_the_limit_they_broke(weights: ModelWeights) -> None:
    prompt = weights.tokenize(PROMPTS[0], bos=True)
    with flash_off(weights, n_ctx=256, n_seq_max=2, n_batch=32, n_threads=THREADS) as context:
        with pytest.raises(ApplianceError) as info:
            context.add(2, prompt)
        assert info.value.code == "BAD_REQUEST" and info.value.details["n_seq_max"] == 2
        context.add(0, prompt, GREEDY, 4)
        with pytest.raises(ApplianceError) as info:
            context.add(0, prompt)
        assert info.value.details == {"seq_id": 0}
        with pytest.raises(ApplianceError):
            context.add(1, [])
        with pytest.raises(ApplianceError) as info:
            context.add(1, prompt, GREEDY, 0)
        assert info.value.details == {"max_tokens": 0}
        with pytest.raises(ApplianceError) as info:
            context.add(1, [weights.n_vocab])
        assert info.value.details["n_vocab"] == weights.n_vocab
        with pytest.raises(ApplianceError) as info:
            context.add(1, prompt, GREEDY, context.n_ctx)
        assert info.value.code == "CONTEXT_OVERFLOW"
        assert info.value.details["n_ctx"] == context.n_ctx
        assert info.value.details["claimed"] == len(prompt) + 4
        with pytest.raises(ApplianceError):
            context.cancel(1)
        with pytest.raises(ApplianceError):
            context.logits(0)  # nothing sampled yet
        assert context.sequences == [0]


def test_a_context_refuses_too_small_a_batch_and_other_threads(weights: ModelWeights) -> None:
    with pytest.raises(ApplianceError) as info:
        BatchedContext(weights, n_ctx=256, n_seq_max=8, n_batch=4)
    assert info.value.details == {"n_batch": 4, "n_seq_max": 8}
    with flash_off(weights, n_ctx=256, n_seq_max=1, n_batch=8, n_threads=THREADS) as context:
        caught: list[ApplianceError] = []

        def step_elsewhere() -> None:
            try:
                context.step()
            except ApplianceError as exc:
                caught.append(exc)

        thread = threading.Thread(target=step_elsewhere)
        thread.start()
        thread.join(timeout=30)
        assert [exc.code for exc in caught] == ["INTERNAL"]


def test_missing_weights_and_closing_the_weights_close_their_contexts(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ApplianceError) as info:
        ModelWeights(tmp_path / "none.gguf")
    assert info.value.code == "MODEL_LOAD_FAILED"
    loaded = ModelWeights(tiny_model)
    context = BatchedContext(loaded, n_ctx=256, n_seq_max=1, n_batch=8, n_threads=THREADS)
    loaded.close()
    assert context.ctx is None and loaded.model is None
    with pytest.raises(ApplianceError):
        loaded.tokenize("Hello", bos=True)
    with pytest.raises(ApplianceError):
        context.step()


# -- the step planner (pure) ------------------------------------------------------------------------------
def test_plan_gives_every_generating_sequence_its_token_before_any_prompt_chunk() -> None:
    work = [Work(0, 100, False), Work(1, 1, True), Work(2, 30, False), Work(3, 1, True)]
    assert plan_step(work, 16) == [Take(1, 1, True), Take(3, 1, True), Take(0, 14, False)]
    assert plan_step(work, 200) == [Take(1, 1, True), Take(3, 1, True), Take(0, 100, True), Take(2, 30, True)]


def test_plan_limits_prompt_chunks_only_while_a_stream_waits() -> None:
    streaming = [Work(0, 1, True), Work(1, 300, False), Work(2, 5, False)]
    assert plan_step(streaming, 512, prefill_limit=64) == [Take(0, 1, True), Take(1, 64, False), Take(2, 5, True)]
    prefilling = [Work(1, 300, False), Work(2, 5, False)]
    assert plan_step(prefilling, 512, prefill_limit=64) == [Take(1, 300, True), Take(2, 5, True)]
    with pytest.raises(ValueError):
        plan_step(streaming, 512, prefill_limit=0)


def test_plan_evaluates_prompts_that_joined_together_in_one_step_beside_a_stream() -> None:
    """A burst: seven 64-token prompts join while one agent already streams. Each advances by up to
    ``prefill_limit`` in the same step (one ``llama_decode``), not one prompt per step behind the others; the batch
    still holds at most ``n_batch`` tokens."""
    burst = [Work(0, 1, True)] + [Work(seq_id, 64, False) for seq_id in range(1, 8)]
    takes = plan_step(burst, 512, prefill_limit=64)
    assert takes == [Take(0, 1, True)] + [Take(seq_id, 64, True) for seq_id in range(1, 8)]
    assert plan_step(burst, 200, prefill_limit=64) == [Take(0, 1, True), Take(1, 64, True), Take(2, 64, True),
                                                       Take(3, 64, True), Take(4, 7, False)]


def test_plan_skips_idle_sequences_and_waits_when_the_batch_is_full() -> None:
    assert plan_step([Work(0, 0, True), Work(1, 0, False)], 8) == []
    assert plan_step([Work(0, 1, True), Work(1, 1, True), Work(2, 1, True)], 2) == [Take(0, 1, True),
                                                                                    Take(1, 1, True)]
    with pytest.raises(ValueError):
        plan_step([], 0)


def _as_work(items: list[tuple[int, bool]]) -> list[Work]:
    """Sequences in join order; a generating one has its one sampled token pending (or nothing, when done)."""
    return [Work(seq_id, min(pending, 1) if generating else pending, generating)
            for seq_id, (pending, generating) in enumerate(items)]


_works = st.lists(st.tuples(st.integers(0, 300), st.booleans()), max_size=10).map(_as_work)


@settings(max_examples=300, deadline=None)
@given(_works, st.integers(1, 128), st.one_of(st.none(), st.integers(1, 64)))
def test_plan_invariants(work: list[Work], n_batch: int, prefill_limit: int | None) -> None:
    takes = plan_step(work, n_batch, prefill_limit)
    by_id = {item.seq_id: item for item in work}
    assert sum(take.count for take in takes) <= n_batch
    assert len({take.seq_id for take in takes}) == len(takes)
    for take in takes:
        item = by_id[take.seq_id]
        assert 1 <= take.count <= item.pending
        assert take.last == (take.count == item.pending)
        if item.generating:
            assert take.count == 1
    generating = [item.seq_id for item in work if item.generating and item.pending]
    served = [take.seq_id for take in takes if by_id[take.seq_id].generating]
    assert served == generating[:n_batch]  # every stream first, in join order
    chunk = prefill_limit if served and prefill_limit is not None else n_batch
    for take in takes:
        if not by_id[take.seq_id].generating:
            assert take.count <= chunk  # each prompt advances by at most prefill_limit beside a stream
    prompt_tokens = sum(take.count for take in takes if not by_id[take.seq_id].generating)
    waiting = sum(min(item.pending, chunk) for item in work if not item.generating)
    room = n_batch - len(served)
    assert prompt_tokens == min(waiting, room)  # no room left unused while prompts wait


def test_flash_attention_reaches_llama_cpp(weights: ModelWeights) -> None:
    """``flash_attn`` really changes how the context computes: the same prompt's logits differ (slightly) from the
    context without it, and the greedy first token is the same."""
    prompt = weights.tokenize(LONG_PROMPT, bos=True)
    logits = {}
    for flash in (False, True):
        with BatchedContext(weights, n_ctx=N_CTX, n_seq_max=1, n_batch=N_BATCH, n_threads=THREADS,
                            flash_attn=flash) as context:
            context.add(0, prompt, GREEDY, 1)
            while context.has_work():
                context.step()
            logits[flash] = context.logits(0)
    difference = float(np.max(np.abs(logits[True] - logits[False])))
    assert 0 < difference < 0.1
    assert int(np.argmax(logits[True])) == int(np.argmax(logits[False]))
