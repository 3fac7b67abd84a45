"""Flash attention (``engine.flash_attention``: auto, true, false): the setting, what llama.cpp chooses for ``auto``
(appliance/engine/flash.py, read from its log: appliance/engine/llamalog.py), batched decoding against solo runs with
it on, and the V layout a saved state carries, on the real tiny model.

With flash attention a decode of N rows rounds differently from a decode of one, so a sequence decoded beside
others is compared with its solo run under TOLERANCE rather than by its text (tests/test_batched.py holds the
byte-equal texts, with flash attention off)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import yaml

from appliance.config.validate import ConfigInvalid, parse_config
from appliance.engine import flash, llamalog
from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.engine.interface import GREEDY
from appliance.errors import ApplianceError

TOLERANCE = 5e-3
"""Most a logit of a sequence decoded beside 7 others may differ from its solo run's with flash attention on, over
its first POSITIONS generated tokens (measured on the tiny model: at most 1.0e-3, against 5e-4 with it off)."""
POSITIONS = 16
SEQUENCES = 8
THREADS = 2
PROMPTS = ("Hello world the story", "once upon a time there was a model", "the water is hot",
           "What is this question about the data", "my mother said yes to the animal",
           "the cat sat on the mat and", "a long time ago in a galaxy", "numbers one two three four")


@pytest.fixture(scope="module")
def weights(tiny_model: Path) -> Iterator[ModelWeights]:
    with ModelWeights(tiny_model) as loaded:
        yield loaded


# -- the modes (pure) ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "mode"), [("auto", "auto"), ("on", "on"), ("off", "off"), (True, "on"),
                                             (False, "off")])
def test_a_mode_or_a_boolean_is_a_mode(value: object, mode: str) -> None:
    assert flash.mode_of(value) == mode


@pytest.mark.parametrize("value", ["yes", "", "AUTO", 1, 0, None, ["auto"]])
def test_anything_else_is_refused_naming_the_modes(value: object) -> None:
    with pytest.raises(ApplianceError) as info:
        flash.mode_of(value)
    assert info.value.code == "BAD_REQUEST"
    assert "auto, on, off or a boolean" in info.value.message


def test_the_modes_are_llama_cpps_flash_attention_types() -> None:
    assert flash.LLAMA_TYPES == {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
                                 "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                 "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}


@pytest.mark.parametrize(("line", "decided"), [
    ("resolve_fused_ops: Flash Attention enabled\n", True),
    ("resolve_fused_ops: Flash Attention not supported, set to disabled\n", False),
    ("llama_init_from_model: enabling flash_attn since it is required for quantized V cache\n", True),
    ("llama_init_from_model: flash_attn is not compatible with Grok - forcing off\n", False),
])
def test_auto_is_what_llama_cpp_logged_it_chose(line: str, decided: bool) -> None:
    lines = ["llama_context: n_ctx = 256\n", "llama_context: flash_attn            = auto\n", line]
    assert flash.resolved("auto", lines) is decided


def test_auto_without_a_decision_in_the_log_is_an_internal_error_not_a_guess() -> None:
    with pytest.raises(ApplianceError) as info:
        flash.resolved("auto", ["llama_context: flash_attn            = auto\n"])
    assert info.value.code == "INTERNAL"
    assert flash.resolved("on", []) is True and flash.resolved("off", []) is False


def test_only_off_transposes_the_v_cache() -> None:
    assert [flash.v_transposed(mode) for mode in flash.MODES] == [False, False, True]


# -- the setting ----------------------------------------------------------------------------------------------------
def engine_setting(tmp_path: Path, value: object) -> str:
    doc = {"device": "fake:8GiB", "model_dirs": [str(tmp_path)], "engine": {"flash_attention": value}}
    return parse_config(yaml.safe_dump(doc), base_dir=tmp_path, check_files=False).engine.flash_attention


def test_the_setting_defaults_to_auto_and_keeps_accepting_booleans(tmp_path: Path) -> None:
    default = parse_config(yaml.safe_dump({"device": "fake:8GiB", "model_dirs": [str(tmp_path)]}),
                           base_dir=tmp_path, check_files=False)
    assert default.engine.flash_attention == "auto"
    assert [engine_setting(tmp_path, value) for value in ("auto", True, False)] == ["auto", "on", "off"]


@pytest.mark.parametrize("value", ["yes", "on", 1, "Auto"])
def test_another_value_is_a_config_error_naming_the_key_and_the_choices(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigInvalid) as info:
        engine_setting(tmp_path, value)
    [problem] = info.value.problems
    assert problem.path == "engine.flash_attention"
    assert "must be `auto`, true or false" in problem.message


# -- what llama.cpp chose -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "cache_type", "chosen"), [("auto", "f16", True), ("on", "f16", True),
                                                            ("off", "f16", False), ("auto", "q8_0", True)])
def test_a_context_says_what_llama_cpp_chose(weights: ModelWeights, mode: str, cache_type: str,
                                            chosen: bool) -> None:
    """On the CPU llama.cpp can run flash attention for the tiny model, so ``auto`` turns it on (and a quantized V
    cache, which needs it, gets it)."""
    with BatchedContext(weights, n_ctx=256, n_seq_max=2, n_batch=32, n_threads=THREADS, flash_attn=mode,
                        cache_type=cache_type) as context:
        assert context.flash_mode == mode
        assert context.flash_attn is chosen


def test_a_bad_mode_is_refused_before_any_context_is_built(weights: ModelWeights) -> None:
    contexts = len(weights._contexts)
    with pytest.raises(ApplianceError) as info:
        BatchedContext(weights, n_ctx=256, n_seq_max=1, n_batch=32, flash_attn="fast")  # type: ignore[arg-type]
    assert info.value.code == "BAD_REQUEST" and len(weights._contexts) == contexts


def test_a_quantized_kv_cache_with_flash_attention_off_is_refused_saying_why(weights: ModelWeights) -> None:
    with pytest.raises(ApplianceError) as info:
        BatchedContext(weights, n_ctx=256, n_seq_max=1, n_batch=32, flash_attn="off", cache_type="q8_0")
    assert info.value.code == "BAD_REQUEST"
    assert info.value.details == {"cache_type": "q8_0", "flash_attention": "off"}
    assert "needs flash attention" in info.value.message


def test_the_log_lines_are_this_threads_only(weights: ModelWeights) -> None:
    """What another thread makes llama.cpp log meanwhile is not read as this context's choice."""
    other: list[bool] = []

    def build_elsewhere() -> None:
        with BatchedContext(weights, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=1, flash_attn="off") as context:
            other.append(context.flash_attn)

    with llamalog.llama_log_lines() as lines:
        worker = threading.Thread(target=build_elsewhere)
        worker.start()
        worker.join()
    assert other == [False]
    assert lines == []
    with llamalog.llama_log_lines() as lines:
        BatchedContext(weights, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=1, flash_attn="auto").close()
    assert any("Flash Attention enabled" in line for line in lines)


