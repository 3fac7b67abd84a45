"""``GET /metrics`` (SPEC W3) on a real appliance: Prometheus' own parser reads the page, the counters move after
requests on each surface and after a KV swap, the histograms get samples with their labels, and the inference
gateway's gauges are there under their documented names, in range."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import running
from prometheus_client.parser import text_string_to_metric_families

from appliance.client.blocking import MagnClient
from appliance.errors import ApplianceError
from appliance.http.metrics import GIE_KV_USAGE, GIE_RUNNING, GIE_WAITING

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, **headers: str) -> tuple[Samples, dict[str, str]]:
    """Every sample of the page by (sample name, labels), and each family's type."""
    response = httpx.get(url + "/metrics", headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(response.text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape_with_pool(url: str, runtime: Any) -> tuple[Samples, int]:
    """A scrape and the live context's KV cells it was taken against: the adaptive engine may resize the pool after
    a sampled request, beside the scrape, so the cells are read before and after it until they agree."""
    for _ in range(100):
        before = runtime.pool_cells
        samples, _ = scrape(url)
        if runtime.pool_cells == before:
            return samples, before
        time.sleep(0.05)
    raise AssertionError("the pool kept changing around every scrape")


def test_the_page_parses_and_shows_memory_inventory_and_the_gateway_gauges(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        samples, types = scrape(app.appliance.http_url)
        assert value(samples, "appliance_device_total_bytes") == 8 * 1024**3  # device fake:8GiB
        cap = value(samples, "appliance_ledger_cap_bytes")
        assert 0 < cap <= 8 * 1024**3 and value(samples, "appliance_ledger_allocated_bytes") == 0
        assert value(samples, "appliance_models", state="available") == 0  # not known to the daemon until used
        app.line("REGISTER a tiny")
        samples, types = scrape(app.appliance.http_url)
        assert value(samples, "appliance_models", state="loaded") == 1
        assert value(samples, "appliance_ledger_allocated_bytes") > 0
        assert value(samples, "appliance_model_estimate_bytes", model="tiny") > 0
        assert value(samples, "appliance_agents", kv="empty") == 1
        for name in (GIE_WAITING, GIE_RUNNING, GIE_KV_USAGE):
            assert types[name] == "gauge" and (name, frozenset()) in samples
        assert value(samples, GIE_WAITING) == 0 and value(samples, GIE_RUNNING) == 0
        assert value(samples, GIE_KV_USAGE) == 0  # no token evaluated yet
        for name in ("appliance_kv_swaps", "appliance_requests", "appliance_errors", "appliance_reloads",
                     "appliance_connections"):
            assert types[name] == "counter"
        assert types["appliance_request_duration_seconds"] == "histogram"
        assert types["appliance_time_to_first_token_seconds"] == "histogram"


def test_requests_on_the_socket_surfaces_move_the_counters_and_histograms(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        app.line("REGISTER a tiny")
        assert app.line("DECODE a 6 Hello world").startswith("OK")
        agent = app.daemon.agents["a"]
        samples, cells = scrape_with_pool(app.appliance.http_url, agent.model.runtime)  # every sequence's cells
        # the live agent's evaluated tokens are the context's cells in use
        assert value(samples, GIE_KV_USAGE) == pytest.approx(agent.conversation.n_evaluated / cells)
        assert 0 < value(samples, GIE_KV_USAGE) < 1
        with MagnClient(str(app.socket), timeout=60) as client:
            completion = client.infer(model="tiny", prompt="Hi there", max_tokens=4, temperature=0)
        samples, _ = scrape(app.appliance.http_url)
        for surface, generated in (("lines", 6), ("magn", completion.usage.completion_tokens)):
            labels = {"model": "tiny", "surface": surface}
            assert value(samples, "appliance_requests_total", outcome="ok", **labels) == 1
            assert value(samples, "appliance_prompt_tokens_total", **labels) >= 2
            assert value(samples, "appliance_generation_tokens_total", **labels) == generated
            assert value(samples, "appliance_request_duration_seconds_count", **labels) == 1
            assert value(samples, "appliance_request_duration_seconds_sum", **labels) > 0
            assert value(samples, "appliance_request_duration_seconds_bucket", le="+Inf", **labels) == 1
            assert value(samples, "appliance_time_to_first_token_seconds_count", **labels) == 1
        assert value(samples, "appliance_connections_total", protocol="lines") >= 2  # REGISTER, DECODE
        assert value(samples, "appliance_connections_total", protocol="magn") == 1
        # the stateless request took a sequence of its own and left the context; a's cells stayed (in a pool the
        # adaptive engine may have resized since, or resizes now)
        samples, cells = scrape_with_pool(app.appliance.http_url, agent.model.runtime)
        assert value(samples, GIE_KV_USAGE) == pytest.approx(agent.conversation.n_evaluated / cells)


def test_openai_requests_are_counted_under_their_surface(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        url = app.appliance.http_url
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
                "temperature": 0}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        if response.status_code == 404 and "no route" in response.text:
            pytest.skip("the OpenAI endpoint is not there yet")
        assert response.status_code == 200, response.text
        generated = response.json()["usage"]["completion_tokens"]
        samples, _ = scrape(url)
        labels = {"model": "tiny", "surface": "openai"}
        assert value(samples, "appliance_requests_total", outcome="ok", **labels) == 1
        assert value(samples, "appliance_generation_tokens_total", **labels) == generated
        assert value(samples, "appliance_request_duration_seconds_count", **labels) == 1
        assert value(samples, "appliance_time_to_first_token_seconds_count", **labels) == 1


def test_a_kv_swap_moves_the_swap_and_restore_counters(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 engine={"live_slots": 1}) as app:
        url = app.appliance.http_url
        app.line("REGISTER a tiny")
        app.line("REGISTER b tiny")
        before, _ = scrape(url)
        assert value(before, "appliance_kv_swaps_total") == 0
        for agent in ("a", "b", "a"):  # b parks a's state; a parks b's and restores its own
            assert app.line(f"DECODE {agent} 4 Hello world").startswith("OK")
        samples, _ = scrape(url)
        assert value(samples, "appliance_kv_swaps_total") == 2
        assert value(samples, "appliance_kv_restores_total") == 1
        assert value(samples, "appliance_kv_swap_bytes_total") > 0
        assert value(samples, "appliance_kv_restore_bytes_total") > 0
        assert value(samples, "appliance_kv_swap_seconds_total") > 0
        assert value(samples, "appliance_agents", kv="device") == 1
        assert value(samples, "appliance_agents", kv="host") == 1
        assert value(samples, "appliance_host_kv_parked_bytes") > 0


def test_the_gateway_gauges_count_running_and_waiting_generations(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        url = app.appliance.http_url
        app.line("REGISTER warm tiny")  # loaded, so both requests below go straight to the engine
        gate = app.engine.gate
        gate.close()
        replies: list[str] = []

        def decode(agent: str) -> None:
            replies.append(app.line(f"DECODE {agent} 3 Hello"))

        app.line("REGISTER a tiny")
        app.line("REGISTER b tiny")
        threads = [threading.Thread(target=decode, args=(agent,)) for agent in ("a", "b")]
        try:
            threads[0].start()
            gate.wait_arrived(1)  # a decodes (held at its first token)
            threads[1].start()
            samples: Samples = {}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until b reaches the engine's queue
                samples, _ = scrape(url)
                if value(samples, GIE_WAITING) == 1:
                    break
                time.sleep(0.01)
            assert value(samples, GIE_RUNNING) == 1 and value(samples, GIE_WAITING) == 1
        finally:
            gate.open()
            for thread in threads:
                thread.join(60)
        assert len(replies) == 2 and all(reply.startswith("OK") for reply in replies)
        samples, _ = scrape(url)
        assert value(samples, GIE_RUNNING) == 0 and value(samples, GIE_WAITING) == 0


def test_errors_are_counted_by_surface_and_code(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        url = app.appliance.http_url
        assert app.line("DECODE nobody 4 Hello").startswith("ERR")
        with MagnClient(str(app.socket), timeout=60) as client, pytest.raises(ApplianceError) as info:
            client.infer(session_id="nobody", prompt="x", max_tokens=2)
        assert info.value.code == "UNKNOWN_AGENT"
        assert httpx.get(url + "/v1/nothing").status_code == 404
        samples, _ = scrape(url)
        assert value(samples, "appliance_errors_total", surface="lines", code="UNKNOWN_AGENT") == 1
        assert value(samples, "appliance_errors_total", surface="magn", code="UNKNOWN_AGENT") == 1
        assert value(samples, "appliance_errors_total", surface="http", code="NOT_FOUND") == 1


def test_reloads_are_counted_by_result(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], watch=True) as app:
        assert app.reload().result == "unchanged"
        app.edit("models: [")  # invalid YAML
        assert app.reload().result == "invalid"
        samples, _ = scrape(app.appliance.http_url)
        assert value(samples, "appliance_reloads_total", result="unchanged") == 1
        assert value(samples, "appliance_reloads_total", result="invalid") >= 1  # the watcher may reload it too
        assert value(samples, "appliance_reloads_total", result="applied") == 0


def test_with_an_api_token_the_page_needs_it(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"api_token": "metrics-secret-1"}) as app:
        url = app.appliance.http_url
        refused = httpx.get(url + "/metrics")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "UNAUTHORIZED"
        samples, _ = scrape(url, authorization="Bearer metrics-secret-1")
        assert value(samples, "appliance_build_info", version=app.appliance.version) == 1


def test_openmetrics_is_served_when_the_scraper_asks_for_it(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        response = httpx.get(app.appliance.http_url + "/metrics",
                             headers={"accept": "application/openmetrics-text; version=1.0.0"})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/openmetrics-text")
        assert response.text.rstrip().endswith("# EOF")
