"""Durable agents: what a restart, an upgrade, a crash or ``kill -9`` must not lose (the agents' store,
:mod:`appliance.daemon.store`, and the disk tier of KV state, :mod:`appliance.daemon.diskkv`).

* **Which agents.** Those without an owning connection: line ``REGISTER``, OpenAI ``user`` agents, stored Responses
  conversations. A MAGN session agent dies with its connection, as before, so it is never stored.
* **Commits.** A registration and every finished decode are committed before the reply (a cancelled or failed decode
  rolled its conversation back: nothing to commit); an unregistration or expiry deletes the record and the agent's
  KV file.
* **KV tiers.** device -> host RAM (``host_kv_budget``) -> disk (``disk_kv_budget``, ``<data_dir>/kv/``) -> tokens.
  Parked state that does not fit host RAM is written to disk instead of dropped (engine thread); a decode of an agent
  whose state is on disk reads it back first (checked: a file that does not match is discarded and the tokens
  re-evaluated). Every result says where its state came from (:data:`RestoredFrom`).
* **Graceful stop.** Every live context is parked and every durable agent's state written to disk, within what is
  left of ``shutdown_grace_s``; then every record is committed once more.
* **Start-up** brings the agents back lazily (:meth:`Durable.restore`): registered, holding no model (*dormant*)
  until their first decode loads it; ``agent_idle_ttl_s`` counts from their last use before the restart. An agent
  whose model left the config is forgotten (logged). One whose model file changed keeps its tokens when the
  vocabulary is the same (re-evaluated: its KV file no longer matches) and is reset with the one-time notice when
  it is not, as a hot reload does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

from appliance.daemon.base import DaemonBase, log
from appliance.daemon.diskkv import DiskTier
from appliance.daemon.kvfiles import Validity
from appliance.daemon.model import Agent, Model, forget_parked
from appliance.daemon.store import (
    AgentRecord,
    DeleteAgent,
    DeleteResponse,
    PutAgent,
    PutResponse,
    ResponseRecord,
    StoreWriter,
    Write,
    file_identity_text,
)
from appliance.engine import flash
from appliance.engine.interface import Conversation
from appliance.errors import ApplianceError

RestoredFrom = Literal["none", "device", "host", "disk", "tokens"]
"""Where a decode found its agent's KV state: still in its sequence (``device``), copied back from host RAM
(``host``) or from its KV file (``disk``), or nowhere, its tokens re-evaluated (``tokens``); ``none``: there was no
conversation before it (a new agent, a stateless request)."""
RESTORED_FROM: tuple[RestoredFrom, ...] = ("none", "device", "host", "disk", "tokens")
CLIENT_OWNER = "client"
"""A stored agent's ``owner``: a client keeps it (and its model) until it unregisters or expires."""
HTTP_OWNER = "http"
"""A stored agent's ``owner``: an HTTP agent, dormant once its model's idle TTL runs out (:mod:`appliance.daemon.
dormancy`)."""


def durable(agent: Agent) -> bool:
    """An agent that outlives its connection (the store keeps it)."""
    return agent.owner is None


