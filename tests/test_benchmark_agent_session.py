"""``benchmarks/agent_session.py`` and ``benchmarks/contention.py`` (issue #12's benchmarks): their workload and
bookkeeping without a server, then each in its --quick mode against real ``appliance run`` processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from appliance.benchmark import session
from benchmarks import agent_session, contention


@pytest.fixture(scope="module")
def bench_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model folder for both quick runs (the 4x256 tiny model is written once)."""
    return tmp_path_factory.mktemp("bench-models")


def headline_of(printed: str) -> str:
    lines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert len(lines) == 1, printed
    return lines[0]


# -- the workload and the bookkeeping ------------------------------------------------------------------------------


def test_workloads_are_seeded_and_follow_the_seeds_shape() -> None:
    plain = session.session_workload(4, 20, 0)
    assert plain == session.session_workload(4, 20, 0)
    assert plain != session.session_workload(4, 20, 1)
    turns = [t for row in plain.turns for t in row]
    assert len(plain.turns) == 20 and all(len(row) == 4 for row in plain.turns)
    assert all(50 <= t.input_tokens <= 600 and len(t.text.split()) == t.input_tokens for t in turns)
    assert {t.max_tokens for t in turns} == {session.SHORT_OUTPUT, session.LONG_OUTPUT}

    shift = session.phase_shift_workload(4, 20, 0)
    assert [p.name for p in shift.phases] == ["tool_calls", "documents"]
    tools = [t for row in shift.turns[:10] for t in row]
    documents = [t for row in shift.turns[10:] for t in row]
    assert all(50 <= t.input_tokens <= 100 and t.max_tokens == session.SHORT_OUTPUT for t in tools)
    assert all(400 <= t.input_tokens <= 600 and t.max_tokens == session.LONG_OUTPUT for t in documents)


def test_an_agent_starts_a_new_conversation_when_the_turn_would_pass_n_ctx() -> None:
    agent = session.AgentState(2)
    step = session.Turn(100, 16, " the" * 100)
    assert agent.prompt_for(step, 1024) == step.text and agent.user == "agent2-conv0"
    result = session.TurnResult(2, 0, agent.user, 100, 16, text=" and so", prompt_tokens=900,
                                completion_tokens=16)
    agent.answered(step.text, result)
    assert agent.history == step.text + " and so" and agent.held_tokens == 916
    assert agent.prompt_for(step, 4096) == step.text + " and so" + step.text  # fits: the history is re-sent
    assert agent.rollovers == 0
    assert agent.prompt_for(step, 1024) == step.text  # 916 + 100 + 16 + margin > 1024: a new conversation
    assert agent.user == "agent2-conv1" and agent.rollovers == 1 and agent.held_tokens == 0
    assert agent.abandoned == ["agent2-conv0"]  # unregistered once the new conversation has answered


def test_an_answer_that_retokenizes_longer_is_counted_by_its_bytes() -> None:
    """Random weights write pieces that re-tokenize apart when the history is re-sent (a 128-token answer of the
    demo model came back as about 250 tokens, and the next turn overflowed n_ctx): the conversation is counted at
    the answer's UTF-8 bytes when they are more than its generated tokens, so it starts anew in time."""
    agent = session.AgentState(0)
    step = session.Turn(118, 16, " the" * 118)
    babble = "xq" * 200  # 400 bytes that were 128 generated tokens
    result = session.TurnResult(0, 0, agent.user, 316, 128, text=babble, prompt_tokens=1758, completion_tokens=128)
    agent.answered(agent.prompt_for(step, 2048), result)
    assert agent.held_tokens == 1758 + 400
    assert agent.prompt_for(step, 2048) == step.text and agent.rollovers == 1  # 1758 + 128 + 118 + 32 would fit


def test_improvement_is_positive_when_adaptive_is_better() -> None:
    assert session.improvement("ttft_p99_ms", 100.0, 70.0) == pytest.approx(0.3)
    assert session.improvement("peak_memory_bytes", 100.0, 130.0) == pytest.approx(-0.3)
    assert session.improvement("tokens_per_s", 100.0, 110.0) == pytest.approx(0.1)
    assert session.improvement("memory_growth_bytes", 1000.0, 0.0) is None  # under 1 MiB: meaningless
    assert session.improvement("tokens_per_s", None, 110.0) is None


def test_the_fixed_strategy_is_llama_cpp_pythons_defaults_and_the_config_carries_it(tmp_path: Path) -> None:
    fixed = agent_session.fixed_strategy(4096)
    assert fixed.engine == {"adaptive": False, "threads": session.llama_cpp_default_threads()}
    doc = yaml.safe_load(agent_session.session_config(tmp_path / "m.gguf", tmp_path, fixed, 8123))
    assert doc["engine"] == fixed.engine and doc["models"][0]["n_ctx"] == 4096
    adaptive = yaml.safe_load(agent_session.session_config(tmp_path / "m.gguf", tmp_path,
                                                           agent_session.adaptive_strategy(4096), 8123))
    assert adaptive["engine"] == {"adaptive": True}  # every other engine setting at its default


