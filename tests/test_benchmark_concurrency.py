"""``benchmarks/concurrency.py`` in its --quick mode with the llama.cpp peer absent (and present, where it is built),
and the peer helpers (``benchmarks/peer.py``) that need no build."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

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


def test_batched_bench_refuses_output_missing_a_requested_row(tmp_path: Path) -> None:
    """Runs that exit 0 with fewer rows than asked (seen: the 1-sequence row only), every time, are an error that
    shows the output, not a shorter table."""
    binary = tmp_path / "llama-batched-bench"
    binary.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'runs'}\ncat <<'EOF'\n{BATCHED_BENCH_OUTPUT}\nEOF\n")
    os.chmod(binary, 0o755)
    model = tmp_path / "model.gguf"
    rows = peer.batched_bench(binary, model, threads=2, n_parallel=(1, 4))
    assert [r["n_parallel"] for r in rows] == [1, 4]
    (tmp_path / "runs").unlink()
    with pytest.raises(RuntimeError, match=r"no row for \[2, 8\] parallel sequences in 3 runs:\n(.|\n)*S_TG t/s"):
        peer.batched_bench(binary, model, threads=2, n_parallel=(1, 2, 4, 8))
    assert (tmp_path / "runs").read_text().count("run") == peer.BATCHED_BENCH_ATTEMPTS


def test_batched_bench_runs_again_when_a_run_stops_after_its_first_row(tmp_path: Path) -> None:
    """The first run prints the 1-sequence row only (as llama-batched-bench sometimes does), the next one every
    row: the table is the next run's."""
    first_row_only = "\n".join(BATCHED_BENCH_OUTPUT.splitlines()[:5])
    binary = tmp_path / "llama-batched-bench"
    runs = tmp_path / "runs"
    binary.write_text(f"#!/bin/sh\nif [ -f {runs} ]; then cat <<'EOF'\n{BATCHED_BENCH_OUTPUT}\nEOF\n"
                      f"else touch {runs}; cat <<'EOF'\n{first_row_only}\nEOF\nfi\n")
    os.chmod(binary, 0o755)
    rows = peer.batched_bench(binary, tmp_path / "model.gguf", threads=2, n_parallel=(1, 4))
    assert [r["n_parallel"] for r in rows] == [1, 4]
    assert runs.exists()


def test_batched_bench_asks_for_a_kv_stream_per_sequence_or_one_unified_buffer(tmp_path: Path) -> None:
    """llama-batched-bench's own default depends on its slot count: each run says which KV layout it measures."""
    binary = tmp_path / "llama-batched-bench"
    argv = tmp_path / "argv"
    binary.write_text(f"#!/bin/sh\necho \"$@\" >> {argv}\ncat <<'EOF'\n{BATCHED_BENCH_OUTPUT}\nEOF\n")
    os.chmod(binary, 0o755)
    peer.batched_bench(binary, tmp_path / "model.gguf", threads=2, n_parallel=(1, 4))
    peer.batched_bench(binary, tmp_path / "model.gguf", threads=2, n_parallel=(1, 4), unified=True)
    split, unified = (line.split() for line in argv.read_text().splitlines())
    assert "-no-kvu" in split and "-kvu" not in split
    assert "-kvu" in unified and "-no-kvu" not in unified


def test_ceiling_figures_give_split_and_unified_medians_side_by_side(tmp_path: Path) -> None:
    """Each round runs both layouts, which first alternating; per parallel count the median of each and the median
    of the rounds' unified / split ratios."""
    binary = tmp_path / "llama-batched-bench"
    unified_output = BATCHED_BENCH_OUTPUT.replace("185.78", "148.62")  # the 4-sequence row, about 0.8x
    argv = tmp_path / "argv"
    binary.write_text(f"#!/bin/sh\necho \"$@\" >> {argv}\n"
                      f"case \"$*\" in *-no-kvu*) cat <<'EOF'\n{BATCHED_BENCH_OUTPUT}\nEOF\n;;\n"
                      f"*) cat <<'EOF'\n{unified_output}\nEOF\n;; esac\n")
    os.chmod(binary, 0o755)
    args = concurrency.parse_args(["--agents", "1", "4", "--rounds", "3"])
    rows = concurrency.ceiling_figures(binary, tmp_path / "model.gguf", args)
    assert [row["n_parallel"] for row in rows] == [1, 4]
    assert rows[0]["gen_tok_s_runs"] == rows[0]["gen_tok_s_unified_runs"] == [83.77] * 3
    assert rows[1]["gen_tok_s"] == 185.78 and rows[1]["gen_tok_s_unified"] == 148.62
    assert rows[0]["unified_over_split"] == 1.0
    assert rows[1]["unified_over_split"] == pytest.approx(148.62 / 185.78)
    layouts = ["unified" if line.split()[-1] == "-kvu" else "split" for line in argv.read_text().splitlines()]
    assert layouts == ["split", "unified", "unified", "split", "split", "unified"]


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


