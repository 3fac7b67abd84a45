"""benchmarks/flash_attention.py in its --quick mode: both settings measured in the same run, what llama.cpp chose for
each, the ratios and the headline (the figures themselves are the full run's, not checked here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_the_quick_run_measures_off_and_on_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import flash_attention as bench

    out = tmp_path / "flash_attention.json"
    rc = bench.main(["--quick", "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert rc == 0
    assert result["benchmark"] == "flash_attention" and result["quick"] is True
    off, on = result["modes"]["off"], result["modes"]["on"]
    assert off["flash_attn"] is False and on["flash_attn"] is True  # what llama.cpp ran, not what was asked
    for row in (off, on):
        assert row["tokens_per_s"] > 0 and row["park_ms"] > 0
        assert row["cells"] == bench.PROMPT + result["decode_steps"]
        assert len(row["rounds"]) == result["rounds"] == 1
    assert off["state_bytes"] == on["state_bytes"]  # the same cells, laid out differently
    assert result["ratios"]["decode_on_vs_off"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])
    assert result["ratios"]["park_off_vs_on"] == pytest.approx(off["park_ms"] / on["park_ms"])
    assert result["box"]["other_processes_share_of_box"] >= 0
    assert result["headline"].startswith("HEADLINE: flash attention 2x128 f16")
    assert result["headline"] in printed
