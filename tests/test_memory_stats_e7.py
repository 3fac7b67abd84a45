"""Memory stats (SPEC E7): each model's hot pool, cold pool, plan, threads and load profile, and each agent's KV
cells, on STATUS, the admin page (the Tuning panel, the agents table) and ``/metrics``, all read from a real
daemon's :meth:`~appliance.daemon.core.Daemon.snapshot`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from harness import running
from prometheus_client.parser import text_string_to_metric_families

from appliance.cli import parse_records
from appliance.client import lines as lineclient
from appliance.http.admin import dashboard, figures, render
from appliance.server.lines import profile_records

FIXED = {"adaptive": False, "threads": 2, "warmup_runs": 0}
ADAPTIVE = {"adaptive": True, "threads": 1, "warmup_runs": 0, "adaptive_sample_rate": 1}
"""Every request sampled, threads pinned, no warm-up: the profile holds exactly the test's requests."""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(app: Any) -> Samples:  # type: ignore[no-untyped-def]
    page = httpx.get(app.appliance.http_url + "/metrics", timeout=60).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(page) for sample in family.samples}


def status(app: Any) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """STATUS's records, as ``appliance status --json`` reads them."""
    return parse_records(lineclient.response_body(app.line("STATUS")), ("models", "agents"))


def the_context(snapshot: dict[str, Any], model: str) -> dict[str, Any]:
    return next(c for c in snapshot["contexts"] if c["model"] == model)


def test_status_shows_pools_plan_threads_profile_and_agent_kv_cells(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], engine=ADAPTIVE) as app:
        app.line("REGISTER a tiny")
        for prompt in ("Hello", "Hello there, how are you today", "Hi"):
            assert app.line(f"DECODE a 3 {prompt}").startswith("OK")
        snapshot = app.daemon.snapshot()
        doc = status(app)
        context = the_context(snapshot, "tiny")
        record = doc["context"]
        for key in ("pool_cells", "pool_bytes", "cold_cells", "cold_bytes", "plan", "threads"):
            assert record[key] == context[key], key
        assert record["threads"] == 1 and record["plan"] in ("S", "M", "L") and record["pool_cells"] > 0
        assert record["adaptive"] is True and doc["engine"]["adaptive"] is True and doc["engine"]["warming"] is False
        # engine.flash_attention's default, auto, resolved by llama.cpp: on, on the CPU
        assert doc["engine"]["flash_attention"] == "auto" and record["flash_attention"] is True
        summary = snapshot["profiles"]["tiny"]
        profile = doc["profile"]
        assert profile["model"] == "tiny" and profile["sampled"] == summary["sampled"] == 3
        assert profile["in_window"] == 3
        for figure in ("input_tokens", "output_tokens", "kv_cells_peak"):
            for quantile in ("p50", "p90", "p99"):
                assert profile[f"{figure}_{quantile}"] == summary["percentiles"][figure][quantile]
        assert profile["input_tokens_p99"] > profile["input_tokens_p50"] > 0
        agent = doc["agents"][0]
        assert agent["id"] == "a" and agent["kv_cells"] == app.daemon.agents["a"].conversation.n_evaluated > 0


def test_a_profile_record_is_flat_and_none_while_its_window_is_empty() -> None:
    summary = {"observed": 0, "sampled": 0, "in_window": 0, "window_size": 64, "sample_rate": 4,
               "percentiles": {"input_tokens": {"p50": None, "p90": None, "p99": None},
                               "ttft_s": {"p50": None, "p90": None, "p99": None}}}
    assert profile_records({"tiny": summary}) == [
        {"model": "tiny", "observed": 0, "sampled": 0, "in_window": 0, "window_size": 64, "sample_rate": 4,
         "input_tokens_p50": None, "input_tokens_p90": None, "input_tokens_p99": None,
         "ttft_s_p50": None, "ttft_s_p90": None, "ttft_s_p99": None}]


def test_metrics_show_pools_threads_profile_percentiles_and_agent_kv_cells(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], engine=ADAPTIVE) as app:
        app.line("REGISTER a tiny")
        for prompt in ("Hello", "Hello there, how are you today", "Hi"):
            assert app.line(f"DECODE a 3 {prompt}").startswith("OK")
        samples = scrape(app)
        snapshot = app.daemon.snapshot()
        context = the_context(snapshot, "tiny")
        model = (("model", "tiny"),)
        assert samples["appliance_hot_pool_cells", model] == context["pool_cells"] > 0
        assert samples["appliance_hot_pool_bytes", model] == context["pool_bytes"] > 0
        assert samples["appliance_cold_pool_cells", model] == context["cold_cells"] == 0
        assert samples["appliance_cold_pool_bytes", model] == context["cold_bytes"] == 0
        assert samples["appliance_threads", model] == 1
        assert samples["appliance_kv_streams", model] == context["kv_streams"] == 0  # one agent at a time: one pool
        summary = snapshot["profiles"]["tiny"]
        assert samples["appliance_profile_requests_sampled", model] == summary["sampled"] == 3
        assert samples["appliance_profile_window_requests", model] == 3
        names = {"input_tokens": "appliance_profile_input_tokens", "output_tokens": "appliance_profile_output_tokens",
                 "ttft_s": "appliance_profile_ttft_seconds", "kv_cells_peak": "appliance_profile_kv_cells_peak"}
        for figure, name in names.items():
            for key in ("p50", "p90", "p99"):
                labels = (("model", "tiny"), ("percentile", key))
                assert samples[name, labels] == summary["percentiles"][figure][key], (name, key)
        kv_cells = app.daemon.agents["a"].conversation.n_evaluated
        assert samples["appliance_agent_kv_cells", (("agent", "a"),)] == kv_cells > 0
        assert samples["appliance_requests_by_plan_total", (("model", "tiny"), ("plan", context["plan"]))] == 3