class Durable(DaemonBase):
    """The durable-agents part of a :class:`~appliance.daemon.core.Daemon` (module docstring)."""

    store: StoreWriter | None
    disk: DiskTier | None
    wall: Callable[[], float]
    stored_responses: dict[str, ResponseRecord]

    def attach_durability(self, store: StoreWriter | None, disk: DiskTier | None) -> None:
        self.store = store
        self.disk = disk

    # -- records -------------------------------------------------------------------------------------------
    def wall_time(self, monotonic: float) -> float:
        """The wall-clock time of a :attr:`clock` reading."""
        return self.wall() - (self.clock() - monotonic)

    def record_of(self, agent: Agent) -> AgentRecord:
        model = agent.model
        conv = agent.conversation
        model_file = agent.model_file if agent.dormant or model.file is None else file_identity_text(model.file)
        vocabulary = agent.vocabulary if agent.dormant or not model.vocabulary else model.vocabulary
        disk = self.disk
        on_disk = disk is not None and disk.holds(agent.id)
        kv = "disk" if on_disk and conv.where != "device" else conv.where
        owner = HTTP_OWNER if agent.releases_model else CLIENT_OWNER
        return AgentRecord(agent.id, model.key, model_file, vocabulary, owner, agent.created,
                           self.wall_time(agent.last_used), tuple(conv.tokens), kv,
                           f"kv/{agent.id}.kv" if on_disk else None)

    async def commit_agent(self, agent: Agent) -> bool:
        """Commit ``agent`` as it is now (a no-op for a connection's agent or without a store); False when the store
        cannot be written now (it retries; the caller goes on)."""
        if self.store is None or not durable(agent):
            return True
        return await self.store.commit([PutAgent(self.record_of(agent))])

    async def forget_agent(self, agent: Agent) -> None:
        """Delete ``agent``'s record and its KV file (it was unregistered or expired)."""
        if self.disk is not None:
            await self.engine.call(self.disk.discard, agent.id, None)
        if self.store is not None and durable(agent):
            await self.store.commit([DeleteAgent(agent.id)])

    async def store_response(self, ident: str, agent: Agent, document: str, messages: str) -> None:
        """Keep a stored Responses response (its document and messages as JSON) with its agent's record."""
        if self.store is None:
            return
        record = ResponseRecord(ident, agent.id, self.wall(), document, messages)
        self.stored_responses[ident] = record
        await self.store.commit([PutAgent(self.record_of(agent)), PutResponse(record)])

    async def drop_response(self, ident: str) -> None:
        self.stored_responses.pop(ident, None)
        if self.store is not None:
            await self.store.commit([DeleteResponse(ident)])

    # -- start-up --------------------------------------------------------------------------------------------
    def restore(self, records: Iterable[AgentRecord], responses: Iterable[ResponseRecord] = ()) -> int:
        """Bring back the stored agents, dormant (module docstring); returns how many came back."""
        kept: list[Agent] = []
        gone: list[Write] = []
        ordered = sorted(records, key=_recency, reverse=True)
        for record in ordered:
            if len(kept) >= self.config.max_agents:
                log.warning("agent %s not restored: max_agents (%d) agents were used more recently", record.id,
                            self.config.max_agents)
                gone.append(DeleteAgent(record.id))
                continue
            try:
                model = self.resolve(record.model)
            except ApplianceError as exc:
                log.warning("agent %s not restored: its model %s is gone (%s)", record.id, record.model, exc.message)
                gone.append(DeleteAgent(record.id))
                continue
            conv = Conversation(tokens=list(record.tokens))
            if self.disk is not None and self.disk.holds(record.id):
                conv.where = "disk"
            idle_s = max(0.0, self.wall() - record.last_used)
            agent = Agent(record.id, model, conv, last_used=self.clock() - idle_s, created=record.created,
                          dormant=True, model_file=record.model_file, vocabulary=record.vocabulary,
                          releases_model=record.owner == HTTP_OWNER)
            self.agents[agent.id] = agent
            kept.append(agent)
        if self.disk is not None:
            last_used = {agent.id: agent.last_used for agent in kept}
            orphans = self.disk.adopt(last_used, last_used)
            if orphans:
                log.info("disk KV: %d file(s) of agents that are not restored deleted", len(orphans))
        self.stored_responses = {}
        for response in responses:
            if response.agent in self.agents:
                self.stored_responses[response.id] = response
            else:
                gone.append(DeleteResponse(response.id))
        if gone and self.store is not None:
            self.store.queue(gone)
        if kept:
            on_disk = sum(agent.conversation.where == "disk" for agent in kept)
            log.info("%d agent(s) restored from the store (%d with their KV state on disk); each loads its model at "
                     "its first decode", len(kept), on_disk)
        return len(kept)

    async def rouse(self, agent: Agent) -> None:
        """A dormant agent's first decode (its lock held): load its model, then check that its tokens still mean
        what they meant (module docstring)."""
        model = agent.model
        model.refcount += 1
        try:
            await self.acquire(model)
        except BaseException:
            model.refcount -= 1
            raise
        agent.dormant = False
        if model.file is None or agent.model_file == file_identity_text(model.file):
            return
        if agent.vocabulary and model.vocabulary and agent.vocabulary != model.vocabulary:
            agent.conversation.tokens.clear()
            agent.notice = f"conversation reset: model {model.key} was replaced with a different vocabulary"
            log.info("agent %s: model %s's file changed with another vocabulary: conversation reset", agent.id,
                     model.key)
        else:
            log.info("agent %s: model %s's file changed: its tokens are re-evaluated", agent.id, model.key)
        if agent.conversation.where == "disk":
            forget_parked(agent.conversation)
            if self.disk is not None:
                await self.engine.call(self.disk.discard, agent.id, "the model file changed")

    # -- the disk tier (engine thread) -----------------------------------------------------------------------
    def validity(self, model: Model, v_transposed: bool | None = None) -> Validity:
        """What a KV file of ``model`` must be made for to be loaded now: its V layout is the loaded runtime's (a
        live change of ``engine.flash_attention`` applies to models loaded after it), or ``v_transposed``'s (the
        layout a parked state was saved in)."""
        identity = "" if model.file is None else file_identity_text(model.file)
        if v_transposed is None and model.runtime is not None:
            v_transposed = model.runtime.v_transposed
        if v_transposed is None:  # no model loaded: the configured setting is the layout it will load with
            v_transposed = flash.v_transposed(flash.mode_of(self.config.engine.flash_attention))
        return Validity(identity, model.spec.n_ctx, model.spec.cache_type, not v_transposed)

    def spill(self, agent: Agent) -> bool:
        """Write ``agent``'s parked state to disk and free its host buffer; False when there is no disk tier or the
        write did not happen (the caller drops the state). Engine thread."""
        disk = self.disk
        conv = agent.conversation
        if disk is None or disk.budget <= 0 or conv.buffer is None or conv.n_evaluated < 1:
            return False
        tokens = conv.tokens[:conv.n_evaluated]
        if len(tokens) < conv.n_evaluated:
            return False
        state = memoryview(conv.buffer)[:conv.nbytes]
        written, evicted = disk.write(agent.id, self.validity(agent.model, conv.v_transposed), tokens, state,
                                      self.wall_time(agent.last_used))  # tagged with the layout it was saved in
        state.release()
        for key in evicted:
            other = self.agents.get(key)
            if other is not None and other.conversation.where == "disk":
                forget_parked(other.conversation)
        if not written:
            return False
        conv.buffer = None
        conv.nbytes = 0
        conv.where = "disk"
        self.counters["disk_kv_spills"] += 1
        return True

    def unspill(self, agent: Agent) -> bool:
        """Read ``agent``'s state back from disk into host RAM (its decode restores it from there); False when the
        file is missing or fails its checks (discarded: its tokens are re-evaluated). Engine thread."""
        conv = agent.conversation
        disk = self.disk
        validity = self.validity(agent.model)
        got = None if disk is None else disk.read(agent.id, validity, conv.tokens)
        if got is None:
            forget_parked(conv)
            return False
        state, n_tokens = got
        conv.buffer = state
        conv.nbytes = len(state)
        conv.n_evaluated = n_tokens
        conv.v_transposed = not validity.flash_attention
        conv.where = "host"
        return True

    # -- graceful stop ---------------------------------------------------------------------------------------
    async def write_out(self, deadline: float) -> None:
        """Park every live context and write every durable agent's KV state to disk until ``deadline``
        (``time.monotonic()``), then commit every durable agent once more."""
        started = time.monotonic()
        written = 0
        if self.disk is not None and self.disk.budget > 0:
            for model in [m for m in self.models.values() if m.runtime is not None and m.context_claimed]:
                if time.monotonic() >= deadline:
                    break
                with contextlib.suppress(Exception):
                    await self._free_context(model)
            for agent in sorted(self.agents.values(), key=_last_use, reverse=True):
                if time.monotonic() >= deadline:
                    log.warning("stop: the grace ran out before every agent's KV state was written: the rest "
                                "re-evaluate their tokens after the restart")
                    break
                if not durable(agent) or agent.conversation.where != "host":
                    continue
                if await self.engine.call(self.spill, agent):
                    written += 1
        if self.store is not None:
            records = [PutAgent(self.record_of(agent)) for agent in self.agents.values() if durable(agent)]
            if records:
                await self.store.commit(records)
        if written:
            log.info("stop: %d agent(s)' KV state written to disk in %.2f s", written, time.monotonic() - started)

    def durability(self) -> dict[str, Any]:
        """The store's and the disk tier's reports (STATUS, health)."""
        report: dict[str, Any] = {}
        if self.store is not None:
            report["store"] = self.store.report()
        if self.disk is not None:
            report["disk_kv"] = self.disk.report()
        return report


def _recency(record: AgentRecord) -> float:
    return record.last_used


def _last_use(agent: Agent) -> float:
    return agent.last_used


async def _noop() -> None:
    await asyncio.sleep(0)
