"""The live-context budget (SPEC L8): the Daemon's part that claims, frees and rebuilds each model's live context.

``engine.live_contexts`` bounds how many exist at once (``auto``: as many as the ledger fits). A model that needs
its context back while the budget is spent frees the least recently used idle context of another model (its agents
parked in host RAM; its weights stay loaded); with only busy ones in the way it waits for one to go idle; a context
that cannot fit even with every other one freed is ``VRAM_LEDGER_DENY``.
"""

from __future__ import annotations

import asyncio

from appliance.daemon.base import DaemonBase, log
from appliance.daemon.model import Model, context_key, next_key
from appliance.engine.interface import Conversation
from appliance.errors import ApplianceError


class LiveContexts(DaemonBase):
    """The live-context budget of a :class:`~appliance.daemon.core.Daemon` (module docstring)."""

    def live_contexts(self) -> list[Model]:
        """The models whose live context is admitted (built, or being built with the model's load)."""
        return [m for m in self.models.values() if m.context_claimed]

    async def _claim_context(self, model: Model, *, extra: int = 0) -> list[Conversation]:
        """Reserve ``model``'s live context in the ledger (with ``extra`` bytes free beside it), within
        ``engine.live_contexts``: the least recently used idle context of another model is freed (its agents
        parked in host RAM) until it fits; while only busy ones stand in the way, wait for one to go idle. A
        context that cannot fit even with every other one freed is ``VRAM_LEDGER_DENY``. Returns the
        conversations parked on the way."""
        parked: list[Conversation] = []
        async with self._context_lock:
            while True:
                others = [m for m in self.live_contexts() if m is not model]
                limit = self.config.engine.live_contexts
                counted = limit is None or len(others) < limit
                if counted and self.ledger.free >= model.context_bytes + extra:
                    if model.context_bytes:
                        self.ledger.try_reserve(context_key(model.key), model.context_bytes)
                    model.context_claimed = True
                    return parked
                reclaimable = sum(m.context_bytes for m in others)
                if self.ledger.free + reclaimable < model.context_bytes + extra:  # even with every other freed
                    self.ledger.try_reserve(context_key(model.key), model.context_bytes + extra)  # the denial
                idle = [m for m in others if m.active == 0 and m.runtime is not None]
                if idle:
                    victim = min(idle, key=self._context_age)
                    parked.extend(await self._free_context(victim))
                    continue
                if not others:
                    raise ApplianceError("INTERNAL", "no live context to wait for")
                waiter = asyncio.get_running_loop().create_future()
                self.context_waiters.append(waiter)
                self._context_lock.release()
                try:
                    await waiter
                finally:
                    await self._context_lock.acquire()

    def _context_age(self, model: Model) -> float:
        return model.context_used

    async def _free_context(self, model: Model) -> list[Conversation]:
        """Park ``model``'s live conversations and free its context (its weights stay); releases its ledger key."""
        runtime = model.runtime
        if runtime is None:
            return []
        parked = await self.engine.call(runtime.close_context)  # a context prepared beside it goes too
        self.ledger.release(context_key(model.key))
        self.ledger.release(next_key(model.key))
        model.context_claimed = False
        log.info("model %s: live context freed (%d conversations parked in host RAM)", model.key, len(parked))
        return parked

    async def _open_context(self, model: Model) -> list[Conversation]:
        """Make sure ``model`` (loaded, ``active``) has its live context; returns what was parked to make room."""
        runtime = model.runtime
        if runtime is None:
            raise ApplianceError("INTERNAL", f"model {model.key!r} is not loaded")
        model.context_used = self.clock()
        if runtime.has_context:
            return []
        parked = await self._claim_context(model)
        try:
            await self.engine.call(runtime.open_context)
        except BaseException:
            self.ledger.release(context_key(model.key))
            model.context_claimed = False
            raise
        log.info("model %s: live context built", model.key)
        return parked

    def _context_idle(self) -> None:
        """A model's last active request ended: wake whoever waits for a context to go idle."""
        waiters, self.context_waiters = self.context_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