def test_an_absent_peer_says_why(tmp_path: Path) -> None:
    assert peer.binaries_or_why(True, False, tmp_path) == (None, "absent: --no-peer was given")
    binaries, why = peer.binaries_or_why(False, False, tmp_path)
    assert binaries is None and why.startswith(f"absent: llama.cpp is not built in {tmp_path};")


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
    others = [concurrency.AgentPrompt("r", "a"), concurrency.AgentPrompt("s", "b")]  # the first round's own
    entry = concurrency.summarize_bursts([slow, fast, fast], [others, prompts, prompts], 8, 1000)
    assert entry["tokens_per_s_rounds"] == pytest.approx([8.0, 16.0, 16.0])
    assert entry["tokens_per_s"] == pytest.approx(16.0)  # the median round
    assert sorted(entry["ttft_ms"]) == pytest.approx([100, 200, 200, 300, 400, 400])
    assert entry["ttft_p50_ms"] == pytest.approx(250.0)
    assert entry["ttft_p99_ms"] == pytest.approx(400.0)
    assert entry["tokens_complete"] and entry["peak_rss_bytes"] == 1000
    assert entry["agents"] == 2
    assert entry["texts_match_solo"] == [True] * 6  # each burst against its own prompts' solo texts
    assert entry["texts_differing"] == []
    swapped = concurrency.summarize_bursts([slow, fast], [prompts, others], 8, 1000)
    assert swapped["texts_match_solo"] == [True, False, True, False]
    assert [(d["round"], d["agent"]) for d in swapped["texts_differing"]] == [(0, 1), (1, 1)]
    short = concurrency.summarize_bursts([[slow[0], concurrency.Stream(sent=0.0, first_token=0.2, last_token=0.5,
                                                                      tokens=3)]], [prompts], 8, 1)
    assert not short["tokens_complete"]
    failed = concurrency.summarize_bursts([[slow[0], concurrency.Stream(error="RuntimeError: HTTP 500")]], [prompts],
                                          8, 1)
    assert failed["tokens_per_s"] is None and failed["errors"] == ["RuntimeError: HTTP 500"]


def test_every_round_sends_prompts_no_earlier_round_sent() -> None:
    prompts = [concurrency.AgentPrompt(f"p{i}", f"s{i}") for i in range(12)]
    rounds = [concurrency.round_prompts(prompts, attempt, 2, per_round=4) for attempt in range(3)]
    assert [[p.text for p in sent] for sent in rounds] == [["p0", "p1"], ["p4", "p5"], ["p8", "p9"]]
    assert [p.text for p in concurrency.round_prompts(prompts, 2, 4, per_round=4)] == ["p8", "p9", "p10", "p11"]
    with pytest.raises(RuntimeError, match="round 3 needs prompts 12-13, only 12 were made"):
        concurrency.round_prompts(prompts, 3, 2, per_round=4)


def test_targets_need_both_sides() -> None:
    both = {"defaults_tok_s": 1.1, "defaults_ttft_p99": 0.9, "vs_one_at_a_time": 1.7,
            "adaptive_vs_fixed_tok_s": 1.0, "adaptive_vs_fixed_ttft_p99": 1.0}
    one_side = {"defaults_tok_s": None, "defaults_ttft_p99": None, "vs_one_at_a_time": 1.9,
                "adaptive_vs_fixed_tok_s": None, "adaptive_vs_fixed_ttft_p99": 0.5}
    met = concurrency.targets_met({"4": both, "8": one_side})
    assert met == {"defaults_tok_s_n4": True, "defaults_ttft_p99_n4": True, "defaults_tok_s_n8": None,
                   "defaults_ttft_p99_n8": None, "vs_one_at_a_time_n4": True, "vs_one_at_a_time_n8": False,
                   "adaptive_vs_fixed_tok_s_n4": True, "adaptive_vs_fixed_ttft_p99_n4": True,
                   "adaptive_vs_fixed_tok_s_n8": None, "adaptive_vs_fixed_ttft_p99_n8": True}
    slower = concurrency.targets_met({"4": {**both, "defaults_tok_s": 0.99, "defaults_ttft_p99": 1.01,
                                            "adaptive_vs_fixed_tok_s": 0.99, "adaptive_vs_fixed_ttft_p99": 1.01}})
    assert slower["defaults_tok_s_n4"] is False and slower["defaults_ttft_p99_n4"] is False
    assert slower["adaptive_vs_fixed_tok_s_n4"] is False and slower["adaptive_vs_fixed_ttft_p99_n4"] is False
    assert slower["vs_one_at_a_time_n8"] is None  # N=8 not run


