"""The adaptive engine's policies: hot pool size, plan and thread count (SPEC E2-E4). Pure: no IO.

The adaptive loop reads the profile (:mod:`appliance.engine.profile`), ``/proc/stat`` and the cgroup's
``cpu.max``, and hands the figures to these functions; it applies what they return. Each choice has hysteresis,
so a workload sitting on a boundary does not flap between two values:

* **Hot pool (E2).** :func:`hot_pool_cells` is the size the figures ask for; :func:`resize_pool` grows the pool
  to it at once but shrinks only when the wanted size is at least ``shrink_margin`` below the current one.
  :func:`queue_pool_cells` is the size asked for when admission is blocked on cells (the requests in flight and
  those waiting need more than the pool); :func:`split_streams` the streams of a split context (a KV stream per
  live sequence) where concurrent requests' claims allow one; :func:`builds_beside` says whether the next context
  may be built beside the live one or only after the live one is freed, and :func:`growth_ceiling` how large a
  growth may go without the model's KV memory (pools and host buffers) passing what the fixed strategy
  preallocates.
* **Plan (E3).** :func:`choose_plan`: S below the first boundary, M between, L above the second (P90 input
  tokens). Away from the current plan each boundary moves by ``margin`` times itself: leaving a plan needs the
  value past the boundary by that much. :func:`burst_plan`: the plan whose micro-batch holds the steps that
  evaluate several prompts at once (P90 of those steps' tokens); the context runs the larger of the two.
* **Threads (E4).** :func:`choose_threads`: CPU idle above the first threshold -> 4, between -> 3, below the
  second -> 2, capped by the cores the process may use (:func:`usable_cores`). Away from the current count each
  threshold moves by ``margin`` percentage points.

Inputs out of range raise :class:`ValueError` naming the limit.
"""

from __future__ import annotations

import math
import re

from appliance.errors import ApplianceError

PLANS = ("S", "M", "L")
THREADS_BY_BAND = (2, 3, 4)
PROC_STAT_COUNTERS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
IDLE = PROC_STAT_COUNTERS.index("idle")
IOWAIT = PROC_STAT_COUNTERS.index("iowait")
WHOLE_NUMBER = re.compile(r"[0-9]+")
STREAM_GRANULARITY = 256
"""llama.cpp pads a split context's stream (one sequence's cells) to a multiple of 256 cells: a split context's
``n_ctx`` is a multiple of 256 per sequence (:class:`~appliance.engine.batched.BatchedContext` and the fake engine's
context refuse others)."""


def check_split(n_ctx: int, n_seq_max: int) -> None:
    """Refuse a split context whose ``n_ctx`` is not :data:`STREAM_GRANULARITY` cells per sequence times a whole
    number (llama.cpp would pad each stream past its share)."""
    if n_ctx % (STREAM_GRANULARITY * n_seq_max):
        raise ApplianceError("BAD_REQUEST", f"a split context's n_ctx must be a multiple of {STREAM_GRANULARITY} "
                                            "cells per sequence", {"n_ctx": n_ctx, "n_seq_max": n_seq_max})


