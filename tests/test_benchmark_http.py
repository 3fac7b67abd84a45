"""``benchmarks/http.py`` in its --quick mode with llama.cpp's ``llama-server`` absent (and present, where it is
built): the appliance's OpenAI API returns the in-process library's greedy texts for the same prompt tokens, and
health is probed under the 8 streams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import http as bench
from benchmarks import peer


def check_result(result: dict[str, Any], printed: str) -> None:
    """What every quick run shows, the peer present or not."""
    assert result["texts_match"] is True and result["flash_attention"] == "on"
    for name, path in result["paths"].items():
        assert path["one"]["completion_tokens"] == [1], name
        assert path["stream"]["completion_tokens"] == [result["tokens"]], name
        assert path["prompt_tokens_match_in_process"], (name, path["prompt_tokens"])
        assert path["one"]["overhead_ms"] == pytest.approx(
            path["one"]["median_ms"] - result["paths"]["in_process"]["one"]["median_ms"])
    rounds = result["rounds"]
    assert rounds["wanted"] == 2 and len(rounds["kept_attempts"]) == 2
    assert len(rounds["records"]) == rounds["attempted"] <= rounds["wanted"] + rounds["max_reruns"]
    assert ("NOISY" in result["headline"]) == rounds["noisy"] == (rounds["clean"] < rounds["wanted"])
    for name, path in result["paths"].items():  # 5 timed 1-token requests and one of each other kind per kept round
        assert (path["one"]["n"], path["request"]["n"], path["stream"]["n"]) == (10, 2, 2), name
    health = result["health"]
    assert health["streams_all_running"] and not health["load_failures"] and health["under_load"]["median_ms"] > 0
    for row in result["targets"]:
        assert row["target"] in printed
    headlines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert headlines == [result["headline"]]


@pytest.mark.slow
def test_the_http_benchmark_runs_quick_with_llama_server_absent(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "http.json"
    rc = bench.main(["--quick", "--peer-cache", str(tmp_path / "no-peer"), "--model-dir", str(tmp_path / "models"),
                     "--out", str(out)])
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert set(result["paths"]) == {"in_process", "appliance"}
    assert result["notes"]["llama_server"].startswith("absent: llama.cpp is not built in")
    assert "llama-server absent" in result["headline"]
    met = result["meets_targets"]
    assert met["overhead_1_token"] is None and met["stream_tokens_per_s"] is None  # absent, not faked
    assert met["health_under_load"] is not None
    check_result(result, printed)


@pytest.mark.slow
@pytest.mark.skipif(peer.built_binaries() is None, reason="llama.cpp's llama-server is not built "
                                                          "(python -m benchmarks.peer build)")
def test_the_http_benchmark_runs_quick_against_llama_server(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "http.json"
    rc = bench.main(["--quick", "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert set(result["paths"]) == {"in_process", "appliance", "llama_server"}
    assert result["notes"]["llama_server"] == "measured"
    assert result["llama_server_flash_attention_logged"] == "enabled"  # --flash-attn on, as the others
    # llama-server honoured the request as sent: same prompt tokens, max_tokens, greedy text as the library.
    assert result["paths"]["llama_server"]["text_matches_in_process"]
    met = result["meets_targets"]
    assert met["overhead_1_token"] is not None and met["stream_tokens_per_s"] is not None
    assert "appliance / llama-server" in result["headline"]
    check_result(result, printed)


def test_targets_compare_the_appliance_with_llama_server_and_are_absent_without_it() -> None:
    def path(one_ms: float, tokens_per_s: float) -> dict[str, Any]:
        return {"one": {"paired_overhead_ms": one_ms}, "stream": {"tokens_per_s": tokens_per_s}}

    health = {"under_load": {"median_ms": 1.5}}
    rows = {row["key"]: row for row in bench.target_rows({"appliance": path(0.9, 960.0),
                                                          "llama_server": path(1.0, 1000.0)}, health, 32)}
    assert rows["overhead_1_token"]["met"] and rows["overhead_1_token"]["ratio"] == pytest.approx(0.9)
    assert rows["stream_tokens_per_s"]["met"] and rows["stream_tokens_per_s"]["ratio"] == pytest.approx(0.96)
    assert rows["health_under_load"]["met"]
    rows = {row["key"]: row for row in bench.target_rows({"appliance": path(1.1, 940.0),
                                                          "llama_server": path(1.0, 1000.0)}, None, 32)}
    assert rows["overhead_1_token"]["met"] is False and rows["stream_tokens_per_s"]["met"] is False
    assert rows["health_under_load"]["met"] is None
    rows = {row["key"]: row for row in bench.target_rows({"appliance": path(1.1, 940.0)}, health, 32)}
    assert rows["overhead_1_token"]["met"] is None and rows["stream_tokens_per_s"]["met"] is None
    rows = {row["key"]: row for row in bench.target_rows({"appliance": path(0.5, 940.0),
                                                          "llama_server": path(-0.1, 1000.0)}, health, 32)}
    assert rows["overhead_1_token"]["ratio"] is None and rows["overhead_1_token"]["met"] is False


def test_every_server_gets_the_same_raw_greedy_body() -> None:
    assert bench.completion_body("Once upon a time", 1, False) == {
        "model": "bench", "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0.0, "stream": False}
    assert bench.completion_body("x", 32, True)["stream_options"] == {"include_usage": True}
