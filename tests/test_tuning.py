"""The adaptive engine's policies (SPEC E2-E4): every boundary, the hysteresis around it, the clamps, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.engine.tuning import (
    burst_plan,
    choose_plan,
    choose_threads,
    cpu_idle_percent,
    hot_pool_cells,
    larger_plan,
    parse_cpu_max,
    parse_proc_stat,
    resize_pool,
    usable_cores,
)

# --- hot pool (E2) ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("need", "slack", "live", "expected"),
    [
        (0, 1.2, 0, 256),  # the minimum
        (100, 1.2, 0, 256),
        (213, 1.2, 0, 256),  # 255.6 -> 256
        (214, 1.2, 0, 512),  # 256.8 -> 512
        (256, 1.0, 0, 256),  # exactly on the granularity
        (257, 1.0, 0, 512),
        (100, 1.1, 0, 256),  # 110.00000000000001 is 110
        (640, 1.2, 0, 768),  # 768 exactly
        (641, 1.2, 0, 1024),
        (1000, 1.2, 0, 1280),
        (100, 1.2, 600, 768),  # never below what live conversations hold, rounded up
        (100, 1.2, 768, 768),
        (700, 1.2, 300, 1024),  # the need wins over the live cells
        (3000, 1.5, 0, 4096),  # clamped to the maximum
        (100, 1.2, 4000, 4096),
    ],
)
def test_hot_pool_cells(need: int, slack: float, live: int, expected: int) -> None:
    assert hot_pool_cells(need, slack, live, maximum=4096) == expected


@pytest.mark.parametrize(
    ("need", "live", "granularity", "minimum", "maximum", "expected"),
    [
        (100, 0, 32, 32, 4096, 128),  # 120 -> 128
        (100, 0, 1, 1, 4096, 120),
        (10, 0, 256, 512, 4096, 512),  # a larger minimum
        (900, 0, 256, 256, 1000, 1000),  # the maximum wins over the rounding
        (10, 990, 256, 256, 1000, 1000),  # live cells rounded up past the maximum: the maximum, still >= live
        (10, 0, 256, 256, 256, 256),
    ],
)
def test_hot_pool_granularity_and_clamps(
    need: int, live: int, granularity: int, minimum: int, maximum: int, expected: int
) -> None:
    found = hot_pool_cells(need, 1.2, live, granularity=granularity, minimum=minimum, maximum=maximum)
    assert found == expected


@given(
    st.integers(min_value=0, max_value=50_000),
    st.floats(min_value=1.0, max_value=10.0),
    st.integers(min_value=0, max_value=32_768),
    st.sampled_from([1, 32, 64, 256, 512]),
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=0, max_value=40_000),
)
def test_the_pool_is_a_multiple_of_the_granularity_and_holds_the_live_cells(
    need: int, slack: float, live: int, granularity: int, minimum_units: int, extra: int
) -> None:
    minimum = minimum_units * granularity
    maximum = max(live, minimum) + extra
    found = hot_pool_cells(need, slack, live, granularity=granularity, minimum=minimum, maximum=maximum)
    assert minimum <= found <= maximum
    assert found >= live
    assert found % granularity == 0 or found == maximum
    assert found >= min(need * slack, maximum) - 1e-6


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"profile_p90_need": -1}, "profile_p90_need must be at least 0, got -1"),
        ({"slack": 0.9}, "slack must be at least 1.0, got 0.9"),
        ({"live_cells": -5}, "live_cells must be at least 0, got -5"),
        ({"granularity": 0}, "granularity must be at least 1, got 0"),
        ({"minimum": 0}, "minimum must be at least 1, got 0"),
        ({"minimum": 300}, r"minimum must be a multiple of granularity \(256\), got 300"),
        ({"maximum": 128}, r"maximum must be at least minimum \(256\), got 128"),
        ({"live_cells": 5000}, r"live_cells must be at most maximum \(4096\), got 5000"),
    ],
)
def test_bad_pool_arguments(arguments: dict[str, float], message: str) -> None:
    values: dict[str, float] = {"profile_p90_need": 100, "slack": 1.2, "live_cells": 0, "maximum": 4096}
    values.update(arguments)
    with pytest.raises(ValueError, match=message):
        hot_pool_cells(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("current", "wanted", "expected"),
    [
        (1024, 1024, 1024),
        (1024, 1280, 1280),  # grows at once
        (256, 4096, 4096),
        (1024, 1023, 1024),  # a shrink by less than 25 % waits
        (1024, 769, 1024),
        (1024, 768, 768),  # exactly 25 % below: shrinks
        (1024, 512, 512),
        (1000, 751, 1000),
        (1000, 750, 750),
    ],
)
def test_resize_pool(current: int, wanted: int, expected: int) -> None:
    assert resize_pool(current, wanted) == expected


def test_a_need_oscillating_within_the_shrink_margin_keeps_the_pool() -> None:
    pool = 1024
    history = []
    for wanted in (768 + 1, 1024, 800, 1024, 900, 1024):
        pool = resize_pool(pool, wanted)
        history.append(pool)
    assert history == [1024] * 6
    assert resize_pool(pool, 512) == 512


@pytest.mark.parametrize(
    ("current", "wanted", "margin", "expected"),
    [
        (1000, 900, 0.1, 900),
        (1000, 901, 0.1, 1000),
        (1000, 999, 0.0, 999),  # no margin: follows the wanted size
        (1024, 513, 0.5, 1024),
        (1024, 512, 0.5, 512),
    ],
)
def test_resize_pool_margins(current: int, wanted: int, margin: float, expected: int) -> None:
    assert resize_pool(current, wanted, shrink_margin=margin) == expected


@pytest.mark.parametrize(
    ("current", "wanted", "margin", "message"),
    [
        (0, 256, 0.25, "current must be at least 1, got 0"),
        (256, 0, 0.25, "wanted must be at least 1, got 0"),
        (256, 256, 1.0, "shrink_margin must be at least 0 and below 1, got 1.0"),
        (256, 256, -0.1, "shrink_margin must be at least 0 and below 1, got -0.1"),
    ],
)
def test_bad_resize_arguments(current: int, wanted: int, margin: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resize_pool(current, wanted, margin)


# --- plans (E3) ------------------------------------------------------------------------------------------------

BOUNDARIES = (128, 512)


@pytest.mark.parametrize(
    ("p90", "expected"),
    [
        (0, "S"),
        (127, "S"),
        (127.9, "S"),
        (128, "M"),  # the first boundary starts M
        (300, "M"),
        (512, "M"),  # the second boundary is still M
        (512.1, "L"),
        (513, "L"),
        (100_000, "L"),
    ],
)
def test_plan_without_a_current_plan(p90: float, expected: str) -> None:
    assert choose_plan(p90, BOUNDARIES, None) == expected


@pytest.mark.parametrize(
    ("current", "p90", "expected"),
    [
        # From S: M needs at least 128 * 1.1 = 140.8; L more than 512 * 1.1 = 563.2.
        ("S", 128, "S"),
        ("S", 140, "S"),
        ("S", 141, "M"),
        ("S", 540, "M"),  # past the second boundary by less than the margin: only as far as M
        ("S", 563, "M"),
        ("S", 564, "L"),
        # From M: S below 128 * 0.9 = 115.2; L above 563.2.
        ("M", 127, "M"),
        ("M", 116, "M"),
        ("M", 115, "S"),
        ("M", 0, "S"),
        ("M", 513, "M"),
        ("M", 563, "M"),
        ("M", 564, "L"),
        # From L: M at 512 * 0.9 = 460.8 or below; S below 115.2.
        ("L", 512, "L"),
        ("L", 461, "L"),
        ("L", 460, "M"),
        ("L", 120, "M"),  # below the first boundary by less than the margin: only as far as M
        ("L", 115, "S"),
    ],
)
def test_plan_hysteresis(current: str, p90: float, expected: str) -> None:
    assert choose_plan(p90, BOUNDARIES, current) == expected


@pytest.mark.parametrize(
    ("current", "p90", "margin", "expected"),
    [
        ("S", 159, 0.25, "S"),  # a margin of 0.25: the boundaries 128 and 512 move to 160 and 640 going up
        ("S", 160, 0.25, "M"),
        ("M", 640, 0.25, "M"),
        ("M", 640.5, 0.25, "L"),
        ("L", 385, 0.25, "L"),  # and to 96 and 384 going down
        ("L", 384, 0.25, "M"),
        ("M", 96, 0.25, "M"),
        ("M", 95.5, 0.25, "S"),
        ("S", 128, 0.0, "M"),  # no margin: the plain bands
        ("M", 127, 0.0, "S"),
        ("M", 512, 0.0, "M"),
        ("L", 512, 0.0, "M"),
    ],
)
def test_plan_margins(current: str, p90: float, margin: float, expected: str) -> None:
    assert choose_plan(p90, BOUNDARIES, current, margin=margin) == expected


UBATCHES = (128, 256, 512)


@pytest.mark.parametrize(
    ("current", "p90", "expected"),
    [
        # Without a plan: the first whose micro-batch holds the step.
        (None, 0, "S"),
        (None, 128, "S"),
        (None, 129, "M"),
        (None, 256, "M"),
        (None, 257, "L"),
        (None, 512, "L"),
        (None, 4000, "L"),  # past every micro-batch: the largest
        # Up as soon as the step no longer fits one micro-batch of the current plan.
        ("S", 128, "S"),
        ("S", 129, "M"),
        ("S", 300, "L"),
        ("M", 257, "L"),
        # Down only within 90 % of the smaller plan's micro-batch: 230.4 for M, 115.2 for S.
        ("L", 256, "L"),
        ("L", 231, "L"),
        ("L", 230, "M"),
        ("L", 115, "S"),
        ("M", 128, "M"),
        ("M", 116, "M"),
        ("M", 115, "S"),
        ("M", 0, "S"),
        # No burst figure: the plan stays.
        ("L", None, "L"),
        ("M", None, "M"),
        (None, None, "S"),
    ],
)
def test_the_burst_plan_holds_the_burst_step_in_one_micro_batch(current: str | None, p90: float | None,
                                                                 expected: str) -> None:
    assert burst_plan(p90, UBATCHES, current) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ubatches": (128, 256)}, "ubatches"),
        ({"ubatches": (256, 128, 512)}, "ubatches"),
        ({"ubatches": (0, 128, 512)}, "ubatches"),
        ({"margin": 1.0}, "margin"),
        ({"current": "XL"}, "current"),
        ({"p90_burst": -1}, "p90_burst"),
    ],
)
def test_the_burst_plan_refuses_bad_input(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"p90_burst": 200, "ubatches": UBATCHES, "current": "S"}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        burst_plan(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", UBATCHES[:2])
def test_a_burst_oscillating_across_a_micro_batch_keeps_the_larger_plan(size: int) -> None:
    plan = burst_plan(size + 1, UBATCHES, None)
    for p90 in (size - 1, size + 1, size - 5, size + 3):
        assert burst_plan(p90, UBATCHES, plan) == plan


def test_the_larger_plan_of_two() -> None:
    assert larger_plan("S", "L") == larger_plan("L", "S") == "L"
    assert larger_plan("M", "S") == "M"
    assert larger_plan("S", "S") == "S"


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_a_p90_oscillating_across_a_boundary_keeps_the_plan(boundary: int) -> None:
    below = choose_plan(boundary - 1, BOUNDARIES, None)
    above = choose_plan(boundary + 1, BOUNDARIES, None)
    assert below != above
    for start in (below, above):
        plan = start
        for p90 in [boundary - 10, boundary + 10] * 5:
            plan = choose_plan(p90, BOUNDARIES, plan)
            assert plan == start
    assert choose_plan(boundary * 1.2, BOUNDARIES, below) == above
    assert choose_plan(boundary * 0.8, BOUNDARIES, above) == below


@pytest.mark.parametrize(("current", "expected"), [(None, "S"), ("S", "S"), ("M", "M"), ("L", "L")])
def test_no_figure_keeps_the_plan(current: str | None, expected: str) -> None:
    assert choose_plan(None, BOUNDARIES, current) == expected


@given(st.floats(min_value=0, max_value=5000), st.sampled_from(["S", "M", "L"]))
def test_a_plan_only_moves_towards_the_plain_band(p90: float, current: str) -> None:
    plain = choose_plan(p90, BOUNDARIES, None)
    chosen = choose_plan(p90, BOUNDARIES, current)
    order = "SML"
    assert chosen in (current, plain) or order.index(current) < order.index(chosen) < order.index(plain) or (
        order.index(plain) < order.index(chosen) < order.index(current)
    )
    # Once chosen, the same figure keeps it.
    assert choose_plan(p90, BOUNDARIES, chosen) == chosen


@pytest.mark.parametrize(
    ("p90", "boundaries", "current", "margin", "message"),
    [
        (10, (512, 128), None, 0.1, r"boundaries must be two token counts.*got \(512, 128\)"),
        (10, (0, 128), None, 0.1, r"boundaries must be two token counts, at least 1.*got \(0, 128\)"),
        (10, (128, 128), None, 0.1, r"boundaries must be .*the first below the second"),
        (10, BOUNDARIES, "XL", 0.1, "current must be one of S, M, L, got 'XL'"),
        (-1, BOUNDARIES, None, 0.1, "p90_input must be at least 0, got -1"),
        (10, BOUNDARIES, None, 1.0, "margin must be at least 0 and below 1, got 1.0"),
        (10, BOUNDARIES, None, -0.5, "margin must be at least 0 and below 1, got -0.5"),
    ],
)
def test_bad_plan_arguments(
    p90: float, boundaries: tuple[int, int], current: str | None, margin: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        choose_plan(p90, boundaries, current, margin)


# --- threads (E4) ----------------------------------------------------------------------------------------------

THRESHOLDS = (60, 30)


@pytest.mark.parametrize(
    ("idle", "expected"),
    [
        (100, 4),
        (60.1, 4),
        (60, 3),  # the first threshold is still 3
        (45, 3),
        (30, 3),  # the second threshold too
        (29.9, 2),
        (0, 2),
    ],
)
def test_threads_without_a_current_count(idle: float, expected: int) -> None:
    assert choose_threads(idle, THRESHOLDS, 16, None) == expected


@pytest.mark.parametrize(
    ("current", "idle", "expected"),
    [
        # From 4: 3 at 55 or below, 2 below 25.
        (4, 60, 4),
        (4, 55.5, 4),
        (4, 55, 3),
        (4, 26, 3),  # below the second threshold by less than the margin: only down to 3
        (4, 24.9, 2),
        # From 3: 4 above 65, 2 below 25.
        (3, 61, 3),
        (3, 65, 3),
        (3, 65.1, 4),
        (3, 29, 3),
        (3, 25, 3),
        (3, 24.9, 2),
        # From 2: 3 from 35, 4 above 65.
        (2, 31, 2),
        (2, 34.9, 2),
        (2, 35, 3),
        (2, 64, 3),  # above the first threshold by less than the margin: only up to 3
        (2, 65.1, 4),
    ],
)
def test_thread_hysteresis(current: int, idle: float, expected: int) -> None:
    assert choose_threads(idle, THRESHOLDS, 16, current) == expected


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_an_idle_reading_oscillating_across_a_threshold_keeps_the_count(threshold: int) -> None:
    below = choose_threads(threshold - 1, THRESHOLDS, 16, None)
    above = choose_threads(threshold + 1, THRESHOLDS, 16, None)
    assert below < above
    for start in (below, above):
        threads = start
        for idle in [threshold - 4, threshold + 4] * 5:
            threads = choose_threads(idle, THRESHOLDS, 16, threads)
            assert threads == start
    assert choose_threads(threshold + 6, THRESHOLDS, 16, below) == above
    assert choose_threads(threshold - 6, THRESHOLDS, 16, above) == below


@pytest.mark.parametrize(
    ("idle", "cores", "current", "expected"),
    [
        (90, 1, None, 1),  # capped by the usable cores
        (90, 2, None, 2),
        (90, 3, None, 3),
        (10, 1, None, 1),
        (90, 3, 3, 3),
        (90, 2, 4, 2),  # the cores went down: the count follows at once
        (58, 3, 4, 3),  # within the margin but above the cap
        (90, 8, 1, 4),  # a count below every band (a former one-core cap) moves up
    ],
)
def test_threads_are_capped_by_the_usable_cores(idle: float, cores: int, current: int | None, expected: int) -> None:
    assert choose_threads(idle, THRESHOLDS, cores, current) == expected


def test_other_thresholds_and_margin() -> None:
    assert choose_threads(81, (80, 20), 8, None) == 4
    assert choose_threads(80, (80, 20), 8, None) == 3
    assert choose_threads(75, (80, 20), 8, 4, margin=10.0) == 4
    assert choose_threads(70, (80, 20), 8, 4, margin=10.0) == 3
    assert choose_threads(60.5, THRESHOLDS, 8, 3, margin=0.0) == 4
    assert choose_threads(60, THRESHOLDS, 8, 4, margin=0.0) == 3


@given(
    st.floats(min_value=0, max_value=100),
    st.integers(min_value=1, max_value=64),
    st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
)
def test_threads_stay_within_the_bands_and_cores(idle: float, cores: int, current: int | None) -> None:
    threads = choose_threads(idle, THRESHOLDS, cores, current)
    assert 1 <= threads <= min(4, cores)
    assert threads >= min(2, cores)
    assert choose_threads(idle, THRESHOLDS, cores, threads) == threads


@pytest.mark.parametrize(
    ("idle", "thresholds", "cores", "current", "margin", "message"),
    [
        (50, (30, 60), 4, None, 5.0, r"thresholds must be two percentages.*got \(30, 60\)"),
        (50, (60, 60), 4, None, 5.0, r"thresholds must be two percentages.*first above the second"),
        (50, (101, 30), 4, None, 5.0, r"thresholds must be two percentages from 0 to 100"),
        (50, (60, -1), 4, None, 5.0, r"thresholds must be two percentages from 0 to 100"),
        (100.5, THRESHOLDS, 4, None, 5.0, "idle_percent must be from 0 to 100, got 100.5"),
        (-1, THRESHOLDS, 4, None, 5.0, "idle_percent must be from 0 to 100, got -1"),
        (50, THRESHOLDS, 0, None, 5.0, "usable_cores must be at least 1, got 0"),
        (50, THRESHOLDS, 4, 0, 5.0, "current must be at least 1, got 0"),
        (50, THRESHOLDS, 4, None, -1.0, "margin must be at least 0, got -1.0"),
    ],
)
def test_bad_thread_arguments(
    idle: float, thresholds: tuple[int, int], cores: int, current: int | None, margin: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        choose_threads(idle, thresholds, cores, current, margin)


# --- CPU readings ----------------------------------------------------------------------------------------------

PROC_STAT = """cpu  10132153 290696 3084719 46828483 16683 0 25195 0 175628 0
cpu0 1393280 32966 572056 13343292 6130 0 17875 0 23933 0
cpu1 1335321 32393 412180 13429296 5237 0 3624 0 47512 0
intr 1462898 0 0 0
ctxt 115315
btime 769041601
"""


def test_parse_proc_stat_reads_the_aggregate_line() -> None:
    assert parse_proc_stat(PROC_STAT) == (10132153, 290696, 3084719, 46828483, 16683, 0, 25195, 0)


def test_parse_proc_stat_takes_eight_counters_from_a_short_or_long_line() -> None:
    assert parse_proc_stat("cpu 1 2 3 4 5 6 7 8\n") == (1, 2, 3, 4, 5, 6, 7, 8)
    assert parse_proc_stat("intr 5\ncpu 1 2 3 4 5 6 7 8 9 10 11\n") == (1, 2, 3, 4, 5, 6, 7, 8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no aggregate 'cpu' line"),
        ("cpu0 1 2 3 4 5 6 7 8\n", "no aggregate 'cpu' line"),
        ("cpu 1 2 3 4\n", "the cpu line must have at least 8 counters, got 4"),
        ("cpu 1 2 3 x 5 6 7 8\n", "the cpu line's counters must be whole numbers"),
        ("cpu 1 2 3 -4 5 6 7 8\n", "the cpu line's counters must be whole numbers"),
    ],
)
def test_parse_proc_stat_refuses_a_malformed_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_proc_stat(text)


@pytest.mark.parametrize(
    ("delta", "expected"),
    [
        ((0, 0, 0, 100, 0, 0, 0, 0), 100.0),
        ((100, 0, 0, 0, 0, 0, 0, 0), 0.0),
        ((30, 5, 5, 50, 10, 0, 0, 0), 60.0),  # idle and iowait
        ((20, 0, 10, 30, 0, 20, 10, 10), 30.0),  # irq, softirq and steal are busy time
        ((1, 0, 0, 3, 0, 0, 0, 0), 75.0),
    ],
)
def test_cpu_idle_percent(delta: tuple[int, ...], expected: float) -> None:
    before = parse_proc_stat(PROC_STAT)
    after = tuple(start + step for start, step in zip(before, delta, strict=True))
    assert cpu_idle_percent(before, after) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("before", "after", "message"),
    [
        ((1,) * 8, (1,) * 8, "no CPU time passed between the readings"),
        ((5,) * 8, (4,) * 8, "a counter went backwards"),
        ((1,) * 4, (2,) * 8, "readings must have 8 counters, got 4 and 8"),
    ],
)
def test_bad_cpu_readings(before: tuple[int, ...], after: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_idle_percent(before, after)


@pytest.mark.parametrize(
    ("affinity", "quota", "period", "expected"),
    [
        (16, None, None, 16),
        (16, None, 100000, 16),
        (16, 200000, 100000, 2),
        (16, 150000, 100000, 2),  # 1.5 cores: 2 threads may run
        (16, 50000, 100000, 1),
        (2, 400000, 100000, 2),  # the affinity is the smaller
        (1, None, None, 1),
    ],
)
def test_usable_cores(affinity: int, quota: int | None, period: int | None, expected: int) -> None:
    assert usable_cores(affinity, quota, period) == expected


@pytest.mark.parametrize(
    ("affinity", "quota", "period", "message"),
    [
        (0, None, None, "affinity must be at least 1, got 0"),
        (4, 0, 100000, "quota_us must be at least 1, got 0"),
        (4, 100000, None, "period_us must be at least 1 with a quota, got None"),
        (4, 100000, 0, "period_us must be at least 1 with a quota, got 0"),
    ],
)
def test_bad_core_arguments(affinity: int, quota: int | None, period: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        usable_cores(affinity, quota, period)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max 100000\n", (None, 100000)),
        ("200000 100000\n", (200000, 100000)),
        ("50000 100000", (50000, 100000)),
    ],
)
def test_parse_cpu_max(text: str, expected: tuple[int | None, int]) -> None:
    assert parse_cpu_max(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "cpu.max must be '<quota|max> <period>'"),
        ("max\n", "cpu.max must be '<quota|max> <period>'"),
        ("1 2 3", "cpu.max must be '<quota|max> <period>'"),
        ("max 0", "cpu.max's period must be a whole number at least 1, got '0'"),
        ("max abc", "cpu.max's period must be a whole number at least 1, got 'abc'"),
        ("-5 100000", "cpu.max's quota must be 'max' or a whole number at least 1, got '-5'"),
        ("0 100000", "cpu.max's quota must be 'max' or a whole number at least 1, got '0'"),
    ],
)
def test_parse_cpu_max_refuses_a_malformed_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cpu_max(text)


def test_the_cores_of_this_box_read_through_the_parsers() -> None:
    quota, period = parse_cpu_max("max 100000")
    assert usable_cores(4, quota, period) == 4
    quota, period = parse_cpu_max("250000 100000")
    assert usable_cores(4, quota, period) == 3
