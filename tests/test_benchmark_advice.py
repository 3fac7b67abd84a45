"""The tuning advice of ``appliance benchmark`` (issues #13, #26): each rule over crafted measurement tables, at its
boundaries, and every advised value of a config key accepted by the config validator. ``engine.live_slots`` comes
from the concurrency curve (never from the session's own agent count), ``engine.threads: 1`` from a thread curve
whose best is one thread."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from appliance.benchmark.advice import (
    ADVISED,
    ADVISED_KEYS,
    GIB,
    MIB,
    ConcurrencyPoint,
    Machine,
    Measurements,
    ModelFootprint,
    Recommendation,
    SlackPoint,
    ThreadPoint,
    advise,
    changes,
    contexts_advice,
    current_settings,
    device_class,
    instance_advice,
    pin_advice,
    preset_advice,
    slack_advice,
    slots_advice,
    thread_advice,
)
from appliance.config.schema import BY_KEY
from appliance.config.validate import ConfigInvalid, parse_config
from appliance.engine.adaptive import PRESETS
from appliance.engine.tuning import choose_threads

CURRENT: dict[str, Any] = {
    "engine.adaptive_window_size": 64,
    "engine.adaptive_sample_rate": 4,
    "engine.hot_pool_slack": 1.2,
    "engine.thread_idle_thresholds": [60, 30],
    "engine.threads": 0,
    "engine.live_slots": 4,
    "engine.live_contexts": "auto",
}


def config_value(key: str, value: Any) -> Any:
    """``value`` of the dotted ``key`` as the config validator reads it from a tiny file that sets only it."""
    section, _, name = key.partition(".")
    text = yaml.safe_dump({section: {name: value}})
    config = parse_config(text, check_files=False)
    return getattr(getattr(config, section), name)


def assert_valid(recommendation: Recommendation) -> None:
    """A keyed recommendation's value passes the schema check (ConfigInvalid would say why not)."""
    if recommendation.key is None:
        return
    config_value(recommendation.key, recommendation.value)


def assert_one_line(recommendation: Recommendation) -> None:
    assert recommendation.reason.strip()
    assert "\n" not in recommendation.reason


def machine(cores: int = 4, memory_gib: float = 16, device_gib: float = 8, kind: str = "host") -> Machine:
    return Machine(cores, int(memory_gib * GIB), kind, int(device_gib * GIB))


# --- device class ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cores", "memory_bytes", "tokens", "expected", "named"),
    [
        (2, 64 * GIB, 100.0, "low", "2 cores"),
        (1, 64 * GIB, 100.0, "low", "1 cores"),
        (3, 16 * GIB, 20.0, "mid", "3 cores"),
        (4, 8 * GIB - 1, 20.0, "low", "memory"),
        (4, 8 * GIB, 20.0, "mid", "4 cores"),
        (4, 16 * GIB, 9.99, "low", "10.0 tokens/s"),
        (4, 16 * GIB, 10.0, "mid", "4 cores"),
        (8, 32 * GIB, 40.0, "high", "40.0 tokens/s"),
        (7, 32 * GIB, 40.0, "mid", "7 cores"),
        (8, 32 * GIB - MIB, 40.0, "mid", "memory"),
        (8, 32 * GIB, 39.9, "mid", "39.9 tokens/s"),
        (16, 128 * GIB, 5.0, "low", "5.0 tokens/s"),
        (8, 32 * GIB, None, "high", "not measured"),
        (2, 32 * GIB, None, "low", "2 cores"),
        (4, 32 * GIB, None, "mid", "4 cores"),
        (8, 4 * GIB, None, "low", "memory"),
    ],
    ids=[
        "2-cores-low", "1-core-low", "3-cores-mid", "memory-below-8GiB-low", "memory-8GiB-mid",
        "tokens-below-10-low", "tokens-10-mid", "all-at-high-boundary", "7-cores-mid", "memory-below-32GiB-mid",
        "tokens-below-40-mid", "slow-big-box-low", "no-tokens-high", "no-tokens-low", "no-tokens-mid",
        "no-tokens-small-memory-low",
    ],
)
def test_device_class(cores: int, memory_bytes: int, tokens: float | None, expected: str, named: str) -> None:
    name, reason = device_class(Machine(cores, memory_bytes, "host", GIB), tokens)
    assert name == expected
    assert named in reason
    assert "\n" not in reason
    assert ("not measured" in reason) == (tokens is None)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_advice_follows_the_presets(name: str) -> None:
    recommendations = preset_advice(name, CURRENT)
    values = {recommendation.key: recommendation.value for recommendation in recommendations}
    assert values == {f"engine.{key}": value for key, value in PRESETS[name].items()}
    for recommendation in recommendations:
        assert recommendation.current == CURRENT[recommendation.key]
        assert name in recommendation.reason
        assert_one_line(recommendation)
        assert_valid(recommendation)


