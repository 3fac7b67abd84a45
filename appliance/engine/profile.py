"""The load profile: a sliding window of sampled requests and the percentiles of each figure (SPEC E1). Pure.

The engine reports every finished request to :meth:`LoadProfile.observe` as a :class:`RequestSample`. The profile
counts them all and keeps one in ``sample_rate`` of them, picked at random (:meth:`LoadProfile.observe`), in a
window of the last ``window_size`` kept samples; an older sample drops out of the window when a new one comes in.
The policies of :mod:`appliance.engine.tuning` read the window's percentiles.

**Percentiles** are *nearest-rank* percentiles: the P-th percentile of ``n`` values is the value of rank
``ceil(P / 100 * n)`` (1-based) in the values sorted ascending. It is always one of the observed values (an ``int``
field gives an ``int``); P50 of an even count is the lower of the two middle values, and P90 and P99 of fewer than
10 or 100 values are the largest value. An empty window has no percentiles: each one is ``None``.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, fields

Figure = int | float
SAMPLING_SEED = 0
"""The seed of a profile's own sampling RNG when none is given: a daemon's picks are the same run after run."""


@dataclass(frozen=True)
class RequestSample:
    """The figures of one finished request.

    ``prompt_evaluated``: prompt tokens really evaluated (the rest came from a shared prefix); ``ttft_s``: time to
    first token; ``decode_s``: time from the first token to the last; ``kv_cells_used``: the KV cells its
    conversation held at the end, ``kv_cells_peak``: the most it held; ``live_sequences``: sequences live in the
    context when it ran; ``threads``: the thread count it ran with; ``queue_length``: requests waiting when it
    started; ``burst_tokens``: the tokens of the step that evaluated the end of its prompt when that step ended
    other requests' prompts too (a burst of agents evaluated together), else 0; ``kv_cells_need``: the cells its own
    sequence claimed (its conversation, prompt and ``max_tokens``: what a KV stream of its own must hold; 0: not
    told). Every figure is at least 0.
    """

    input_tokens: int
    output_tokens: int
    prompt_evaluated: int
    ttft_s: float
    decode_s: float
    kv_cells_used: int
    kv_cells_peak: int
    live_sequences: int
    threads: int
    queue_length: int
    burst_tokens: int = 0
    kv_cells_need: int = 0

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be at least 0, got {value}")


FIELDS: tuple[str, ...] = tuple(item.name for item in fields(RequestSample))


@dataclass(frozen=True)
class Percentiles:
    """P50, P90 and P99 of one figure over the window; all ``None`` when the window is empty."""

    p50: Figure | None
    p90: Figure | None
    p99: Figure | None


def nearest_rank(ordered: list[Figure], percent: int) -> Figure:
    """The nearest-rank ``percent``-th percentile (1 to 100) of ``ordered`` (sorted ascending, not empty)."""
    rank = -(-percent * len(ordered) // 100)
    return ordered[rank - 1]


def percentiles_of(values: list[Figure]) -> Percentiles:
    """P50/P90/P99 (nearest rank) of ``values``, in any order; all ``None`` for no values."""
    if not values:
        return Percentiles(None, None, None)
    ordered = sorted(values)
    return Percentiles(nearest_rank(ordered, 50), nearest_rank(ordered, 90), nearest_rank(ordered, 99))


class LoadProfile:
    """A sliding window of the last ``window_size`` sampled requests, one kept in ``sample_rate`` on average, picked
    by ``rng`` (default: a :class:`random.Random` seeded with :data:`SAMPLING_SEED`; a test injects its own)."""

    def __init__(self, window_size: int, sample_rate: int, rng: random.Random | None = None) -> None:
        if window_size < 1:
            raise ValueError(f"window_size must be at least 1, got {window_size}")
        if sample_rate < 1:
            raise ValueError(f"sample_rate must be at least 1, got {sample_rate}")
        self.window_size = window_size
        self.sample_rate = sample_rate
        self.rng = rng if rng is not None else random.Random(SAMPLING_SEED)
        self.observed = 0
        self.sampled = 0
        self._window: deque[RequestSample] = deque(maxlen=window_size)

    def observe(self, sample: RequestSample) -> bool:
        """Count ``sample``'s request; keep it in the window with a chance of 1 in ``sample_rate`` (then True).

        The pick is random, not every ``sample_rate``-th request: agents' requests come in waves (N agents send
        together, the short ones end first, in the same order every round), and a fixed stride equal to, or
        dividing, the wave's length keeps the same place in every wave, so the window would only ever see (say) the
        smallest request of each wave. Sampling every request while the window is young would only delay that
        until it is full. An independent draw per request has no period to align with."""
        self.observed += 1
        if self.sample_rate > 1 and self.rng.randrange(self.sample_rate) != 0:
            return False
        self.sampled += 1
        self._window.append(sample)
        return True

    def seed(self, sample: RequestSample) -> None:
        """Keep ``sample`` in the window whatever the sample rate (a warm-up run's, SPEC E5); it is not counted as
        an observed request."""
        self._window.append(sample)

    @property
    def window(self) -> tuple[RequestSample, ...]:
        """The samples in the window, oldest first."""
        return tuple(self._window)

    def __len__(self) -> int:
        return len(self._window)

    def values(self, field: str) -> list[Figure]:
        """``field``'s value in each sample of the window, oldest first."""
        if field not in FIELDS:
            raise ValueError(f"unknown field {field!r}: must be one of {', '.join(FIELDS)}")
        return [getattr(sample, field) for sample in self._window]

    def percentiles(self, field: str) -> Percentiles:
        """P50/P90/P99 (nearest rank) of ``field`` over the window; all ``None`` when it is empty."""
        return percentiles_of(self.values(field))

    def summary(self) -> dict[str, object]:
        """The counts and every field's percentiles, ready for JSON::

            {"observed": 12, "sampled": 3, "in_window": 3, "window_size": 64, "sample_rate": 4,
             "percentiles": {"input_tokens": {"p50": 90, "p90": 300, "p99": 300}, ...}}

        With an empty window every percentile is ``None``.
        """
        table: dict[str, dict[str, Figure | None]] = {}
        for field in FIELDS:
            found = self.percentiles(field)
            table[field] = {"p50": found.p50, "p90": found.p90, "p99": found.p99}
        return {
            "observed": self.observed,
            "sampled": self.sampled,
            "in_window": len(self._window),
            "window_size": self.window_size,
            "sample_rate": self.sample_rate,
            "percentiles": table,
        }
