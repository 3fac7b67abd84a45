"""The benchmarks' foreign-CPU check (``benchmarks/common.py``): a round during which other processes used more than
10 % of the box's CPU is dropped and re-run up to a bound; too few clean rounds make the result NOISY."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks import common
from benchmarks.common import CpuSnapshot, foreign_share, rounds_finished, run_clean_rounds, select_rounds

LIMIT = 0.10


def test_a_clean_series_stops_at_the_wanted_rounds_and_keeps_them() -> None:
    assert not rounds_finished([0.02, 0.05], 3, 3, LIMIT)
    assert rounds_finished([0.02, 0.05, 0.10], 3, 3, LIMIT)  # at the limit is clean
    records = select_rounds([0.02, 0.05, 0.10], 3, LIMIT)
    assert [(r.kept, r.clean) for r in records] == [(True, True)] * 3


def test_contaminated_rounds_are_dropped_and_rerun() -> None:
    shares = [0.02, 0.40, 0.03, 0.11]
    assert not rounds_finished(shares, 3, 3, LIMIT)  # 2 clean, 4 of 6 attempts
    shares.append(0.01)
    assert rounds_finished(shares, 3, 3, LIMIT)
    records = select_rounds(shares, 3, LIMIT)
    assert [r.attempt for r in records if r.kept] == [0, 2, 4]
    dropped = [r for r in records if not r.kept]
    assert [r.attempt for r in dropped] == [1, 3]
    assert dropped[0].why == "dropped: other processes used 40% of the CPU > 10%"
    summary = common.rounds_summary(records, 3, 3, LIMIT)
    assert summary["kept_attempts"] == [0, 2, 4] and summary["dropped"] == 2 and not summary["noisy"]


def test_the_bound_stops_a_noisy_series_and_the_least_contaminated_rounds_fill_it() -> None:
    shares = [0.50, 0.05, 0.30, 0.20]
    assert rounds_finished(shares, 3, 1, LIMIT)  # 3 + 1 attempts
    records = select_rounds(shares, 3, LIMIT)
    assert [r.attempt for r in records if r.kept] == [1, 2, 3]  # the clean one, then 20 % and 30 %
    assert records[3].why.startswith("kept to fill: other processes used 20% of the CPU > 10%, only 1 of 3")
    summary = common.rounds_summary(records, 3, 1, LIMIT)
    assert summary["noisy"] and summary["clean"] == 1 and summary["contaminated"] == 3 and summary["dropped"] == 1


def test_a_round_too_short_to_measure_counts_as_clean_and_says_so() -> None:
    records = select_rounds([None, 0.5, 0.0], 2, LIMIT)
    assert [r.kept for r in records] == [True, False, True]
    assert records[0].why.startswith("clean: too short to measure")


def test_foreign_share_is_busy_time_less_the_benchmarks_own() -> None:
    before = CpuSnapshot((100, 0, 50, 1000, 0, 0, 0, 0), 40)
    after = CpuSnapshot((160, 0, 90, 1100, 0, 0, 0, 0), 100)  # 200 ticks, 100 busy, 60 of them ours
    assert foreign_share(before, after) == pytest.approx(0.2)
    assert foreign_share(before, before) is None
    mine = CpuSnapshot((160, 0, 90, 1100, 0, 0, 0, 0), 150)  # the kernel counts ours a few ticks over: not below 0
    assert foreign_share(before, mine) == 0.0


def test_a_busy_process_that_is_not_ours_contaminates_the_round() -> None:
    """A real busy loop in another process is foreign; the same loop counted as ours is not."""
    loop = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", loop])
    try:
        time.sleep(0.3)  # it is running

        def spin(attempt: int) -> None:
            time.sleep(1.0)

        def nobody() -> list[int]:
            return []

        def the_busy_loop() -> list[int]:
            return [busy.pid]

        foreign = run_clean_rounds(1, 0, spin, nobody, LIMIT)
        ours = run_clean_rounds(1, 0, spin, the_busy_loop, LIMIT)
    finally:
        busy.kill()
        busy.wait()
    cpus = os.cpu_count() or 1
    assert foreign["records"][0]["foreign_share"] > 0.5 / cpus  # one core of the box, less scheduling noise
    assert foreign["noisy"] and foreign["records"][0]["why"].startswith("kept to fill")
    assert ours["records"][0]["foreign_share"] < foreign["records"][0]["foreign_share"]


def test_a_gone_server_is_an_error_not_a_zero() -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with pytest.raises(RuntimeError, match="a measured server is gone"):
        common.process_ticks(int(done.stdout))
