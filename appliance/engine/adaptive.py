"""The adaptive engine's decisions for one model (SPEC E1-E4, E8). Pure: no IO, no llama.cpp.

A :class:`Tuner` holds a model's :class:`~appliance.engine.profile.LoadProfile` and the :class:`Tuning` its live
context runs with. The daemon feeds it every finished request (:meth:`Tuner.observe`) and the CPU reading it takes
about once a second (:class:`CpuShare`), asks it what the context should be (:meth:`Tuner.decide`), applies the
answer on the engine thread and tells it what was applied (:meth:`Tuner.applied`). The policies themselves are the
functions of :mod:`appliance.engine.tuning`:

* **hot pool** (E2): P90 of the requests' KV need (the cells the context had to hold for the request to run: its
  conversation, prompt and ``max_tokens``, plus the other requests in flight) x ``hot_pool_slack``, in steps of
  :data:`POOL_GRANULARITY` cells, never below what the live conversations hold, at most the model's ``n_ctx``;
* **split KV streams** (E2): where two or more requests ran together (P90 of ``live_sequences``) and those generate
  at least as many tokens as they evaluate of their prompts (:func:`prompts_lighter`), that many
  sequences each with a KV stream of its own (:meth:`Tuner.split_streams`), each holding P99 of the requests' own
  claims (``kv_cells_need``) x ``hot_pool_slack``, when they fit where the pool may grow; requests waiting for a
  stream raise the count at once (:meth:`Tuner.stream_demand`), a request longer than a stream brings one pool back
  for a window (:meth:`Tuner.queue_demand`);
* **plan** (E3): S, M or L by P90 input tokens and ``plan_boundaries``, or larger where the steps that evaluate
  several prompts at once (a burst of agents) need a larger micro-batch (P90 of ``burst_tokens``,
  :func:`~appliance.engine.tuning.burst_plan`; until :data:`MIN_SAMPLES` served requests were sampled the plan
  bursts chose stays, the initial one holding a first burst on every live sequence);
* **threads** (E4): by the share of the CPU this process can get (idle time plus its own), bands
  ``thread_idle_thresholds``, capped by the usable cores and by the cores that share stands for.

**Queue demand.** When admission is blocked on cells (a sequence is free, but the cells the requests in flight and
those waiting need are more than the pool), :meth:`Tuner.queue_demand` raises the pool at once to hold them all,
without waiting for samples, and holds that size while the window turns over (:attr:`Tuner.floor`, for
``window_size`` more requests): the samples taken meanwhile count the waiting requests' cells too, and only past
that, with the usual shrink margin, may the pool shrink again.

Until the window holds :data:`MIN_SAMPLES` samples the pool and plan stay as they are (a model starts with
:func:`initial_pool` cells and :func:`initial_plan`, or what its warm-up runs showed). ``adaptive: false`` is the
fixed strategy: the configured ``n_ctx`` as one pool, the fixed plan, the fixed thread count; :meth:`Tuner.decide`
then returns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from appliance.engine import tuning
from appliance.engine.plans import PLANS
from appliance.engine.profile import LoadProfile, RequestSample

POOL_GRANULARITY = 256
"""llama.cpp pads a context's cells to 256."""
INITIAL_POOL = 512
"""The fewest hot pool cells of an adaptive model before its profile says anything."""
TURN_CELLS = 128
"""Cells of one short agent turn (a 64-token prompt and 64 tokens): the initial pool holds one for each live
sequence, so that a first burst filling every sequence does not wait for a growth (measured,
``benchmarks/concurrency.py``, 8 agents on ``live_slots`` 8: the 4 that did not fit 512 cells got their first token
0.6-1.6 s after the other 4, the growth built beside 4 running sequences)."""
TURN_PROMPT = 64
"""Prompt tokens of one short agent turn (:data:`TURN_CELLS`)."""
UBATCHES = (PLANS["S"].n_ubatch, PLANS["M"].n_ubatch, PLANS["L"].n_ubatch)
"""The micro-batch of each plan, S to L (:func:`~appliance.engine.tuning.burst_plan`)."""
MIN_SAMPLES = 4
"""Samples in the window before the pool or the plan follows it."""
FIXED = "fixed"

