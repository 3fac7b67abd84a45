"""What ``appliance ps`` shows: one line per loaded model, read from a STATUS reply's records (pure).

The records are those :func:`appliance.cli.parse_records` makes of STATUS: ``{"device": {...}, "models": [...]}``.
A model's line: its name, the ledger bytes it holds now (weights and contexts), where its layers run as the daemon
placed them (``CPU``, ``GPU``, or ``CPU/GPU`` with the split), its agents, its requests in flight, and when it
unloads: after its idle TTL counts down, when its agents leave, after its requests, or never (``idle_ttl_s: 0``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

MIB = 1024 * 1024
HEADERS = ("NAME", "SIZE", "PROCESSOR", "AGENTS", "REQUESTS", "UNLOADS")


@dataclass(frozen=True)
class LoadedModel:
    """One line of ``appliance ps``."""

    name: str
    size_bytes: int
    processor: str
    agents: int
    requests: int
    unloads: str
    unloads_in_s: float | None  # None: no countdown runs (agents, requests, or never)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def processor(model: dict[str, Any]) -> str:
    """Where a loaded model's layers run, from its STATUS record's placement (``processor``, ``gpu_layers``):
    ``CPU``, ``GPU``, or ``CPU/GPU (3/5 layers on the GPU)``; ``unknown`` for a record without a placement."""
    placed = model.get("processor")
    if placed is None:
        return "unknown"
    if placed == "CPU/GPU":
        return f"CPU/GPU ({model['gpu_layers']} layers on the GPU)"
    return str(placed)


def in_words(seconds: float) -> str:
    """A countdown as people say it: ``in 45 seconds``, ``in 29 minutes``, ``in 2 hours`` (rounded up, so it never
    reads as sooner than it is)."""
    if seconds < 1:
        return "now"
    if seconds < 90:
        count, unit = math.ceil(seconds), "second"
    elif seconds < 90 * 60:
        count, unit = math.ceil(seconds / 60), "minute"
    else:
        count, unit = math.ceil(seconds / 3600), "hour"
    return f"in {count} {unit}{'' if count == 1 else 's'}"


def unloads(model: dict[str, Any]) -> str:
    """When a loaded model's record says it unloads."""
    if model["refcount"] > 0:
        return "when its agents leave"
    if model["inflight"] > 0:
        return "after its requests"
    if model["unloads_in_s"] is None:
        return "never (idle_ttl_s 0)"
    return in_words(model["unloads_in_s"])


def loaded_models(status: dict[str, Any]) -> list[LoadedModel]:
    """The loaded models of a STATUS reply's records, in its order."""
    return [LoadedModel(name=model["name"], size_bytes=model["held_bytes"], processor=processor(model),
                        agents=model["refcount"], requests=model["inflight"], unloads=unloads(model),
                        unloads_in_s=model["unloads_in_s"])
            for model in status.get("models", []) if model["loaded"]]


def render(models: list[LoadedModel]) -> str:
    """The table: a header line, then one aligned line per model (sizes in MiB)."""
    rows = [list(HEADERS)]
    rows += [[m.name, f"{m.size_bytes / MIB:.1f} MiB", m.processor, str(m.agents), str(m.requests), m.unloads]
             for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    return "".join("   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n"
                   for row in rows)
