"""``benchmarks/kv_pool.py``: its workloads and bookkeeping without a server, then its --quick run against real
``appliance run`` processes (fixed and adaptive)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import kv_pool


def test_the_short_workload_is_one_agent_of_short_seeded_turns() -> None:
    short = kv_pool.short_workload(4, 0)
    assert short == kv_pool.short_workload(4, 0) and short != kv_pool.short_workload(4, 1)
    assert len(short.turns) == 4 and all(len(row) == 1 for row in short.turns)
    assert all(50 <= t.input_tokens <= 100 and t.max_tokens == 16 for row in short.turns for t in row)
    four = kv_pool.four_agent_workload(3, 0)
    assert four.name == "four_agents" and len(four.turns) == 3 and all(len(row) == 4 for row in four.turns)


def run_record(workload: str, strategy: str, peak: int | None, *, errors: bool = False, pools: int = 512) -> dict:
    return {"workload": workload, "strategy": strategy, "errors": ["x"] if errors else [],
            "figures": {"peak_memory_bytes": peak},
            "rounds": [{"contexts": [{"pool_cells": pools, "cold_cells": 0}]}]}


def test_compare_takes_medians_of_complete_runs_and_checks_the_target() -> None:
    runs = [run_record("short", "fixed", 1000), run_record("short", "fixed", 1200),
            run_record("short", "fixed", 1100), run_record("short", "adaptive", 600, pools=256),
            run_record("short", "adaptive", 900, pools=768), run_record("short", "adaptive", 100, errors=True)]
    compared = kv_pool.compare(runs, "short")
    assert compared["fixed_peak_bytes"] == 1100 and compared["adaptive_peak_bytes"] == 750
    assert compared["ratio"] == pytest.approx(750 / 1100)
    assert compared["met"] is True and compared["target_at_most"] == 0.7  # 0.68
    assert compared["adaptive_largest_pool_cells"] == 768
    missed = kv_pool.compare([run_record("four_agents", "fixed", 1000), run_record("four_agents", "adaptive", 1010)],
                             "four_agents")
    assert missed["met"] is False
    assert kv_pool.compare([run_record("short", "fixed", 1000)], "short")["ratio"] is None


def test_kv_pool_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kv_pool.json"
    rc = kv_pool.main(["--quick", "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    r = json.loads(out.read_text())
    assert r["benchmark"] == "kv_pool" and r["quick"] and r["complete"]
    assert set(r["comparison"]) == {"short", "four_agents"}
    for compared in r["comparison"].values():
        assert compared["fixed_peak_bytes"] > 0 and compared["adaptive_peak_bytes"] > 0
        assert compared["ratio"] == pytest.approx(compared["adaptive_peak_bytes"] / compared["fixed_peak_bytes"])
        assert compared["adaptive_largest_cold_cells"] == 0  # long requests grew the hot pool: no cold context
    assert {(run["workload"], run["strategy"]) for run in r["runs"]} == {
        (w, s) for w in ("short", "four_agents") for s in ("fixed", "adaptive")}
    headlines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert headlines == [r["headline"]]
    assert r["headline"].startswith("HEADLINE: kv_pool (4x256 f16, n_ctx 2048")