def test_preset_advice_refuses_an_unknown_class() -> None:
    with pytest.raises(ValueError, match="unknown device class 'huge'"):
        preset_advice("huge", CURRENT)


# --- hot pool slack --------------------------------------------------------------------------------------------------


def sweep(*rows: tuple[float, float | None, int | None]) -> list[SlackPoint]:
    """(slack, ttft_avg_ms, peak MiB) rows; p99 and tokens/s are not what the knee rests on."""
    return [SlackPoint(slack, ttft, None, None if mib is None else mib * MIB, 20.0) for slack, ttft, mib in rows]


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        (sweep((1.0, 200.0, 100), (1.2, 199.0, 110), (1.5, 198.0, 130), (2.0, 197.0, 160)), 1.0),
        (sweep((1.0, 400.0, 100), (1.2, 300.0, 110), (1.5, 250.0, 130), (2.0, 200.0, 160)), 2.0),
        (sweep((1.0, 250.0, 100), (1.05, 212.0, 104), (1.5, 205.0, 142), (2.0, 206.0, 160)), 1.05),
        (sweep((1.0, 220.0, 100), (1.2, 210.0, 110), (1.5, 200.0, 130)), 1.2),  # 210 is exactly 5 % above 200
        (sweep((1.0, 220.0, 100), (1.2, 210.1, 110), (1.5, 200.0, 130)), 1.5),  # just past 5 %
        (sweep((2.0, 197.0, 160), (1.0, 200.0, 100), (1.5, 198.0, 130)), 1.0),  # order of the sweep is not kept
        (sweep((1.0, None, 100), (1.2, 201.0, 110), (1.5, 200.0, 130)), 1.2),  # no TTFT: skipped
        (sweep((1.0, 150.0, None), (1.2, 201.0, 110), (1.5, 200.0, 130)), 1.2),  # no peak memory: skipped
        (sweep((1.0, 235.3, 185), (1.2, 304.8, 192), (1.5, 225.7, 179)), 1.5),  # a recorded noisy sweep
        (sweep((1.0, 200.0, 120), (1.2, 201.0, 120), (1.5, 199.0, 130)), 1.0),  # equal memory: the smaller
    ],
    ids=["flat-smallest", "steep-largest", "knee-in-between", "on-the-5pct-boundary", "past-5pct",
         "unsorted", "none-ttft-skipped", "none-memory-skipped", "least-measured-memory", "memory-tie-smaller"],
)
def test_slack_knee(points: list[SlackPoint], expected: float) -> None:
    [recommendation] = slack_advice(points, CURRENT)
    assert recommendation.key == "engine.hot_pool_slack"
    assert recommendation.value == expected
    assert recommendation.current == 1.2
    knee = next(point for point in points if point.slack == expected)
    assert f"TTFT avg {knee.ttft_avg_ms:.0f} ms at {expected:g}" in recommendation.reason
    assert f"{knee.peak_memory_bytes // MIB} MiB" in recommendation.reason
    assert_one_line(recommendation)
    assert_valid(recommendation)


