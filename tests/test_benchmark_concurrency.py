"""``benchmarks/concurrency.py`` in its --quick mode without the llama.cpp peer, and the peer helpers
(``benchmarks/peer.py``) that need no build."""

from __future__ import annotations

import json
import os
from pathlib import Path

import llama_cpp
import pytest

from benchmarks import concurrency, peer
from benchmarks.common import tiny_model

BATCHED_BENCH_OUTPUT = """
main: n_kv_max = 1088, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = 0
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |     64 |    1 |    128 |    0.108 |   592.59 |    0.764 |    83.77 |    0.872 |   146.79 |
|    64 |     64 |    4 |    512 |    0.373 |   686.33 |    1.378 |   185.78 |    1.751 |   292.40 |

llama_perf_context_print:        load time =     120.00 ms
"""


def test_parse_batched_bench_reads_every_row() -> None:
    rows = peer.parse_batched_bench(BATCHED_BENCH_OUTPUT)
    assert [r["n_parallel"] for r in rows] == [1, 4]
    assert rows[0] == {"n_prompt": 64, "n_gen": 64, "n_parallel": 1, "n_kv": 128, "prompt_s": 0.108,
                       "prompt_tok_s": 592.59, "gen_s": 0.764, "gen_tok_s": 83.77, "total_s": 0.872,
                       "total_tok_s": 146.79}
    with pytest.raises(ValueError, match="no table rows"):
        peer.parse_batched_bench("main: nothing\n")


def test_peer_build_pins_the_projects_llama_cpp_python_and_returns_a_cached_build_at_once(tmp_path: Path) -> None:
    assert peer.pinned_version() == llama_cpp.__version__
    assert peer.default_cache().name == f"llama.cpp-{llama_cpp.__version__}"
    assert peer.built_binaries(tmp_path) is None
    (tmp_path / "bin").mkdir()
    for name in peer.BINARIES:
        binary = tmp_path / "bin" / name
        binary.write_text("#!/bin/sh\n")
        os.chmod(binary, 0o755)
    assert peer.build(tmp_path) == tmp_path / "bin"  # no download, no compiler: already built
    assert peer.built_binaries(tmp_path) == {name: tmp_path / "bin" / name for name in peer.BINARIES}


def test_agent_prompts_are_distinct_exactly_the_asked_tokens_and_continue_with_plain_text(tmp_path: Path) -> None:
    model = tiny_model(tmp_path, layers=1, dim=64)
    prompts = concurrency.agent_prompts(model, 4, 64, 8, 1)
    assert len({p.text for p in prompts}) == 4
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=128, n_threads=1, verbose=False)
    try:
        for prompt in prompts:
            assert len(llm.tokenize(prompt.text.encode(), add_bos=True)) == 64
            llm.reset()
            done = llm.create_completion(prompt.text, max_tokens=8, temperature=0.0)
            assert done["choices"][0]["text"] == prompt.solo and done["choices"][0]["finish_reason"] == "length"
    finally:
        llm.close()


