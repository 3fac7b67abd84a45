"""The registry page: register / unregister agents, load / unload models. Each form POSTs through htmx (the CSRF
header comes from the layout) and shows its result, or the structured error, in its own result area. The agents
table shows a page of :data:`paging.ADMIN_AGENTS` (``?offset=``, next / previous links), and each model
names at most :data:`paging.HOLDERS_SHOWN` of its agents: the page stays small however many register."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.daemon import policy
from appliance.errors import ApplianceError
from appliance.http.admin import render
from appliance.protocol import paging
from appliance.protocol.identifiers import AGENT_ID_RULE, MAX_AGENT_ID_CHARS, agent_id_problem

if TYPE_CHECKING:
    from appliance.daemon.core import Daemon
    from appliance.daemon.model import Model

MAX_MODEL_CHARS = 1024
"""A model name, or a GGUF path inside the model directories."""


def listing(daemon: Daemon, offset: int) -> dict[str, Any]:
    """The tables beside the forms: a page of agents from ``offset`` on, and every model with its state and (some
    of) its holders."""
    holders: dict[str, list[str]] = {}
    for agent in daemon.agents.values():
        holders.setdefault(agent.model.key, []).append(agent.id)
    names = [spec.name for spec in daemon.config.models]
    names += [name for name in daemon.models if name not in names]
    models = []
    for name in names:
        held = holders.get(name, [])
        models.append({"name": name, "state": daemon.model_state(name), "agents": held[:paging.HOLDERS_SHOWN],
                       "more_agents": max(0, len(held) - paging.HOLDERS_SHOWN)})
    page = paging.page_of(list(daemon.agents.values()), offset, paging.ADMIN_AGENTS)
    agents = [{"id": agent.id, "model": agent.model.key} for agent in page.items]
    return {"models": models, "agents": agents, "agents_page": page,
            "model_names": [spec.name for spec in daemon.config.models]}


def agent_field(fields: dict[str, str]) -> str:
    """The form's agent id, by the agents' one rule (protocol.identifiers)."""
    agent_id = render.required(fields, "agent", max_chars=MAX_AGENT_ID_CHARS)
    problem = agent_id_problem(agent_id)
    if problem is not None:
        raise ApplianceError("BAD_REQUEST", f"agent id {problem}",
                             {"field": "agent", "rule": AGENT_ID_RULE, "max_agent_chars": MAX_AGENT_ID_CHARS})
    return agent_id


def busy(daemon: Daemon, model: Model) -> ApplianceError:
    agents = sorted(agent.id for agent in daemon.agents.values() if agent.model is model)
    return ApplianceError("MODEL_BUSY", f"model {model.key!r} is in use: unregister its agents first",
                          {"model": model.key, "agents": agents, "refcount": model.refcount,
                           "inflight": model.inflight})


async def unload_unheld(daemon: Daemon, name: str) -> bool:
    """Unload the model ``name`` unless an agent or a request holds it (then MODEL_BUSY, with who holds it), the
    check made again under the model's lock; False when it was not loaded."""
    model = daemon.resolve(name)
    if model.refcount > 0 or model.inflight > 0:
        raise busy(daemon, model)
    unloaded = await daemon.unload(model, policy.unload_on_release, reason="admin page")
    if not unloaded and (model.refcount > 0 or model.inflight > 0):
        raise busy(daemon, model)  # an agent registered on it meanwhile
    return unloaded


async def registry(request: Request) -> Response:
    daemon = render.daemon_of(request)
    offset = paging.parse_offset(request.query_params.get("offset"))
    return render.page(request, "registry.html", "registry", **listing(daemon, offset))


async def registry_partial(request: Request) -> Response:
    daemon = render.daemon_of(request)
    offset = paging.parse_offset(request.query_params.get("offset"))
    return render.fragment("_registry.html", **listing(daemon, offset))


async def register(request: Request) -> Response:
    try:
        daemon = render.daemon_of(request)
        fields = await render.form_fields(request)
        agent_id = agent_field(fields)
        ref = render.required(fields, "model", max_chars=MAX_MODEL_CHARS)
        agent = await daemon.register(agent_id, ref)
    except ApplianceError as error:
        return render.result("Register failed.", error)
    return render.result(f"Agent {agent.id} registered on model {agent.model.key}.")


async def unregister(request: Request) -> Response:
    try:
        daemon = render.daemon_of(request)
        fields = await render.form_fields(request)
        agent_id = agent_field(fields)
        await daemon.unregister(agent_id, reason="admin page")
    except ApplianceError as error:
        return render.result("Unregister failed.", error)
    return render.result(f"Agent {agent_id} unregistered.")


async def load(request: Request) -> Response:
    try:
        daemon = render.daemon_of(request)
        fields = await render.form_fields(request)
        if daemon.closing:
            raise ApplianceError("SHUTTING_DOWN")
        model = daemon.resolve(render.required(fields, "model", max_chars=MAX_MODEL_CHARS))
        was_loaded = model.runtime is not None
        await daemon.acquire(model)
    except ApplianceError as error:
        return render.result("Load failed.", error)
    if was_loaded:
        return render.result(f"Model {model.key} was already loaded.")
    return render.result(f"Model {model.key} loaded ({model.estimate} bytes reserved); with no agent on it, the "
                         f"idle sweep unloads it after {model.spec.idle_ttl_s:g} s.")


async def unload(request: Request) -> Response:
    try:
        daemon = render.daemon_of(request)
        fields = await render.form_fields(request)
        name = render.required(fields, "model", max_chars=MAX_MODEL_CHARS)
        unloaded = await unload_unheld(daemon, name)
    except ApplianceError as error:
        return render.result("Unload failed.", error)
    if not unloaded:
        return render.result(f"Model {name} was not loaded.")
    return render.result(f"Model {name} unloaded.")


routes = [
    Route("/admin/registry", registry, methods=["GET"]),
    Route("/admin/registry/_tables", registry_partial, methods=["GET"]),
    Route("/admin/registry/register", register, methods=["POST"]),
    Route("/admin/registry/unregister", unregister, methods=["POST"]),
    Route("/admin/registry/load", load, methods=["POST"]),
    Route("/admin/registry/unload", unload, methods=["POST"]),
]