def round_up(value: int, granularity: int) -> int:
    """``value`` rounded up to a multiple of ``granularity``."""
    return -(-value // granularity) * granularity


def hot_pool_cells(
    profile_p90_need: int,
    slack: float,
    live_cells: int,
    *,
    granularity: int = 256,
    minimum: int = 256,
    maximum: int,
) -> int:
    """The hot pool's KV cells for a P90 need of ``profile_p90_need`` cells.

    The need times ``slack``, rounded up to ``granularity``, and never below ``live_cells`` (what live
    conversations hold, also rounded up), clamped to ``[minimum, maximum]``; ``minimum`` must be a multiple of
    ``granularity``. ``maximum`` (the model's context length) is a hard cap that wins over the rounding: the result
    is a multiple of ``granularity`` or ``maximum``. Live conversations holding more than ``maximum`` cells is an
    error.
    """
    if profile_p90_need < 0:
        raise ValueError(f"profile_p90_need must be at least 0, got {profile_p90_need}")
    if slack < 1.0:
        raise ValueError(f"slack must be at least 1.0, got {slack}")
    if live_cells < 0:
        raise ValueError(f"live_cells must be at least 0, got {live_cells}")
    if granularity < 1:
        raise ValueError(f"granularity must be at least 1, got {granularity}")
    if minimum < 1:
        raise ValueError(f"minimum must be at least 1, got {minimum}")
    if minimum % granularity != 0:
        raise ValueError(f"minimum must be a multiple of granularity ({granularity}), got {minimum}")
    if maximum < minimum:
        raise ValueError(f"maximum must be at least minimum ({minimum}), got {maximum}")
    if live_cells > maximum:
        raise ValueError(f"live_cells must be at most maximum ({maximum}), got {live_cells}")
    # round() drops float noise such as 100 * 1.1 = 110.00000000000001 before rounding up.
    need = round_up(math.ceil(round(profile_p90_need * slack, 6)), granularity)
    wanted = max(need, round_up(live_cells, granularity), minimum)
    return min(wanted, maximum)


def resize_pool(current: int, wanted: int, shrink_margin: float = 0.25) -> int:
    """The pool size to apply: ``wanted`` when it is larger than ``current`` or at least ``shrink_margin`` (a
    share of ``current``) below it, else ``current``."""
    if current < 1:
        raise ValueError(f"current must be at least 1, got {current}")
    if wanted < 1:
        raise ValueError(f"wanted must be at least 1, got {wanted}")
    if not 0.0 <= shrink_margin < 1.0:
        raise ValueError(f"shrink_margin must be at least 0 and below 1, got {shrink_margin}")
    if wanted >= current:
        return wanted
    if current - wanted >= round(shrink_margin * current, 6):
        return wanted
    return current


def queue_pool_cells(demand: int, current: int, slack: float, *, granularity: int = 256, maximum: int) -> int | None:
    """The hot pool to grow to now when admission is blocked on cells: ``demand`` is what the requests in flight and
    those waiting for cells need together. That demand times ``slack``, rounded up to ``granularity``, at most
    ``maximum``; None when it is not larger than ``current`` (the pool already holds it, or is at its cap)."""
    if demand < 0:
        raise ValueError(f"demand must be at least 0, got {demand}")
    if current < 1:
        raise ValueError(f"current must be at least 1, got {current}")
    if slack < 1.0:
        raise ValueError(f"slack must be at least 1.0, got {slack}")
    if granularity < 1 or maximum < 1:
        raise ValueError(f"granularity and maximum must be at least 1, got {granularity} and {maximum}")
    wanted = min(round_up(math.ceil(round(demand * slack, 6)), granularity), maximum)
    if wanted <= current:
        return None
    return wanted


STREAMS_SHRINK_MARGIN = 0.5
"""A split context's stream count shrinks only to half or less: one stream fewer saves a stream's cells, and the
switch rebuilds the context."""


def split_streams(need: int, live: int, slack: float, live_slots: int, *, maximum: int,
                  granularity: int = STREAM_GRANULARITY, current: tuple[int, int] | None = None,
                  shrink_margin: float = 0.25) -> tuple[int, int] | None:
    """The KV streams of a split context, as (cells of one stream, streams), for requests that claim ``need`` cells
    each (a high percentile) and run ``live`` at a time: a stream of ``need`` times ``slack``, rounded up to
    ``granularity`` (:data:`STREAM_GRANULARITY`), for each of the ``live`` requests, at most
    ``live_slots``. With ``current`` (the context is split now: its stream cells and streams) each figure grows at
    once and shrinks only past ``shrink_margin`` (:func:`resize_pool`; the streams past
    :data:`STREAMS_SHRINK_MARGIN`). None, one pool, when fewer than two requests run together (a lone sequence
    attends only its own cells in one pool too) or the streams would take more than ``maximum`` cells."""
    if min(need, live) < 0:
        raise ValueError(f"need and live must be at least 0, got {need} and {live}")
    if slack < 1.0:
        raise ValueError(f"slack must be at least 1.0, got {slack}")
    if min(live_slots, granularity, maximum) < 1:
        raise ValueError(f"live_slots, granularity and maximum must be at least 1, got {live_slots}, {granularity} "
                         f"and {maximum}")
    streams = min(live, live_slots)
    if streams < 2:
        return None
    stream = max(granularity, round_up(math.ceil(round(need * slack, 6)), granularity))
    if current is not None:
        stream = resize_pool(current[0], stream, shrink_margin)
        streams = resize_pool(current[1], streams, STREAMS_SHRINK_MARGIN)
    if stream * streams > maximum:
        return None
    return stream, streams


def builds_beside(current: int, wanted: int, n_ctx: int, held: int = 0) -> bool:
    """Whether a context of ``wanted`` cells may be built beside the live one of ``current`` cells: both together,
    and ``held`` cells' worth of host RAM the model holds meanwhile (its conversations' host buffers, the buffer a
    move copies through), hold at most ``n_ctx`` cells (what the fixed strategy preallocates). Otherwise the live
    conversations are parked and the live context freed first, so that two contexts never hold more than the fixed
    strategy's one."""
    if min(current, wanted, n_ctx) < 1:
        raise ValueError(f"current, wanted and n_ctx must be at least 1, got {current}, {wanted}, {n_ctx}")
    if held < 0:
        raise ValueError(f"held must be at least 0, got {held}")
    return current + wanted + held <= n_ctx


def growth_ceiling(current: int, n_ctx: int, *, live: int, largest: int, parked: int, reused: int,
                   granularity: int = 256) -> int:
    """The largest hot pool a growth from ``current`` cells may build now while the model's KV memory stays within
    what the fixed strategy preallocates (``n_ctx`` cells), in cells (host buffers counted at their cells' worth):

    * built beside the live one: ``current`` + the new pool + the largest live conversation (``largest``: the
      buffer a move copies through) + every host buffer (``parked`` states and the ``reused`` buffers live
      conversations keep for their next park) <= ``n_ctx``;
    * rebuilt (the live conversations parked in host RAM, the live context freed, then the new one built): the new
      pool + the live conversations' cells (``live``) + every host buffer <= ``n_ctx`` (counting a reuse buffer
      beside the state parked into it: an upper bound).

    The better of the two, rounded down to ``granularity``, at most ``n_ctx``; ``current`` when neither allows a
    larger pool."""
    if min(current, n_ctx, granularity) < 1:
        raise ValueError(f"current, n_ctx and granularity must be at least 1, got {current}, {n_ctx}, {granularity}")
    if min(live, largest, parked, reused) < 0:
        raise ValueError(f"live, largest, parked and reused must be at least 0, got {live}, {largest}, {parked}, "
                         f"{reused}")
    beside = n_ctx - current - largest - parked - reused
    rebuilt = n_ctx - live - parked - reused
    best = max(beside, rebuilt) // granularity * granularity
    return max(current, min(best, n_ctx))


def band(value: float, low: float, high: float) -> int:
    """0 below ``low``, 1 from ``low`` to ``high`` (both included), 2 above ``high``."""
    if value < low:
        return 0
    if value <= high:
        return 1
    return 2


def _check_hysteresis(margin: float, current: str | None) -> None:
    """The margin and current plan :func:`choose_plan` and :func:`burst_plan` both take."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be at least 0 and below 1, got {margin}")
    if current is not None and current not in PLANS:
        raise ValueError(f"current must be one of {', '.join(PLANS)}, got {current!r}")


def choose_plan(
    p90_input: float | None,
    boundaries: tuple[int, int],
    current: str | None,
    margin: float = 0.1,
) -> str:
    """The plan for a P90 input length of ``p90_input`` tokens: "S" below ``boundaries[0]``, "M" from it to
    ``boundaries[1]``, "L" above.

    With a ``current`` plan, moving up needs the value past a boundary ``b`` by ``margin * b`` (the boundaries
    become ``b * (1 + margin)``), moving down below it by as much (``b * (1 - margin)``); otherwise the current
    plan stays. No figure (``None``, an empty profile) keeps the current plan, or "S" without one.
    """
    small, large = boundaries
    if not 1 <= small < large:
        raise ValueError(f"boundaries must be two token counts, at least 1 and the first below the second, got "
                         f"{boundaries}")
    _check_hysteresis(margin, current)
    if p90_input is not None and p90_input < 0:
        raise ValueError(f"p90_input must be at least 0, got {p90_input}")
    if p90_input is None:
        return current or PLANS[0]
    if current is None:
        return PLANS[band(p90_input, small, large)]
    up = band(p90_input, small * (1 + margin), large * (1 + margin))
    down = band(p90_input, small * (1 - margin), large * (1 - margin))
    now = PLANS.index(current)
    if up > now:
        return PLANS[up]
    if down < now:
        return PLANS[down]
    return current


def burst_plan(p90_burst: float | None, ubatches: tuple[int, int, int], current: str | None,
               margin: float = 0.1) -> str:
    """The plan whose micro-batch holds a burst's step of ``p90_burst`` tokens (the P90 of the batches that
    evaluated several requests' prompts together): the first of S, M, L whose ``ubatches`` entry (their
    ``n_ubatch``) is at least it, L past them all. A step larger than one micro-batch runs as several graphs, and
    several prompts evaluated in 2-4 graphs took 15-25 % longer than in one (8 x 64 tokens: 0.80-0.87 s at
    ``n_ubatch`` 128 or 256, 0.65-0.70 s at 512; 4 x 64: 0.39-0.47 s at 128, 0.34-0.36 s at 256; one prompt of
    the same length the same at every size; ``llama-batched-bench``, 12 x 768 f16, 2 threads).

    Moving up needs only the step past the current plan's micro-batch; moving down needs it within ``1 - margin``
    of the smaller plan's, so a burst sitting on a boundary does not flap. No figure (``None``: no burst seen)
    keeps the current plan, or "S" without one."""
    if len(ubatches) != len(PLANS) or not 1 <= ubatches[0] < ubatches[1] < ubatches[2]:
        raise ValueError(f"ubatches must be three rising micro-batch sizes, at least 1, got {ubatches}")
    _check_hysteresis(margin, current)
    if p90_burst is not None and p90_burst < 0:
        raise ValueError(f"p90_burst must be at least 0, got {p90_burst}")
    if p90_burst is None:
        return current or PLANS[0]
    holding = next((index for index, size in enumerate(ubatches) if p90_burst <= size), len(PLANS) - 1)
    if current is None:
        return PLANS[holding]
    now = PLANS.index(current)
    if holding > now:
        return PLANS[holding]
    while now > 0 and p90_burst <= ubatches[now - 1] * (1 - margin):
        now -= 1
    return PLANS[now]


def larger_plan(first: str, second: str) -> str:
    """The larger of two plans (S < M < L)."""
    return max(first, second, key=PLANS.index)


def choose_threads(
    idle_percent: float,
    thresholds: tuple[int, int],
    usable_cores: int,
    current: int | None,
    margin: float = 5.0,
) -> int:
    """The thread count for a CPU idle reading of ``idle_percent``: 4 above ``thresholds[0]``, 3 from
    ``thresholds[1]`` to ``thresholds[0]``, 2 below ``thresholds[1]``; never more than ``usable_cores``.

    With a ``current`` count, more threads need the reading ``margin`` points above a threshold, fewer threads
    ``margin`` points below it; otherwise the current count stays (capped by ``usable_cores``).
    """
    high, low = thresholds
    if not 0 <= low < high <= 100:
        raise ValueError(f"thresholds must be two percentages from 0 to 100, the first above the second, got "
                         f"{thresholds}")
    if not 0.0 <= idle_percent <= 100.0:
        raise ValueError(f"idle_percent must be from 0 to 100, got {idle_percent}")
    if usable_cores < 1:
        raise ValueError(f"usable_cores must be at least 1, got {usable_cores}")
    if current is not None and current < 1:
        raise ValueError(f"current must be at least 1, got {current}")
    if margin < 0:
        raise ValueError(f"margin must be at least 0, got {margin}")
    if current is None:
        return min(THREADS_BY_BAND[band(idle_percent, low, high)], usable_cores)
    more = min(THREADS_BY_BAND[band(idle_percent, low + margin, high + margin)], usable_cores)
    fewer = min(THREADS_BY_BAND[band(idle_percent, low - margin, high - margin)], usable_cores)
    if more > current:
        return more
    if fewer < current:
        return fewer
    return current


def parse_proc_stat(text: str) -> tuple[int, ...]:
    """The aggregate ``cpu`` line's first eight counters (:data:`PROC_STAT_COUNTERS`) from ``/proc/stat``'s
    text; guest time is left out (the kernel counts it in user and nice already)."""
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] != "cpu":
            continue
        counters = parts[1:]
        if len(counters) < len(PROC_STAT_COUNTERS):
            raise ValueError(f"the cpu line must have at least {len(PROC_STAT_COUNTERS)} counters, got "
                             f"{len(counters)}: {line!r}")
        wanted = counters[: len(PROC_STAT_COUNTERS)]
        if not all(WHOLE_NUMBER.fullmatch(item) for item in wanted):
            raise ValueError(f"the cpu line's counters must be whole numbers: {line!r}")
        return tuple(int(item) for item in wanted)
    raise ValueError("no aggregate 'cpu' line in the /proc/stat text")


def cpu_idle_percent(before: tuple[int, ...], after: tuple[int, ...]) -> float:
    """The share (0 to 100) of CPU time spent idle or waiting for IO between two readings of
    :func:`parse_proc_stat`, ``before`` then ``after``. Readings with no time between them are an error."""
    if len(before) != len(PROC_STAT_COUNTERS) or len(after) != len(PROC_STAT_COUNTERS):
        raise ValueError(f"readings must have {len(PROC_STAT_COUNTERS)} counters, got {len(before)} and "
                         f"{len(after)}")
    deltas = [later - earlier for earlier, later in zip(before, after, strict=True)]
    if any(delta < 0 for delta in deltas):
        raise ValueError("a counter went backwards: the readings must be given oldest first")
    total = sum(deltas)
    if total == 0:
        raise ValueError("no CPU time passed between the readings")
    return 100.0 * (deltas[IDLE] + deltas[IOWAIT]) / total


def usable_cores(affinity: int, quota_us: int | None, period_us: int | None) -> int:
    """The cores the process may use: its affinity count (``len(os.sched_getaffinity(0))``), and with a cgroup
    quota (``cpu.max``: ``quota_us`` per ``period_us``) at most ``ceil(quota_us / period_us)``."""
    if affinity < 1:
        raise ValueError(f"affinity must be at least 1, got {affinity}")
    if quota_us is None:
        return affinity
    if quota_us < 1:
        raise ValueError(f"quota_us must be at least 1, got {quota_us}")
    if period_us is None or period_us < 1:
        raise ValueError(f"period_us must be at least 1 with a quota, got {period_us}")
    return min(affinity, -(-quota_us // period_us))


def parse_cpu_max(text: str) -> tuple[int | None, int]:
    """(quota, period) in microseconds from a cgroup v2 ``cpu.max`` text: ``"max 100000"`` -> ``(None, 100000)``,
    ``"200000 100000"`` -> ``(200000, 100000)``."""
    parts = text.split()
    if len(parts) != 2:
        raise ValueError(f"cpu.max must be '<quota|max> <period>', got {text!r}")
    quota_text, period_text = parts
    if not WHOLE_NUMBER.fullmatch(period_text) or int(period_text) < 1:
        raise ValueError(f"cpu.max's period must be a whole number at least 1, got {period_text!r}")
    if quota_text == "max":
        return None, int(period_text)
    if not WHOLE_NUMBER.fullmatch(quota_text) or int(quota_text) < 1:
        raise ValueError(f"cpu.max's quota must be 'max' or a whole number at least 1, got {quota_text!r}")
    return int(quota_text), int(period_text)
