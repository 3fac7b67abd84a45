"""The value types of a validated ``appliance.yaml`` (SPEC C1): frozen dataclasses, one per schema section.

Built by :func:`appliance.config.validate.parse_config`; field names are the keys of
:mod:`appliance.config.schema`. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Config", "EngineConfig", "HttpConfig", "ModelConfig", "SocketConfig", "TinySpec"]


@dataclass(frozen=True)
class TinySpec:
    layers: int
    dim: int
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: Path
    aliases: tuple[str, ...]
    vram_bytes: int | None  # None = auto (estimated from GGUF metadata)
    n_ctx: int
    n_gpu_layers: int | None  # -1 = all; None = auto (as many as the ledger admits)
    idle_ttl_s: float  # 0 = never unload
    embeddings: bool  # an embeddings context of its own (POST /v1/embeddings)
    reasoning: str  # "split" | "inline": what a template's <think>…</think> becomes
    cache_type: str
    generate_if_missing: TinySpec | None


@dataclass(frozen=True)
class SocketConfig:
    path: Path
    mode: int
    group: str | None
    request_timeout_s: float
    idle_timeout_s: float
    stall_timeout_s: float


@dataclass(frozen=True)
class HttpConfig:
    host: str
    port: int
    api_token: str | None
    allowed_hosts: tuple[str, ...]
    cors_origins: tuple[str, ...]
    keep_alive_timeout_s: float
    scrape_without_token: bool
    confirm_public_scrape: bool
    instance_name: str | None  # None = "<host name>:<port>" (appliance.http.affinity.instance_name)


@dataclass(frozen=True)
class EngineConfig:
    adaptive_window_size: int
    adaptive_sample_rate: int
    hot_pool_slack: float
    async_switch: bool
    thread_idle_thresholds: tuple[int, int]
    warmup_runs: int
    plan_boundaries: tuple[int, int]
    threads: int  # 0 = automatic
    live_slots: int
    flash_attention: str  # "auto" | "on" | "off" (appliance.engine.flash.FlashMode)
    live_contexts: int | None  # None = auto
    adaptive: bool


@dataclass(frozen=True)
class Config:
    """A validated configuration; every path is absolute. Field names are the schema's keys."""

    source: Path | None
    base_dir: Path
    data_dir: Path
    device: str
    admission_percent: float
    resync_interval_s: float
    model_dirs: tuple[Path, ...]
    socket: SocketConfig
    http: HttpConfig
    max_connections: int
    max_frame_bytes: int
    heartbeat_interval_s: float
    log_level: str
    max_tasks_per_connection: int
    host_kv_budget: int | None  # None = auto (a quarter of physical RAM)
    disk_kv_budget: int | None  # None = auto (a quarter of the state folder's free space at start); 0 = off
    agent_idle_ttl_s: float  # 0 = agents never expire
    max_agents: int
    shutdown_grace_s: float  # SIGTERM: how long running requests may still take
    engine: EngineConfig
    models: tuple[ModelConfig, ...]
    lines: Mapping[str, int] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The 1-based line of each key path's value in the file (``models[2].path`` -> 31); not a setting."""

    def model(self, name: str) -> ModelConfig | None:
        """The configured model called ``name``, or None."""
        for model in self.models:
            if model.name == name:
                return model
        return None

    def named(self, ref: str) -> ModelConfig | None:
        """The configured model whose name or one of whose aliases is ``ref``, or None."""
        for model in self.models:
            if model.name == ref or ref in model.aliases:
                return model
        return None

    def with_overrides(self, **changes: Any) -> Config:
        """A copy with top-level fields replaced (not validated; meant for tests)."""
        return dataclasses.replace(self, **changes)
