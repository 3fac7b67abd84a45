"""Every inference reports its output tokens, time to first token, elapsed time, peak memory, plan and threads
(SPEC E6) on every surface: the line protocol's DECODE ``OK`` lines, MAGN's TASK_COMPLETE (``timings`` and
``stats``), OpenAI's ``usage`` (plain and the stream's usage chunk) and ``/metrics``' requests by plan. The values
are the daemon's: the plan and threads of the context the request ran in (read back from llama.cpp), the ledger's
bytes for the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from harness import running
from prometheus_client.parser import text_string_to_metric_families

from appliance.client import lines as lineclient
from appliance.client.blocking import MagnClient
from appliance.daemon.core import DecodeResult, context_key
from appliance.engine.interface import Generation
from appliance.http.openai import Done
from appliance.protocol import lines
from appliance.server.lines import results_header, timings_header
from appliance.server.magn import completion

FIXED = {"adaptive": False, "threads": 2, "warmup_runs": 0}
"""The fixed strategy with a pinned thread count: every figure is known before the request runs."""
ADAPTIVE = {"adaptive": True, "threads": 1, "warmup_runs": 0, "adaptive_sample_rate": 1}
"""The adaptive engine, threads pinned (no CPU reading can move them mid-test), no warm-up."""


def context_threads(app: Any, model: str) -> int:  # type: ignore[no-untyped-def]
    """The thread count llama.cpp reports for ``model``'s live context (read on the engine thread)."""
    runtime = app.daemon.models[model].runtime

    def read() -> int:
        return runtime.context.threads

    return app.call(app.daemon.engine.call(read))


def model_bytes(app: Any, model: str) -> int:  # type: ignore[no-untyped-def]
    """The ledger's bytes for ``model``: its weights and its live context."""
    held = app.daemon.ledger.reservations()
    return held[model] + held.get(context_key(model), 0)


def the_context(app: Any, model: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    return next(c for c in app.daemon.snapshot()["contexts"] if c["model"] == model)


def test_the_decode_ok_lines_carry_the_fixed_plan_threads_memory_and_times(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], engine=FIXED) as app:
        app.line("REGISTER a tiny")
        reply = app.line("DECODE a 6 Hello world")
        head = lineclient.header_fields(reply)
        first = reply.splitlines()[2]
        assert first.startswith("OK prompt_tokens=3 generated_tokens=")
        assert first.endswith(" plan=fixed threads=2")  # the existing fields first, the new ones at the end
        assert " peak_memory_bytes=" in first
        assert reply.splitlines()[3].startswith("OK elapsed_ms=") and " ttft_ms=" in reply.splitlines()[3]
        assert head["plan"] == "fixed" == the_context(app, "tiny")["plan"]
        assert int(head["threads"]) == 2 == context_threads(app, "tiny") == the_context(app, "tiny")["threads"]
        assert int(head["peak_memory_bytes"]) == model_bytes(app, "tiny") > 0
        assert 0 < float(head["ttft_ms"]) <= float(head["elapsed_ms"])
        assert int(head["generated_tokens"]) >= 1


def test_an_adaptive_decode_reports_its_context_plan_and_threads(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], engine=ADAPTIVE) as app:
        app.line("REGISTER a tiny")
        head = lineclient.header_fields(app.line("DECODE a 4 Hello"))
        context = the_context(app, "tiny")
        assert context["adaptive"] is True
        assert head["plan"] in ("S", "M", "L") and head["plan"] == context["plan"]
        assert int(head["threads"]) == 1 == context_threads(app, "tiny")
        assert int(head["peak_memory_bytes"]) >= model_bytes(app, "tiny") > 0


def test_magn_task_complete_carries_them_in_timings_and_stats(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], engine=FIXED) as app, \
            MagnClient(str(app.socket), timeout=60) as client:
        done = client.infer(model="tiny", prompt="Hi there", max_tokens=4, temperature=0)
        assert done.usage.completion_tokens >= 1
        assert 0 < done.timings["ttft_ms"] <= done.timings["elapsed_ms"]
        assert done.stats["plan"] == "fixed" and done.stats["threads"] == 2 == context_threads(app, "tiny")
        assert done.stats["peak_memory_bytes"] == model_bytes(app, "tiny")


def openai_usage_fields(usage: dict[str, Any], app: Any) -> None:  # type: ignore[no-untyped-def]
    assert usage["plan"] == "fixed" and usage["threads"] == 2 == context_threads(app, "tiny")
    assert usage["peak_memory_bytes"] == model_bytes(app, "tiny")
    assert 0 < usage["ttft_ms"] <= usage["elapsed_ms"]
    assert usage["completion_tokens"] >= 1


def test_openai_usage_carries_them_plain_and_streamed(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], engine=FIXED) as app:
        url = app.appliance.http_url + "/v1/chat/completions"
        request = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        plain = httpx.post(url, json=request, timeout=60)
        assert plain.status_code == 200, plain.text
        openai_usage_fields(plain.json()["usage"], app)
        streamed = httpx.post(url, json={**request, "stream": True, "stream_options": {"include_usage": True}},
                              timeout=60)
        events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        openai_usage_fields(events[-1]["usage"], app)


def test_metrics_count_requests_by_plan(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], engine=FIXED) as app:
        app.line("REGISTER a tiny")
        for _ in range(2):
            assert app.line("DECODE a 2 Hi").startswith("OK")
        page = httpx.get(app.appliance.http_url + "/metrics", timeout=60).text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(page) for s in family.samples}
        assert samples["appliance_requests_by_plan_total", (("model", "tiny"), ("plan", "fixed"))] == 2
        assert samples["appliance_threads", (("model", "tiny"),)] == 2


# -- no token generated: the time to first token is left out (MAGN), none (lines) or null (OpenAI) ----------------

def result_without_tokens() -> DecodeResult:
    generation = Generation(text="", tokens=(), prompt_tokens=3, stop_reason="length", elapsed_s=0.25, ttft_s=None,
                            prompt_evaluated=3)
    return DecodeResult(agent="a", model="tiny", generation=generation, evicted=None, restored=False, plan="M",
                        threads=3, peak_memory_bytes=12345)


def test_without_a_token_the_first_token_time_is_none_null_or_left_out() -> None:
    result = result_without_tokens()
    text = lines.format_reply("DECODE", [results_header(result), timings_header(result)], body=[""])
    assert "OK prompt_tokens=3 generated_tokens=0 stopped_on_eos=false prompt_evaluated=3 " \
           "peak_memory_bytes=12345 plan=M threads=3\n" in text
    assert "OK elapsed_ms=250.000 ttft_ms=none\n" in text
    done = completion("t1", result)
    assert done.timings == {"elapsed_ms": 250.0}
    assert done.stats["plan"] == "M" and done.stats["threads"] == 3 and done.stats["peak_memory_bytes"] == 12345
    usage = Done(result).usage()
    assert usage["ttft_ms"] is None and usage["elapsed_ms"] == 250.0
    assert (usage["plan"], usage["threads"], usage["peak_memory_bytes"]) == ("M", 3, 12345)
