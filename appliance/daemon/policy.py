"""Pure admission and lifetime decisions: no IO, no clocks, no llama.cpp (llama-swap style)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePath


@dataclass(frozen=True)
class ModelView:
    """What the policies need to know about one model."""

    key: str
    loaded: bool
    refcount: int
    inflight: int
    last_used: float
    idle_ttl_s: float
    retired: bool = False  # removed from the config (hot reload): it goes as soon as nothing uses it


def expired(models: Iterable[ModelView], now: float) -> list[str]:
    """Models to unload: loaded, no agents, nothing running, and idle for their TTL (L7; a TTL of 0 = never)."""
    return [m.key for m in models if m.loaded and m.refcount == 0 and m.inflight == 0
            and m.idle_ttl_s > 0 and now - m.last_used >= m.idle_ttl_s]


@dataclass(frozen=True)
class AgentView:
    """What the agent idle TTL needs to know about one agent."""

    id: str
    last_used: float  # when it last registered or decoded
    busy: bool  # a command on it runs or waits now


def idle_agents(agents: Iterable[AgentView], now: float, ttl_s: float) -> list[str]:
    """Agents to unregister (L11): idle, nothing running on them, for ``ttl_s`` (0 = never)."""
    if ttl_s <= 0:
        return []
    return [a.id for a in agents if not a.busy and now - a.last_used >= ttl_s]


@dataclass(frozen=True)
class HolderView:
    """What the idle release needs to know about one agent: its model, whether it holds it (not dormant), whether
    it lets it go once idle (an HTTP agent) and whether a command on it runs or waits now."""

    id: str
    model: str
    dormant: bool
    releases_model: bool
    busy: bool


def dozing(models: Iterable[ModelView], holders: Iterable[HolderView], now: float) -> dict[str, list[str]]:
    """Models to unload although agents hold them: loaded, not retired, nothing in flight, idle for their TTL (0 =
    never), and held only by agents that let their model go once idle, none busy. ``{model: the agents that go
    dormant first}``; a model some other holder keeps (a line-protocol agent, a registration in progress) is not
    one."""
    holding: dict[str, list[HolderView]] = {}
    for holder in holders:
        if not holder.dormant:
            holding.setdefault(holder.model, []).append(holder)
    found: dict[str, list[str]] = {}
    for m in models:
        agents = holding.get(m.key, [])
        if (m.loaded and not m.retired and m.inflight == 0 and m.idle_ttl_s > 0 and now - m.last_used >= m.idle_ttl_s
                and agents and len(agents) == m.refcount
                and all(a.releases_model and not a.busy for a in agents)):
            found[m.key] = sorted(a.id for a in agents)
    return found


SWEEP_MIN_PERIOD_S = 0.05
SWEEP_MAX_PERIOD_S = 5.0


def sweep_period(ttls_s: Iterable[float]) -> float:
    """Seconds between idle sweeps: a quarter of the shortest TTL that is on (model ``idle_ttl_s`` and
    ``agent_idle_ttl_s`` alike; 0 = off), within [0.05, 5] s."""
    quarters = [ttl / 4 for ttl in ttls_s if ttl > 0]
    return max(SWEEP_MIN_PERIOD_S, min(quarters + [SWEEP_MAX_PERIOD_S]))


def unload_on_release(model: ModelView) -> bool:
    """L4: the last UNREGISTER frees the model at once, unless an anonymous request is still running."""
    return model.loaded and model.refcount == 0 and model.inflight == 0


def unload_retired(model: ModelView) -> bool:
    """A retired model (removed from the config) unloads as soon as it has no agent and nothing in flight."""
    return model.retired and model.refcount == 0 and model.inflight == 0


def inside(path: PurePath, folders: Iterable[PurePath]) -> bool:
    """True when ``path`` (already resolved, symlinks followed) lies inside one of ``folders`` (resolved)."""
    return any(path == folder or folder in path.parents for folder in folders)


def unloads_in(model: ModelView, now: float) -> float | None:
    """Seconds (to a tenth) until the idle sweep unloads ``model``: its idle TTL counting down since its last use (0
    for a retired one, unloaded at the next sweep). None while nothing counts down: it is not loaded, an agent holds
    it (it goes when the last one leaves), a request runs on it, or its TTL is 0 (never)."""
    if not model.loaded or model.refcount > 0 or model.inflight > 0:
        return None
    if model.retired:
        return 0.0
    if model.idle_ttl_s <= 0:
        return None
    return round(max(0.0, model.idle_ttl_s - (now - model.last_used)), 1)
