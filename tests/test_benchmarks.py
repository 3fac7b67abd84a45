"""The benchmark scripts (SPEC B4) in their --quick mode: they run, write sane JSON and print a HEADLINE."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from appliance.engine.runtime import Conversation
from appliance.engine.slots import Slots
from benchmarks import admission, common, kv_swap, prefix


def run_main(main: Any, argv: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any],
                                                                                               str]:
    rc = main([*argv, "--out", str(out)])
    printed = capsys.readouterr().out
    return rc, json.loads(out.read_text()), printed


def headline_of(printed: str) -> str:
    lines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert len(lines) == 1, printed
    return lines[0]


# -- common -------------------------------------------------------------------------------------------------

def test_tiny_model_is_cached_under_a_name_that_holds_every_parameter(tmp_path: Path) -> None:
    a = common.tiny_model(tmp_path, layers=1, dim=64)
    assert a.name == "tiny-1x64-f16-ctx2048-s0.gguf" and a.is_file()
    mtime = a.stat().st_mtime_ns
    assert common.tiny_model(tmp_path, layers=1, dim=64) == a and a.stat().st_mtime_ns == mtime  # not rewritten
    b = common.tiny_model(tmp_path, layers=1, dim=64, n_ctx_train=8192)  # same shape, other n_ctx_train
    c = common.tiny_model(tmp_path, layers=1, dim=64, heads=1, kv_heads=1, ff=32, seed=3, label="x")
    assert b.name == "tiny-1x64-f16-ctx8192-s0.gguf"
    assert c.name == "x-1x64-h1kv1-ff32-f16-ctx2048-s3.gguf"
    assert len({a, b, c}) == 3 and b.is_file() and c.is_file()


# -- admission ----------------------------------------------------------------------------------------------

def test_admission_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, r, printed = run_main(admission.main, ["--quick", "--model-dir", str(tmp_path / "models")],
                              tmp_path / "admission.json", capsys)
    assert rc == 0
    assert r["benchmark"] == "admission"
    assert r["device"]["total_bytes"] == 8 * 2**30
    assert r["cap_bytes"] == 8 * 2**30 * 9 // 10
    n_models = len(r["models"])
    n_agents = r["agents_per_model"] * n_models
    assert n_models == 3

    # Shapes really come from the files written, and the KV figures follow from them.
    for m, decl in zip(r["models"], admission.MODELS, strict=True):
        f = m["measured_from_file"]
        assert (f["layers"], f["n_head_kv"], f["n_ctx_train"]) == (decl.layers, decl.kv_heads, decl.n_ctx_train)
        assert f["head_dim_k"] == decl.dim // decl.heads
        assert f["kv_bytes_per_token"] == f["layers"] * 2 * f["n_head_kv"] * f["head_dim_k"] * 2  # f16 K + V
        assert (tmp_path / "models" / m["file"]).is_file()
        assert m["naive_estimate"]["kv"] == f["kv_bytes_per_token"] * f["n_ctx_train"]
        assert m["naive_process_bytes"] > m["appliance_estimate"]["total"]

    naive, appl = r["naive"], r["appliance"]
    # The scenario: a naive one-process-per-model setup cannot hold the three models; the appliance can.
    assert naive["one_process_per_model"]["needed_bytes"] > r["device"]["total_bytes"]
    assert naive["one_process_per_model"]["models_placed"] < n_models
    assert appl["models_placed"] == n_models and appl["agents_placed"] == n_agents
    assert appl["models_placed"] >= naive["one_process_per_agent"]["models_placed"]
    assert appl["agents_placed"] > naive["one_process_per_agent"]["agents_placed"]
    assert appl["ledger_allocated_bytes"] <= appl["ledger_cap_bytes"]
    assert sum(appl["reservations"].values()) == appl["ledger_allocated_bytes"]

    headline = headline_of(printed)
    assert headline == r["headline"]
    expected = (f"appliance placed {appl['models_placed']}/{n_models} models ({appl['agents_placed']}/{n_agents} "
                f"agents), naive per-process placed {naive['one_process_per_agent']['models_placed']}/{n_models} "
                f"models ({naive['one_process_per_agent']['agents_placed']}/{n_agents} agents)")
    assert headline.endswith(expected)


def test_admission_refuses_what_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a 4 GiB device the 7B-class model no longer fits: the real ledger denies it, with its CAP details."""
    rc, r, _ = run_main(admission.main, ["--quick", "--device-size", "4GiB", "--model-dir", str(tmp_path / "m")],
                        tmp_path / "admission.json", capsys)
    assert rc == 0
    denied = [m for m in r["models"] if not m["appliance_admitted"]]
    assert [m["name"] for m in denied] == ["chat-7b"]
    assert denied[0]["appliance_denial"]["code"] == "CAP"
    assert r["appliance"]["models_placed"] == 2
    assert r["appliance"]["agents_placed"] == 2 * r["agents_per_model"]
    assert "appliance placed 2/3 models" in r["headline"]