def test_slack_reason_quotes_the_memory_saved_against_the_largest_slack() -> None:
    points = sweep((1.05, 212.0, 100), (1.5, 205.0, 138))
    [recommendation] = slack_advice(points, CURRENT)
    assert "within 5% of the sweep's best (205 ms at 1.5)" in recommendation.reason
    assert "38 MiB less peak memory" in recommendation.reason


@pytest.mark.parametrize(
    "points",
    [[], sweep((1.2, 200.0, 100)), sweep((1.0, None, 100), (1.2, 200.0, 100)), sweep((1.0, None, 1), (1.5, 1.0, None))],
    ids=["empty", "one-point", "one-usable", "none-usable"],
)
def test_slack_needs_two_usable_points(points: list[SlackPoint]) -> None:
    assert slack_advice(points, CURRENT) == []


@pytest.mark.parametrize("slack", [0.5, 10.5, float("nan")], ids=["below-1", "above-10", "nan"])
def test_slack_point_outside_the_schema_range_is_refused(slack: float) -> None:
    with pytest.raises(ValueError, match="hot_pool_slack"):
        SlackPoint(slack, 1.0, 1.0, 1, 1.0)


# --- threads ---------------------------------------------------------------------------------------------------------


def curve(*tokens: float) -> list[ThreadPoint]:
    """Tokens/s with 1, 2, 3, ... threads."""
    return [ThreadPoint(index + 1, value) for index, value in enumerate(tokens)]


@pytest.mark.parametrize(
    ("points", "cores", "expected", "best", "slower"),
    [
        (curve(10.0, 19.0, 27.0, 34.0), 8, [50, 38], 4, None),
        (curve(12.0, 9.0), 2, [100, 99], 1, "2 threads were slower than 1 (9.0 vs 12.0 tokens/s)"),
        (curve(10.0, 19.0, 27.0, 34.0, 40.0, 45.0, 49.0, 52.0), 16, [25, 19], 8, None),
        (curve(10.0, 19.0, 27.0, 26.0), 8, [100, 38], 3, "4 threads were slower than 3 (26.0 vs 27.0 tokens/s)"),
        (curve(10.0, 19.0, 18.0, 17.0), 4, [100, 99], 2, "3 threads were slower than 2 (18.0 vs 19.0 tokens/s)"),
        (curve(10.0, 19.0, 29.5, 30.0), 8, [50, 38], 3, None),  # 29.5 is within 3 % of 30
        (curve(10.0, 19.0, 29.0, 30.0), 8, [50, 38], 4, None),  # 29.0 is not
        (curve(10.0, 19.0, 27.0, 34.0, 40.0, 39.0), 16, [25, 19], 5, "6 threads were slower than 5"),
        (curve(10.0, 11.0), 1, [100, 99], 2, None),
        (curve(10.0, 18.0, 25.0, 30.0), 6, [67, 50], 4, None),  # 66.7 -> 67, exactly 50
        ([ThreadPoint(4, 30.0), ThreadPoint(1, 10.0), ThreadPoint(2, 18.0)], 8, [50, 38], 4, None),
    ],
    ids=["monotone-8-cores", "2-cores-2-slower-than-1", "16-cores", "8-cores-4-slower", "4-cores-3-slower",
         "best-within-3pct", "best-not-within-3pct", "16-cores-slower-past-the-bands", "1-core", "6-cores-rounding",
         "unsorted-curve"],
)
def test_thread_thresholds(
    points: list[ThreadPoint], cores: int, expected: list[int], best: int, slower: str | None
) -> None:
    [recommendation] = thread_advice(points, cores, CURRENT)
    assert recommendation.key == "engine.thread_idle_thresholds"
    assert recommendation.value == expected
    assert recommendation.current == [60, 30]
    assert f"best count {best} threads" in recommendation.reason
    if slower is None:
        assert "slower" not in recommendation.reason
    else:
        assert slower in recommendation.reason
    assert_one_line(recommendation)
    assert_valid(recommendation)