PRESETS: dict[str, dict[str, int]] = {
    "high": {"adaptive_window_size": 128, "adaptive_sample_rate": 2},
    "mid": {"adaptive_window_size": 64, "adaptive_sample_rate": 4},
    "low": {"adaptive_window_size": 32, "adaptive_sample_rate": 8},
}
"""Device-class presets for the profile's window and sample rate (SPEC E8), used by the tuning advice."""


@dataclass(frozen=True)
class Tuning:
    """What a live context runs with: its hot pool's cells, its plan ("S", "M", "L" or "fixed") and threads; with
    ``streams`` (split KV streams) that many sequences, each a KV stream of its own, an equal share of the pool (0:
    one pool of ``pool_cells`` shared by ``live_slots`` sequences)."""

    pool_cells: int
    plan: str
    threads: int
    streams: int = 0

    def __post_init__(self) -> None:
        if self.pool_cells < 1:
            raise ValueError(f"pool_cells must be at least 1, got {self.pool_cells}")
        if self.plan not in (*tuning.PLANS, FIXED):
            raise ValueError(f"plan must be one of S, M, L, fixed, got {self.plan!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.streams < 0 or (self.streams and self.pool_cells % self.streams):
            raise ValueError(f"streams must be 0 or divide pool_cells ({self.pool_cells}), got {self.streams}")
        if self.streams and self.plan == FIXED:
            raise ValueError("the fixed strategy's pool is one pool, not split streams")

    @property
    def split(self) -> bool:
        return self.streams > 0

    def sequences(self, live_slots: int) -> int:
        """The sequences of a context built for this tuning in a model of ``live_slots``."""
        return self.streams or live_slots

    def seq_cells(self) -> int:
        """The most cells one sequence may hold in a context built for this tuning."""
        return self.pool_cells // self.streams if self.streams else self.pool_cells


@dataclass(frozen=True)
class CpuShare:
    """One CPU reading over an interval: the percent of all CPU time that was idle or this process's own (what
    the engine can get), and the cores that percent stands for (``percent`` x ``cores`` / 100)."""

    percent: float
    cores: int

    @property
    def spare_cores(self) -> int:
        """The whole cores the share stands for, at least 1."""
        return max(1, round(self.percent * self.cores / 100.0))


def cpu_share(before: tuple[int, ...], after: tuple[int, ...], own_ticks: int, cores: int) -> CpuShare:
    """The :class:`CpuShare` between two ``/proc/stat`` readings (:func:`~appliance.engine.tuning.parse_proc_stat`)
    when this process used ``own_ticks`` clock ticks (user + system, ``/proc/self/stat``) in between."""
    if own_ticks < 0:
        raise ValueError(f"own_ticks must be at least 0, got {own_ticks}")
    if cores < 1:
        raise ValueError(f"cores must be at least 1, got {cores}")
    idle = tuning.cpu_idle_percent(before, after)
    total = sum(after) - sum(before)
    own = 100.0 * own_ticks / total
    return CpuShare(min(100.0, idle + own), cores)


@dataclass(frozen=True)
class Settings:
    """The ``engine.*`` settings a tuner reads."""

    adaptive: bool
    window_size: int
    sample_rate: int
    hot_pool_slack: float
    plan_boundaries: tuple[int, int]
    thread_idle_thresholds: tuple[int, int]
    fixed_threads: int  # engine.threads, or the engine's default when 0
    pinned_threads: bool  # engine.threads > 0: the thread count never changes
    live_slots: int  # engine.live_slots: sequences decoded together in the live context


def initial_pool(n_ctx: int, live_slots: int) -> int:
    """The hot pool of an adaptive model before its profile says anything: a short turn (:data:`TURN_CELLS`) for
    each of its ``live_slots`` sequences, at least :data:`INITIAL_POOL`, at most ``n_ctx``."""
    if live_slots < 1:
        raise ValueError(f"live_slots must be at least 1, got {live_slots}")
    wanted = tuning.round_up(live_slots * TURN_CELLS, POOL_GRANULARITY)
    return min(max(INITIAL_POOL, wanted), n_ctx)


def initial_plan(live_slots: int) -> str:
    """The plan of an adaptive model before its profile says anything: the one whose micro-batch holds a first
    burst of a short turn's prompt (:data:`TURN_PROMPT`) on each of its ``live_slots`` sequences, as
    :func:`initial_pool` holds their cells (S for 1 or 2 sequences, M for 3 or 4, L from 5)."""
    if live_slots < 1:
        raise ValueError(f"live_slots must be at least 1, got {live_slots}")
    return tuning.burst_plan(live_slots * TURN_PROMPT, UBATCHES, None)


class Tuner:
    """A model's load profile and the tuning of its live context (module docstring). ``n_ctx`` is the model's
    configured context length: the largest pool and the fixed strategy's."""

    def __init__(self, settings: Settings, n_ctx: int, usable_cores: int) -> None:
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be at least 1, got {n_ctx}")
        self.settings = settings
        self.n_ctx = n_ctx
        self.usable_cores = usable_cores
        self.profile = LoadProfile(settings.window_size, settings.sample_rate)
        self.current = self.initial()
        self.floor = 0  # the pool the queue asked for (queue_demand): kept until floor_until requests were observed
        self.floor_until = 0
        self.ceiling = n_ctx  # the largest pool a growth may build now (limit)
        self.burst = self.current.plan  # the plan bursts asked for last (kept while no burst figure is known)
        self.unified_until = 0  # a request outgrew a split context's stream: unified until this many were observed
        self.splits = True  # the model's contexts may be split KV streams (the daemon sets it from its runtime)
        self.stream_floor = 0  # the streams requests waiting for one asked for (stream_demand), until:
        self.stream_floor_until = 0

    def initial(self) -> Tuning:
        """The tuning a model starts with (nothing profiled yet)."""
        if not self.settings.adaptive:
            return Tuning(self.n_ctx, FIXED, self.settings.fixed_threads)
        return Tuning(initial_pool(self.n_ctx, self.settings.live_slots), initial_plan(self.settings.live_slots),
                      self.start_threads())

    def start_threads(self) -> int:
        if self.settings.pinned_threads:
            return self.settings.fixed_threads
        return min(max(tuning.THREADS_BY_BAND), self.usable_cores)

    def reconfigure(self, settings: Settings, n_ctx: int) -> None:
        """New settings (a reload): the profile is kept unless its window or sample rate changed."""
        if (settings.window_size, settings.sample_rate) != (self.settings.window_size, self.settings.sample_rate):
            old = self.profile.window
            self.profile = LoadProfile(settings.window_size, settings.sample_rate)
            for sample in old[-settings.window_size:]:
                self.profile.seed(sample)
        switched = settings.adaptive != self.settings.adaptive
        slots_changed = settings.live_slots != self.settings.live_slots
        self.settings = settings
        self.n_ctx = n_ctx
        if switched or not settings.adaptive:
            self.current = self.initial()
            self.burst = self.current.plan
        elif self.current.pool_cells > n_ctx or (self.current.split and slots_changed):
            self.current = replace(self.current, pool_cells=min(self.current.pool_cells, n_ctx), streams=0)

    def observe(self, sample: RequestSample) -> bool:
        """Count a finished request; True when it was sampled (the pool and plan may change)."""
        return self.profile.observe(sample)

    def seed(self, sample: RequestSample) -> None:
        """A warm-up run's sample: always kept (SPEC E5)."""
        self.profile.seed(sample)

    def limit(self, ceiling: int) -> None:
        """A growth may build at most ``ceiling`` cells now (never less than the current pool): what the model's KV
        memory allows (:func:`~appliance.engine.tuning.growth_ceiling`). :meth:`decide` and :meth:`queue_demand`
        ask for no more until the next limit; a held queue floor above it comes down to it."""
        if ceiling < 1:
            raise ValueError(f"ceiling must be at least 1, got {ceiling}")
        self.ceiling = max(min(ceiling, self.n_ctx), self.current.pool_cells)
        self.floor = min(self.floor, self.ceiling)

    def queue_demand(self, demand: int) -> bool:
        """Admission is blocked on cells: the requests in flight and those waiting need ``demand`` cells. True when
        the pool must grow for them (:meth:`decide` then asks for it at once, and keeps it while the next
        ``window_size`` requests are observed); False when the pool holds them already, is at ``n_ctx``, or the
        strategy is fixed."""
        if not self.settings.adaptive:
            return False
        current = self.current.pool_cells
        if self.current.split:  # cells run short only for a request longer than a stream: unified for a window
            if demand <= self.current.seq_cells():
                return False
            self.unified_until = self.profile.observed + self.settings.window_size
            current = 1
        wanted = tuning.queue_pool_cells(demand, max(current, self.floor),
                                         self.settings.hot_pool_slack, granularity=POOL_GRANULARITY,
                                         maximum=min(self.n_ctx, max(self.ceiling, self.current.pool_cells)))
        if wanted is None:
            return False
        self.floor = wanted
        self.floor_until = self.profile.observed + self.settings.window_size
        return True

    def held_floor(self) -> int:
        """The pool the queue asked for while it is held (0 once ``window_size`` requests were observed since)."""
        if self.profile.observed >= self.floor_until:
            self.floor = 0
        return self.floor

    def decide(self, live_cells: int, cpu: CpuShare | None = None) -> Tuning:
        """The tuning the context should have now, with ``live_cells`` held by its live conversations and the
        latest CPU reading (None: threads stay)."""
        settings = self.settings
        current = self.current
        if not settings.adaptive:
            return Tuning(self.n_ctx, FIXED, settings.fixed_threads)
        pool = current.pool_cells
        plan = current.plan if current.plan != FIXED else tuning.PLANS[0]
        if len(self.profile) >= MIN_SAMPLES:
            need = self.profile.percentiles("kv_cells_peak").p90
            wanted = tuning.hot_pool_cells(int(need or 0), settings.hot_pool_slack, min(live_cells, self.n_ctx),
                                           granularity=POOL_GRANULARITY, minimum=POOL_GRANULARITY,
                                           maximum=max(self.n_ctx, POOL_GRANULARITY))
            pool = min(tuning.resize_pool(pool, wanted), self.n_ctx)
            by_input = tuning.choose_plan(self.profile.percentiles("input_tokens").p90, settings.plan_boundaries,
                                          plan)
            self.burst = tuning.burst_plan(self.burst_figure(), UBATCHES, self.burst)
            plan = tuning.larger_plan(by_input, self.burst)
        pool = max(pool, min(live_cells, self.n_ctx), min(self.held_floor(), self.n_ctx))
        if pool > current.pool_cells:
            pool = max(current.pool_cells, min(pool, self.ceiling))
        split = self.split_streams()
        threads = current.threads
        if settings.pinned_threads:
            threads = settings.fixed_threads
        elif cpu is not None:
            threads = choose_threads(cpu, settings.thread_idle_thresholds, self.usable_cores, threads)
        if split is not None:
            stream_cells, streams = split
            return Tuning(stream_cells * streams, plan, threads, streams=streams)
        return Tuning(pool, plan, threads)

    def split_streams(self) -> tuple[int, int] | None:
        """The streams of a split context for the window's requests, as (cells of one stream, streams)
        (:func:`~appliance.engine.tuning.split_streams`: a stream holds P99 of the requests' own claims, one for each
        of the P90 requests that ran together, or more while requests wait for one: :meth:`stream_demand`), within
        what a growth may build now and the model's ``n_ctx``; None for one pool: a model that cannot split, too few
        samples (or none telling its claim), requests that evaluate more prompt than they generate
        (:func:`prompts_lighter`), a request outgrew a stream less than ``window_size`` requests ago, a queue floor
        is held (a unified pool's demand), or the streams would not fit."""
        settings = self.settings
        current = self.current
        if not self.splits or len(self.profile) < MIN_SAMPLES or self.profile.observed < self.unified_until:
            return None
        if self.held_floor():
            return None
        need = self.profile.percentiles("kv_cells_need").p99
        live = self.profile.percentiles("live_sequences").p90
        if not need:  # samples that do not tell their own claim
            return None
        if not prompts_lighter(self.profile.window):
            return None
        if self.profile.observed >= self.stream_floor_until:
            self.stream_floor = 0
        maximum = min(self.n_ctx, max(self.ceiling, current.pool_cells))
        now = (current.seq_cells(), current.streams) if current.split else None
        return tuning.split_streams(int(need), max(int(live or 0), self.stream_floor), settings.hot_pool_slack,
                                    settings.live_slots, granularity=POOL_GRANULARITY, maximum=maximum, current=now)

    def stream_demand(self, wanted: int) -> bool:
        """Every stream of the split context is busy and ``wanted`` requests want one (in flight and waiting): True
        while the context has fewer streams than that (:meth:`decide` asks for them at once, and keeps them while
        the next ``window_size`` requests are observed). A demand asked for before and not served yet (its retune
        still running, or one that built nothing: the ledger, a queue floor) is True again: the daemon runs one
        retune at a time, so a demand repeated meanwhile is one more retune after it, not one lost."""
        current = self.current
        if not self.settings.adaptive or not current.split:
            return False
        wanted = min(wanted, self.settings.live_slots)
        if wanted <= current.streams:
            return False
        self.stream_floor = max(self.stream_floor, wanted)
        self.stream_floor_until = self.profile.observed + self.settings.window_size
        return True

    def burst_figure(self) -> int | None:
        """P90 of the window's ``burst_tokens`` (0 for a request whose prompt was evaluated alone); None until
        :data:`MIN_SAMPLES` served requests were sampled (warm-up runs are alone by design: they say nothing of
        bursts)."""
        if self.profile.sampled < MIN_SAMPLES:
            return None
        figure = self.profile.percentiles("burst_tokens").p90
        return None if figure is None else int(figure)

    def applied(self, tuning_now: Tuning) -> None:
        """The context now runs with ``tuning_now``."""
        self.current = tuning_now


def prompts_lighter(samples: Sequence[RequestSample]) -> bool:
    """Whether the window's requests that ran beside others (``live_sequences`` 2 or more: the ones split streams
    serve) generated at least as many tokens as they evaluated of their prompts, summed. Split streams shorten
    decode steps but lengthen prompt steps: llama.cpp evaluates a split context's prompts in micro-batches of equal
    length per sequence, so unequal prompts evaluated together, or a prompt beside other sequences' decode tokens,
    take several graphs (measured, 12x768 f16, 2 threads, 4 sequences: prompts of 50, 64, 70 and 80 tokens 711 and
    671 ms split against 525 and 578 ms in one pool; a 64-token prompt beside 3 decoding sequences 189 and 181 ms
    against 153 and 156 ms; the decode step of 4, 5-10 % shorter split). False without such a request."""
    together = [sample for sample in samples if sample.live_sequences >= 2]
    if not together:
        return False
    generated = sum(sample.output_tokens for sample in together)
    return generated >= sum(sample.prompt_evaluated for sample in together)


def choose_threads(cpu: CpuShare, thresholds: tuple[int, int], usable_cores: int, current: int | None) -> int:
    """:func:`~appliance.engine.tuning.choose_threads` on the CPU share, also capped by its spare cores: threads
    beyond the cores nobody else uses spin against the other process (measured, 12x768 model, 2 cores: a 64-token
    decode with 2 threads took 0.44 s idle, 1.9 s beside one busy loop and up to 11.9 s beside two; with 1 thread
    0.56 s and 0.9-1.0 s)."""
    cap = min(usable_cores, cpu.spare_cores)
    chosen = tuning.choose_threads(cpu.percent, thresholds, cap, current)
    return min(chosen, cap)
