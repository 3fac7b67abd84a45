"""Prometheus metrics (SPEC W3): ``GET /metrics``, in Prometheus' text format (or OpenMetrics when the scraper
asks for it), written by ``prometheus_client``. The metrics, their labels and the inference-gateway flags are in
docs/metrics.md.

This module (and ``prometheus_client``) is imported at the first scrape. Each appliance has a
``CollectorRegistry`` of its own (:func:`registry_of`; not the process-global one, so several appliances in one
process do not clash), kept per daemon so that an HTTP rebind keeps it:

* :class:`DaemonCollector` reads the daemon's figures when scraped (``snapshot()``, ``counters``, the ledger, host
  KV, the engine's queue, the reload record): gauges and counters that cost nothing between scrapes;
* :class:`RequestCollector` writes the per-request counters and the latency and time-to-first-token histograms,
  counted from the daemon's start by :mod:`appliance.http.requestcounts` (an observer of ``daemon.requests``: one
  :class:`~appliance.daemon.requestlog.RequestRecord` per generation, every surface).

Also the gauges of the Kubernetes Gateway API Inference Extension's model-server protocol (requests waiting,
requests running, KV-cache utilization as a 0-1 fraction), so that its endpoint picker can route to appliances:
under vLLM's names (its defaults), one series per configured model labelled ``model_name``, and under the
appliance's own names, the box's totals.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from appliance.daemon.core import Daemon
from appliance.daemon.durable import RESTORED_FROM
from appliance.daemon.model import Model
from appliance.http import requestcounts
from appliance.http.requestcounts import CountedMetric, RequestCounts

if TYPE_CHECKING:
    from appliance.app import Appliance

MODEL_STATES = ("available", "loading", "loaded", "unloading", "missing")
KV_PLACES = ("device", "host", "empty")
RELOAD_RESULTS = ("applied", "unchanged", "invalid", "failed")
PROTOCOLS = ("magn", "lines")

PROFILE_FIGURES = {
    "input_tokens": ("appliance_profile_input_tokens", "Input tokens of a model's sampled requests, by percentile."),
    "output_tokens": ("appliance_profile_output_tokens", "Output tokens of a model's sampled requests, by "
                      "percentile."),
    "ttft_s": ("appliance_profile_ttft_seconds", "Time to first token of a model's sampled requests, by "
               "percentile."),
    "kv_cells_peak": ("appliance_profile_kv_cells_peak", "The most KV cells a model's sampled requests' "
                      "conversations held, by percentile."),
}
"""The load-profile figures on the page: the profile's field -> the metric's name and help."""
PROFILE_PERCENTILES = ("p50", "p90", "p99")
"""The ``percentile`` label's values, the profile's own keys. Not ``quantile``: Prometheus keeps that label for
summaries (whose ``_count`` and ``_sum`` only grow), and a profile's percentiles are gauges over a sliding window
(``promtool check metrics`` refuses a ``quantile`` label on them)."""

GIE_WAITING = "appliance_requests_waiting"
GIE_RUNNING = "appliance_requests_running"
GIE_KV_USAGE = "appliance_kv_cache_usage_ratio"
"""The three model-server-protocol gauges, by their names here (docs/metrics.md: the endpoint picker's flags)."""
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
"""The same three gauges under vLLM's names, the endpoint picker's defaults: one series per configured model,
labelled :data:`VLLM_MODEL_LABEL` as vLLM labels them, with that model's figures."""
VLLM_MODEL_LABEL = "model_name"


def kv_cells(model: Model) -> tuple[int, int]:
    """The KV cells ``model``'s live context holds for its live conversations (their evaluated tokens) and its
    cells in all (its hot pool); (0, 0) without a live context. Parked agents' KV is in host RAM, not in a context,
    so it does not count."""
    runtime = model.runtime
    if runtime is None or not runtime.has_context:
        return 0, 0
    used = sum(conv.n_evaluated for conv in runtime.live)
    return used, runtime.pool_cells or runtime.n_ctx


def usage_ratio(used: int, total: int) -> float:
    """``used`` over ``total`` cells as a 0-1 fraction; 0 with no cells."""
    if total <= 0:
        return 0.0
    return min(1.0, used / total)


def kv_cache_usage(daemon: Daemon) -> float:
    """KV cells in use over the cells of every live context: a 0-1 fraction, 0 when none is live."""
    used = 0
    total = 0
    for model in list(daemon.models.values()):
        model_used, model_total = kv_cells(model)
        used += model_used
        total += model_total
    return usage_ratio(used, total)


@dataclass(frozen=True)
class ModelLoad:
    """One model's model-server-protocol figures: its requests waiting (accepted, not decoding yet: waiting for its
    load, a free sequence or the engine thread), its requests decoding now, and its KV-cache usage (0-1)."""

    waiting: int
    running: int
    kv_usage: float


def model_load(model: Model) -> ModelLoad:
    """``model``'s :class:`ModelLoad` (:func:`kv_cells` for its KV usage)."""
    running = max(0, model.decoding)
    return ModelLoad(max(0, model.inflight - running), running, usage_ratio(*kv_cells(model)))


def model_loads(daemon: Daemon) -> dict[str, ModelLoad]:
    """Every configured model's :class:`ModelLoad`, by name (all zero for one not in memory)."""
    loads = {}
    for spec in daemon.config.models:
        model = daemon.models.get(spec.name)
        loads[spec.name] = ModelLoad(0, 0, 0.0) if model is None else model_load(model)
    return loads


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    """A counter family; ``name`` without ``_total`` (prometheus_client adds it to the sample)."""
    return CounterMetricFamily(name, documentation, value=value)


class DaemonCollector(Collector):
    """The figures the daemon and the appliance already keep, read at scrape time (on the event loop)."""

    def __init__(self, appliance: Appliance) -> None:
        self._appliance = weakref.ref(appliance)  # the daemon holds this collector: no cycle through it

    def collect(self) -> Iterator[Metric]:
        appliance = self._appliance()
        if appliance is None or appliance.daemon is None:
            return
        daemon = appliance.daemon
        snapshot = daemon.snapshot()
        yield from self.memory(snapshot)
        yield from self.inventory(snapshot)
        yield from self.tuning(snapshot)
        yield from self.profiles(snapshot["profiles"])
        yield from self.agent_kv(snapshot["agents"])
        yield from self.kv(daemon, snapshot["counters"])
        yield from self.gateway(daemon)
        yield from self.traffic(appliance, daemon)
        info = GaugeMetricFamily("appliance_build_info", "The appliance's version (value 1).", labels=["version"])
        info.add_metric([appliance.version], 1)
        yield info

    @staticmethod
    def memory(snapshot: dict) -> Iterator[Metric]:
        ledger = snapshot["ledger"]
        device = snapshot["device"]
        host = snapshot["host_kv"]
        yield gauge("appliance_ledger_cap_bytes", "The VRAM ledger's cap: admission_percent of the device, less "
                    "external use.", ledger["cap_bytes"])
        yield gauge("appliance_ledger_allocated_bytes", "Bytes the VRAM ledger has admitted (loaded and loading "
                    "models).", ledger["allocated_bytes"])
        yield gauge("appliance_device_total_bytes", "The accelerator's memory, as last read (start, resync).",
                    device["total_bytes"])
        yield gauge("appliance_device_used_bytes", "The accelerator's memory in use by every process, as last "
                    "read.", device["used_bytes"])
        yield gauge("appliance_device_external_bytes", "Accelerator memory other processes use, as last read "
                    "(kept out of the ledger's cap).", device["external_bytes"])
        yield gauge("appliance_host_kv_budget_bytes", "Host RAM that parked KV state may hold (host_kv_budget).",
                    host["budget_bytes"])
        yield gauge("appliance_host_kv_parked_bytes", "Host RAM held for KV state now (parked agents and reuse "
                    "buffers).", host["parked_bytes"])

    @staticmethod
    def inventory(snapshot: dict) -> Iterator[Metric]:
        models = GaugeMetricFamily("appliance_models", "Models by lifecycle state.", labels=["state"])
        for state in MODEL_STATES:
            models.add_metric([state], sum(m["state"] == state for m in snapshot["models"]))
        yield models
        estimate = GaugeMetricFamily("appliance_model_estimate_bytes", "A known model's ledger figure (its "
                                     "estimate or vram_bytes).", labels=["model"])
        measured = GaugeMetricFamily("appliance_model_measured_bytes", "What a loaded model's load added to the "
                                     "process, measured after its first request.", labels=["model"])
        for model in snapshot["models"]:
            if model["estimate_bytes"] is not None:
                estimate.add_metric([model["name"]], model["estimate_bytes"])
            if model["measured_bytes"] is not None:
                measured.add_metric([model["name"]], model["measured_bytes"])
        yield estimate
        yield measured
        agents = GaugeMetricFamily("appliance_agents", "Registered agents by where their KV state lives: in its "
                                   "model's context (device), parked in host RAM (host), or nowhere (empty).",
                                   labels=["kv"])
        for place in KV_PLACES:
            agents.add_metric([place], sum(a["state"] == place for a in snapshot["agents"]))
        yield agents
        yield gauge("appliance_live_contexts", "Live contexts on the device now (engine.live_contexts bounds them).",
                    len(snapshot["contexts"]))
        slots = GaugeMetricFamily("appliance_context_slots_used", "Sequences of a model's live context that hold a "
                                  "conversation (engine.live_slots of them).", labels=["model"])
        context_bytes = GaugeMetricFamily("appliance_context_bytes", "The ledger figure of a model's live context "
                                          "(KV cache and compute buffers).", labels=["model"])
        for context in snapshot["contexts"]:
            slots.add_metric([context["model"]], context["slots_used"])
            context_bytes.add_metric([context["model"]], context["kv_bytes"])
        yield slots
        yield context_bytes

    @staticmethod
    def tuning(snapshot: dict) -> Iterator[Metric]:
        """Each live context's hot pool, cold pool and threads (SPEC E7)."""
        hot_cells = GaugeMetricFamily("appliance_hot_pool_cells", "KV cells of a model's live (hot) context.",
                                      labels=["model"])
        hot_bytes = GaugeMetricFamily("appliance_hot_pool_bytes", "The ledger bytes of a model's hot pool.",
                                      labels=["model"])
        cold_cells = GaugeMetricFamily("appliance_cold_pool_cells", "KV cells of a model's cold context (a request "
                                       "longer than the hot pool runs there; 0 when none is open).",
                                       labels=["model"])
        cold_bytes = GaugeMetricFamily("appliance_cold_pool_bytes", "The ledger bytes of a model's cold context "
                                       "(0 when none is open).", labels=["model"])
        threads = GaugeMetricFamily("appliance_threads", "Threads a model's live context decodes with.",
                                    labels=["model"])
        streams = GaugeMetricFamily("appliance_kv_streams", "KV streams of a model's live context: split, one per "
                                    "sequence, each an equal share of the hot pool (0: one pool its sequences "
                                    "share).", labels=["model"])
        for context in snapshot["contexts"]:
            model = context["model"]
            streams.add_metric([model], context["kv_streams"])
            hot_cells.add_metric([model], context["pool_cells"])
            hot_bytes.add_metric([model], context["pool_bytes"])
            cold_cells.add_metric([model], context["cold_cells"])
            cold_bytes.add_metric([model], context["cold_bytes"])
            threads.add_metric([model], context["threads"])
        yield hot_cells
        yield hot_bytes
        yield cold_cells
        yield cold_bytes
        yield threads
        yield streams

    @staticmethod
    def profiles(profiles: dict[str, dict]) -> Iterator[Metric]:
        """Each model's load profile (SPEC E1, E7): the P50/P90/P99 of its window, and how many requests it
        holds."""
        families = {figure: GaugeMetricFamily(name, documentation, labels=["model", "percentile"])
                    for figure, (name, documentation) in PROFILE_FIGURES.items()}
        sampled = GaugeMetricFamily("appliance_profile_requests_sampled", "Requests a model's load profile kept "
                                    "since it was made (one in every engine.adaptive_sample_rate).",
                                    labels=["model"])
        in_window = GaugeMetricFamily("appliance_profile_window_requests", "Requests in a model's load profile "
                                      "window now (warm-up runs included): what its percentiles are taken "
                                      "over.",
                                      labels=["model"])
        for model, summary in profiles.items():
            sampled.add_metric([model], summary["sampled"])
            in_window.add_metric([model], summary["in_window"])
            for figure, family in families.items():
                for key in PROFILE_PERCENTILES:
                    found = summary["percentiles"][figure][key]
                    if found is not None:  # an empty window has no percentiles
                        family.add_metric([model, key], found)
        yield from families.values()
        yield sampled
        yield in_window

    @staticmethod
    def agent_kv(agents: list[dict]) -> Iterator[Metric]:
        """KV cells of the agents whose conversation is in a live context (``engine.live_slots`` per context at
        most, so the series stay few however many agents are registered)."""
        cells = GaugeMetricFamily("appliance_agent_kv_cells", "KV cells an agent's conversation holds in its "
                                  "model's live context (agents whose KV is on the device only).", labels=["agent"])
        for agent in agents:
            if agent["state"] == "device":
                cells.add_metric([agent["id"]], agent["kv_cells"])
        yield cells

    @staticmethod
    def kv(daemon: Daemon, counters: dict[str, int]) -> Iterator[Metric]:
        yield counter("appliance_kv_swaps", "KV swaps: a live conversation's state parked in host RAM to make "
                      "room for another agent's.", counters["kv_swaps"])
        yield counter("appliance_kv_swap_bytes", "Bytes of KV state parked in host RAM by swaps.",
                      counters.get("kv_swap_bytes", 0))
        yield counter("appliance_kv_restores", "KV restores: an agent's parked state copied back into its model's "
                      "context.", counters["kv_restores"])
        yield counter("appliance_kv_restore_bytes", "Bytes of KV state restored from host RAM.",
                      counters.get("kv_restore_bytes", 0))
        yield counter("appliance_kv_swap_seconds", "Engine time spent moving KV state (a request's start parks "
                      "the idle states it needs room from and restores its own).", daemon.kv_swap_seconds)
        yield counter("appliance_host_kv_drops", "Parked KV states dropped to stay within host_kv_budget.",
                      counters["host_kv_drops"])
        yield counter("appliance_host_kv_rebuilds", "Decodes that re-evaluated an agent's tokens because its "
                      "parked state had been dropped.", counters["host_kv_rebuilds"])
        yield counter("appliance_ledger_denials", "Model loads the VRAM ledger refused (VRAM_LEDGER_DENY).",
                      counters["denials"])
        restored = CounterMetricFamily("appliance_kv_restored_from", "Agent decodes by where their KV state was "
                                       "found: device, host (RAM), disk (its KV file), tokens (re-evaluated), none "
                                       "(no conversation before).", labels=["tier"])
        for where in RESTORED_FROM:
            restored.add_metric([where], counters[f"restored_from_{where}"])
        yield restored
        yield counter("appliance_disk_kv_spills", "Parked KV states written to disk because host_kv_budget was "
                      "full, or an adaptive pool left no more of n_ctx.", counters["disk_kv_spills"])
        durability = daemon.durability()
        disk = durability.get("disk_kv")
        if disk is not None:
            yield gauge("appliance_disk_kv_budget_bytes", "Disk that KV files may hold (disk_kv_budget).",
                        disk["budget_bytes"])
            yield gauge("appliance_disk_kv_held_bytes", "Disk held by KV files now.", disk["held_bytes"])
            yield gauge("appliance_disk_kv_degraded", "1 while KV files cannot be written (full or read-only "
                        "disk).", disk["status"] == "degraded")
        agents_store = durability.get("store")
        if agents_store is not None:
            yield gauge("appliance_store_degraded", "1 while the agents store cannot be written (its writes wait "
                        "in memory and are retried).", agents_store["status"] == "degraded")
            yield counter("appliance_store_transactions", "Transactions committed to the agents store.",
                          agents_store["transactions"])

    @staticmethod
    def gateway(daemon: Daemon) -> Iterator[Metric]:
        running = daemon.decoding
        waiting = max(0, daemon.generating - running)
        yield gauge(GIE_WAITING, "Generation requests waiting for the engine thread (inference-gateway "
                    "TotalQueuedRequests).", waiting)
        yield gauge(GIE_RUNNING, "Generation requests decoding on the engine thread now (inference-gateway "
                    "TotalRunningRequests).", running)
        yield gauge(GIE_KV_USAGE, "KV cells in use over the cells of the loaded models' contexts, 0-1 "
                    "(inference-gateway KVCacheUtilization).", kv_cache_usage(daemon))
        waiting_by_model = GaugeMetricFamily(VLLM_WAITING, "A model's generation requests accepted and not "
                                             "decoding yet (vLLM's name: inference-gateway TotalQueuedRequests).",
                                             labels=[VLLM_MODEL_LABEL])
        running_by_model = GaugeMetricFamily(VLLM_RUNNING, "A model's generation requests decoding now (vLLM's "
                                             "name: inference-gateway TotalRunningRequests).",
                                             labels=[VLLM_MODEL_LABEL])
        kv_by_model = GaugeMetricFamily(VLLM_KV_USAGE, "KV cells in use over the cells of a model's live context, "
                                        "0-1 (vLLM's name: inference-gateway KVCacheUtilization).",
                                        labels=[VLLM_MODEL_LABEL])
        for name, load in model_loads(daemon).items():
            waiting_by_model.add_metric([name], load.waiting)
            running_by_model.add_metric([name], load.running)
            kv_by_model.add_metric([name], load.kv_usage)
        yield waiting_by_model
        yield running_by_model
        yield kv_by_model

    @staticmethod
    def traffic(appliance: Appliance, daemon: Daemon) -> Iterator[Metric]:
        connections = CounterMetricFamily("appliance_connections", "Socket connections served, by the protocol "
                                          "their first bytes spoke.", labels=["protocol"])
        for protocol in PROTOCOLS:
            connections.add_metric([protocol], daemon.connections[protocol])
        yield connections
        yield gauge("appliance_connections_open", "Open connections of every surface (what max_connections "
                    "caps).", appliance.open_connections())
        errors = CounterMetricFamily("appliance_errors", "Errors sent to clients (denials included), by surface "
                                     "and code.", labels=["surface", "code"])
        for (surface, code), count in sorted(daemon.errors.items()):
            errors.add_metric([surface, code], count)
        yield errors
        reloads = CounterMetricFamily("appliance_reloads", "Config reloads by result.", labels=["result"])
        results = appliance.reloader.results if appliance.reloader is not None else {}
        for result in RELOAD_RESULTS:
            reloads.add_metric([result], results.get(result, 0))
        yield reloads


def created_series() -> bool:
    """Whether counters and histograms have their ``_created`` sample: unless ``PROMETHEUS_DISABLE_CREATED_SERIES``
    says not, as ``prometheus_client`` decides it for its own."""
    return os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")


def counted_family(metric: CountedMetric, created: bool) -> Metric:
    """``metric``'s family, its samples as ``prometheus_client``'s ``Counter`` or ``Histogram`` with the same
    series would write them."""
    spec = metric.spec
    names = spec.labels
    if spec.buckets is None:
        counter = CounterMetricFamily(spec.name, spec.documentation, labels=names)
        for values, series in metric.series.items():
            counter.add_metric(values, series.value, created=series.created if created else None)
        return counter
    histogram = HistogramMetricFamily(spec.name, spec.documentation, labels=names)
    for values, series in metric.series.items():
        cumulative = itertools.accumulate(float(count) for count in series.counts)
        buckets = [(floatToGoString(bound), total) for bound, total in zip(spec.bounds, cumulative, strict=True)]
        histogram.add_metric(values, buckets, series.value)
        if created:
            histogram.add_sample(spec.name + "_created", dict(zip(names, values, strict=True)), series.created)
    return histogram


class RequestCollector(Collector):
    """The per-request counters and histograms (:mod:`appliance.http.requestcounts`), read at scrape time."""

    def __init__(self, counts: RequestCounts) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        created = created_series()
        for metric in self.counts.metrics:
            yield counted_family(metric, created)


_BY_DAEMON: weakref.WeakKeyDictionary[Daemon, CollectorRegistry] = weakref.WeakKeyDictionary()


def registry_of(appliance: Appliance) -> CollectorRegistry | None:
    """The registry of ``appliance``'s daemon (the :class:`DaemonCollector`, then the :class:`RequestCollector`),
    made on the first scrape; None before the daemon exists."""
    daemon = appliance.daemon
    counts = requestcounts.attach(appliance)
    if daemon is None or counts is None:
        return None
    registry = _BY_DAEMON.get(daemon)
    if registry is None:
        registry = _BY_DAEMON[daemon] = CollectorRegistry()
        registry.register(DaemonCollector(appliance))
        registry.register(RequestCollector(counts))
    return registry


async def metrics_page(request: Request) -> Response:
    registry = registry_of(request.app.state.appliance)
    if registry is None:
        return Response("", media_type="text/plain")
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(registry), headers={"Content-Type": content_type})


routes: list[BaseRoute] = [Route("/metrics", metrics_page, methods=["GET"])]