def test_summary_aggregates_each_burst_over_its_wall_time_and_pools_the_ttfts() -> None:
    slow = [concurrency.Stream(sent=0.0, first_token=0.1, last_token=1.0, text="a", tokens=8),
            concurrency.Stream(sent=0.0, first_token=0.3, last_token=2.0, text="b", tokens=8)]  # 16 tokens in 2 s
    fast = [concurrency.Stream(sent=5.0, first_token=5.2, last_token=6.0, text="a", tokens=8),
            concurrency.Stream(sent=5.0, first_token=5.4, last_token=6.0, text="c", tokens=8)]  # 16 in 1 s
    prompts = [concurrency.AgentPrompt("p", "a"), concurrency.AgentPrompt("q", "c")]
    entry = concurrency.summarize_bursts([slow, fast, fast], prompts, 8, 1000)
    assert entry["tokens_per_s_rounds"] == pytest.approx([8.0, 16.0, 16.0])
    assert entry["tokens_per_s"] == pytest.approx(16.0)  # the median round
    assert sorted(entry["ttft_ms"]) == pytest.approx([100, 200, 200, 300, 400, 400])
    assert entry["ttft_p50_ms"] == pytest.approx(250.0)
    assert entry["ttft_p99_ms"] == pytest.approx(400.0)
    assert entry["tokens_complete"] and entry["peak_rss_bytes"] == 1000
    assert entry["texts_match_solo"] == [True, False, True, True, True, True]
    short = concurrency.summarize_bursts([[slow[0], concurrency.Stream(sent=0.0, first_token=0.2, last_token=0.5,
                                                                      tokens=3)]], prompts, 8, 1)
    assert not short["tokens_complete"]
    failed = concurrency.summarize_bursts([[slow[0], concurrency.Stream(error="RuntimeError: HTTP 500")]], prompts,
                                          8, 1)
    assert failed["tokens_per_s"] is None and failed["errors"] == ["RuntimeError: HTTP 500"]


def test_targets_need_both_sides() -> None:
    compared = {"4": {"vs_one_at_a_time": 1.7, "vs_llama_server": 1.1, "ttft_p99_vs_llama_server": 0.9},
                "8": {"vs_one_at_a_time": 1.9, "vs_llama_server": None, "ttft_p99_vs_llama_server": None}}
    met = concurrency.targets_met(compared)
    assert met == {"batched_4_vs_one_at_a_time": True, "batched_8_vs_one_at_a_time": False,
                   "batched_vs_llama_server_every_n": None, "ttft_p99_vs_llama_server_every_n": None}


def test_config_sets_the_slots_of_each_path(tmp_path: Path) -> None:
    batched, single, flash = concurrency.appliance_paths()
    for path, slots in ((batched, concurrency.BATCHED_SLOTS), (single, 1), (flash, concurrency.BATCHED_SLOTS)):
        text = concurrency.concurrency_config(tmp_path / "m.gguf", tmp_path, n_ctx=512, http_port=1,
                                              engine=concurrency.engine_settings(path, 2))
        assert f"{concurrency.SLOTS_KEY}: {slots}" in text and "threads: 2" in text
        assert ("flash_attention: true" in text) == (path is flash)


def test_concurrency_quick_without_peer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = concurrency.slots_setting_missing()
    if missing is not None:
        pytest.skip(missing)
    out = tmp_path / "concurrency.json"
    rc = concurrency.main(["--quick", "--no-peer", "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert rc == 0, printed
    assert r["benchmark"] == "concurrency" and r["quick"] and r["agents"] == [1, 2]
    assert set(r["paths"]) == {"appliance_batched", "appliance_one_at_a_time", "appliance_flash"}
    assert r["notes"]["llama_server"].startswith("skipped: --no-peer")
    assert r["llama_batched_bench"] is None
    for name, path in r["paths"].items():
        for n, entry in path["by_agents"].items():
            if name != "appliance_flash":  # flash attention may change a text, and so its token count
                assert entry["tokens"] == [[r["tokens"]] * int(n)] * r["rounds"], entry["errors"]
            assert entry["tokens_per_s"] > 0 and entry["peak_rss_bytes"] > 0
            assert 0 < entry["ttft_p50_ms"] <= entry["ttft_p99_ms"]
    assert r["tokens_complete"]
    # One at a time, every text is the solo one. Batched, a near-tie in the random model's logits may flip with the
    # batch's makeup (recorded in the JSON); tests/test_engine_v2.py asserts SPEC L9 on prompts without near-ties.
    assert r["texts_match_solo"]["appliance_one_at_a_time"]
    assert r["comparisons"]["2"]["vs_one_at_a_time"] > 0
    assert r["box_load"]["wall_s"] > 0 and r["box_load"]["other_processes_share_of_box"] >= 0
    headlines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert len(headlines) == 1 and headlines[0] == r["headline"]
