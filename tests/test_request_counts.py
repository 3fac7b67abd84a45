"""The per-request figures of ``/metrics`` are counted without ``prometheus_client``
(:mod:`appliance.http.requestcounts`) and written at the scrape (:class:`appliance.http.metrics.RequestCollector`)
exactly as ``prometheus_client``'s own ``Counter`` and ``Histogram`` fed the same records write them, in both
formats: the same families, series, values and ``_created`` series (their times are each series' first count)."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from appliance.daemon.requestlog import RequestRecord
from appliance.http.metrics import RequestCollector
from appliance.http.requestcounts import RequestCounts

RECORDS = [
    RequestRecord(at=1.0, surface="openai", model="tiny", agent=None, prompt_tokens=17, generated_tokens=4,
                  ttft_s=0.004, elapsed_s=0.03, outcome="ok", plan="S"),
    RequestRecord(at=2.0, surface="lines", model="tiny", agent="a", prompt_tokens=3, generated_tokens=6,
                  ttft_s=0.0025, elapsed_s=1.0, outcome="ok", plan="S"),  # on a bucket's bound
    RequestRecord(at=3.0, surface="openai", model="tiny", agent=None, prompt_tokens=5, generated_tokens=0,
                  ttft_s=None, elapsed_s=0.2, outcome="error", error="BAD_REQUEST"),  # never ran: no plan
    RequestRecord(at=4.0, surface="anthropic", model="big", agent=None, prompt_tokens=900, generated_tokens=1,
                  ttft_s=45.0, elapsed_s=400.0, outcome="ok", plan="M"),  # past every bound: +Inf only
    RequestRecord(at=5.0, surface="openai", model="tiny", agent=None, prompt_tokens=9, generated_tokens=2,
                  ttft_s=0.01, elapsed_s=0.5, outcome="cancelled", plan="S"),
    RequestRecord(at=6.0, surface="openai", model="embed", agent=None, prompt_tokens=4, generated_tokens=0,
                  ttft_s=None, elapsed_s=0.01, outcome="ok", task="embed"),  # not a generation: not counted
    RequestRecord(at=7.0, surface="openai", model="tiny", agent=None, prompt_tokens=30, generated_tokens=8,
                  ttft_s=0.02, elapsed_s=0.7, outcome="ok", plan="M"),
]


def prometheus_client_registry(records: list[RequestRecord]) -> CollectorRegistry:
    """The records counted by ``prometheus_client``'s own metrics, as the appliance counted them before."""
    registry = CollectorRegistry()
    counts = RequestCounts()
    made = {}
    for metric in counts.metrics:
        spec = metric.spec
        if spec.buckets is None:
            made[spec.name] = Counter(spec.name, spec.documentation, spec.labels, registry=registry)
        else:
            made[spec.name] = Histogram(spec.name, spec.documentation, spec.labels, buckets=spec.buckets,
                                        registry=registry)
    for record in records:
        if record.task != "generate":
            continue
        labels = (record.model, record.surface)
        made["appliance_requests"].labels(*labels, record.outcome).inc()
        made["appliance_prompt_tokens"].labels(*labels).inc(record.prompt_tokens)
        made["appliance_generation_tokens"].labels(*labels).inc(record.generated_tokens)
        if record.outcome == "ok":
            made["appliance_request_duration_seconds"].labels(*labels).observe(record.elapsed_s)
        if record.ttft_s is not None:
            made["appliance_time_to_first_token_seconds"].labels(*labels).observe(record.ttft_s)
        if record.plan is not None:
            made["appliance_requests_by_plan"].labels(record.model, record.plan).inc()
    return registry


def our_registry(records: list[RequestRecord]) -> CollectorRegistry:
    counts = RequestCounts()
    for record in records:
        counts.observe(record)
    registry = CollectorRegistry()
    registry.register(RequestCollector(counts))
    return registry


def without_created(page: str) -> list[str]:
    return [line for line in page.splitlines() if "_created" not in line]


def created_series(page: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(page) for sample in family.samples
            if sample.name.endswith("_created")}


@pytest.mark.parametrize("records", [RECORDS, RECORDS[:1], []], ids=["several", "one", "none"])
@pytest.mark.parametrize("encode", [generate_latest, generate_openmetrics], ids=["text", "openmetrics"])
def test_the_page_is_what_prometheus_clients_own_metrics_write(records: list[RequestRecord], encode: object) -> None:
    assert callable(encode)
    start = time.time()
    theirs = encode(prometheus_client_registry(records)).decode()
    ours = encode(our_registry(records)).decode()
    end = time.time()
    assert without_created(ours) == without_created(theirs)
    if encode is generate_latest:  # the text format's parser reads the _created series as gauges of their own
        created = created_series(ours)
        assert created.keys() == created_series(theirs).keys()
        assert len(created) == (20 if records is RECORDS else 6 if records else 0)
        assert all(start <= value <= end for value in created.values())


def test_a_series_keeps_its_first_count_as_its_creation() -> None:
    counts = RequestCounts()
    counts.observe(RECORDS[0])
    first = counts.requests.series["tiny", "openai", "ok"].created
    counts.observe(RECORDS[6])
    assert counts.requests.series["tiny", "openai", "ok"].created == first
    assert counts.requests.series["tiny", "openai", "ok"].value == 2


def test_a_record_that_cannot_be_counted_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    counts = RequestCounts()
    broken = RequestRecord(at=1.0, surface="openai", model="tiny", agent=None, prompt_tokens=-1, generated_tokens=1,
                           ttft_s=None, elapsed_s=math.nan, outcome="ok")
    counts.observe(broken)
    assert "could not be counted" in caplog.text
