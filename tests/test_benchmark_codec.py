"""benchmarks/codec.py in its --quick mode: it runs, the codecs agree on every payload, the JSON is sane."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from appliance.protocol import jsoncodec
from benchmarks import codec


def test_codec_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "codec.json"
    rc = codec.main(["--quick", "--out", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert rc == 0 and result["name"] == "codec" and result["problems"] == []
    assert 1800 <= result["payload_bytes"]["chat_body"] <= 2600  # the "2 KB chat request body"
    assert len(result["rounds"]) == 1
    for key, row in result["summary"].items():
        for name in codec.CODECS:
            assert row[f"{name}_us"] > 0, key
        assert row["msgspec_speedup"] == pytest.approx(row["stdlib_us"] / row["msgspec_us"])
    headlines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert headlines == [result["headline"]]
    pattern = (r"HEADLINE: codec \(per call, medians of 1 rounds\): 1-token MAGN reply encode stdlib [\d.]+ us, "
               r"orjson [\d.]+x, msgspec [\d.]+x; .*; the appliance uses msgspec"
               r"(; NOISY: other processes used \d+% of the CPU)?")
    assert re.fullmatch(pattern, result["headline"])


def test_the_benchmark_names_the_codec_the_appliance_uses() -> None:
    assert codec.CHOSEN == jsoncodec.LIBRARY == "msgspec"
    assert isinstance(jsoncodec._ENCODER, msgspec.json.Encoder)
    assert isinstance(jsoncodec._DECODER, msgspec.json.Decoder)
