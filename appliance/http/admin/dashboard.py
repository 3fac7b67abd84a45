"""The dashboard: the ledger bar, device memory, models, agents, tokens/s and recent requests, and each model's
tuning (pools, plan, threads, load profile); the page polls its ``_dashboard.html`` fragment
(``/admin/_dashboard``) and its ``_tuning.html`` fragment (``/admin/_tuning``) every :data:`POLL_S` seconds. The
agents table shows a page of :data:`paging.ADMIN_AGENTS` (``?offset=``, kept by the poll, with next /
previous links), so the fragment stays small however many agents register."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from appliance.daemon import offload
from appliance.http.admin import figures, render, tail
from appliance.protocol import paging

if TYPE_CHECKING:
    from appliance.app import Appliance
    from appliance.daemon.core import Daemon

POLL_S = 2
RECENT_REQUESTS = 15
KV_PLACES = {"empty": "none yet", "device": "on device", "host": "in host RAM", "disk": "on disk"}
RESTORED = {"none": "\u2014", "device": "device", "host": "host RAM", "disk": "disk", "tokens": "re-evaluated"}
"""Where an agent's last decode found its KV state, as the agents table says it."""


def model_rows(daemon: Daemon) -> list[dict[str, Any]]:
    """Every configured model (and any other the daemon resolved: a GGUF path, a retired one), in config order, with
    where its layers run (:func:`appliance.daemon.offload.record`; None before its first load)."""
    now = daemon.clock()
    rows = []
    names = [spec.name for spec in daemon.config.models]
    names += [name for name in daemon.models if name not in names]
    for name in names:
        model = daemon.models.get(name)
        if model is None:  # configured, never used since start
            spec = daemon.config.model(name)
            assert spec is not None
            rows.append({"name": name, "state": daemon.model_state(name), "estimate": spec.vram_bytes, "measured": None,
                         "refcount": 0, "inflight": 0, "ttl_s": spec.idle_ttl_s, "ttl_left": None, "retired": False,
                         **offload.record(None)})
            continue
        ttl_left = figures.ttl_left(loaded=model.runtime is not None, refcount=model.refcount,
                                    inflight=model.inflight, idle_ttl_s=model.spec.idle_ttl_s,
                                    last_used=model.last_used, now=now)
        rows.append({"name": name, "state": daemon.model_state(name), "estimate": model.estimate,
                     "measured": model.measured,
                     "refcount": model.refcount, "inflight": model.inflight, "ttl_s": model.spec.idle_ttl_s,
                     "ttl_left": ttl_left, "retired": model.retired, **offload.record(model.offload)})
    return rows


def agent_row(daemon: Daemon, agent: dict[str, Any]) -> dict[str, Any]:
    """An agent of the snapshot with where its KV is and its bytes: a parked state's own size; for KV live in
    the model's context, its tokens times the model's KV bytes per token (known after its first swap), marked as
    an estimate."""
    row = {**agent, "where": KV_PLACES.get(agent["state"], agent["state"]), "kv_bytes": None, "kv_estimated": False,
           "restored": RESTORED.get(agent["kv_restored_from"], agent["kv_restored_from"])}
    if agent["state"] == "host":
        row["kv_bytes"] = agent["state_bytes"]
    elif agent["state"] == "device":
        model = daemon.models.get(agent["model"])
        if model is not None and model.kv_bytes_per_token > 0:
            row["kv_bytes"] = agent["tokens"] * model.kv_bytes_per_token
            row["kv_estimated"] = True
    return row


PROFILE_ROWS = (("input_tokens", "Input tokens"), ("output_tokens", "Output tokens"), ("ttft_s", "First token"),
                ("kv_cells_peak", "KV cells (peak)"))
"""The load-profile figures a tuning panel shows (the profile's field, its row's label); ``ttft_s`` is a time."""


