"""benchmarks/protocol/ (SPEC B4) in its --quick mode, without the HTTP server: every path is measured and the
appliance over MAGN returns exactly the greedy text of llama-cpp-python called in-process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import protocol
from benchmarks.protocol import clients

IN_PROCESS = ("library", "library_prefix", "engine", "daemon")
MAGN = ("magn_raw", "magn_async", "magn")


def run_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "protocol.json"
    rc = protocol.main(["--quick", "--no-http", "--model-dir", str(tmp_path / "models"), "--out", str(out), *extra])
    return rc, json.loads(out.read_text()), capsys.readouterr().out


def headline_of(printed: str) -> str:
    lines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert len(lines) == 1, printed
    return lines[0]


def test_protocol_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, r, printed = run_quick(tmp_path, capsys)
    assert rc == 0
    assert r["benchmark"] == "protocol" and r["quick"] is True
    assert set(r["paths"]) == {*IN_PROCESS, *MAGN}  # --no-http: no HTTP path
    for name, p in r["paths"].items():
        one, stream = p["one_token"], p["stream"]
        assert one["requests"] == r["requests"] == 20, name
        assert stream["streams"] == r["streams"] == 3, name
        assert 0 < one["min_ms"] <= one["median_ms"] <= one["p90_ms"], name
        assert stream["median_ms"] > 0 and stream["tokens_per_s"] > 0, name
        assert one["completion_tokens"] == [1] and stream["completion_tokens"] == [64], name
        assert stream["tokens_per_s"] == pytest.approx(64 / (stream["median_ms"] / 1e3))
        assert one["overhead_ms"] == pytest.approx(one["median_ms"] - r["paths"]["library"]["one_token"]["median_ms"])

    # Correctness: the strings themselves, one per prompt, identical on the library and over MAGN.
    lib = r["paths"]["library"]["texts"]
    assert set(lib["one_token"]) == set(lib["stream"]) == set(protocol.PROMPTS)
    for kind in ("one_token", "stream"):
        assert all(len(texts) == 1 and texts[0].strip() for texts in lib[kind].values()), lib
    for prompt in protocol.PROMPTS:
        assert lib["stream"][prompt][0].startswith(lib["one_token"][prompt][0])  # greedy: 1 token is a prefix of 64
    for name in (*MAGN, "engine", "daemon"):
        assert r["paths"][name]["texts"] == lib, name
        assert r["paths"][name]["text_matches_library"] is True
    assert r["texts_match"] is True

    # The overhead split adds up: engine + daemon core + transport + client = MAGN - library.
    s = r["split_ms"]
    magn_overhead = r["paths"]["magn"]["one_token"]["overhead_ms"]
    assert s["engine_ms"] + s["daemon_core_ms"] + s["transport_ms"] + s["client_blocking_ms"] == pytest.approx(
        magn_overhead)
    async_overhead = r["paths"]["magn_async"]["one_token"]["overhead_ms"]
    assert s["engine_ms"] + s["daemon_core_ms"] + s["transport_ms"] + s["client_async_ms"] == pytest.approx(
        async_overhead)
    assert set(s) == {"engine_ms", "daemon_core_ms", "transport_ms", "client_async_ms", "client_blocking_ms",
                      "explained"}

    # HTTP was skipped, and the output says so (never silently).
    skipped = "skipped: --no-http was given"
    assert r["http"] == {"appliance": skipped, "llama_cpp_server": skipped}
    assert "HTTP path llama_cpp_server: skipped: --no-http was given" in printed

    headline = headline_of(printed)
    assert headline == r["headline"]
    assert re.fullmatch(r"HEADLINE: protocol 1-token: in-process [\d.]+ ms, MAGN [\d.]+ ms \([+-][\d.]+ ms; "
                        r"AsyncMagnClient [+-][\d.]+ ms\), HTTP llama_cpp.server skipped; 64-token stream: "
                        r"MAGN [\d.]+x \(async [\d.]+x\) in-process tokens/s", headline), headline


def test_protocol_text_check_catches_a_different_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The correctness check can fail: MAGN asked for another prompt answers other text, and the run says so."""
    original = clients.magn_request

    def other_prompt(prompt: str, max_tokens: int) -> dict[str, Any]:
        return original(prompt[::-1], max_tokens)

    monkeypatch.setattr(clients, "magn_request", other_prompt)
    rc, r, printed = run_quick(tmp_path, capsys, "--requests", "2", "--streams", "1", "--warmup", "1",
                               "--stream-tokens", "8")
    assert rc == 1
    assert r["texts_match"] is False
    for name in MAGN:
        assert r["paths"][name]["text_matches_library"] is False, name
        assert r["paths"][name]["texts"] != r["paths"]["library"]["texts"]
    for name in ("library_prefix", "engine", "daemon"):
        assert r["paths"][name]["text_matches_library"] is True, name
    assert headline_of(printed).endswith("texts DIFFER")


def test_protocol_runs_as_a_module() -> None:
    """``python -m benchmarks.protocol`` is the package's entry point."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.protocol", "--help"], cwd=Path(__file__).parent.parent,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m benchmarks.protocol")
    assert "--no-http" in done.stdout and "--model-dir" in done.stdout
