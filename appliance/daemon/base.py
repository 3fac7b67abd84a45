"""What the parts of the :class:`~appliance.daemon.core.Daemon` share: the state they read and write (set by
``Daemon.__init__``, which says what each is), the calls one part makes on another, and their helpers.

The daemon is one class composed of parts, one module each: models and agents (:mod:`appliance.daemon.core`, the
``Daemon`` itself), requests and the step loop (:mod:`appliance.daemon.requests`), the live-context budget
(:mod:`appliance.daemon.contexts`), hot reload and retirement (:mod:`appliance.daemon.reload`), durable agents
(:mod:`appliance.daemon.durable`), the idle release of HTTP agents (:mod:`appliance.daemon.dormancy`). Each part is a
:class:`DaemonBase`; core imports the parts, never the reverse. They all log as ``appliance.daemon.core``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from appliance.errors import ApplianceError

if TYPE_CHECKING:
    from appliance.config.validate import Config, ModelConfig
    from appliance.daemon import policy
    from appliance.daemon.adaptive import AdaptiveLoop
    from appliance.daemon.devices import DeviceReading, MemoryDevice
    from appliance.daemon.ledger import Ledger
    from appliance.daemon.model import Agent, Model
    from appliance.engine.interface import Conversation, EngineProtocol, RuntimeProtocol

log = logging.getLogger("appliance.daemon.core")


def log_load_failure(name: str, error: ApplianceError) -> None:
    """One WARNING line for a model that was not loaded: a ledger denial with its figures, or the failure."""
    if error.code == "VRAM_LEDGER_DENY":
        details = error.details or {}
        log.warning("model %s denied by the VRAM ledger: needs %s bytes, %s of %s bytes allocated", name,
                    details.get("requested_table_bytes"), details.get("ledger_allocated_bytes"),
                    details.get("ledger_max_bytes"))
    else:
        log.warning("model %s not loaded: %s %s", name, error.code, error.message)


async def finish(job: asyncio.Future[Any]) -> Any:
    """Await an engine ``job`` to its end: a caller cancelled meanwhile still waits for it, then is cancelled
    (so that what the job made, a runtime, can be cleaned up)."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await job
        raise


class DaemonBase:
    """The daemon's state as its parts see it, and the methods one part calls on another (defined by
    :class:`~appliance.daemon.core.Daemon` or another part; declared here for type checkers only)."""

    config: Config
    device: MemoryDevice
    engine: EngineProtocol
    clock: Callable[[], float]
    models: dict[str, Model]
    agents: dict[str, Agent]
    reading: DeviceReading
    external: int
    ledger: Ledger
    counters: dict[str, int]
    kv_swap_seconds: float
    decoding: int
    physical_memory: int
    closing: bool
    grace_over: bool
    accepted: int
    adaptive: AdaptiveLoop
    context_waiters: list[asyncio.Future[None]]
    _running: set[threading.Event]
    _tasks: set[asyncio.Task[Any]]
    _context_lock: asyncio.Lock

    if TYPE_CHECKING:
        # models and agents (core.py)
        def _changed(self) -> None: ...

        def resolve(self, ref: str) -> Model: ...

        async def acquire(self, model: Model) -> None: ...

        def tuned_parts(self, model: Model, spec: ModelConfig) -> tuple[int, int]: ...

        def _engine_load(self, model: Model, spec: ModelConfig) -> RuntimeProtocol: ...

        async def unload(self, model: Model, still: Callable[[policy.ModelView], bool] | None = None,
                         reason: str = "requested") -> bool: ...

        def agent(self, agent_id: str) -> Agent: ...

        def background(self, task: asyncio.Task[Any]) -> None: ...

        # the live-context budget (contexts.py)
        async def _open_context(self, model: Model) -> list[Conversation]: ...

        def _context_idle(self) -> None: ...

        async def _free_context(self, model: Model) -> list[Conversation]: ...

        # durable agents (durable.py)
        async def rouse(self, agent: Agent) -> None: ...

        async def commit_agent(self, agent: Agent) -> bool: ...

        def spill(self, agent: Agent) -> bool: ...

        def unspill(self, agent: Agent) -> bool: ...

        # hot reload and retirement (reload.py)
        def _settle_retired(self, model: Model) -> None: ...