# -- batched against solo, flash attention on ---------------------------------------------------------------------
def generate(context: BatchedContext, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], list[np.ndarray]]]:
    """Each prompt's greedy tokens and the logits each was drawn from, all decoded together in ``context``."""
    runs: list[tuple[list[int], list[np.ndarray]]] = [([], []) for _ in prompts]
    for seq_id, tokens in enumerate(prompts):
        context.add(seq_id, tokens, GREEDY, POSITIONS)
    while context.has_work():
        for event in context.step():
            runs[event.seq_id][0].append(event.token)
            runs[event.seq_id][1].append(context.logits(event.seq_id))
    return runs


def test_eight_sequences_with_flash_attention_stay_within_the_tolerance_of_their_solo_runs(
        weights: ModelWeights) -> None:
    """Flash attention on (``auto`` on the CPU), 8 sequences decoded together: over the first POSITIONS generated
    tokens each logit is within TOLERANCE of the same prompt's solo run, and the greedy tokens are the solo run's up
    to the first step whose top-2 margin (solo) is under 2 x TOLERANCE (a closer tie may flip within the
    tolerance; from there on the two runs read different tokens and are no longer compared)."""
    prompts = [weights.tokenize(prompt, bos=True) for prompt in PROMPTS[:SEQUENCES]]
    with BatchedContext(weights, n_ctx=1024, n_seq_max=SEQUENCES, n_batch=64, n_threads=THREADS,
                        flash_attn="auto") as context:
        assert context.flash_attn is True
        together = generate(context, prompts)
    worst = 0.0
    compared = 0
    for prompt, (tokens, logits) in zip(prompts, together, strict=True):
        with BatchedContext(weights, n_ctx=1024, n_seq_max=1, n_batch=64, n_threads=THREADS,
                            flash_attn="auto") as context:
            [(solo_tokens, solo_logits)] = generate(context, [prompt])
        assert len(tokens) == len(solo_tokens) == POSITIONS
        for step in range(POSITIONS):
            worst = max(worst, float(np.max(np.abs(logits[step] - solo_logits[step]))))
            top = np.sort(solo_logits[step])[-2:]
            if float(top[1] - top[0]) < 2 * TOLERANCE:
                break  # a near tie: the tokens may part here, and the logits after it are of other texts
            assert tokens[step] == solo_tokens[step], (prompt, step)
            compared += 1
    print(f"flash attention, {SEQUENCES} sequences: max abs logit diff against solo {worst:.3g}; "
          f"{compared} greedy tokens compared")
    assert worst <= TOLERANCE
    assert compared >= SEQUENCES * POSITIONS // 4  # not vacuous: the margin rule left many tokens compared (73)


# -- the V layout of a saved state -----------------------------------------------------------------------------------
def test_a_state_saved_with_flash_attention_restores_only_into_the_same_v_layout(weights: ModelWeights) -> None:
    """``auto`` and ``on`` store the V cache alike (a state moves between them); llama.cpp refuses one in a context
    with flash attention ``off`` (V transposed): ``INTERNAL``, and the sequence id stays free."""
    prompt = weights.tokenize(PROMPTS[0], bos=True)
    with BatchedContext(weights, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=THREADS, flash_attn="auto") as source:
        source.add(0, prompt, GREEDY, 4)
        while source.has_work():
            source.step()
        saved = source.save(0)
    with BatchedContext(weights, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=THREADS, flash_attn="on") as same:
        same.restore(0, saved)
        assert same.generated(0) == list(saved.generated)
    with BatchedContext(weights, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=THREADS, flash_attn="off") as other:
        with pytest.raises(ApplianceError) as info:
            other.restore(0, saved)
        assert info.value.code == "INTERNAL" and "refused" in info.value.message
        assert other.sequences == []
