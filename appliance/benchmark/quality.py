"""How far a benchmark result can be trusted: its caveats. Pure: no IO, no clock.

A result is one to act on only when it is a full run (not ``--quick``), repeated (``--repeats`` 2 or more: the
figures are medians) and uncontended: other processes used less than :data:`CONTENDED_SHARE` of the box's CPU while
it ran. Each way it falls short is a :class:`Caveat`; the report, the saved JSON, the CLI and the admin page show
them, and the admin page's "Apply advice" asks for a confirmation when there is any.

The CPU others used is measured from two readings of ``/proc/stat`` (every CPU's busy and total time) and the clock
ticks of the benchmark's own processes in between (itself, the appliance processes it started and waited for, or
the running appliance it measured in place): :func:`cpu_use`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.engine.tuning import IDLE, IOWAIT, PROC_STAT_COUNTERS

CONTENDED_SHARE = 0.10
"""A run during which other processes used this share of the box's CPU or more is contended."""
QUICK = "quick"
SINGLE = "single run"
CONTENDED = "contended"
UNMEASURED = "contention not measured"


@dataclass(frozen=True)
class CpuUse:
    """The box's CPU time over a run, in clock ticks of every CPU together: all of it (``total_ticks``), the busy part
    (not idle, not waiting for IO) and the part that was the benchmark's own processes'."""

    total_ticks: int
    busy_ticks: int
    own_ticks: int

    def __post_init__(self) -> None:
        for name in ("total_ticks", "busy_ticks", "own_ticks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer of at least 0, got {value!r}")
        if self.total_ticks < 1:
            raise ValueError("no CPU time passed during the run (total_ticks 0)")
        if self.busy_ticks > self.total_ticks:
            raise ValueError(f"busy_ticks {self.busy_ticks} exceed total_ticks {self.total_ticks}")

    @property
    def others_share(self) -> float:
        """The share (0 to 1) of the box's CPU time that other processes used: busy time less the benchmark's own
        (never below 0: the kernel's accounting of the two differs by a few ticks)."""
        return max(0, self.busy_ticks - self.own_ticks) / self.total_ticks


def cpu_use(before: tuple[int, ...], after: tuple[int, ...], own_ticks: int) -> CpuUse:
    """The :class:`CpuUse` between two ``/proc/stat`` readings (:func:`~appliance.engine.tuning.parse_proc_stat`),
    ``before`` then ``after``, when the benchmark's processes used ``own_ticks`` clock ticks in between."""
    if len(before) != len(PROC_STAT_COUNTERS) or len(after) != len(PROC_STAT_COUNTERS):
        raise ValueError(f"readings must have {len(PROC_STAT_COUNTERS)} counters, got {len(before)} and "
                         f"{len(after)}")
    deltas = [later - earlier for earlier, later in zip(before, after, strict=True)]
    if any(delta < 0 for delta in deltas):
        raise ValueError("a counter went backwards: the readings must be given oldest first")
    total = sum(deltas)
    return CpuUse(total, total - deltas[IDLE] - deltas[IOWAIT], own_ticks)


@dataclass(frozen=True)
class Caveat:
    """One way a result falls short: ``label`` (a few words, for a headline) and ``text`` (one line saying why it
    matters and what to do)."""

    label: str
    text: str


@dataclass(frozen=True)
class RunQuality:
    """What the caveats are decided on: a ``--quick`` run, how many times each measurement ran, and the share of the
    CPU other processes used (None: not measured)."""

    quick: bool
    repeats: int
    others_share: float | None

    def __post_init__(self) -> None:
        if not isinstance(self.repeats, int) or isinstance(self.repeats, bool) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer of at least 1, got {self.repeats!r}")
        share = self.others_share
        if share is not None and not (isinstance(share, int | float) and math.isfinite(share) and 0 <= share <= 1):
            raise ValueError(f"others_share must be a number from 0 to 1 or None, got {share!r}")


def caveats(quality: RunQuality) -> list[Caveat]:
    """The result's caveats, in a fixed order (quick, single run, contended or not measured); none for a full,
    repeated, uncontended run."""
    found = []
    if quality.quick:
        found.append(Caveat(QUICK, "a quick run (--quick): a short session, 3 slack points, few thread and stream "
                                   "counts; too short to act on"))
    if quality.repeats < 2:
        found.append(Caveat(SINGLE, "each measurement ran once (--repeats 1): single runs on a shared box swing by "
                                    "tens of percent; --repeats 3 reports medians"))
    share = quality.others_share
    if share is None:
        found.append(Caveat(UNMEASURED, "the CPU other processes used during the run was not measured, so it may "
                                        "have been contended"))
    elif share >= CONTENDED_SHARE:
        found.append(Caveat(CONTENDED, f"contended: other processes used {share:.0%} of the CPU during the run "
                                       f"({CONTENDED_SHARE:.0%} or more); measure on a quiet box"))
    return found


def quality_of(result: Mapping[str, Any]) -> RunQuality:
    """A saved result's :class:`RunQuality`, read leniently (an older result, or one edited by hand): ``quick`` only
    when it says true, ``repeats`` 1 unless it is a whole number above 1, the CPU share not measured unless
    ``cpu.others_share`` is a number from 0 to 1."""
    repeats = result.get("repeats")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        repeats = 1
    cpu = result.get("cpu")
    share = cpu.get("others_share") if isinstance(cpu, Mapping) else None
    if not (isinstance(share, int | float) and not isinstance(share, bool) and math.isfinite(share)
            and 0 <= share <= 1):
        share = None
    return RunQuality(result.get("quick") is True, repeats, share)


def result_caveats(result: Mapping[str, Any]) -> list[Caveat]:
    """:func:`caveats` of a saved result (:func:`quality_of`)."""
    return caveats(quality_of(result))


def labels(found: list[Caveat]) -> str:
    """The caveats' labels, comma-separated ("" for none)."""
    return ", ".join(caveat.label for caveat in found)