def test_thread_thresholds_close_the_slow_bands_for_the_engine() -> None:
    """On 8 cores where a 4th thread was slower, the engine never picks 4 threads, however idle the box."""
    [recommendation] = thread_advice(curve(10.0, 19.0, 27.0, 26.0), 8, CURRENT)
    thresholds = tuple(recommendation.value)
    assert choose_threads(99.0, thresholds, 8, None) == 3
    assert choose_threads(40.0, thresholds, 8, None) == 3
    assert choose_threads(37.0, thresholds, 8, None) == 2


@pytest.mark.parametrize("cores", range(1, 70))
def test_thread_thresholds_always_pass_the_schema(cores: int) -> None:
    for points in (curve(10.0, 20.0, 30.0, 40.0), curve(10.0, 9.0), curve(10.0, 20.0, 19.0), curve(10.0, 20.0)):
        [recommendation] = thread_advice(points, cores, CURRENT)
        high, low = recommendation.value
        assert isinstance(high, int)
        assert isinstance(low, int)
        assert 0 <= low < high <= 100
        assert config_value(recommendation.key, recommendation.value) == (high, low)


@pytest.mark.parametrize("points", [[], curve(10.0)], ids=["empty", "one-point"])
def test_thread_thresholds_need_two_points(points: list[ThreadPoint]) -> None:
    assert thread_advice(points, 8, CURRENT) == []


def test_thread_curve_with_a_count_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="each thread count once"):
        thread_advice([ThreadPoint(2, 1.0), ThreadPoint(2, 2.0)], 8, CURRENT)


# --- slots, contexts, instances --------------------------------------------------------------------------------------


SLOTS_MAXIMUM = int(BY_KEY["engine.live_slots"].maximum)


def streams(*tokens: float, counts: tuple[int, ...] = (1, 2, 4, 8, 16)) -> list[ConcurrencyPoint]:
    """Aggregate tokens/s with 1, 2, 4, ... streams decoded together."""
    return [ConcurrencyPoint(count, value) for count, value in zip(counts, tokens, strict=False)]


@pytest.mark.parametrize(
    ("points", "expected", "phrase"),
    [
        (streams(100.0, 160.0, 200.0, 205.0, 204.0), 4, "4 reach within 5% of the best (205.0 at 8)"),
        (streams(100.0, 99.0, 98.0), 1, "1 reach within 5% of the best (100.0 at 1)"),
        (streams(100.0, 190.0, 360.0), 4, "still rising at 4 streams, the most measured"),
        (streams(100.0, 150.0, 190.0, 200.0, 190.0), 4, "4 reach within 5% of the best (200.0 at 8)"),
        (streams(100.0, 150.0, 189.0, 200.0), 8, "still rising at 8 streams"),  # 189 is not within 5 % of 200
        ([ConcurrencyPoint(8, 200.0), ConcurrencyPoint(1, 50.0), ConcurrencyPoint(2, 99.0)], 8, "still rising"),
        (streams(10.0, 20.0, counts=(32, 128)), SLOTS_MAXIMUM, "capped at engine.live_slots's maximum 64"),
    ],
    ids=["knee-at-4", "batching-never-helps", "still-rising", "dip-after-the-best", "just-outside-5pct",
         "unsorted-curve", "capped-at-the-schema"],
)
def test_slots_at_the_concurrency_curves_knee(points: list[ConcurrencyPoint], expected: int, phrase: str) -> None:
    [recommendation] = slots_advice(points, CURRENT)
    assert recommendation.key == "engine.live_slots"
    assert recommendation.value == expected
    assert recommendation.current == 4
    assert phrase in recommendation.reason
    assert "aggregate decode tokens/s by streams decoded together" in recommendation.reason
    assert_one_line(recommendation)
    assert_valid(recommendation)


