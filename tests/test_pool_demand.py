"""The hot pool's demand sees the queue (pure, no models): requests waiting for KV cells make the pool grow at once,
the grown pool is held while the window turns over and shrinks only past the margin; a resize is built beside the
live context only when both fit in the fixed strategy's n_ctx; admission counts the cells its queue waits for."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from appliance.daemon.admission import Admission
from appliance.engine import tuning
from appliance.engine.adaptive import MIN_SAMPLES, Settings, Tuner, Tuning
from appliance.engine.profile import LoadProfile, RequestSample

SETTINGS = Settings(adaptive=True, window_size=16, sample_rate=1, hot_pool_slack=1.2, plan_boundaries=(128, 512),
                    thread_idle_thresholds=(60, 30), fixed_threads=2, pinned_threads=False,
                    live_slots=4)
N_CTX = 16384
AGENT_NEED = 129  # one agent's turn: 64 prompt + 64 generated tokens, and its BOS


def sample(peak: int, live: int = 1) -> RequestSample:
    return RequestSample(input_tokens=64, output_tokens=64, prompt_evaluated=64, ttft_s=0.01, decode_s=0.05,
                         kv_cells_used=AGENT_NEED, kv_cells_peak=peak, live_sequences=live, threads=2,
                         queue_length=0)


def test_a_burst_of_8_with_4_waiting_for_cells_grows_the_pool_at_once() -> None:
    """4 agents run in the 512-cell pool, 4 more wait for cells: the pool the tuner asks for holds all 8 at the
    first refusal, before any of them is sampled."""
    tuner = Tuner(SETTINGS, N_CTX, 2)
    for peak in (128, 256, 384, 512) * 2:  # what the admitted requests alone showed: never more than the pool
        tuner.observe(sample(peak))
    assert tuner.decide(0).pool_cells == 768  # P90 512 x 1.2 = 614 -> 768: still short of 8 agents' 1032
    in_flight = 4 * AGENT_NEED
    waiting = 4 * AGENT_NEED
    assert tuner.queue_demand(in_flight + waiting) is True
    wanted = tuner.decide(0)
    assert wanted.pool_cells == 1280  # 1032 x 1.2 = 1238.4 -> 1280 (steps of 256)
    assert wanted.pool_cells >= 8 * AGENT_NEED
    tuner.applied(wanted)
    assert tuner.queue_demand(in_flight + waiting) is False  # held already: no second growth for the same burst


def test_queue_demand_is_capped_by_n_ctx_and_ignored_by_the_fixed_strategy() -> None:
    tuner = Tuner(SETTINGS, 1024, 2)
    assert tuner.queue_demand(5000) is True
    assert tuner.decide(0).pool_cells == 1024
    tuner.applied(tuner.decide(0))
    assert tuner.queue_demand(5000) is False  # at n_ctx: nothing more to grow
    fixed = Tuner(replace(SETTINGS, adaptive=False), 1024, 2)
    assert fixed.queue_demand(5000) is False


def test_the_queue_grown_pool_is_held_while_the_window_turns_over_then_shrinks_only_past_the_margin() -> None:
    tuner = Tuner(SETTINGS, N_CTX, 2)
    assert tuner.queue_demand(8 * AGENT_NEED)
    tuner.applied(tuner.decide(0))
    assert tuner.current.pool_cells == 1280
    for _ in range(SETTINGS.window_size - 1):  # small requests only: the floor holds the pool meanwhile
        tuner.observe(sample(200))
        assert tuner.decide(0).pool_cells == 1280
    tuner.observe(sample(200))  # the window turned over: the profile speaks again (200 x 1.2 -> 256)
    assert tuner.decide(0).pool_cells == 256


def test_a_pool_shrinks_past_the_margin_and_not_before() -> None:
    assert tuning.resize_pool(1280, 1024) == 1280  # 256 below: 20 %, inside the 25 % margin
    assert tuning.resize_pool(1280, 768) == 768  # 512 below: 40 %
    assert tuning.resize_pool(1024, 768) == 768  # exactly 25 %
    assert tuning.resize_pool(512, 1280) == 1280  # growth is at once


def test_queue_pool_cells() -> None:
    assert tuning.queue_pool_cells(1032, 512, 1.2, maximum=N_CTX) == 1280
    assert tuning.queue_pool_cells(1032, 1280, 1.2, maximum=N_CTX) is None  # holds it already
    assert tuning.queue_pool_cells(1032, 512, 1.0, maximum=N_CTX) == 1280  # 1032 -> 1280 in steps of 256
    assert tuning.queue_pool_cells(9000, 512, 1.2, maximum=4096) == 4096
    assert tuning.queue_pool_cells(9000, 4096, 1.2, maximum=4096) is None
    assert tuning.queue_pool_cells(100, 64, 1.0, maximum=128) == 128  # a model smaller than one step
    for bad, message in (({"demand": -1}, "demand"), ({"current": 0}, "current"), ({"slack": 0.5}, "slack")):
        arguments = {"demand": 10, "current": 256, "slack": 1.2, **bad}
        with pytest.raises(ValueError, match=message):
            tuning.queue_pool_cells(arguments["demand"], arguments["current"], arguments["slack"], maximum=N_CTX)


def test_a_context_is_built_beside_the_live_one_only_within_the_fixed_footprint() -> None:
    assert tuning.builds_beside(512, 1280, N_CTX) is True
    assert tuning.builds_beside(512, 16384, N_CTX) is False  # the two would hold 16896 cells > n_ctx
    assert tuning.builds_beside(8192, 8192, N_CTX) is True
    assert tuning.builds_beside(8192, 8448, N_CTX) is False
    with pytest.raises(ValueError, match="at least 1"):
        tuning.builds_beside(0, 512, N_CTX)


def test_admission_counts_the_cells_its_queue_waits_for() -> None:
    admission = Admission()
    tickets = [object() for _ in range(4)]
    for number, ticket in enumerate(tickets):
        admission.join(f"agent{number}", ticket)
    assert (admission.waiting_cells, admission.demand) == (0, 0)  # waiting for a sequence: no cells recorded
    admission.short_of_cells(tickets[0], AGENT_NEED, 4 * AGENT_NEED)  # the head tried: the others wait their turn
    assert admission.waiting_cells == 4 * AGENT_NEED  # 3 not tried yet, counted at the mean of those that did
    assert admission.demand == 8 * AGENT_NEED
    admission.short_of_cells(tickets[1], 200, 3 * AGENT_NEED)  # refused too: the last in-flight figure counts
    assert admission.cells_of(tickets[1]) == 200
    assert admission.waiting_cells == 2 * (AGENT_NEED + 200)  # 2 recorded, 2 more at their mean
    assert admission.demand == 3 * AGENT_NEED + admission.waiting_cells
    admission.leave("agent0", tickets[0])
    assert admission.cells_of(tickets[0]) == 0 and admission.waiting_cells == 3 * 200
    for number in (1, 2, 3):
        admission.leave(f"agent{number}", tickets[number])
    assert (admission.waiting, admission.waiting_cells, admission.demand) == (0, 0, 0)
    with pytest.raises(ValueError, match="not queued"):
        admission.short_of_cells(tickets[0], 10, 0)
    admission.join("agent0", tickets[0])
    with pytest.raises(ValueError, match="at least 0"):
        admission.short_of_cells(tickets[0], -1, 0)


def test_waves_of_4_with_the_queue_in_the_demand_keep_the_pool_for_8() -> None:
    """The 8-agent burst after the growth: every admitted request's demand counts the 8 in flight (or in flight and
    waiting), sampled at random one in four: the P90 the tuner reads holds all 8, whatever place in the wave."""
    tuner = Tuner(replace(SETTINGS, window_size=64, sample_rate=4), N_CTX, 2)
    tuner.profile = LoadProfile(64, 4, rng=random.Random(3))
    assert tuner.queue_demand(8 * AGENT_NEED)
    tuner.applied(tuner.decide(0))
    for _ in range(200):
        for place in range(8):
            tuner.observe(sample(8 * AGENT_NEED if place % 4 == 0 else (place % 4 + 4) * AGENT_NEED, live=8))
    assert len(tuner.profile) >= MIN_SAMPLES
    assert tuner.decide(0) == Tuning(1280, "S", 2)
