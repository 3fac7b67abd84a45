"""The daemon's data: a :class:`Model` (its spec, state, counts and loaded runtime), an :class:`Agent` (its
conversation), a :class:`DecodeResult`, a model file's :data:`FileIdentity`, and the ledger keys a model's bytes are
held under: its weights under its name, its live context under :func:`context_key`, its embeddings context under
:func:`embedding_key`, a reload's new estimate under :func:`reload_key`, a context prepared beside the live one under
:func:`next_key` and a cold one under :func:`cold_key`. Imported by the daemon's parts and by its adaptive loop
(:mod:`appliance.daemon.adaptive`), it imports neither."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from appliance.config import schema as settings
from appliance.config.validate import ModelConfig
from appliance.daemon import hostkv, policy
from appliance.daemon.admission import Admission
from appliance.daemon.offload import Offload
from appliance.engine import gguf_meta
from appliance.engine.adaptive import Tuner, Tuning
from appliance.engine.interface import Conversation, Generation, RuntimeProtocol
from appliance.errors import ApplianceError

ModelState = Literal["available", "loading", "loaded", "unloading", "missing"]
"""A model's lifecycle, as health, the registry file and STATUS show it: ``available`` (not in memory) ->
``loading`` (estimate, reserve, load; back to ``available`` on failure) -> ``loaded`` -> ``unloading`` (its
runtime is being closed) -> ``available``. Only :meth:`~appliance.daemon.core.Daemon.acquire` and
:meth:`~appliance.daemon.core.Daemon.unload` change it, under the model's lock. ``missing`` is never stored: it is
what :meth:`~appliance.daemon.core.Daemon.model_state` shows for a configured model that is not in memory while its
file is not there (:mod:`appliance.config.modelfiles`)."""


@dataclass(eq=False)
class Model:
    spec: ModelConfig
    estimate: int | None = None
    measured: int | None = None
    runtime: RuntimeProtocol | None = None
    state: ModelState = "available"
    refcount: int = 0
    inflight: int = 0
    decoding: int = 0  # its requests started on the engine thread and not ended (written by that thread only)
    last_used: float = 0.0
    baseline: int = 0
    kv_bytes_per_token: int = 0  # the largest ratio its KV swaps showed (engine thread): sizes a state before a swap
    retired: bool = False  # removed from the config: no new users, unloaded and forgotten once unused
    file: FileIdentity | None = None  # the model file as it was when the loaded runtime was read from it
    context_bytes: int = 0  # the ledger figure of its live context (KV cache and compute buffers), in the estimate
    context_claimed: bool = False  # its live context is admitted (built, or being built with its load)
    active: int = 0  # requests that claimed its live context and have not ended (it is not freed meanwhile)
    context_used: float = 0.0  # when its live context last served a request (least recently used goes first)
    ended: int = 0  # requests ended so far (a request waiting for a sequence retries when this moves)
    waiters: list[asyncio.Future[None]] = field(default_factory=list)  # woken when a request ends or one starts
    admission: Admission = field(default_factory=Admission)  # requests waiting to start, round-robin by queue
    stepper: asyncio.Task[None] | None = None  # the loop that steps its live context while requests are in flight
    gather_until: float = 0.0  # time.monotonic() until which requests starting together wait for one first step
    gather_limit: float = 0.0  # how far requests joining the open window may extend gather_until (burst.gather_span)
    gather_opened: float = 0.0  # when the open window's first start began (burst.gather_wait's cap counts from it)
    gather_window: float = 0.0  # the open window's length: a request that joins extends it by this much
    starting: int = 0  # start jobs submitted to the engine and not yet answered (a burst's first step waits for them)
    registering: int = 0  # agents being registered on it now: their first requests may join a burst's first step
    serving: asyncio.Event = field(default_factory=asyncio.Event)  # cleared while a reload swaps its runtime
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tuner: Tuner | None = None  # its load profile and the tuning of its live context (SPEC E1-E4)
    shape: gguf_meta.ModelShape | None = None  # read once, for the ledger figure of each context size
    retuning: asyncio.Task[None] | None = None  # the adaptive loop's retune of its context in progress
    retune_again: bool = False  # a retune was asked for while one ran (new settings, say): it runs once more after
    pending: Tuning | None = None  # a tuning its next request applies inline (engine.async_switch: false)
    cold_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one cold context at a time
    cold_bytes: int = 0  # the ledger figure of its cold context while one exists
    vocabulary: str = ""  # the loaded runtime's vocabulary digest (what a stored agent's tokens are checked with)
    offload: Offload | None = None  # where its layers run: decided with its estimate, before each load or reload

    @property
    def key(self) -> str:
        return self.spec.name

    def __post_init__(self) -> None:
        self.serving.set()

    @property
    def path(self) -> Path:
        return self.spec.path

    @property
    def gpu_layers(self) -> int:
        """The layers its next load offloads to the GPU, as placed with its estimate (``Daemon.place``)."""
        if self.offload is None:
            raise ApplianceError("INTERNAL", f"model {self.key!r} was not placed before its load", {"model": self.key})
        return self.offload.gpu_layers

    def view(self) -> policy.ModelView:
        return policy.ModelView(self.key, self.state == "loaded", self.refcount, self.inflight,
                                self.last_used, self.spec.idle_ttl_s, self.retired)


@dataclass(eq=False)
class Agent:
    id: str
    model: Model
    conversation: Conversation = field(default_factory=Conversation)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    owner: object | None = None  # a connection that owns this agent (MAGN sessions); None = until UNREGISTER
    last_used: float = 0.0  # when it registered or last decoded (agent_idle_ttl_s, host KV drop order)
    notice: str | None = None  # said once, by its next decode result (its model was reloaded: conversation reset)
    created: float = 0.0  # wall-clock time of its registration (kept across restarts)
    dormant: bool = False  # restored at start-up: holds no model (no refcount) until its first decode loads it
    model_file: str = ""  # restored: the identity of the model file its tokens were made with
    vocabulary: str = ""  # restored: that model's vocabulary digest
    restored_from: str = "none"  # where its last decode found its KV state (appliance.daemon.durable.RestoredFrom)
    releases_model: bool = False  # an HTTP agent: idle past its model's idle_ttl_s, it goes dormant (dormancy.py)

    def view(self) -> policy.AgentView:
        return policy.AgentView(self.id, self.last_used, self.lock.locked())

    def holder_view(self) -> policy.HolderView:
        return policy.HolderView(self.id, self.model.key, self.dormant, self.releases_model, self.lock.locked())

    def held(self) -> hostkv.HeldState | None:
        """Its host KV buffer as the budget sees it (None when it holds none). Read on the engine thread."""
        conv = self.conversation
        if conv.buffer is None:
            return None
        return hostkv.HeldState(self.id, len(conv.buffer), conv.where == "host", self.last_used)


@dataclass(frozen=True)
class DecodeResult:
    agent: str | None
    model: str
    generation: Generation
    evicted: str | None
    restored: bool
    rebuilt: bool = False  # its parked KV state had been dropped (host_kv_budget): its tokens were re-evaluated
    dropped: tuple[str, ...] = ()  # agents whose parked KV state this decode dropped to stay within host_kv_budget
    notice: str | None = None  # a one-time message for the client (its conversation was reset by a model reload)
    plan: str = ""  # the plan of the context it ran in (S, M, L or fixed; L for a cold context)
    threads: int = 0  # the threads that context decoded with
    peak_memory_bytes: int = 0  # the ledger bytes of the model (weights, live and cold contexts) while it ran
    restored_from: str = "none"  # where its KV state came from: none, device, host, disk or tokens (durable.py)
    burst_tokens: int = 0  # the step that ended its prompt, when it ended other prompts too (the plan's figure)


FileIdentity = tuple[int, int, int, int]
"""A file's (device, inode, size, mtime_ns); (0, 0, 0, 0) when it cannot be read."""