@pytest.mark.parametrize("points", [[], streams(100.0)], ids=["not-measured", "one-point"])
def test_slots_need_a_curve_of_two_points(points: list[ConcurrencyPoint]) -> None:
    assert slots_advice(points, CURRENT) == []


def test_a_concurrency_curve_with_a_count_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="each stream count once"):
        slots_advice([ConcurrencyPoint(2, 1.0), ConcurrencyPoint(2, 2.0)], CURRENT)


@pytest.mark.parametrize(
    ("points", "current", "expected"),
    [
        (curve(12.0, 9.0), 0, 1),  # two threads slower than one
        (curve(12.0, 12.2), 0, 1),  # within 3 %: a second thread buys nothing
        (curve(12.0, 12.2, 11.0, 10.0), 4, 1),  # an operator's pin to 4 threads, one is best
        (curve(10.0, 17.0), 0, None),  # two threads are better: the engine's own choice stays
        (curve(10.0, 17.0), 1, 0),  # a pin to one thread that the curve no longer backs
        (curve(10.0, 17.0, 25.0), 3, None),  # the operator's pin to 3 is left alone
        (curve(12.0, 9.0), 1, 1),  # keep one
    ],
    ids=["one-faster", "one-within-3pct", "pinned-4-one-best", "two-better", "unpin-one", "operator-pin-kept",
         "keep-one"],
)
def test_threads_pinned_to_one_when_the_curve_says_so(points: list[ThreadPoint], current: int,
                                                     expected: int | None) -> None:
    found = pin_advice(points, {**CURRENT, "engine.threads": current})
    if expected is None:
        assert found == []
        return
    [recommendation] = found
    assert recommendation.key == "engine.threads"
    assert recommendation.value == expected and recommendation.current == current
    assert recommendation.differs == (expected != current)
    assert "single-stream decode tokens/s by threads 1:" in recommendation.reason
    assert_one_line(recommendation)
    assert_valid(recommendation)
    assert ADVISED["engine.threads"].admits(recommendation.value, 1)


def test_a_pin_to_one_is_applied_with_the_thresholds() -> None:
    """A curve where two threads are slower than one advises both keys, and --apply may write both."""
    _, recommendations = advise(measurements(thread_curve=tuple(curve(12.0, 9.0))))
    wanted = changes(recommendations)
    assert wanted["engine.threads"] == 1 and wanted["engine.thread_idle_thresholds"] == [100, 99]
    assert not ADVISED["engine.threads"].admits(2, 1)  # the advice never pins another count


@pytest.mark.parametrize("points", [[], curve(10.0)], ids=["empty", "one-point"])
def test_the_thread_pin_needs_two_points(points: list[ThreadPoint]) -> None:
    assert pin_advice(points, {**CURRENT, "engine.threads": 1}) == []


