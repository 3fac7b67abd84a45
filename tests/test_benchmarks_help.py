"""Every benchmark script answers ``--help`` (argparse formats each option's help with ``%``: a stray percent sign
breaks it only when someone asks for help)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py") if "def main(" in path.read_text()) + ["protocol"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_and_exits_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exited:
        module.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out