def test_comparisons_divide_the_appliance_by_llama_server_per_pair() -> None:
    results = {"appliance_defaults": {"2": {"tokens_per_s": 90.0, "ttft_p99_ms": 30.0}},
               "llama_server_defaults": {"2": {"tokens_per_s": 100.0, "ttft_p99_ms": 20.0}},
               "appliance_flash_on": {"2": {"tokens_per_s": 120.0, "ttft_p99_ms": 10.0}},
               "llama_server_flash_on": {"2": {"tokens_per_s": 100.0, "ttft_p99_ms": 20.0}},
               "appliance_one_at_a_time": {"2": {"tokens_per_s": 45.0, "ttft_p99_ms": 60.0}},
               "appliance_fixed": {"2": {"tokens_per_s": 75.0, "ttft_p99_ms": 40.0}}}
    c = concurrency.comparisons(results, [2])["2"]
    assert c["adaptive_vs_fixed_tok_s"] == pytest.approx(1.2) and c["adaptive_vs_fixed_ttft_p99"] == pytest.approx(0.75)
    del results["appliance_fixed"]
    assert concurrency.comparisons(results, [2])["2"]["adaptive_vs_fixed_tok_s"] is None
    assert c["defaults_tok_s"] == pytest.approx(0.9) and c["defaults_ttft_p99"] == pytest.approx(1.5)
    assert c["flash_on_tok_s"] == pytest.approx(1.2) and c["flash_on_ttft_p99"] == pytest.approx(0.5)
    assert c["flash_off_tok_s"] is None and c["vs_one_at_a_time"] == pytest.approx(2.0)


def test_same_settings_pairs_only_servers_whose_defaults_ran_flash_attention() -> None:
    results = {"appliance_defaults": {"1": {"tokens_per_s": 90.0, "ttft_p99_ms": 30.0,
                                            "flash_attention_resolved": True},
                                      "2": {"tokens_per_s": 90.0, "ttft_p99_ms": 30.0,
                                            "flash_attention_resolved": False}},
               "appliance_flash_on": {"1": {"tokens_per_s": 100.0, "ttft_p99_ms": 20.0},
                                      "2": {"tokens_per_s": 100.0, "ttft_p99_ms": 20.0}},
               "llama_server_defaults": {"1": {"tokens_per_s": 110.0, "ttft_p99_ms": 40.0},
                                         "2": {"tokens_per_s": 110.0, "ttft_p99_ms": 40.0}},
               "llama_server_flash_on": {"1": {"tokens_per_s": 100.0, "ttft_p99_ms": 50.0},
                                         "2": {"tokens_per_s": 100.0, "ttft_p99_ms": 50.0}}}
    same = concurrency.same_settings(results, {"llama_server_defaults": "auto -> enabled"}, [1, 2])
    assert same["appliance"] == {"1": {"tok_s": pytest.approx(0.9), "ttft_p99": pytest.approx(1.5)}}  # N=2: off
    assert same["llama_server"]["2"] == {"tok_s": pytest.approx(1.1), "ttft_p99": pytest.approx(0.8)}
    assert "llama_server" not in concurrency.same_settings(results, {"llama_server_defaults": "auto -> disabled"},
                                                           [1, 2])
    del results["appliance_flash_on"]
    assert "appliance" not in concurrency.same_settings(results, {}, [1, 2])