def footprints(*gib: float) -> tuple[ModelFootprint, ...]:
    """Models m0, m1, ... of the given total GiB (three quarters weights, a quarter KV)."""
    models = []
    for index, size in enumerate(gib):
        total = int(size * GIB)
        models.append(ModelFootprint(f"m{index}", total - total // 4, total // 4))
    return tuple(models)


@pytest.mark.parametrize(
    ("models", "device_gib", "expected"),
    [
        (footprints(1, 2), 8, "auto"),
        (footprints(3.6, 3.6), 8, "auto"),  # exactly 90 % of the device
        (footprints(5, 1, 2), 8, 2),  # 1 + 2 fit, + 5 does not
        (footprints(4, 4, 4), 8, 1),
        (footprints(9, 10), 8, 1),  # not even the smallest: still 1
        (footprints(1, 1, 1, 1, 1, 1, 1, 1), 8, 7),
    ],
    ids=["fit", "fit-exactly", "two-smallest-fit", "one-fits", "none-fits", "seven-of-eight"],
)
def test_contexts(models: tuple[ModelFootprint, ...], device_gib: float, expected: Any) -> None:
    [recommendation] = contexts_advice(models, machine(device_gib=device_gib), CURRENT)
    assert recommendation.key == "engine.live_contexts"
    assert recommendation.value == expected
    assert recommendation.current == "auto"
    assert f"the {len(models)} models need" in recommendation.reason
    assert f"{device_gib:.1f} GiB" in recommendation.reason
    assert_one_line(recommendation)
    assert_valid(recommendation)


def test_contexts_current_none_reads_as_auto() -> None:
    [recommendation] = contexts_advice(footprints(1), machine(), {"engine.live_contexts": None})
    assert recommendation.current == "auto"
    assert not recommendation.differs


def test_contexts_without_models_advise_nothing() -> None:
    assert contexts_advice((), machine(), CURRENT) == []


@pytest.mark.parametrize(
    ("models", "device_gib", "max_connections", "expected", "capped"),
    [
        (footprints(1), 10, 128, [9], False),  # floor(0.9 * 10 / 1)
        (footprints(1, 2, 3), 10, 128, [9, 4, 3], False),
        (footprints(1), 10, 4, [4], True),  # 9 fit, capped by max_connections
        (footprints(0.001), 8, 128, [128], True),
        (footprints(12), 8, 128, [0], False),  # does not fit at all
        (footprints(0.9), 1, 128, [1], False),  # exactly 90 %
    ],
    ids=["one-model", "three-models", "capped", "tiny-model-capped", "too-big", "exactly-90pct"],
)
def test_instances(
    models: tuple[ModelFootprint, ...], device_gib: float, max_connections: int, expected: list[int], capped: bool
) -> None:
    recommendations = instance_advice(models, machine(device_gib=device_gib), max_connections)
    assert [recommendation.value for recommendation in recommendations] == expected
    for recommendation, model in zip(recommendations, models, strict=True):
        assert recommendation.key is None
        assert recommendation.current is None
        assert recommendation.model == model.name
        assert recommendation.reason.startswith(f"model {model.name}: {recommendation.value} instances fit")
        assert "not a config key" in recommendation.reason
        assert ("capped by max_connections" in recommendation.reason) == capped
        assert_one_line(recommendation)


@pytest.mark.parametrize(
    ("weights", "kv"),
    [(0, 0), (-1, 5), (1.5, 1)],
    ids=["empty", "negative", "not-whole"],
)
def test_model_footprint_refuses_bad_sizes(weights: Any, kv: Any) -> None:
    with pytest.raises(ValueError, match="weights_bytes"):
        ModelFootprint("m", weights, kv)


# --- advise, changes, the JSON ---------------------------------------------------------------------------------------


def measurements(**overrides: Any) -> Measurements:
    fields: dict[str, Any] = {
        "machine": machine(cores=2, memory_gib=8, device_gib=8),
        "tokens_per_s": 17.0,
        "slack_sweep": tuple(sweep((1.0, 250.0, 100), (1.2, 212.0, 110), (1.5, 205.0, 140))),
        "thread_curve": tuple(curve(12.0, 9.0)),
        "concurrency_curve": tuple(streams(100.0, 160.0, 200.0)),
        "models": footprints(0.5, 1),
        "max_connections": 128,
        "current": CURRENT,
    }
    fields.update(overrides)
    return Measurements(**fields)


def test_advise_gives_the_class_and_every_recommendation_in_a_fixed_order() -> None:
    (name, reason), recommendations = advise(measurements())
    assert name == "low"
    assert "2 cores" in reason
    keys = [recommendation.key for recommendation in recommendations]
    assert keys == [*ADVISED_KEYS, None, None]
    assert [recommendation.model for recommendation in recommendations[-2:]] == ["m0", "m1"]
    for recommendation in recommendations:
        assert_one_line(recommendation)
        assert_valid(recommendation)


def test_advise_leaves_out_what_was_not_measured() -> None:
    (name, reason), recommendations = advise(measurements(tokens_per_s=None, slack_sweep=(), thread_curve=(),
                                                          concurrency_curve=()))
    assert name == "low"
    assert "not measured" in reason
    keys = [recommendation.key for recommendation in recommendations]
    assert "engine.hot_pool_slack" not in keys
    assert "engine.thread_idle_thresholds" not in keys
    assert "engine.threads" not in keys
    assert "engine.live_slots" not in keys
    assert "engine.live_contexts" in keys


def test_changes_are_the_keyed_recommendations_that_differ() -> None:
    recommendations = [
        Recommendation("engine.live_slots", 2, 4, "r"),
        Recommendation("engine.live_contexts", "auto", "auto", "r"),
        Recommendation("engine.thread_idle_thresholds", [60, 30], (60, 30), "r"),  # a tuple is the same pair
        Recommendation("engine.hot_pool_slack", 1.5, 1.2, "r"),
        Recommendation("engine.adaptive_window_size", 32, None, "r"),  # current unknown: written
        Recommendation(None, 3, None, "r", "demo"),
    ]
    assert changes(recommendations) == {
        "engine.live_slots": 2,
        "engine.hot_pool_slack": 1.5,
        "engine.adaptive_window_size": 32,
    }


def test_changes_refuse_two_values_for_one_key() -> None:
    recommendations = [Recommendation("engine.live_slots", 2, 4, "r"), Recommendation("engine.live_slots", 3, 4, "r")]
    with pytest.raises(ValueError, match="two recommendations for engine.live_slots"):
        changes(recommendations)


def test_recommendations_round_trip_through_json() -> None:
    _, recommendations = advise(measurements())
    documents = json.loads(json.dumps([recommendation.to_dict() for recommendation in recommendations]))
    assert [Recommendation.from_dict(document) for document in documents] == recommendations
    assert "model" not in documents[0]
    assert documents[-1]["model"] == "m1"
    assert documents[-1]["key"] is None


def test_to_dict_writes_pairs_as_lists() -> None:
    document = Recommendation("engine.thread_idle_thresholds", (50, 38), (60, 30), "r").to_dict()
    assert document == {"key": "engine.thread_idle_thresholds", "value": [50, 38], "current": [60, 30],
                        "reason": "r"}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"key": "engine.live_slots", "value": 2, "current": 4}, "needs reason"),
        ({"key": "engine.live_slots", "value": 2, "current": 4, "reason": "r", "extra": 1}, "unknown field"),
        ({"key": "engine.live_slots", "value": 2, "current": 4, "reason": "two\nlines"}, "one line"),
        ({"key": 5, "value": 2, "current": 4, "reason": "r"}, "dotted config key"),
        ({"key": None, "value": 2, "current": None, "reason": "r", "model": ""}, "model name"),
        (["not", "a", "mapping"], "must be a mapping"),
    ],
    ids=["missing-reason", "unknown-field", "multi-line-reason", "bad-key", "empty-model", "not-a-mapping"],
)
def test_from_dict_refuses_malformed_entries(document: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Recommendation.from_dict(document)


def test_current_settings_reads_a_config_as_the_file_spells_it() -> None:
    config = parse_config("engine:\n  live_contexts: auto\n  thread_idle_thresholds: [70, 40]\n", check_files=False)
    current = current_settings(config)
    assert set(current) == set(ADVISED_KEYS)
    assert current["engine.live_contexts"] == "auto"
    assert current["engine.thread_idle_thresholds"] == [70, 40]
    assert current["engine.live_slots"] == BY_KEY["engine.live_slots"].default


def test_a_value_the_schema_refuses_is_caught_by_the_check_the_tests_use() -> None:
    """The schema check in these tests can fail: thresholds the wrong way round are refused."""
    with pytest.raises(ConfigInvalid):
        config_value("engine.thread_idle_thresholds", [30, 60])
