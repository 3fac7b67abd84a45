"""The adaptive engine's decisions (appliance/engine/adaptive.py): pure, on synthetic windows and CPU readings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from appliance.engine.adaptive import (
    FIXED,
    INITIAL_POOL,
    MIN_SAMPLES,
    PRESETS,
    TURN_CELLS,
    CpuShare,
    Settings,
    Tuner,
    Tuning,
    choose_threads,
    cpu_share,
    initial_plan,
    initial_pool,
)
from appliance.engine.profile import RequestSample

SETTINGS = Settings(adaptive=True, window_size=8, sample_rate=1, hot_pool_slack=1.2, plan_boundaries=(128, 512),
                    thread_idle_thresholds=(60, 30), fixed_threads=2, pinned_threads=False,
                    live_slots=4)


def sample(input_tokens: int = 50, peak: int = 100, threads: int = 2, burst: int = 0) -> RequestSample:
    return RequestSample(input_tokens=input_tokens, output_tokens=16, prompt_evaluated=input_tokens, ttft_s=0.01,
                         decode_s=0.05, kv_cells_used=peak, kv_cells_peak=peak, live_sequences=8 if burst else 1,
                         threads=threads, queue_length=0, burst_tokens=burst)


def fed(tuner: Tuner, samples: list[RequestSample]) -> Tuner:
    for item in samples:
        tuner.observe(item)
    return tuner


def test_an_adaptive_model_starts_small_and_a_fixed_one_with_its_whole_context():
    assert Tuner(SETTINGS, 4096, usable_cores=8).current == Tuning(INITIAL_POOL, "M", 4)
    assert Tuner(SETTINGS, 4096, usable_cores=2).current == Tuning(INITIAL_POOL, "M", 2)
    assert Tuner(SETTINGS, 300, usable_cores=2).current.pool_cells == 300
    fixed = Tuner(replace(SETTINGS, adaptive=False), 4096, usable_cores=8)
    assert fixed.current == Tuning(4096, FIXED, 2)
    assert fixed.decide(0, CpuShare(0.0, 8)) == Tuning(4096, FIXED, 2)  # nothing moves it
    pinned = Tuner(replace(SETTINGS, fixed_threads=3, pinned_threads=True), 4096, usable_cores=8)
    assert pinned.current.threads == 3
    assert pinned.decide(0, CpuShare(5.0, 8)).threads == 3


def test_the_initial_pool_holds_a_short_turn_for_every_live_sequence():
    assert initial_pool(4096, 1) == INITIAL_POOL  # never below the floor
    assert initial_pool(4096, 4) == 4 * TURN_CELLS == INITIAL_POOL
    assert initial_pool(4096, 8) == 8 * TURN_CELLS
    assert initial_pool(4096, 9) == 1280  # rounded up to llama.cpp's 256-cell padding
    assert initial_pool(700, 8) == 700  # never past n_ctx
    assert Tuner(replace(SETTINGS, live_slots=8), 4096, usable_cores=2).current == Tuning(8 * TURN_CELLS, "L", 2)
    with pytest.raises(ValueError, match="live_slots"):
        initial_pool(4096, 0)


@pytest.mark.parametrize(("live_slots", "plan"), [(1, "S"), (2, "S"), (3, "M"), (4, "M"), (5, "L"), (64, "L")])
def test_the_initial_plan_holds_a_first_burst_of_short_prompts_in_one_micro_batch(live_slots, plan):
    assert initial_plan(live_slots) == plan  # 64 tokens a sequence: S holds 128, M 256, L 512
    assert Tuner(replace(SETTINGS, live_slots=live_slots), 4096, usable_cores=2).current.plan == plan


def test_initial_plan_refuses_no_sequences():
    with pytest.raises(ValueError, match="live_slots"):
        initial_plan(0)


def test_nothing_moves_until_the_window_has_enough_samples():
    tuner = fed(Tuner(SETTINGS, 4096, 2), [sample(900, 2000)] * (MIN_SAMPLES - 1))
    assert tuner.decide(0).pool_cells == INITIAL_POOL and tuner.decide(0).plan == initial_plan(4) == "M"
    tuner.observe(sample(900, 2000))
    assert tuner.decide(0) == Tuning(2560, "L", 2)  # 2000 x 1.2 = 2400, in steps of 256


@pytest.mark.parametrize(("peaks", "slack", "live", "expected"), [
    ([100] * 8, 1.2, 0, 256),  # never below one step
    ([300] * 8, 1.2, 0, 512),  # 360 -> 512
    ([100] * 7 + [3000], 1.2, 0, 3840),  # the P90 of 8 is the largest: 3600 -> 3840
    ([100] * 8, 1.2, 1000, 1024),  # never below what live conversations hold
    ([5000] * 8, 1.2, 0, 4096),  # at most n_ctx
    ([1000] * 8, 1.0, 0, 1024),
])
def test_the_hot_pool_is_the_p90_need_times_the_slack(peaks, slack, live, expected):
    tuner = fed(Tuner(replace(SETTINGS, hot_pool_slack=slack), 4096, 2), [sample(peak=p) for p in peaks])
    tuner.applied(Tuning(256, "S", 2))  # from the smallest pool: growth applies at once
    assert tuner.decide(live).pool_cells == expected


def test_the_pool_grows_at_once_but_shrinks_only_past_a_margin():
    tuner = fed(Tuner(SETTINGS, 4096, 2), [sample(peak=1000)] * 8)
    assert tuner.decide(0).pool_cells == 1280
    tuner.applied(Tuning(1280, "S", 2))
    fed(tuner, [sample(peak=900)] * 8)  # wants 1280 still (1080 -> 1280)
    assert tuner.decide(0).pool_cells == 1280
    fed(tuner, [sample(peak=800)] * 8)  # wants 1024: 256 below 1280 is 20 %, under the 25 % margin
    assert tuner.decide(0).pool_cells == 1280
    fed(tuner, [sample(peak=600)] * 8)  # wants 768: 40 % below
    assert tuner.decide(0).pool_cells == 768
    tuner.applied(Tuning(768, "S", 2))
    fed(tuner, [sample(peak=700)] * 8)  # 840 -> 1024: growth is at once
    assert tuner.decide(0).pool_cells == 1024


@pytest.mark.parametrize(("current", "p90", "expected"), [
    ("S", 127, "S"), ("S", 140, "S"), ("S", 141, "M"),  # up past 128 needs 128 x 1.1 = 140.8
    ("M", 116, "M"), ("M", 115, "S"),  # down below 128 needs 128 x 0.9 = 115.2
    ("M", 563, "M"), ("M", 564, "L"),  # 512 x 1.1 = 563.2
    ("L", 461, "L"), ("L", 460, "M"),  # 512 x 0.9 = 460.8
])
def test_the_plan_follows_the_p90_input_with_hysteresis_at_each_boundary(current, p90, expected):
    tuner = fed(Tuner(SETTINGS, 4096, 2), [sample(input_tokens=p90)] * 8)
    tuner.applied(Tuning(INITIAL_POOL, current, 2))
    assert tuner.decide(0).plan == expected


def test_bursts_of_short_prompts_raise_the_plan_until_they_stop():
    tuner = fed(Tuner(replace(SETTINGS, live_slots=8), 4096, 2), [sample(input_tokens=64, burst=512)] * 8)
    tuner.applied(Tuning(1024, "S", 2))
    assert tuner.decide(0).plan == "L"  # 8 prompts of 64 tokens in one step: one micro-batch of 512
    tuner.applied(Tuning(1024, "L", 2))
    fed(tuner, [sample(input_tokens=64, burst=256)] * 8)  # bursts of 4: M would hold them, but not within 90 %
    assert tuner.decide(0).plan == "L"
    fed(tuner, [sample(input_tokens=64, burst=192)] * 8)  # bursts of 3
    assert tuner.decide(0).plan == "M"
    tuner.applied(Tuning(1024, "M", 2))
    fed(tuner, [sample(input_tokens=64, burst=128)] * 8)  # bursts of 2: S holds them, but not within 90 %
    assert tuner.decide(0).plan == "M"
    fed(tuner, [sample(input_tokens=64)] * 8)  # one agent at a time
    assert tuner.decide(0).plan == "S"


def test_a_long_prompt_keeps_its_plan_whatever_the_bursts():
    tuner = fed(Tuner(SETTINGS, 4096, 2), [sample(input_tokens=700, peak=800)] * 8)
    assert tuner.decide(0).plan == "L"  # by the input, no burst at all
    tuner.applied(Tuning(1024, "L", 2))
    fed(tuner, [sample(input_tokens=64, burst=512)] * 7 + [sample(input_tokens=64, burst=0)])
    assert tuner.decide(0).plan == "L"  # by the bursts, short inputs


def test_warm_up_runs_alone_do_not_undo_the_initial_plan():
    tuner = Tuner(replace(SETTINGS, live_slots=8, sample_rate=4), 4096, 2)
    for _ in range(8):
        tuner.seed(sample(input_tokens=32))
    assert tuner.burst_figure() is None and tuner.decide(0).plan == "L"
    for _ in range(MIN_SAMPLES - 1):
        tuner.profile.seed(sample(input_tokens=32))  # seeds are not sampled requests
    assert tuner.burst_figure() is None
    fed(tuner, [sample(input_tokens=32)] * 64)  # served requests, one at a time: about 16 sampled
    assert tuner.profile.sampled >= MIN_SAMPLES
    assert tuner.burst_figure() == 0 and tuner.decide(0).plan == "S"


@pytest.mark.parametrize(("percent", "cores", "usable", "current", "expected"), [
    (100.0, 8, 8, None, 4),
    (50.0, 8, 8, None, 3),  # 30-60 % -> 3 (4 spare cores)
    (20.0, 8, 8, None, 2),  # below 30 % -> 2 (20 % of 8 cores: 1.6, rounded to 2 spare)
    (5.0, 8, 8, None, 1),  # 0.4 of a core spare: 1
    (100.0, 2, 2, None, 2),  # capped by the cores it may use
    (50.0, 2, 2, 2, 1),  # another process takes a core: one spare core
    (10.0, 2, 2, 2, 1),
    (63.0, 8, 8, 3, 3),  # above 60 but not past the +5 margin: stays
    (66.0, 8, 8, 3, 4),
    (27.0, 16, 16, 3, 3),  # below 30 but not past the -5 margin (4 of 16 cores spare)
    (27.0, 8, 8, 3, 2),  # ... with only 2 of 8 cores spare: 2
])
def test_threads_follow_the_cpu_share_and_the_spare_cores(percent, cores, usable, current, expected):
    assert choose_threads(CpuShare(percent, cores), (60, 30), usable, current) == expected


def test_a_tuner_moves_threads_with_the_cpu_reading_only():
    tuner = Tuner(SETTINGS, 4096, usable_cores=2)
    assert tuner.decide(0, None).threads == 2
    assert tuner.decide(0, CpuShare(45.0, 2)).threads == 1
    tuner.applied(Tuning(INITIAL_POOL, "S", 1))
    assert tuner.decide(0, None).threads == 1
    assert tuner.decide(0, CpuShare(98.0, 2)).threads == 2


def test_the_cpu_share_counts_idle_time_and_the_process_own():
    before = (100, 0, 100, 800, 0, 0, 0, 0)
    after = (300, 0, 100, 900, 100, 0, 0, 0)  # 400 ticks: 100 idle, 100 iowait, 200 user
    share = cpu_share(before, after, own_ticks=100, cores=2)
    assert share == CpuShare(75.0, 2) and share.spare_cores == 2  # 1.5 cores rounds to 2
    assert cpu_share(before, after, own_ticks=0, cores=2).spare_cores == 1
    with pytest.raises(ValueError, match="own_ticks"):
        cpu_share(before, after, own_ticks=-1, cores=2)
    with pytest.raises(ValueError, match="no CPU time"):
        cpu_share(before, before, own_ticks=0, cores=2)


def test_warm_up_samples_are_kept_whatever_the_sample_rate():
    tuner = Tuner(replace(SETTINGS, sample_rate=4), 4096, 2)
    for _ in range(MIN_SAMPLES):
        tuner.seed(sample(input_tokens=300, peak=600))
    assert len(tuner.profile) == MIN_SAMPLES and tuner.profile.observed == 0
    assert tuner.decide(0) == Tuning(768, "M", 2)


def test_a_reload_keeps_the_profile_unless_its_window_changes_and_switches_strategies():
    tuner = fed(Tuner(SETTINGS, 4096, 2), [sample(peak=1000)] * 8)
    tuner.applied(Tuning(1280, "M", 2))
    tuner.reconfigure(replace(SETTINGS, hot_pool_slack=1.5), 4096)
    assert len(tuner.profile) == 8 and tuner.current == Tuning(1280, "M", 2)
    tuner.reconfigure(replace(SETTINGS, window_size=4), 1024)  # a smaller window keeps the newest samples
    assert len(tuner.profile) == 4 and tuner.current.pool_cells == 1024  # n_ctx shrank under the pool
    tuner.reconfigure(replace(SETTINGS, adaptive=False), 1024)
    assert tuner.current == Tuning(1024, FIXED, 2)
    tuner.reconfigure(SETTINGS, 1024)
    assert tuner.current == Tuning(INITIAL_POOL, "M", 2)


def test_presets_are_the_device_classes_of_the_spec():
    assert PRESETS == {"high": {"adaptive_window_size": 128, "adaptive_sample_rate": 2},
                       "mid": {"adaptive_window_size": 64, "adaptive_sample_rate": 4},
                       "low": {"adaptive_window_size": 32, "adaptive_sample_rate": 8}}


@pytest.mark.parametrize(("field", "value"), [("pool_cells", 0), ("plan", "XL"), ("threads", 0)])
def test_a_tuning_validates_itself(field, value):
    with pytest.raises(ValueError, match=field):
        replace(Tuning(256, "S", 2), **{field: value})