def file_identity(path: Path) -> FileIdentity:
    try:
        stat = path.stat()
    except OSError:
        return (0, 0, 0, 0)
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def model_defaults(name: str, path: Path) -> ModelConfig:
    """A model registered by path takes every ``models[]`` setting's schema default."""
    def default(key: str) -> Any:
        setting = settings.BY_KEY[f"models[].{key}"]
        return setting.kind.convert(setting.default)

    return ModelConfig(name=name, path=path, aliases=(), vram_bytes=default("vram_bytes"), n_ctx=default("n_ctx"),
                       n_gpu_layers=default("n_gpu_layers"), idle_ttl_s=default("idle_ttl_s"),
                       embeddings=default("embeddings"), reasoning=default("reasoning"),
                       cache_type=default("cache_type"), generate_if_missing=None)


def context_key(name: str) -> str:
    """The ledger key of a model's live context (its KV cache and compute buffers), apart from its weights."""
    return f"{name} (context)"


def embedding_key(name: str) -> str:
    """The ledger key of a model's embeddings context (``models[].embeddings``), apart from its live context."""
    return f"{name} (embeddings)"


def reload_key(name: str) -> str:
    """The ledger key that holds a reloading model's new estimate while its old runtime still serves."""
    return f"{name} (reloading)"


def next_key(name: str) -> str:
    """The ledger key of a model's next context while it is prepared beside the live one."""
    return f"{name} (next)"


def cold_key(name: str) -> str:
    """The ledger key of a model's cold context."""
    return f"{name} (cold)"


def buffer_bytes(conv: Conversation) -> int:
    """The bytes of ``conv``'s host buffer (read once: the engine thread may drop it meanwhile)."""
    buffer = conv.buffer
    return 0 if buffer is None else len(buffer)


def forget_parked(conv: Conversation) -> None:
    """Drop a parked conversation's KV state: it keeps its tokens, and its next request re-evaluates them (the
    runtime starts from an empty context when ``where`` is not ``host``). Engine thread only."""
    conv.buffer = None
    conv.nbytes = 0
    conv.where = "empty"
    conv.n_evaluated = 0