# -- kv_swap ------------------------------------------------------------------------------------------------

def test_kv_swap_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, r, printed = run_main(kv_swap.main, ["--quick", "--model-dir", str(tmp_path / "models")],
                              tmp_path / "kv_swap.json", capsys)
    assert rc == 0
    assert r["benchmark"] == "kv_swap" and r["quick"] is True
    assert r["context_tokens"] == 200
    kv = r["kv_bytes"]
    # f16 K and V for 2 layers x 128 wide x 200 cells, plus llama.cpp's small per-cell header.
    assert 2 * 2 * 128 * 200 * 2 <= kv < 2 * 2 * 128 * 200 * 2 + 16 * 1024
    ours, cp, lcp = r["ours"], r["memcpy"], r["llama_cpp_python"]
    assert ours["bytes_moved"] == 2 * kv
    assert ours["save_ms"] > 0 and ours["restore_ms"] > 0
    assert ours["evict_restore_ms"] == pytest.approx(2 * kv / (ours["gb_per_s"] * 1e9) * 1e3)
    assert cp["bytes"] == kv and cp["gb_per_s"] > 0
    assert ours["pct_of_memcpy"] == pytest.approx(100 * ours["gb_per_s"] / cp["gb_per_s"])
    assert lcp["state_bytes"] >= kv and lcp["gb_per_s"] > 0 and lcp["pct_of_memcpy"] > 0

    c = r["correctness"]
    assert c["restore_correct"] is True
    assert c["tokens_equal"] is True
    assert c["restored_tokens"] == c["reference_tokens"] and len(c["reference_tokens"]) == kv_swap.CHECK_TOKENS
    assert c["resumed_at_tokens"] == r["context_tokens"]
    assert c["max_abs_logit_diff"] <= kv_swap.LOGIT_TOLERANCE

    headline = headline_of(printed)
    assert headline == r["headline"]
    assert re.fullmatch(r"HEADLINE: kv_swap 200 ctx 2x128 f16: evict\+restore [\d.]+ ms, [\d.]+ GB/s = \d+% of "
                        r"memcpy \(llama-cpp-python save/load_state: \d+%\), resumed tokens match", headline)


def test_kv_swap_check_catches_a_corrupted_restore(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume check can fail: K data damaged on its way back changes the continuation's logits."""
    original = Slots._place

    def corrupting_place(self: Slots, conv: Conversation, seq_id: int) -> bool:
        if conv.where == "host" and conv.buffer is not None and conv.nbytes > 0:
            mid = conv.nbytes // 8  # inside layer 0's K rows, past the per-cell header
            conv.buffer[mid - 4096: mid + 4096] = b"\x3c" * 8192
        return original(self, conv, seq_id)

    monkeypatch.setattr(Slots, "_place", corrupting_place)
    rc, r, printed = run_main(kv_swap.main, ["--quick", "--model-dir", str(tmp_path / "models")],
                              tmp_path / "kv_swap.json", capsys)
    assert rc == 1
    assert r["correctness"]["restore_correct"] is False
    assert r["correctness"]["max_abs_logit_diff"] > kv_swap.LOGIT_TOLERANCE
    assert headline_of(printed).endswith("resumed tokens DIFFER")


def test_prefix_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With a shared system prompt the new agent evaluates only its question, and answers the same."""
    rc, r, printed = run_main(prefix.main, ["--quick", "--model-dir", str(tmp_path / "models")],
                              tmp_path / "prefix.json", capsys)
    assert rc == 0 and r["answers_equal"] is True
    cold, warm = r["without_reuse"], r["with_reuse"]
    assert cold["prompt_evaluated"] == r["prompt_tokens"] >= r["system_tokens"]
    assert 0 < warm["prompt_evaluated"] < 20  # the question only
    assert len(cold["ttft_ms"]) == len(warm["ttft_ms"]) == r["repeats"]
    assert r["ratio"] == pytest.approx(cold["median_ttft_ms"] / warm["median_ttft_ms"])
    assert re.fullmatch(r"HEADLINE: prefix 2x128 f16, \d+-token prompt: time to first token [\d.]+ ms with a shared "
                        r"200-token system prompt vs [\d.]+ ms without \([\d.]+x lower, target 5x\); answers equal",
                        headline_of(printed))