def test_metrics_list_only_agents_whose_kv_is_on_the_device(tiny_model: Path) -> None:
    engine = {**FIXED, "live_slots": 1}
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], engine=engine) as app:
        for agent in ("a", "b"):
            app.line(f"REGISTER {agent} tiny")
            assert app.line(f"DECODE {agent} 2 Hello").startswith("OK")
        assert app.daemon.agents["a"].conversation.where == "host"  # parked for b's turn (one slot)
        samples = scrape(app)
        agents = {labels for name, labels in samples if name == "appliance_agent_kv_cells"}
        assert agents == {(("agent", "b"),)}
        context = the_context(app.daemon.snapshot(), "tiny")
        assert samples["appliance_hot_pool_cells", (("model", "tiny"),)] == context["pool_cells"]
        assert samples["appliance_threads", (("model", "tiny"),)] == 2


def test_the_dashboard_has_a_tuning_panel_per_model_and_agent_kv_cells(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], engine=FIXED) as app:
        url = app.appliance.http_url
        app.line("REGISTER a tiny")
        assert app.line("DECODE a 3 Hello there").startswith("OK")
        snapshot = app.daemon.snapshot()
        context = the_context(snapshot, "tiny")
        page = httpx.get(url + "/admin/").text
        assert 'hx-get="/admin/_tuning" hx-trigger="every 2s"' in page and '<article class="card" data-tuning="tiny">' \
            in page
        html = httpx.get(url + "/admin/_tuning").text
        assert "<html" not in html
        assert '<strong id="engine-strategy">fixed</strong>' in html and 'id="warming"' not in html
        panel = html[html.index('data-tuning="tiny"'):]
        panel = panel[:panel.index("</article>")]
        assert '<dd data-figure="plan">fixed</dd>' in panel and '<dd data-figure="threads">2</dd>' in panel
        hot = f'<dd data-figure="hot-pool">{context["pool_cells"]} cells, {figures.format_bytes(context["pool_bytes"])}'
        assert hot in panel and '<dd data-figure="cold-pool">none open</dd>' in panel
        if "tiny" in snapshot["profiles"]:  # the fixed strategy may keep a profile too
            assert '<tr data-figure="input_tokens">' in panel
        row = httpx.get(url + "/admin/_dashboard").text
        row = row[row.index('<tr data-agent="a">'):]
        row = row[:row.index("</tr>")]
        assert f"<td>{app.daemon.agents['a'].conversation.n_evaluated}</td>" in row


def test_the_tuning_panel_says_warming_and_shows_the_profile() -> None:
    profile = {"observed": 5, "sampled": 5, "in_window": 5, "window_size": 64, "sample_rate": 1,
               "percentiles": {"input_tokens": {"p50": 40, "p90": 300, "p99": 600},
                               "output_tokens": {"p50": 8, "p90": 64, "p99": 64},
                               "ttft_s": {"p50": 0.012, "p90": 0.25, "p99": 0.5},
                               "kv_cells_peak": {"p50": 48, "p90": 364, "p99": 664}}}
    context = {"model": "demo", "pool_cells": 768, "pool_bytes": 3 * 1024**2, "cold_cells": 2048,
               "cold_bytes": 8 * 1024**2, "plan": "M", "threads": 3, "flash_attention": True, "adaptive": True}
    snapshot = {"engine": {"adaptive": True, "warming": True, "flash_attention": "auto"}, "contexts": [context],
                "profiles": {"demo": profile, "other": {**profile, "in_window": 0}}}
    tuning = {"engine": snapshot["engine"], "panels": dashboard.tuning_panels(snapshot), "poll_s": 2}
    html = render.render("_tuning.html", tuning=tuning)
    assert '<strong id="warming" class="state state-loading">warming</strong>' in html
    demo = html[html.index('data-tuning="demo"'):html.index('data-tuning="other"')]
    assert '<dd data-figure="cold-pool">2048 cells, 8.0 MiB</dd>' in demo
    assert '<dd data-figure="hot-pool">768 cells, 3.0 MiB</dd>' in demo
    assert '<dd data-figure="flash-attention">on (engine.flash_attention: auto)</dd>' in demo
    assert "<td>40</td>" in demo and "<td>600</td>" in demo and "<td>12.0 ms</td>" in demo and "<td>664</td>" in demo
    other = html[html.index('data-tuning="other"'):]
    assert "<dd>none live</dd>" in other and "0 requests in the window" in other
