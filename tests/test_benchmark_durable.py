"""``benchmarks/durable.py`` (issue #24's benchmark): its bookkeeping without a server, the tier guard against a real
``appliance run``, and its --quick mode end to end (the result's shape and the tiers, not the speed)."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from appliance.daemon.store import AgentRecord, DeleteAgent, PutAgent
from benchmarks import durable


def headline_of(printed: str) -> str:
    lines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert len(lines) == 1, printed
    return lines[0]


# -- bookkeeping ---------------------------------------------------------------------------------------------------


def test_the_variants_differ_only_in_the_disk_tier(tmp_path: Path) -> None:
    import yaml

    docs = {v.name: yaml.safe_load(durable.restart_config(tmp_path / "m.gguf", tmp_path, v, 4096, 1))
            for v in durable.VARIANTS}
    assert {v.name: v.expect for v in durable.VARIANTS} == {"disk": "disk", "tokens": "tokens"}
    assert docs["disk"]["disk_kv_budget"] == "auto" and docs["tokens"]["disk_kv_budget"] == 0
    assert {k: v for k, v in docs["disk"].items() if k != "disk_kv_budget"} == \
        {k: v for k, v in docs["tokens"].items() if k != "disk_kv_budget"}
    assert docs["disk"]["http"]["port"] == 0 and docs["disk"]["device"].startswith("fake:")
    assert docs["disk"]["engine"] == {"adaptive": False, "threads": 1}


def test_the_conversation_prompt_is_one_word_per_token() -> None:
    prompt = durable.conversation_prompt(2000)
    assert len(prompt.split()) == 1999 and prompt == durable.conversation_prompt(2000)  # seeded


def test_payload_and_batching_arithmetic() -> None:
    record = AgentRecord("a", "m", "1:2", "v", "client", 0.0, 0.0, tuple(range(100)), "device", None)
    assert durable.payload_bytes(PutAgent(record)) == 400 + len("am1:2vclientdevice") + 16
    assert durable.payload_bytes(DeleteAgent("a")) == 0
    before = {"commits": 2, "transactions": 1, "writes": 2, "commit_seconds": 0.5, "payload": 10, "wchar": 100}
    after = {"commits": 10, "transactions": 5, "writes": 9, "commit_seconds": 1.5, "payload": 90, "wchar": 4100}
    counts = durable.batching(before, after)
    assert counts == {"commits": 8, "transactions": 4, "writes": 7, "transaction_seconds": 1.0, "payload_bytes": 80,
                      "written_bytes": 4000}
    summary = durable.store_summary([0.001, 0.002, 0.003], counts)
    assert summary["commits_per_transaction"] == 2.0 and summary["written_bytes_per_commit"] == 500
    assert summary["commit_wait_median_ms"] == pytest.approx(2.0)


def test_a_conversation_that_does_not_fit_n_ctx_is_refused() -> None:
    with pytest.raises(SystemExit):
        durable.parse_args(["--tokens", "4080", "--n-ctx", "4096"])


def test_a_restart_that_reports_another_tier_stops_the_run(tiny_model: Path) -> None:
    """The guard: a folder without a KV file (disk_kv_budget 0) restarted by a variant that expects ``disk`` raises
    WrongTier instead of timing the re-evaluation as a disk restore."""
    args = argparse.Namespace(n_ctx=512, threads=1)
    state = Path(tempfile.mkdtemp(prefix="ap-durt-"))
    try:
        built = durable.build(tiny_model, state, durable.VARIANTS[1], args, durable.conversation_prompt(50))
        assert built["kv_restored_from"] == "none" and built["prompt_tokens"] == 50
        mislabelled = durable.Variant("disk", 0, "disk")
        with pytest.raises(durable.WrongTier, match="kv_restored_from=tokens, not disk"):
            durable.restart(state, mislabelled, "wrong", warm_kv=True)
    finally:
        shutil.rmtree(state, ignore_errors=True)


# -- --quick end to end --------------------------------------------------------------------------------------------


def test_quick_run_measures_both_tiers_and_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "durable.json"
    rc = durable.main(["--quick", "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert rc == 0 and r["ok"], printed
    assert r["benchmark"] == "durable" and r["quick"] is True

    rs = r["restart"]
    assert rs["rounds"] == 2 and rs["conversation_tokens"] == 200 + durable.BUILD_TOKENS
    assert {name: b["kv_restored_from"] for name, b in rs["build"].items()} == {"disk": "none", "tokens": "none"}
    assert [s["kv_restored_from"] for s in rs["samples"]["disk"]] == ["disk", "disk"]
    assert [s["kv_restored_from"] for s in rs["samples"]["tokens"]] == ["tokens", "tokens"]
    assert all(s["kv_swap_restored"] == "true" for s in rs["samples"]["disk"])
    assert all(s["prompt_evaluated"] == 1 for s in rs["samples"]["disk"])  # only the token before the new one
    assert all(s["prompt_evaluated"] > 200 for s in rs["samples"]["tokens"])  # the whole conversation again
    assert [s["round"] for s in rs["samples"]["disk"]] == [0, 1]
    assert rs["tiers_as_expected"] is True and rs["continuations_equal"] is True
    for name in ("disk", "tokens"):
        m = rs["medians"][name]
        assert 0 < m["ready_s"] < m["restart_to_first_token_s"]
        assert m["decode_s"] > 0 and m["stop_s"] > 0 and m["ttft_ms"] > 0
        assert m["model_load_s"] is None or 0 < m["model_load_s"] < m["decode_s"]  # parsed from its log line
    assert set(rs["ratio_tokens_to_disk"]) == {"restart_to_first_token", "decode", "decode_less_load",
                                               "restart_to_first_token_paired_median"}
    kv = rs["kv_file"]
    assert kv["bytes"] > 100_000 and len(kv["reads"]) == 2
    assert kv["raw_cold_s"] > 0 and kv["raw_warm_s"] > 0 and kv["checked_cold_s"] > 0

    st = r["store"]
    decodes = st["agents"] * st["decodes_per_agent"] * st["rounds"]
    assert (st["agents"], st["decodes_per_agent"], st["rounds"]) == (2, 3, 2)
    assert st["decode_latency"]["store"]["decodes"] == st["decode_latency"]["none"]["decodes"] == decodes
    d = st["in_daemon"]
    assert d["commits"] == decodes  # one awaited commit per timed decode, registrations and warm-up left out
    assert 1 <= d["transactions"] <= d["commits"] and d["commits_per_transaction"] >= 1
    assert d["payload_bytes_per_commit"] > 4 * 8  # at least the tokens of a conversation
    assert d["written_bytes_per_commit"] is None or d["written_bytes_per_commit"] > 0
    assert d["commit_wait_p99_ms"] >= d["commit_wait_median_ms"] > 0
    direct = st["direct_2k_records"]
    assert set(direct) == {"at_once_1", "at_once_2"}
    assert direct["at_once_1"]["commits_per_transaction"] == 1.0
    assert direct["at_once_1"]["payload_bytes_per_commit"] > durable.DIRECT_TOKENS * 4
    assert all(s["store"] is False and "commit_waits_s" not in s for s in st["sessions"]["none"])
    assert not st["failures"]

    headline = headline_of(printed)
    assert headline == r["headline"] and headline.startswith("HEADLINE: durable 208-token agent 4x256 f16: ")
    assert "from disk vs" in headline and "commits per transaction" in headline
