"""The registry page: register / unregister agents, load / unload models. Each form POSTs through htmx (the CSRF
header comes from the layout) and shows its result, or the structured error, in its own result area. The agents
table shows a page of :data:`paging.ADMIN_AGENTS` (``?offset=``, next / previous links), and each model
names at most :data:`paging.HOLDERS_SHOWN` of its agents: the page stays small however many register."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.config import schema
from appliance.daemon import policy
from appliance.errors import ApplianceError
from appliance.http.admin import pickers, render
from appliance.protocol import paging
from appliance.protocol.identifiers import AGENT_ID_RULE, MAX_AGENT_ID_CHARS, agent_id_problem

if TYPE_CHECKING:
    from appliance.daemon.core import Daemon
    from appliance.daemon.model import Model

N_CTX = schema.BY_KEY["models[].n_ctx"]
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
    return {"models": models, "agents": agents, "agents_page": page}


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
    files = await asyncio.to_thread(pickers.unconfigured_files, daemon.config)
    groups = pickers.model_groups(daemon.config, known=daemon.models, files=files)
    adding = {"can": request.app.state.appliance.config_path is not None, "files": pickers.file_groups(files),
              "n_ctx": N_CTX.default, "n_ctx_min": N_CTX.minimum, "n_ctx_max": N_CTX.maximum,
              "model_dirs": [str(folder) for folder in daemon.config.model_dirs]}
    return render.page(request, "registry.html", "registry", model_groups=groups, adding=adding,
                       **listing(daemon, offset))


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
        message = await unregister_agent(daemon, agent_field(fields))
    except ApplianceError as error:
        return render.result("Unregister failed.", error)
    return render.result(message)


async def load(request: Request) -> Response:
    try:
        daemon = render.daemon_of(request)
        fields = await render.form_fields(request)
        message = await load_model(daemon, render.required(fields, "model", max_chars=MAX_MODEL_CHARS))
    except ApplianceError as error:
        return render.result("Load failed.", error)
    return render.result(message)


async def unload(request: Request) -> Response:
    try:
        daemon = render.daemon_of(request)
        fields = await render.form_fields(request)
        message = await unload_model(daemon, render.required(fields, "model", max_chars=MAX_MODEL_CHARS))
    except ApplianceError as error:
        return render.result("Unload failed.", error)
    return render.result(message)


async def unregister_agent(daemon: Daemon, agent_id: str) -> str:
    """Unregister ``agent_id`` (its model unloads with its last agent); what the page says."""
    await daemon.unregister(agent_id, reason="admin page")
    return f"Agent {agent_id} unregistered."


async def load_model(daemon: Daemon, ref: str) -> str:
    """Load the model ``ref`` (a name, an alias or a GGUF path) without an agent: the daemon's ``acquire``, as a
    request's first use of it would; the idle sweep unloads it after its TTL. What the page says."""
    if daemon.closing:
        raise ApplianceError("SHUTTING_DOWN")
    model = daemon.resolve(ref)
    was_loaded = model.runtime is not None
    await daemon.acquire(model)
    if was_loaded:
        return f"Model {model.key} was already loaded."
    return (f"Model {model.key} loaded ({model.estimate} bytes reserved); with no agent on it, the idle sweep "
            f"unloads it after {model.spec.idle_ttl_s:g} s.")


async def unload_model(daemon: Daemon, ref: str) -> str:
    """Unload the model ``ref`` unless it is held (:func:`unload_unheld`); what the page says."""
    if not await unload_unheld(daemon, ref):
        return f"Model {ref} was not loaded."
    return f"Model {ref} unloaded."


routes = [
    Route("/admin/registry", registry, methods=["GET"]),
    Route("/admin/registry/_tables", registry_partial, methods=["GET"]),
    Route("/admin/registry/register", register, methods=["POST"]),
    Route("/admin/registry/unregister", unregister, methods=["POST"]),
    Route("/admin/registry/load", load, methods=["POST"]),
    Route("/admin/registry/unload", unload, methods=["POST"]),
]