def test_config_sets_the_slots_and_only_the_asked_flash_attention(tmp_path: Path) -> None:
    defaults, fixed, single, flash_on, flash_off = concurrency.appliance_paths()
    for path, slots in ((defaults, concurrency.BATCHED_SLOTS), (fixed, concurrency.BATCHED_SLOTS), (single, 1),
                        (flash_on, concurrency.BATCHED_SLOTS), (flash_off, concurrency.BATCHED_SLOTS)):
        text = concurrency.concurrency_config(tmp_path / "m.gguf", tmp_path, n_ctx=512, http_port=1,
                                              engine=concurrency.engine_settings(path, 2))
        assert f"{concurrency.SLOTS_KEY}: {slots}" in text and "threads: 2" in text
        assert ("flash_attention: true" in text) == (path is flash_on)
        assert ("flash_attention: false" in text) == (path is flash_off)
        assert ("adaptive: false" in text) == (path is fixed) and "adaptive: true" not in text
    assert [p.name for p in concurrency.appliance_paths(flash_off=False)] == [defaults.name, fixed.name, single.name,
                                                                                flash_on.name]
    assert [p.flash_attention for p in concurrency.llama_server_paths()] == [None, True, False]
    assert [p.strict for p in (defaults, fixed, single, flash_on, flash_off)] == [False, False, False, False, True]
    assert all(p.strict for p in concurrency.llama_server_paths())


def test_llama_server_gets_flash_attention_only_when_asked(tmp_path: Path) -> None:
    assert peer.flash_attention_args(None) == []
    assert peer.flash_attention_args(True) == ["--flash-attn", "on"]
    assert peer.flash_attention_args(False) == ["--flash-attn", "off"]
    server = peer.LlamaServer(tmp_path / "llama-server", tmp_path / "m.gguf", 2, 2, 192)
    assert "--flash-attn" not in server.argv()
    os.environ["LLAMA_ARG_FLASH_ATTN"] = "off"
    try:
        assert "LLAMA_ARG_FLASH_ATTN" not in peer.server_environment()
    finally:
        del os.environ["LLAMA_ARG_FLASH_ATTN"]
    log = "llama_context: flash_attn            = auto\n...\nsched_reserve: Flash Attention enabled\n"
    assert peer.logged_flash_attention(log) == "auto -> enabled"
    assert peer.logged_flash_attention("llama_context: flash_attn            = disabled\n") == "disabled"
    assert peer.logged_flash_attention("nothing about it\n") is None


def check_quick_result(r: dict[str, Any], printed: str) -> None:
    """What every quick run shows, the peer present or not."""
    assert r["benchmark"] == "concurrency" and r["quick"] and r["agents"] == [1, 2]
    for path in r["paths"].values():
        for n, entry in path["by_agents"].items():
            if path["strict"]:
                assert entry["tokens"] == [[r["tokens"]] * int(n)] * r["rounds"], entry["errors"]
            assert entry["tokens_per_s"] > 0 and entry["peak_rss_bytes"] > 0
            assert 0 < entry["ttft_p50_ms"] <= entry["ttft_p99_ms"]
    assert r["tokens_complete"]
    for rounds in r["rounds_by_agents"].values():  # every attempt recorded; the figures from `rounds` of them
        assert len(rounds["records"]) == rounds["attempted"] <= r["rounds"] + r["max_reruns"]
        assert len(rounds["kept_attempts"]) == r["rounds"]
        assert rounds["noisy"] == (rounds["clean"] < r["rounds"])
        assert all(rec["foreign_share"] is None or 0 <= rec["foreign_share"] <= 1 for rec in rounds["records"])
    assert r["box_load"]["wall_s"] > 0 and r["box_load"]["other_processes_share_of_box"] >= 0
    assert {row["key"] for row in r["targets"]} >= {"defaults_tok_s_n1", "defaults_tok_s_n2",
                                                     "defaults_ttft_p99_n1", "defaults_ttft_p99_n2"}
    for n in ("1", "2"):  # the adaptive engine beside the fixed strategy, in the same rounds
        adaptive = r["paths"]["appliance_defaults"]["by_agents"][n]
        fixed = r["paths"]["appliance_fixed"]["by_agents"][n]
        for key, figure in (("adaptive_vs_fixed_tok_s", "tokens_per_s"), ("adaptive_vs_fixed_ttft_p99", "ttft_p99_ms")):
            assert r["comparisons"][n][key] == pytest.approx(adaptive[figure] / fixed[figure])
            assert 0 < r["comparisons"][n][key] < math.inf
        row = {row["key"]: row for row in r["targets"]}[f"adaptive_vs_fixed_tok_s_n{n}"]
        assert row["value"] == r["comparisons"][n]["adaptive_vs_fixed_tok_s"] and row["met"] == (row["value"] >= 1.0)
        assert f"N={n}: adaptive / fixed tok/s" in printed
    assert "adaptive / fixed tok/s N=1" in r["headline"]
    for n in ("1", "2"):  # read from each appliance's /v1/health after its warm-up
        assert isinstance(r["paths"]["appliance_flash_on"]["by_agents"][n]["flash_attention_resolved"], bool)
    for name, path in r["paths"].items():  # and its live context after the rounds
        if path["kind"] == "appliance":
            for entry in path["by_agents"].values():
                context = entry["context_after_rounds"]
                assert context["pool_cells"] > 0 and context["kv_streams"] >= 0, context
            assert f"{name}: live context after the rounds: N=1 " in printed
    if r["paths"]["appliance_defaults"]["by_agents"]["1"]["flash_attention_resolved"]:  # an A/A pair: its ratios
        defaults = r["paths"]["appliance_defaults"]["by_agents"]["1"]
        flash_on = r["paths"]["appliance_flash_on"]["by_agents"]["1"]
        assert r["same_settings"]["appliance"]["1"]["tok_s"] == pytest.approx(defaults["tokens_per_s"]
                                                                               / flash_on["tokens_per_s"])
        assert "A/A (appliance defaults / flash on, the same settings) tok/s N=1" in r["headline"]
        assert "A/A, appliance defaults / flash on" in printed
    for row in r["targets"]:
        assert f"{row['target']}" in printed
    headlines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert len(headlines) == 1 and headlines[0] == r["headline"]
    noisy = any(rounds["noisy"] for rounds in r["rounds_by_agents"].values())
    assert ("NOISY" in r["headline"]) == noisy


