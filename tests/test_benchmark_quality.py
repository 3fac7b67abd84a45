"""How far a benchmark result can be trusted (issue #26, "Honest benchmark advice"): the CPU other processes used
during a run from two /proc/stat readings less the benchmark's own ticks, the caveats of a quick, single-repeat or
contended run, how an older or hand-edited result is read, and the printed report and headline that carry the
caveats. Pure: crafted readings and results, no processes."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.benchmark import quality, report
from appliance.benchmark.quality import CONTENDED_SHARE, CpuUse, RunQuality, caveats, cpu_use, quality_of
from appliance.benchmark.session import FIGURE_KEYS
from appliance.engine.tuning import parse_proc_stat

BEFORE = parse_proc_stat("cpu  1000 0 500 8000 100 0 0 0 0 0\ncpu0 500 0 250 4000 50 0 0 0 0 0\n")
# 1,000 ticks later: 300 user, 100 system, 550 idle, 50 iowait -> 400 busy of 1,000
AFTER = parse_proc_stat("cpu  1300 0 600 8550 150 0 0 0 0 0\ncpu0 650 0 300 4275 75 0 0 0 0 0\n")


def test_others_use_what_is_busy_and_not_ours() -> None:
    use = cpu_use(BEFORE, AFTER, own_ticks=150)
    assert (use.total_ticks, use.busy_ticks, use.own_ticks) == (1000, 400, 150)
    assert use.others_share == pytest.approx(0.25)


def test_our_own_ticks_above_the_busy_time_leave_nothing_to_others() -> None:
    """The kernel accounts a process's ticks and /proc/stat apart: a few ticks more of ours is not a negative share."""
    assert cpu_use(BEFORE, AFTER, own_ticks=420).others_share == 0.0


@pytest.mark.parametrize(
    ("before", "after", "own", "message"),
    [
        (AFTER, BEFORE, 0, "went backwards"),
        (BEFORE, BEFORE, 0, "no CPU time passed"),
        (BEFORE[:4], AFTER, 0, "counters"),
        (BEFORE, AFTER, -1, "own_ticks"),
    ],
    ids=["backwards", "no-time", "short-reading", "negative-own"],
)
def test_bad_readings_are_refused(before: tuple[int, ...], after: tuple[int, ...], own: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_use(before, after, own)


def test_busy_time_cannot_exceed_the_total() -> None:
    with pytest.raises(ValueError, match="exceed"):
        CpuUse(100, 101, 0)


@pytest.mark.parametrize(
    ("run", "labels"),
    [
        (RunQuality(quick=False, repeats=3, others_share=0.02), []),
        (RunQuality(quick=True, repeats=1, others_share=0.02), ["quick", "single run"]),
        (RunQuality(quick=False, repeats=1, others_share=0.0), ["single run"]),
        (RunQuality(quick=False, repeats=2, others_share=CONTENDED_SHARE), ["contended"]),
        (RunQuality(quick=False, repeats=2, others_share=CONTENDED_SHARE - 0.001), []),
        (RunQuality(quick=False, repeats=3, others_share=None), ["contention not measured"]),
        (RunQuality(quick=True, repeats=1, others_share=0.47), ["quick", "single run", "contended"]),
    ],
    ids=["trusted", "quick-single", "single", "contended-at-the-limit", "just-below", "not-measured", "all-three"],
)
def test_caveats(run: RunQuality, labels: list[str]) -> None:
    found = caveats(run)
    assert [caveat.label for caveat in found] == labels
    assert all(caveat.text and "\n" not in caveat.text for caveat in found)
    if "contended" in labels:
        share = run.others_share
        assert share is not None
        assert f"other processes used {share:.0%} of the CPU" in found[-1].text


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"quick": True, "repeats": 3, "cpu": {"others_share": 0.05}}, RunQuality(True, 3, 0.05)),
        ({}, RunQuality(False, 1, None)),  # a result older than the caveats
        ({"quick": "yes", "repeats": True, "cpu": {"others_share": 2.0}}, RunQuality(False, 1, None)),
        ({"quick": False, "repeats": 0, "cpu": [0.5]}, RunQuality(False, 1, None)),
        ({"repeats": 2, "cpu": {"others_share": float("nan")}}, RunQuality(False, 2, None)),
    ],
    ids=["saved", "older", "hand-edited", "nonsense", "not-a-number"],
)
def test_a_saved_result_is_read_leniently(document: dict[str, Any], expected: RunQuality) -> None:
    assert quality_of(document) == expected


@pytest.mark.parametrize("share", [-0.1, 1.5, float("inf")])
def test_a_share_outside_0_to_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="others_share"):
        RunQuality(False, 1, share)


def result(**overrides: Any) -> dict[str, Any]:
    """A crafted result document with what the report reads."""
    figures = dict.fromkeys(FIGURE_KEYS, 1.0)
    document: dict[str, Any] = {
        "table": {"fixed": figures, "adaptive": figures, "improvement": dict.fromkeys(FIGURE_KEYS, 0.0)},
        "model": {"name": "m", "path": "/m.gguf", "n_ctx": 2048},
        "machine": {"cores": 2, "memory_bytes": 2**33, "device_kind": "host", "device_total_bytes": 2**33},
        "workload": {"agents": 2, "rounds": 3, "description": "d"},
        "strategies": {"fixed": {"label": "fixed"}},
        "sweep": {"rounds": 3}, "slack_sweep": [], "thread_curve": [], "decode": {"tokens": 32, "repeats": 1},
        "concurrency_curve": [{"streams": 1, "tokens_per_s": 50.0}, {"streams": 2, "tokens_per_s": 90.0}],
        "concurrency": {"max_in_flight": 2},
        "device_class": {"name": "low", "reason": "r"}, "advice": [], "complete": True, "errors": [],
        "models_skipped": [], "quick": True, "repeats": 1, "cpu": {"others_share": 0.31},
    }
    document.update(overrides)
    document["headline"] = report.headline(document)
    return document


def test_the_report_and_headline_carry_the_caveats() -> None:
    document = result()
    assert document["headline"].endswith("; CAVEATS: quick, single run, contended")
    text = report.text(document)
    assert "caveats (quick, single run, contended): measure again before acting on this advice" in text
    for caveat in quality.result_caveats(document):
        assert f"  {caveat.text}" in text
    assert "other processes used 31% of the CPU during the run" in text
    assert "aggregate decode tokens/s by streams decoded together: 1: 50.0, 2: 90.0" in text


def test_a_trusted_run_says_it_has_no_caveats() -> None:
    document = result(quick=False, repeats=3, cpu={"others_share": 0.01})
    assert "CAVEATS" not in document["headline"]
    assert "caveats: none (a full run, repeated, on an uncontended box)" in report.text(document)


def test_an_older_result_without_the_curve_or_the_cpu_is_shown_as_not_measured() -> None:
    document = result(quick=False, repeats=3)
    del document["concurrency_curve"], document["cpu"]
    text = report.text(document)
    assert "aggregate decode tokens/s by streams decoded together: not measured" in text
    assert report.headline(document).endswith("; CAVEATS: contention not measured")
