"""The per-request figures of ``/metrics`` (SPEC W3), counted from the daemon's start without ``prometheus_client``:
an observer of ``daemon.requests`` (one :class:`~appliance.daemon.requestlog.RequestRecord` per request, every
surface) adds each generation to a few counters and two histograms, kept per daemon. ``prometheus_client`` is
imported at the first scrape (:mod:`appliance.http.metrics`), which writes them as its own ``Counter`` and
``Histogram`` write theirs: a serving process that is never scraped never imports it.

Each series keeps what ``prometheus_client`` keeps for a labelled child: its value (a histogram's sum and its
observations per bucket) and when it was first counted (its ``_created`` sample)."""

from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.daemon.core import Daemon
from appliance.daemon.requestlog import RequestRecord

if TYPE_CHECKING:
    from appliance.app import Appliance

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Request latency buckets: a few tokens of a tiny model on a CPU to a long generation on a slow box."""
TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Time-to-first-token buckets (a prompt's prefill, after any wait for the engine)."""


@dataclass(frozen=True)
class MetricSpec:
    """One metric's name (a counter's without ``_total``), help, label names, and a histogram's bucket bounds
    (None: a counter)."""

    name: str
    documentation: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None

    @property
    def bounds(self) -> tuple[float, ...]:
        """A histogram's upper bounds, ``+Inf`` last (as ``prometheus_client`` adds it)."""
        assert self.buckets is not None
        return self.buckets if self.buckets[-1] == math.inf else (*self.buckets, math.inf)


class Series:
    """One labelled series: a counter's total, or a histogram's sum and its observations per bucket (not
    cumulative; the last above every finite bound), and the time it was first counted."""

    def __init__(self, created: float, buckets: int) -> None:
        self.created = created
        self.value = 0.0
        self.counts = [0] * buckets


class CountedMetric:
    """A counter or a histogram: its series by label values, in the order they were first counted."""

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.series: dict[tuple[str, ...], Series] = {}

    def child(self, values: tuple[str, ...]) -> Series:
        if len(values) != len(self.spec.labels):
            raise ValueError(f"{self.spec.name} takes {len(self.spec.labels)} label values, not {len(values)}")
        key = tuple(str(value) for value in values)
        found = self.series.get(key)
        if found is None:
            buckets = len(self.spec.bounds) if self.spec.buckets is not None else 0
            found = self.series[key] = Series(time.time(), buckets)
        return found

    def inc(self, values: tuple[str, ...], amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"{self.spec.name}: a counter cannot be incremented by {amount}")
        self.child(values).value += amount

    def observe(self, values: tuple[str, ...], amount: float) -> None:
        series = self.child(values)
        series.value += amount
        for index, bound in enumerate(self.spec.bounds):
            if amount <= bound:
                series.counts[index] += 1
                break


REQUESTS = MetricSpec("appliance_requests", "Generation requests by model, surface and outcome (ok, error, "
                      "cancelled).", ("model", "surface", "outcome"))
PROMPT_TOKENS = MetricSpec("appliance_prompt_tokens", "Prompt tokens evaluated (prefill).", ("model", "surface"))
GENERATION_TOKENS = MetricSpec("appliance_generation_tokens", "Tokens generated.", ("model", "surface"))
LATENCY = MetricSpec("appliance_request_duration_seconds", "Completed generation requests' duration, as their "
                     "surface saw it (waiting included).", ("model", "surface"), LATENCY_BUCKETS_S)
BY_PLAN = MetricSpec("appliance_requests_by_plan", "Generation requests by model and the plan their context ran "
                     "with (S, M, L, or fixed).", ("model", "plan"))
TTFT = MetricSpec("appliance_time_to_first_token_seconds", "Time from a generation's start on the engine to its "
                  "first token (its prefill).", ("model", "surface"), TTFT_BUCKETS_S)


class RequestCounts:
    """One daemon's per-request metrics, fed by :meth:`observe`; :attr:`metrics` in the page's order."""

    def __init__(self) -> None:
        self.requests = CountedMetric(REQUESTS)
        self.prompt_tokens = CountedMetric(PROMPT_TOKENS)
        self.generation_tokens = CountedMetric(GENERATION_TOKENS)
        self.latency = CountedMetric(LATENCY)
        self.by_plan = CountedMetric(BY_PLAN)
        self.ttft = CountedMetric(TTFT)
        self.metrics = (self.requests, self.prompt_tokens, self.generation_tokens, self.latency, self.by_plan,
                        self.ttft)

    def observe(self, record: RequestRecord) -> None:
        """One finished request (called by ``daemon.requests``; never raises into the request's path). Generations
        only: an embeddings request is in the request log (and the access log), not in these figures."""
        if record.task != "generate":
            return
        try:
            labels = (record.model, record.surface)
            self.requests.inc((*labels, record.outcome))
            self.prompt_tokens.inc(labels, record.prompt_tokens)
            self.generation_tokens.inc(labels, record.generated_tokens)
            if record.outcome == "ok":
                self.latency.observe(labels, record.elapsed_s)
            if record.ttft_s is not None:
                self.ttft.observe(labels, record.ttft_s)
            if record.plan is not None:  # the request reached a context
                self.by_plan.inc((record.model, record.plan))
        except Exception:
            log.exception("metrics: a request record could not be counted")


_BY_DAEMON: weakref.WeakKeyDictionary[Daemon, RequestCounts] = weakref.WeakKeyDictionary()


def attach(appliance: Appliance) -> RequestCounts | None:
    """The request counts of ``appliance``'s daemon, made (and added to its request log's observers) on the first
    call; None before the daemon exists. Kept per daemon, so that an HTTP rebind keeps them."""
    daemon = appliance.daemon
    if daemon is None:
        return None
    counts = _BY_DAEMON.get(daemon)
    if counts is None:
        counts = _BY_DAEMON[daemon] = RequestCounts()
        daemon.requests.observers.append(counts.observe)
    return counts
