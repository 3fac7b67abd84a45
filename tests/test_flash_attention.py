"""Flash attention (``engine.flash_attention``: auto, true, false): the setting, what llama.cpp chooses for ``auto``
(appliance/engine/flash.py, read from its log: appliance/engine/llamalog.py), batched decoding against solo runs with
it on, and the V layout a saved state carries, on the real tiny model.

With flash attention a decode of N rows rounds differently from a decode of one, so a sequence decoded beside
others is compared with its solo run under TOLERANCE rather than by its text (tests/test_batched.py holds the
byte-equal texts, with flash attention off)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import yaml

from appliance.config.validate import Config, ConfigInvalid, parse_config
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.daemon.diskkv import DiskTier
from appliance.daemon.model import DecodeResult
from appliance.daemon.store import AgentStore, StoreWriter
from appliance.engine import flash, llamalog
from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.engine.interface import GREEDY, Conversation
from appliance.engine.runtime import Engine, Runtime
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


def test_a_parked_conversation_from_the_other_layout_is_re_evaluated_not_refused(tiny_model: Path) -> None:
    """A conversation parked by a runtime loaded with flash attention (``auto``) and continued by one loaded with
    it off (``engine.flash_attention`` changed and the model loaded again): its state is never handed to llama.cpp
    (which refuses it, ``INTERNAL``); its tokens are evaluated again, to the continuation a fresh evaluation of them
    gives."""
    with_flash = Runtime(tiny_model, n_ctx=256, n_gpu_layers=0, n_threads=THREADS, flash_attention="auto")
    try:
        conv = Conversation()
        with_flash.generate(conv, PROMPTS[0], 4)
        with_flash.slots.park(conv)
        assert conv.where == "host" and conv.nbytes > 0
    finally:
        with_flash.close()
    without = Runtime(tiny_model, n_ctx=256, n_gpu_layers=0, n_threads=THREADS, flash_attention="off")
    try:
        fresh = Conversation(tokens=list(conv.tokens))  # the same tokens, no state
        expected = without.generate(fresh, "", 4)
        without.slots.park(fresh)
        got = without.generate(conv, "", 4)
        assert got.text == expected.text and got.prompt_evaluated == expected.prompt_evaluated == len(fresh.tokens) - 4
        assert without.slots.layout_discards == 1 and without.slots.restores == 0
        assert without.v_transposed is True
        without.slots.park(conv)  # parked again, now in this runtime's layout: it comes back as it is
        assert conv.v_transposed is True
        assert without.generate(conv, "", 2).prompt_evaluated == 1 and without.slots.restores == 1
    finally:
        without.close()


def test_a_live_flash_attention_change_never_makes_a_kv_file_llama_cpp_refuses(tiny_model: Path,
                                                                               tmp_path: Path) -> None:
    """``engine.flash_attention`` changed by a reload applies to models loaded after it, so the loaded model keeps
    saving states in its old layout: a KV file written at the stop says that layout, and the restart under the new
    setting re-evaluates the agent's tokens (``kv_restored_from=tokens``) instead of failing with ``INTERNAL``; a
    restart under the old setting restores it from disk."""

    def config(setting: object) -> Config:
        doc = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tiny_model.parent)],
               "resync_interval_s": 0, "engine": {"live_slots": 1, "flash_attention": setting, "warmup_runs": 0},
               "models": [{"name": "m", "path": str(tiny_model), "n_ctx": 256}]}
        return parse_config(yaml.safe_dump(doc), base_dir=tmp_path)

    async def life(setting: object, change_to: object | None, prompt: str) -> tuple[DecodeResult, tuple[int, ...]]:
        daemon = Daemon(config(setting), FakeDevice(8 * 2**30), Engine(THREADS))
        store, _ = AgentStore.open(tmp_path / "state" / "agents.db")
        daemon.attach_durability(StoreWriter(store), DiskTier(tmp_path / "state" / "kv", 10**8))
        daemon.restore(store.load_agents(), store.load_responses())
        try:
            if prompt:
                await daemon.register("a", "m")
                await daemon.register("b", "m")
                await daemon.decode("b", 4, "another agent")
            result = await daemon.decode("a", 4, prompt)
            if change_to is not None:
                daemon.apply_config(config(change_to))  # a hot reload: the loaded model keeps its contexts
            return result, tuple(daemon.agents["a"].conversation.tokens)
        finally:
            await daemon.close(deadline=asyncio.get_running_loop().time() + 60)

    (tmp_path / "state").mkdir()
    first, tokens = asyncio.run(life("auto", False, PROMPTS[1]))
    assert first.generation.generated_tokens == 4
    again, after = asyncio.run(life(False, None, ""))
    assert again.restored_from == "tokens" and again.generation.generated_tokens == 4
    assert after[:len(tokens)] == tokens  # nothing of the conversation lost
    back, _ = asyncio.run(life(False, "auto", ""))  # the model loaded under false keeps saving transposed states
    assert back.restored_from == "disk"
    last, _ = asyncio.run(life(False, None, ""))  # so a restart under false restores its file from disk
    assert last.restored_from == "disk"
