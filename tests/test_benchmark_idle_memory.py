"""``benchmarks/idle_memory.py`` in its --quick mode: a real ``appliance run`` on the demo model, measured started
and with the model loaded, beside the bare interpreter with llama_cpp (and llama-server where it is built)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import idle_memory as bench
from benchmarks import peer


def check_result(result: dict[str, Any], printed: str) -> None:
    appliance = result["mib"]["appliance"]
    for phase in ("started", "loaded"):
        figures = appliance[phase]
        assert set(figures) == set(bench.STATUS_FIELDS)
        assert 0 < figures["VmRSS"] <= figures["VmHWM"]
        assert figures["RssAnon"] + figures["RssFile"] <= figures["VmRSS"] + 1  # RssShmem is the rest
    # the loaded model's weights are mapped: 7 MiB of f16 for 4 layers x 256 plus the 32k-token embeddings
    assert appliance["loaded"]["RssFile"] > appliance["started"]["RssFile"] + 5
    # the floor imports numpy with llama_cpp, which a serving appliance no longer does: no order between the two
    assert result["mib"]["python_floor"]["loaded"]["VmRSS"] > 0
    assert result["meets_target"] == (appliance["loaded"]["VmRSS"] <= result["target_mib"])
    headlines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert headlines == [result["headline"]]
    assert f"appliance {appliance['loaded']['VmRSS']:.1f} MiB" in result["headline"]


@pytest.mark.slow
def test_idle_memory_runs_quick_with_llama_server_absent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "idle_memory.json"
    rc = bench.main(["--quick", "--peer-cache", str(tmp_path / "no-peer"), "--model-dir", str(tmp_path / "models"),
                     "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(out.read_text())
    assert result["starts"] == 1 and set(result["mib"]) == {"appliance", "python_floor"}
    assert result["ratio_to_llama_server"] is None and "llama-server absent" in result["headline"]
    assert result["notes"]["llama_server"].startswith("absent: llama.cpp is not built in")
    assert result["model"] == "tiny-4x256-f16-ctx2048-s0.gguf"
    check_result(result, printed)


@pytest.mark.slow
@pytest.mark.skipif(peer.built_binaries() is None, reason="llama.cpp's llama-server is not built "
                                                          "(python -m benchmarks.peer build)")
def test_idle_memory_runs_quick_beside_llama_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "idle_memory.json"
    rc = bench.main(["--quick", "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(out.read_text())
    theirs = result["mib"]["llama_server"]["loaded"]["VmRSS"]
    assert theirs > 0
    assert result["ratio_to_llama_server"] == pytest.approx(result["mib"]["appliance"]["loaded"]["VmRSS"] / theirs,
                                                            abs=0.01)
    check_result(result, printed)
