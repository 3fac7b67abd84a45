"""The load profile (SPEC E1): sampling, the sliding window and nearest-rank percentiles, without models."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_layers import forbidden_imports

from appliance.engine.profile import FIELDS, LoadProfile, Percentiles, RequestSample, percentiles_of


def sample(input_tokens: int = 10, **changes: float) -> RequestSample:
    figures = {
        "input_tokens": input_tokens,
        "output_tokens": 5,
        "prompt_evaluated": 8,
        "ttft_s": 0.05,
        "decode_s": 0.2,
        "kv_cells_used": 15,
        "kv_cells_peak": 16,
        "live_sequences": 1,
        "threads": 4,
        "queue_length": 0,
    }
    figures.update(changes)
    return RequestSample(**figures)


def test_profile_and_tuning_are_pure() -> None:
    assert forbidden_imports("engine.profile") == {}
    assert forbidden_imports("engine.tuning") == {}


def test_fields_are_the_sample_figures_in_order() -> None:
    assert FIELDS == (
        "input_tokens", "output_tokens", "prompt_evaluated", "ttft_s", "decode_s",
        "kv_cells_used", "kv_cells_peak", "live_sequences", "threads", "queue_length", "burst_tokens",
        "kv_cells_need",
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], Percentiles(None, None, None)),
        ([7], Percentiles(7, 7, 7)),
        ([3, 1, 2], Percentiles(2, 3, 3)),  # odd: rank ceil(1.5) = 2
        ([4, 1, 3, 2], Percentiles(2, 4, 4)),  # even: P50 is the lower middle value
        ([1, 7, 7, 7], Percentiles(7, 7, 7)),  # ties
        ([5, 5, 5, 5, 5], Percentiles(5, 5, 5)),
        (list(range(10, 0, -1)), Percentiles(5, 9, 10)),  # rank 9 of 10 is exactly P90
        (list(range(1, 12)), Percentiles(6, 10, 11)),  # 11 values: P90 rank ceil(9.9) = 10
        (list(range(1, 101)), Percentiles(50, 90, 99)),
        (list(range(1, 201)), Percentiles(100, 180, 198)),
        ([0.25, 0.5, 0.125], Percentiles(0.25, 0.5, 0.5)),
    ],
)
def test_nearest_rank_percentiles(values: list[float], expected: Percentiles) -> None:
    assert percentiles_of(values) == expected


@given(st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=300))
def test_percentiles_are_nearest_rank_values(values: list[int]) -> None:
    found = percentiles_of(values)
    assert min(values) <= found.p50 <= found.p90 <= found.p99 <= max(values)
    for percent, value in ((50, found.p50), (90, found.p90), (99, found.p99)):
        assert value in values
        # The smallest value with at least percent % of the values at or below it.
        assert 100 * sum(1 for item in values if item <= value) >= percent * len(values)
        assert 100 * sum(1 for item in values if item < value) < percent * len(values)


def picks(seed: int, rate: int, count: int) -> list[bool]:
    """What a profile with ``random.Random(seed)`` keeps of ``count`` requests at ``rate`` (a twin of its RNG)."""
    twin = random.Random(seed)
    return [rate == 1 or twin.randrange(rate) == 0 for _ in range(count)]


@pytest.mark.parametrize("rate", [1, 2, 3, 8])
def test_a_request_is_kept_by_the_injected_rng_one_in_rate(rate: int) -> None:
    profile = LoadProfile(window_size=64, sample_rate=rate, rng=random.Random(7))
    kept = [profile.observe(sample(index)) for index in range(1, 41)]
    assert kept == picks(7, rate, 40)
    assert profile.observed == 40
    assert profile.sampled == sum(kept)
    expected = [index for index, keep in enumerate(kept, start=1) if keep]
    assert [item.input_tokens for item in profile.window] == expected[-64:]


def test_the_default_rng_is_seeded_so_two_profiles_keep_the_same_requests() -> None:
    first = LoadProfile(window_size=64, sample_rate=4)
    second = LoadProfile(window_size=64, sample_rate=4)
    assert [first.observe(sample(n)) for n in range(200)] == [second.observe(sample(n)) for n in range(200)]
    assert 25 <= first.sampled <= 75  # one in four on average: 50 expected


@pytest.mark.parametrize("big_at", [0, 1, 2, 3])
def test_sampling_does_not_alias_with_waves_of_four(big_at: int) -> None:
    """Agents answer in waves of 4 whose one big request has the same place in every wave: whatever that place, the
    window sees the big ones (a stride of 4 would see only one place of the wave, so P90 would be 128 for 3 of the 4
    placements)."""
    profile = LoadProfile(window_size=64, sample_rate=4)
    for _ in range(100):
        for place in range(4):
            profile.observe(sample(kv_cells_peak=1030 if place == big_at else 128))
    peaks = profile.values("kv_cells_peak")
    assert len(peaks) == 64
    assert 6 <= peaks.count(1030) <= 40  # a quarter of the requests: 16 expected
    assert profile.percentiles("kv_cells_peak").p90 == 1030


def test_the_window_slides_over_the_last_samples() -> None:
    profile = LoadProfile(window_size=3, sample_rate=1)
    for tokens in (100, 200, 300):
        profile.observe(sample(tokens))
    assert profile.percentiles("input_tokens") == Percentiles(200, 300, 300)
    for tokens in (10, 20):
        profile.observe(sample(tokens))
    assert [item.input_tokens for item in profile.window] == [300, 10, 20]
    assert len(profile) == 3
    assert profile.percentiles("input_tokens") == Percentiles(20, 300, 300)
    profile.observe(sample(30))
    assert profile.percentiles("input_tokens") == Percentiles(20, 30, 30)
    assert (profile.observed, profile.sampled) == (6, 6)


@given(
    st.integers(min_value=1, max_value=20),
    st.integers(min_value=1, max_value=5),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=100),
)
def test_the_window_holds_the_last_sampled_requests(window_size: int, rate: int, tokens: list[int]) -> None:
    profile = LoadProfile(window_size, rate, rng=random.Random(11))
    for count in tokens:
        profile.observe(sample(count))
    sampled = [count for count, keep in zip(tokens, picks(11, rate, len(tokens)), strict=True) if keep]
    assert profile.observed == len(tokens)
    assert profile.sampled == len(sampled)
    assert [item.input_tokens for item in profile.window] == sampled[-window_size:]
    assert profile.percentiles("input_tokens") == percentiles_of(sampled[-window_size:])


def test_an_empty_window_has_no_percentiles() -> None:
    profile = LoadProfile(window_size=4, sample_rate=2)
    profile.observe(sample())
    summary = profile.summary()
    assert (summary["observed"], summary["sampled"], summary["in_window"]) == (1, 0, 0)
    assert summary["percentiles"] == {field: {"p50": None, "p90": None, "p99": None} for field in FIELDS}
    assert profile.percentiles("ttft_s") == Percentiles(None, None, None)


def test_summary_has_every_field_and_the_counts() -> None:
    profile = LoadProfile(window_size=2, sample_rate=1)
    profile.observe(sample(100, ttft_s=0.5, kv_cells_peak=128))
    profile.observe(sample(300, ttft_s=0.25, kv_cells_peak=512))
    profile.observe(sample(200, ttft_s=0.125, kv_cells_peak=256))
    summary = profile.summary()
    assert {key: summary[key] for key in ("observed", "sampled", "in_window", "window_size", "sample_rate")} == {
        "observed": 3, "sampled": 3, "in_window": 2, "window_size": 2, "sample_rate": 1,
    }
    table = summary["percentiles"]
    assert list(table) == list(FIELDS)
    assert table["input_tokens"] == {"p50": 200, "p90": 300, "p99": 300}
    assert table["ttft_s"] == {"p50": 0.125, "p90": 0.25, "p99": 0.25}
    assert table["kv_cells_peak"] == {"p50": 256, "p90": 512, "p99": 512}
    assert table["threads"] == {"p50": 4, "p90": 4, "p99": 4}


@pytest.mark.parametrize(
    ("window_size", "rate", "message"),
    [
        (0, 4, "window_size must be at least 1, got 0"),
        (-3, 4, "window_size must be at least 1, got -3"),
        (64, 0, "sample_rate must be at least 1, got 0"),
    ],
)
def test_bad_profile_arguments(window_size: int, rate: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadProfile(window_size, rate)


def test_an_unknown_field_names_the_known_ones() -> None:
    profile = LoadProfile(window_size=4, sample_rate=1)
    with pytest.raises(ValueError, match="unknown field 'latency': must be one of input_tokens, .*queue_length"):
        profile.percentiles("latency")


@pytest.mark.parametrize("field", FIELDS)
def test_a_negative_figure_is_refused(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be at least 0, got -1"):
        sample(**{field: -1})


def test_a_sample_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample().input_tokens = 3  # type: ignore[misc]
