"""The inference gateway's model-server gauges under vLLM's names (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, labelled ``model_name``), read with
``prometheus_client``'s parser while requests wait and run on a real appliance (the tiny models, two sequences per
context, each decode step slowed), and checked against ``STATUS`` taken around the same scrape."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness import Running, running
from prometheus_client.parser import text_string_to_metric_families

from appliance.http.metrics import (
    GIE_KV_USAGE,
    GIE_RUNNING,
    GIE_WAITING,
    VLLM_KV_USAGE,
    VLLM_MODEL_LABEL,
    VLLM_RUNNING,
    VLLM_WAITING,
    usage_ratio,
)
from appliance.protocol.lines import parse_fields, parse_reply

LIVE_SLOTS = 2
TINY_AGENTS = 5
"""Agents decoding on ``tiny`` at once: more than its sequences, so some wait."""
STEP_DELAY_S = 0.05
"""Each decode step waits this long: the states last long enough to be seen."""


@dataclass(frozen=True)
class Gauges:
    """One scrape's model-server gauges: by model (vLLM's names) and for the whole box (the appliance's)."""

    waiting: dict[str, float]
    running: dict[str, float]
    kv_usage: dict[str, float]
    types: dict[str, str]
    box: dict[str, float]


def scrape(url: str) -> Gauges:
    response = httpx.get(url + "/metrics", timeout=60)
    assert response.status_code == 200, response.text
    by_name: dict[str, dict[str, float]] = {VLLM_WAITING: {}, VLLM_RUNNING: {}, VLLM_KV_USAGE: {}}
    types: dict[str, str] = {}
    box: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        types[family.name] = family.type
        for sample in family.samples:
            if sample.name in by_name:
                assert set(sample.labels) == {VLLM_MODEL_LABEL}, sample
                by_name[sample.name][sample.labels[VLLM_MODEL_LABEL]] = sample.value
            elif sample.name in (GIE_WAITING, GIE_RUNNING, GIE_KV_USAGE):
                box[sample.name] = sample.value
    return Gauges(by_name[VLLM_WAITING], by_name[VLLM_RUNNING], by_name[VLLM_KV_USAGE], types, box)


@dataclass(frozen=True)
class Status:
    """What STATUS says of each model's requests and KV cells."""

    inflight: dict[str, int]
    decoding: dict[str, int]
    device_cells: dict[str, int]  # the KV cells of the agents whose state is in the model's live context
    pool_cells: dict[str, int]


def status(app: Running) -> Status:
    reply = parse_reply(app.line("STATUS"))
    assert reply.error is None and reply.body is not None
    inflight: dict[str, int] = {}
    decoding: dict[str, int] = {}
    device_cells: dict[str, int] = {}
    pool_cells: dict[str, int] = {}
    for line in reply.body.splitlines():
        kind, _, tail = line.partition(" ")
        fields = parse_fields(tail)
        if kind == "model":
            inflight[fields["name"]] = int(fields["inflight"])
            decoding[fields["name"]] = int(fields["decoding"])
        elif kind == "agent" and fields["state"] == "device":
            device_cells[fields["model"]] = device_cells.get(fields["model"], 0) + int(fields["kv_cells"])
        elif kind == "context":
            pool_cells[fields["model"]] = int(fields["pool_cells"])
    return Status(inflight, decoding, device_cells, pool_cells)


def test_the_usage_ratio_is_a_fraction_of_the_cells() -> None:
    assert usage_ratio(0, 0) == 0.0  # no live context
    assert usage_ratio(128, 512) == 0.25
    assert usage_ratio(600, 512) == 1.0  # never above 1


def test_the_vllm_gauges_follow_status_while_requests_wait_and_run(tiny_model: Path, tiny_model_b: Path) -> None:
    models = {"tiny": {"path": str(tiny_model)}, "other": {"path": str(tiny_model_b)}}
    with running(models, model_dirs=[tiny_model.parent, tiny_model_b.parent],
                 engine={"live_slots": LIVE_SLOTS}) as app:
        url = app.appliance.http_url
        idle = scrape(url)
        for name in (VLLM_WAITING, VLLM_RUNNING, VLLM_KV_USAGE):
            assert idle.types[name] == "gauge"
        # every configured model has its series from the start (an endpoint picker always finds them)
        assert idle.waiting == {"tiny": 0, "other": 0} and idle.running == {"tiny": 0, "other": 0}
        assert idle.kv_usage == {"tiny": 0, "other": 0}

        agents = [(f"t{index}", "tiny") for index in range(TINY_AGENTS)] + [("o0", "other")]
        for agent, model in agents:
            assert app.line(f"REGISTER {agent} {model}").startswith("OK")
        app.engine.delay_s = STEP_DELAY_S
        replies: list[str] = []

        def decode(agent: str) -> None:
            replies.append(app.line(f"DECODE {agent} 24 Hello world"))

        threads = [threading.Thread(target=decode, args=(agent,)) for agent, _ in agents]
        seen_full = False
        seen_cells = False
        checked = 0
        try:
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (seen_full and seen_cells and checked >= 5):
                before = status(app)
                gauges = scrape(url)
                after = status(app)
                if before != after:  # STATUS moved during the scrape: the instants differ, try again
                    continue
                checked += 1
                for model in ("tiny", "other"):
                    # waiting + running: the model's requests STATUS counts in flight; running: its decoding ones
                    assert gauges.running[model] == before.decoding[model]
                    assert gauges.waiting[model] + gauges.running[model] == before.inflight[model]
                    assert gauges.running[model] <= LIVE_SLOTS
                    cells = before.pool_cells.get(model, 0)
                    expected = before.device_cells.get(model, 0) / cells if cells else 0.0
                    assert abs(gauges.kv_usage[model] - expected) < 1e-9
                    assert 0 <= gauges.kv_usage[model] <= 1
                # the box's totals are the models' sums
                assert gauges.box[GIE_WAITING] == sum(gauges.waiting.values())
                assert gauges.box[GIE_RUNNING] == sum(gauges.running.values())
                pool = sum(before.pool_cells.values())
                assert abs(gauges.box[GIE_KV_USAGE] - sum(before.device_cells.values()) / pool) < 1e-9
                if gauges.running["tiny"] == LIVE_SLOTS and gauges.waiting["tiny"] >= 1 and \
                        gauges.running["other"] == 1:
                    seen_full = True  # both of tiny's sequences busy, some of its requests waiting
                if gauges.running["tiny"] > 0 and gauges.kv_usage["tiny"] > 0:
                    seen_cells = True  # its running conversations' evaluated tokens fill cells
        finally:
            app.engine.delay_s = 0
            for thread in threads:
                thread.join(120)
        assert seen_full, "never saw tiny's sequences full with requests waiting"
        assert seen_cells and checked >= 5
        assert len(replies) == len(agents) and all(reply.startswith("OK") for reply in replies), replies
        done = scrape(url)
        assert done.waiting == {"tiny": 0, "other": 0} and done.running == {"tiny": 0, "other": 0}
        end = status(app)
        for model in ("tiny", "other"):
            assert abs(done.kv_usage[model] - end.device_cells.get(model, 0) / end.pool_cells[model]) < 1e-9