def tuning_panels(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """One tuning panel per model with a live context or a load profile (SPEC E7): its live context's record
    (None without one: then no pool, plan or threads), whether it is adaptive, and its profile's rows (label,
    P50, P90, P99; None while the window is empty) with the profile's counts."""
    contexts = {context["model"]: context for context in snapshot["contexts"]}
    profiles = snapshot["profiles"]
    names = list(contexts) + [name for name in profiles if name not in contexts]
    panels = []
    for name in names:
        context = contexts.get(name)
        summary = profiles.get(name)
        rows = []
        if summary is not None:
            for figure, label in PROFILE_ROWS:
                found = summary["percentiles"][figure]
                rows.append({"figure": figure, "label": label, "p50": found["p50"], "p90": found["p90"],
                             "p99": found["p99"]})
        adaptive = context["adaptive"] if context is not None else snapshot["engine"]["adaptive"]
        panels.append({"model": name, "context": context, "adaptive": adaptive, "profile": summary, "rows": rows})
    return panels


def tuning_of(appliance: Appliance) -> dict[str, Any]:
    """What the tuning fragment shows, read from memory."""
    daemon = appliance.daemon
    assert daemon is not None
    snapshot = daemon.snapshot()
    return {"engine": snapshot["engine"], "panels": tuning_panels(snapshot), "poll_s": POLL_S}


def figures_of(appliance: Appliance, offset: int) -> dict[str, Any]:
    """Everything the dashboard fragment shows, read from memory (the agents from ``offset`` on)."""
    daemon = appliance.daemon
    assert daemon is not None
    snapshot = daemon.snapshot()
    ledger = daemon.ledger.snapshot()
    reading = daemon.reading
    page = paging.page_of(snapshot["agents"], offset, paging.ADMIN_AGENTS)
    agents = [agent_row(daemon, agent) for agent in page.items]
    now = time.time()
    return {
        "device": snapshot["device"],
        "memory": figures.memory_names(snapshot["device"]["kind"]),  # "VRAM ledger" or "Ledger" (host RAM)
        "process_used": reading.process_used,
        "ledger": snapshot["ledger"],
        "ledger_free": ledger.free,
        "bar": figures.ledger_bar(reading.total, ledger.cap, ledger.reservations, daemon.external),
        "host_kv": snapshot["host_kv"],
        "models": model_rows(daemon),
        "agents": agents,
        "agents_page": page,
        "counters": snapshot["counters"],
        "tokens_per_second": daemon.requests.tokens_per_second(now),
        "requests": [record.to_dict() for record in daemon.requests.recent(RECENT_REQUESTS)],
        "request_count": len(daemon.requests),
        "poll_s": POLL_S,
        "now": now,
        "state_problems": [problem.to_dict() for problem in appliance.state_files.problems()],
    }


async def root(request: Request) -> Response:
    return RedirectResponse("/admin/", status_code=307)


async def dashboard(request: Request) -> Response:
    render.daemon_of(request)
    appliance = request.app.state.appliance
    offset = paging.parse_offset(request.query_params.get("offset"))
    return render.page(request, "dashboard.html", "dashboard", **figures_of(appliance, offset),
                       tuning=tuning_of(appliance), log=tail.tail_of(appliance.log_tail))


async def dashboard_partial(request: Request) -> Response:
    render.daemon_of(request)
    offset = paging.parse_offset(request.query_params.get("offset"))
    return render.fragment("_dashboard.html", **figures_of(request.app.state.appliance, offset))


async def tuning_partial(request: Request) -> Response:
    render.daemon_of(request)
    return render.fragment("_tuning.html", tuning=tuning_of(request.app.state.appliance))


routes = [
    Route("/", root, methods=["GET"]),
    Route("/admin", root, methods=["GET"]),
    Route("/admin/", dashboard, methods=["GET"]),
    Route("/admin/_dashboard", dashboard_partial, methods=["GET"]),
    Route("/admin/_tuning", tuning_partial, methods=["GET"]),
]
