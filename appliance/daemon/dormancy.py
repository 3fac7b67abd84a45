"""Idle HTTP agents let their model go: the Daemon's part that puts them to sleep.

An agent an HTTP request registered (an OpenAI ``user``, an Anthropic ``metadata.user_id``, an ``X-Agent-Id`` seen
first over HTTP, a stored Responses conversation) stands for a client that may never come back, so it holds its
model only while it is used: once the model has been idle for its own ``idle_ttl_s`` and every agent holding it is
such an agent, none busy (:func:`~appliance.daemon.policy.dozing`), the agents go *dormant*, as the agents a restart
brings back are: their KV state is parked and written to disk (the disk tier; without one it is dropped and their
tokens are evaluated again), they give their model back, and the model unloads. They stay registered, in the
agents' store too, until ``agent_idle_ttl_s``; the next decode of one loads the model again and restores its state
from disk (``kv_restored_from=disk``), exactly where its conversation stopped
(:meth:`~appliance.daemon.durable.Durable.rouse`).

Agents of the line protocol's ``REGISTER`` and MAGN sessions keep their model loaded, as before: a client that
registers holds the model until it unregisters (or ``agent_idle_ttl_s`` expires it).
"""

from __future__ import annotations

import contextlib

from appliance.daemon import policy
from appliance.daemon.base import DaemonBase, log
from appliance.daemon.model import Agent, Model, forget_parked
from appliance.daemon.store import file_identity_text


class Dormancy(DaemonBase):
    """The idle release of HTTP agents of a :class:`~appliance.daemon.core.Daemon` (module docstring)."""

    async def release_idle(self) -> list[str]:
        """Put to sleep the agents of every model :func:`~appliance.daemon.policy.dozing` names, and unload the
        model; returns the models unloaded."""
        plan = policy.dozing([m.view() for m in self.models.values()],
                             [a.holder_view() for a in self.agents.values()], self.clock())
        unloaded = []
        for key, ids in plan.items():
            model = self.models.get(key)
            if model is not None and await self._release(model, ids):
                unloaded.append(key)
        return unloaded

    async def _release(self, model: Model, ids: list[str]) -> bool:
        agents = [self.agents[agent_id] for agent_id in ids if agent_id in self.agents]
        if len(agents) != len(ids) or any(agent.lock.locked() for agent in agents):
            return False  # one left or is busy now: the next sweep decides again
        async with contextlib.AsyncExitStack() as held:
            for agent in agents:
                await held.enter_async_context(agent.lock)  # free: taken at once, so nothing ran in between
            views = [policy.HolderView(a.id, model.key, a.dormant, a.releases_model, False) for a in agents]  # ours
            still = policy.dozing([model.view()], [*views, *(a.holder_view() for a in self.agents.values()
                                                             if a.model is model and a not in agents)], self.clock())
            if still.get(model.key) != sorted(ids):
                return False
            async with self._context_lock:  # as the live-context budget frees one: never two at once
                await self._free_context(model)  # its conversations parked in host RAM
            on_disk = 0
            for agent in agents:
                if await self.engine.call(self._lay_down, agent):
                    on_disk += 1
                agent.model_file = "" if model.file is None else file_identity_text(model.file)
                agent.vocabulary = model.vocabulary
                agent.dormant = True
                model.refcount -= 1
                await self.commit_agent(agent)
            idle_s = self.clock() - model.last_used
            log.info("model %s idle for %.1f s (idle_ttl_s %g s): its %d HTTP agent(s) went dormant (%d with their KV "
                     "state on disk)", model.key, idle_s, model.spec.idle_ttl_s, len(agents), on_disk)
            return await self.unload(model, policy.unload_on_release, reason="idle TTL; its agents are dormant")

    def _lay_down(self, agent: Agent) -> bool:
        """Write ``agent``'s parked state to disk (True), else drop it: its tokens are evaluated again at its next
        decode. Engine thread."""
        conv = agent.conversation
        if conv.where != "host":
            return conv.where == "disk"
        if self.spill(agent):
            return True
        forget_parked(conv)
        return False