def test_concurrency_quick_with_the_peer_absent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = concurrency.slots_setting_missing()
    if missing is not None:
        pytest.skip(missing)
    out = tmp_path / "concurrency.json"
    rc = concurrency.main(["--quick", "--peer-cache", str(tmp_path / "no-peer"), "--model-dir",
                           str(tmp_path / "models"), "--out", str(out), "--keep-logs", str(tmp_path / "logs")])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert rc == 0, printed
    for n in (1, 2):  # --keep-logs: each appliance's log, at level info, naming the agents of every round
        log = (tmp_path / "logs" / f"N{n}" / "appliance_defaults.log").read_text()
        assert f"agent appliance_defaults-{n}-r0-agent{n - 1}@bench registered" in log, log[-2000:]
    assert set(r["paths"]) == {"appliance_defaults", "appliance_fixed", "appliance_one_at_a_time",
                               "appliance_flash_on", "appliance_flash_off"}
    for name in ("llama_server_defaults", "llama_server_flash_on", "llama_server_flash_off"):
        assert r["notes"][name].startswith("absent: llama.cpp is not built in"), r["notes"]
    assert r["llama_batched_bench"] is None
    assert all(row["met"] is None for row in r["targets"] if row["key"].startswith("defaults_"))
    assert "absent" in r["headline"]
    check_quick_result(r, printed)
    # One at a time and flash attention off, every text is the solo one. With more sequences or flash attention on,
    # a near-tie in the random model's logits may flip (recorded in the JSON); tests/test_engine_v2.py asserts the
    # batched engine's solo equality on prompts without near-ties.
    assert r["texts_match_solo"]["appliance_flash_off"]
    assert r["comparisons"]["2"]["vs_one_at_a_time"] > 0


@pytest.mark.skipif(peer.built_binaries() is None, reason="llama.cpp's llama-server is not built "
                                                          "(python -m benchmarks.peer build)")
def test_concurrency_quick_with_the_peer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "concurrency.json"
    rc = concurrency.main(["--quick", "--no-flash-off", "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert rc == 0, printed
    assert set(r["paths"]) == {"appliance_defaults", "appliance_fixed", "appliance_one_at_a_time",
                               "appliance_flash_on", "llama_server_defaults", "llama_server_flash_on"}
    assert r["notes"]["llama_server_defaults"] == "measured"
    assert r["llama_server_flash_attention"] == {"llama_server_defaults": "auto -> enabled",
                                                 "llama_server_flash_on": "enabled"}
    for n in ("1", "2"):
        assert r["comparisons"][n]["defaults_tok_s"] > 0 and r["comparisons"][n]["flash_on_ttft_p99"] > 0
    assert all(row["met"] is not None for row in r["targets"] if row["key"].startswith("defaults_"))
    assert [b["n_parallel"] for b in r["llama_batched_bench"]] == [1, 2]
    for row in r["llama_batched_bench"]:
        assert row["gen_tok_s"] > 0 and row["gen_tok_s_unified"] > 0
        assert row["unified_over_split"] == pytest.approx(row["gen_tok_s_unified"] / row["gen_tok_s"])
    assert "the same with one unified KV buffer (unified / split): 1: " in printed
    check_quick_result(r, printed)
