"""benchmarks/grammar.py in its --quick mode: it runs, writes sane JSON and prints its HEADLINE."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import grammar


def test_grammar_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grammar.json"
    rc = grammar.main(["--quick", "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert rc == 0 and result["name"] == "grammar"
    assert result["grammar_source"].startswith("appliance.engine.toolcalls")
    assert len(result["rounds"]) == 1
    row = result["rounds"][0]
    for name in ("plain", "grammar"):
        assert row[name]["seconds"] > 0 and row[name]["other_tokens"] > 0
    assert row["plain"]["grammar_tokens"] > 0  # sequence 0 generated in both runs
    assert result["ratio"] == pytest.approx(row["grammar"]["others_tokens_per_s"] / row["plain"]["others_tokens_per_s"])
    assert result["build"]["parse_ms"] > 0 and result["build"]["copy_ms"] > 0
    headlines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert headlines == [result["headline"]]
    assert re.fullmatch(r"HEADLINE: grammar 2x128 f16, \d+-token vocabulary, 4 sequences: the 3 others \d+ tok/s "
                        r"beside one grammar vs \d+ without \([\d.]+x\); the grammar sequence \d+ tok/s \([\d.]+x\); "
                        r"10-tool grammar built in [\d.]+ ms, copied per sequence in \d+ us", result["headline"])