def test_choices_line_shows_only_the_changes() -> None:
    def sample(round_: int, pool: int, plan: str) -> dict[str, object]:
        return {"round": round_, "contexts": [{"pool_cells": pool, "plan": plan, "threads": 2}]}

    line = agent_session.choices_line([sample(1, 512, "S"), sample(2, 512, "S"), sample(3, 1024, "M")])
    assert line == "r1 512/S/2t, r3 1024/M/2t"


# -- the quick runs ------------------------------------------------------------------------------------------------


def test_agent_session_quick(tmp_path: Path, bench_models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "agent_session.json"
    # n_ctx 1024: conversations pass it within the 3 rounds, so agents start new ones and unregister the old
    rc = agent_session.main(["--quick", "--n-ctx", "1024", "--model-dir", str(bench_models), "--out", str(out)])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert rc == 0, printed
    assert r["benchmark"] == "agent_session" and r["quick"] and r["complete"]
    assert (r["agents"], r["rounds"], r["model"]["layers"], r["grid"]) == (2, 3, 4, None)
    assert [(run["workload"], run["strategy"]) for run in r["runs"]] == [
        ("session", "fixed"), ("session", "adaptive"), ("phase_shift", "fixed"), ("phase_shift", "adaptive")]
    for run in r["runs"]:
        assert len(run["turns"]) == 2 * 3 and len(run["rounds"]) == 3 and not run["errors"]
        assert all(t["ttft_ms"] is not None and t["completion_tokens"] > 0 for t in run["turns"])
        assert all(s["rss_bytes"] > 0 and s["hwm_bytes"] >= s["rss_bytes"] for s in run["rounds"])
        assert all(s["agents_registered"] == 2 for s in run["rounds"])  # a conversation left is unregistered
        later = [t for t in run["turns"] if t["round"] > 0]
        assert any(t["cached_tokens"] > 0 for t in later)  # conversations continue: the history is not re-evaluated
    for workload in ("session", "phase_shift"):
        c = r["comparison"][workload]
        for side in ("fixed", "adaptive"):
            assert c[side]["ttft_avg_ms"] > 0 and c[side]["ttft_p99_ms"] >= c[side]["ttft_avg_ms"]
            assert c[side]["tokens_per_s"] > 0 and c[side]["peak_memory_bytes"] > 0
            assert c[side]["memory_growth_bytes"] is not None
        choices = r["adaptive_choices"][workload]
        assert [entry["round"] for entry in choices] == [1, 2, 3]
        record = choices[-1]["contexts"][0]
        assert {"pool_cells", "plan", "threads"} <= set(record)
        assert record["plan"] in ("S", "M", "L") and record["threads"] >= 1
    for run in r["runs"]:
        if run["strategy"] == "fixed":
            record = run["rounds"][-1]["contexts"][0]
            assert record["plan"] == "fixed" and record["pool_cells"] == r["n_ctx"]
    assert sum(run["rollovers"] for run in r["runs"]) > 0
    assert set(r["meets_targets"]) == {f"{w}_{name}" for w in ("session", "phase_shift")
                                       for name, *_ in agent_session.TARGET_FIGURES}
    assert set(r["missed_targets"]) == {name for name, met in r["meets_targets"].items() if met is False}
    assert headline_of(printed) == r["headline"]
    assert "adaptive's hot context" in printed and "adaptive's turns ran with" in printed


def test_contention_quick(tmp_path: Path, bench_models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "contention.json"
    rc = contention.main(["--quick", "--wait", "1", "--settle", "1", "--model-dir", str(bench_models), "--out",
                          str(out)])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert rc == 0, printed
    assert r["benchmark"] == "contention" and r["quick"] and r["complete"]
    assert list(r["by_condition"]) == ["idle", "cores_minus_one", "every_core"]
    assert r["by_condition"]["every_core"]["busy_loops"] == r["cores"]
    assert r["by_condition"]["cores_minus_one"]["busy_loops"] == max(1, r["cores"] - 1)
    for entry in r["by_condition"].values():
        for strategy in ("fixed", "adaptive"):
            side = entry[strategy]
            assert side["median_s"] > 0 and len(side["seconds"]) == 1 and side["texts_equal"]
            assert all(threads >= 1 for threads in side["threads_used"])
            assert all(threads and threads[0] >= 1 for threads in side["context_threads"])
    assert r["strategies"]["fixed"]["engine"] == {"adaptive": False, "threads": min(4, r["cores"])}
    assert set(r["ratio_to_idle"]["adaptive"]) == {"cores_minus_one", "every_core"}
    assert set(r["meets_targets"]) == {"adaptive_cores_minus_one_at_most_3x_idle",
                                       "adaptive_every_core_at_most_3x_idle"}
    assert headline_of(printed) == r["headline"]
