"""Execution plans S/M/L (issue #12 E3): the table's invariants, Plan validation, fixed_plan / plan_for clamping,
and the benchmark that chose them (benchmarks/plans.py) in its --quick mode."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from appliance.engine import plans
from appliance.engine.plans import PLANS, Plan, fixed_plan, plan_for

# -- the table ------------------------------------------------------------------------------------------------


def test_the_table_holds_s_m_l_under_their_own_names() -> None:
    assert list(PLANS) == ["S", "M", "L"]
    for name, plan in PLANS.items():
        assert plan.name == name


def test_longer_prompts_get_larger_micro_batches() -> None:
    ubatches = [PLANS[name].n_ubatch for name in ("S", "M", "L")]
    assert ubatches == sorted(ubatches)
    assert PLANS["S"].n_ubatch < PLANS["L"].n_ubatch


@pytest.mark.parametrize("name", ["S", "M", "L"])
def test_every_plan_fits_llama_cpp_and_bounds_the_stall_of_running_streams(name: str) -> None:
    plan = PLANS[name]
    assert 1 <= plan.n_ubatch <= plan.n_batch <= plans.MAX_BATCH
    assert plan.prefill_limit is not None and 1 <= plan.prefill_limit <= plan.n_batch


# -- Plan validation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "named"), [
    ({"name": ""}, "name"),
    ({"n_batch": 0}, "n_batch"),
    ({"n_batch": -5, "n_ubatch": -5}, "n_batch"),
    ({"n_ubatch": 0}, "n_ubatch"),
    ({"n_ubatch": 513}, "n_ubatch"),
    ({"prefill_limit": 0}, "prefill_limit"),
    ({"prefill_limit": -1}, "prefill_limit"),
])
def test_a_bad_plan_is_refused_naming_its_field(fields: dict[str, Any], named: str) -> None:
    good: dict[str, Any] = {"name": "x", "n_batch": 512, "n_ubatch": 128, "prefill_limit": 64}
    with pytest.raises(ValueError, match=rf"^{named}\b"):
        Plan(**{**good, **fields})


@pytest.mark.parametrize(("n_batch", "n_ubatch", "prefill_limit"), [
    (1, 1, None),
    (512, 512, 1),
    (512, 32, 600),  # a prefill_limit above n_batch is harmless: a step never holds more than n_batch tokens
])
def test_a_good_plan_is_accepted(n_batch: int, n_ubatch: int, prefill_limit: int | None) -> None:
    plan = Plan("x", n_batch, n_ubatch, prefill_limit)
    assert (plan.n_batch, plan.n_ubatch, plan.prefill_limit) == (n_batch, n_ubatch, prefill_limit)


def test_a_plan_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PLANS["S"].n_ubatch = 1  # type: ignore[misc]


# -- fixed_plan and plan_for ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("n_ctx", "live_slots", "size"), [
    (4096, 4, 512),
    (512, 8, 512),
    (300, 4, 300),
    (2, 4, 4),  # one token of every live sequence must fit a step
    (1, 1, 1),
])
def test_the_fixed_plan_is_todays_engine(n_ctx: int, live_slots: int, size: int) -> None:
    assert fixed_plan(n_ctx, live_slots) == Plan("fixed", size, size, 64)
    assert plans.FIXED_PREFILL_LIMIT == 64


@pytest.mark.parametrize("name", ["S", "M", "L"])
def test_plan_for_a_large_context_is_the_table_s_plan(name: str) -> None:
    assert plan_for(name, 8192, 4) == PLANS[name]


@pytest.mark.parametrize(("name", "n_ctx", "live_slots"), [
    ("S", 16, 4), ("M", 100, 4), ("L", 200, 2), ("L", 3, 8), ("S", 1, 1), ("M", 4096, 600),
])
def test_plan_for_clamps_to_the_context_but_holds_every_live_slot(name: str, n_ctx: int, live_slots: int) -> None:
    table = PLANS[name]
    plan = plan_for(name, n_ctx, live_slots)
    assert plan.name == name and plan.prefill_limit == table.prefill_limit
    assert plan.n_batch == max(live_slots, min(table.n_batch, n_ctx))
    assert plan.n_ubatch == max(live_slots, min(table.n_ubatch, n_ctx))
    assert live_slots <= plan.n_ubatch <= plan.n_batch


@pytest.mark.parametrize(("n_ctx", "live_slots", "named"), [(0, 4, "n_ctx"), (2048, 0, "live_slots")])
def test_an_empty_context_or_no_slot_is_refused(n_ctx: int, live_slots: int, named: str) -> None:
    with pytest.raises(ValueError, match=rf"^{named}\b"):
        fixed_plan(n_ctx, live_slots)
    with pytest.raises(ValueError, match=rf"^{named}\b"):
        plan_for("M", n_ctx, live_slots)


def test_plan_for_an_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="XL"):
        plan_for("XL", 2048, 4)


# -- the benchmark --------------------------------------------------------------------------------------------


def test_plans_benchmark_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import plans as bench

    out = tmp_path / "plans.json"
    rc = bench.main(["--quick", "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert rc == 0
    assert r["benchmark"] == "plans" and r["quick"] is True
    assert r["model"]["layers"] == 4 and r["model"]["dim"] == 256
    lengths = [str(length) for length in r["lengths"]]
    assert len(lengths) == 2 and len(r["ubatches"]) == 2

    rows = {(row["n_ubatch"], row["flash_attn"], row["cache_type"]): row for row in r["configs"]}
    small, large = min(r["ubatches"]), max(r["ubatches"])
    refused = [row for row in r["configs"] if "refused" in row]
    assert [(row["cache_type"], row["flash_attn"]) for row in refused] == [("q8_0", False)]
    assert "flash_attn" in refused[0]["refused"]  # a quantized V cache needs it (llama.cpp would not build it)
    for key, row in rows.items():
        if "refused" in row:
            continue
        assert set(row["ttft_ms"]) == set(lengths) and all(ms > 0 for ms in row["ttft_ms"].values())
        assert row["kv_buffer_mib"] > 0 and row["compute_buffer_mib"] > 0
        assert isinstance(row["memory_mib"], float)
        assert ("decode_tokens_per_s" in row) == (key[0] == large)
    # The compute buffer grows with n_ubatch; a q8_0 KV cache is about half an f16 one.
    assert rows[(large, False, "f16")]["compute_buffer_mib"] > rows[(small, False, "f16")]["compute_buffer_mib"]
    assert rows[(large, True, "q8_0")]["kv_buffer_mib"] < 0.6 * rows[(large, True, "f16")]["kv_buffer_mib"]

    joins = r["joins"]
    assert [join["prefill_limit"] for join in joins] == [None, 32]
    for join in joins:
        assert join["prompt_tokens"] == max(r["lengths"]) and join["ttft_ms"] > 0 and join["stream_gap_ms"] > 0

    headlines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert headlines == [r["headline"]]
    assert "llama_kv_cache" not in printed  # llama.cpp's log was collected, not printed
