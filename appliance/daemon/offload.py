"""Where a model's layers run, decided before it loads: how many llama.cpp offloads to the GPU, and which part of the
model's bytes the ledger holds. Pure: the daemon passes in the model's shape, the device's kind, whether this
llama.cpp build can offload at all and the ledger's free bytes.

llama.cpp counts a model's layers as its blocks plus the output layer (:attr:`ModelShape.offload_layers`) and
offloads the last ``n_gpu_layers`` of them (a negative count: all). :func:`place` decides:

* a memory device without a GPU behind it (``host``, and the tests' ``fake:<size>``) has nothing to offload to:
  every layer runs on the CPU, and the ledger holds all of the model's bytes (:attr:`Offload.ledger_all`), as it
  always did there;
* a llama.cpp build without GPU support (a CPU wheel) cannot offload: every layer runs on the CPU; the GPU's ledger
  holds the compute margin only and the rest is in host RAM (:attr:`Offload.host_bytes`);
* ``n_gpu_layers: auto`` (``requested`` None) offloads as many layers as the ledger's free bytes hold
  (:func:`auto_layers`);
* a number offloads that many layers (at most all of them).

A model asked to offload (a number other than 0) that cannot runs on the CPU, loudly: :func:`fallback_warning`
and :func:`startup_notes` are the lines the daemon logs. It is never refused for that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from appliance.engine import gguf_meta
from appliance.engine.gguf_meta import ModelShape

HOST_KINDS = frozenset({"host", "fake"})
"""Device kinds with no GPU behind them: models on them run on the CPU, and the ledger holds all of their bytes."""
REBUILD = "APPLIANCE_GPU=cuda scripts/setup.sh rebuilds it with CUDA"

Level = Literal["warning", "info"]


@dataclass(frozen=True)
class Offload:
    """Where a model's layers run: ``gpu_layers`` of its ``layers`` on the GPU, the others on the CPU.

    ``requested`` is the config's ``n_gpu_layers`` (None: ``auto``). ``ledger_all``: the device has no GPU behind
    it and the ledger holds every byte of the model; else it holds the device's part of the estimate and
    ``host_bytes`` (the CPU layers' weights and KV cache at the model's ``n_ctx``) stay in host RAM, outside it.
    ``reason`` says why fewer layers than asked run on the GPU ("" when as asked). ``layers`` and ``host_bytes``
    are None when the model's file was not read for them (an operator's ``vram_bytes`` is the one figure);
    ``gpu_layers`` is then the configured count (-1: all)."""

    requested: int | None
    gpu_layers: int
    layers: int | None
    ledger_all: bool
    host_bytes: int | None
    reason: str = ""

    @property
    def cpu_fallback(self) -> bool:
        """Asked for GPU layers by number, and every layer runs on the CPU: said loudly (a WARNING)."""
        return self.requested not in (0, None) and self.gpu_layers == 0 and bool(self.reason)

    @property
    def ledger_layers(self) -> int | None:
        """The offloaded layers that :func:`~appliance.engine.gguf_meta.estimate` splits the ledger's figure by
        (None: all of the model counts)."""
        return None if self.ledger_all else self.gpu_layers

    @property
    def split(self) -> str:
        """``3/5``: the layers on the GPU, of all of them (STATUS's ``gpu_layers``); ``all`` or the count alone when
        the model's layers were not read."""
        if self.layers is None:
            return "all" if self.gpu_layers < 0 else str(self.gpu_layers)
        return f"{self.gpu_layers}/{self.layers}"

    @property
    def processor(self) -> str:
        """``CPU``, ``GPU``, or ``CPU/GPU`` for a split model."""
        if self.gpu_layers == 0:
            return "CPU"
        if self.gpu_layers < 0 or (self.layers is not None and self.gpu_layers >= self.layers):
            return "GPU"
        return "CPU/GPU"


def ledger_layers(placed: Offload | None) -> int | None:
    """:attr:`Offload.ledger_layers` of a placement; None (every layer counts) before a model is placed."""
    return None if placed is None else placed.ledger_layers


def cpu_only_reason(device_kind: str, build_offloads: bool) -> str | None:
    """Why no layer can run on the GPU here (None when they can)."""
    if device_kind == "host":
        return "the memory device is host RAM, not a GPU"
    if device_kind == "fake":
        return "the memory device is a fake one (tests), with no GPU behind it"
    if not build_offloads:
        return f"this llama.cpp build cannot offload to a GPU (it was built without GPU support: {REBUILD})"
    return None


def auto_layers(free_bytes: int, device_bytes: Sequence[int]) -> int:
    """The most layers whose device bytes fit in ``free_bytes``: ``device_bytes[n]`` is the device's part of the
    estimate with ``n`` layers offloaded (non-decreasing in ``n``); 0 when not even ``device_bytes[0]`` fits (the
    ledger then refuses the load, as for any model that does not fit)."""
    chosen = 0
    for layers, needed in enumerate(device_bytes):
        if needed > free_bytes:
            break
        chosen = layers
    return chosen


def requested_layers(requested: int, layers: int | None) -> int:
    """A configured count as llama.cpp takes it: negative = all, more than the model has = all (``layers`` None:
    not known, the count as configured)."""
    if layers is None:
        return requested
    return layers if requested < 0 else min(requested, layers)


def place(shape: ModelShape | None, *, requested: int | None, n_ctx: int, cache_type: str, device_kind: str,
          build_offloads: bool, free_bytes: int) -> Offload:
    """Where ``shape``'s layers run for ``requested`` (the config's ``n_gpu_layers``; None: ``auto``) on a device of
    ``device_kind`` whose ledger has ``free_bytes`` free (see the module docstring). ``shape`` None: the file was not
    read (an operator's ``vram_bytes``), which ``auto`` cannot do without."""
    layers = None if shape is None else shape.offload_layers
    why_not = cpu_only_reason(device_kind, build_offloads)
    if why_not is not None:
        ledger_all = device_kind in HOST_KINDS
        host = 0 if ledger_all else _host_bytes(shape, n_ctx, cache_type, 0)
        return Offload(requested, 0, layers, ledger_all, host, "" if requested == 0 else why_not)
    if requested is None:
        if shape is None:
            raise ValueError("n_gpu_layers auto needs the model's shape")
        chosen = auto_layers(free_bytes, gguf_meta.device_bytes_by_layers(shape, n_ctx, cache_type))
        reason = "" if chosen == layers else (f"auto: {chosen} of {layers} layers fit in the ledger's {free_bytes} "
                                              "free bytes")
    else:
        chosen, reason = requested_layers(requested, layers), ""
    return Offload(requested, chosen, layers, False, _host_bytes(shape, n_ctx, cache_type, chosen), reason)


def _host_bytes(shape: ModelShape | None, n_ctx: int, cache_type: str, gpu_layers: int) -> int | None:
    return None if shape is None else gguf_meta.estimate(shape, n_ctx, cache_type, gpu_layers).host


def record(placed: Offload | None) -> dict[str, Any]:
    """A model's placement as STATUS and the admin page show it: ``gpu_layers`` (``3/5``), ``processor``,
    ``host_bytes`` (in host RAM, outside the device's ledger) and ``offload_note`` (why fewer layers than asked run
    on the GPU); all None for a model not placed yet (never loaded since start)."""
    if placed is None:
        return {"gpu_layers": None, "processor": None, "host_bytes": None, "offload_note": None}
    return {"gpu_layers": placed.split, "processor": placed.processor, "host_bytes": placed.host_bytes,
            "offload_note": placed.reason or None}


def shown(requested: int | None) -> str:
    """``n_gpu_layers`` as the config spells it."""
    return "auto" if requested is None else str(requested)


def loaded_note(offload: Offload | None) -> str:
    """Where a loaded model's layers run, for its load's log line: ``3/5 layers on the GPU``, with the reason when
    fewer than asked."""
    if offload is None:
        return "placement unknown"
    note = f"{offload.split} layers on the GPU"
    return f"{note} ({offload.reason})" if offload.reason else note


def fallback_warning(name: str, offload: Offload) -> str:
    """The WARNING line of a model asked to offload that runs on the CPU (:attr:`Offload.cpu_fallback`)."""
    return (f"model {name}: n_gpu_layers {shown(offload.requested)} asks for GPU layers, but {offload.reason}: it runs "
            f"on the CPU ({offload.split} layers on the GPU)")


def startup_notes(models: Iterable[tuple[str, int | None]], device_kind: str,
                  build_offloads: bool) -> list[tuple[Level, str]]:
    """The lines logged at start for the configured ``(name, n_gpu_layers)``: a WARNING for each model asked to
    offload by number where no layer can be offloaded, an INFO for each ``auto`` one (it means the CPU then)."""
    why_not = cpu_only_reason(device_kind, build_offloads)
    if why_not is None:
        return []
    notes: list[tuple[Level, str]] = []
    for name, requested in models:
        if requested is None:
            notes.append(("info", f"model {name}: n_gpu_layers auto runs on the CPU: {why_not}"))
        elif requested != 0:
            notes.append(("warning", f"model {name}: n_gpu_layers {requested} asks for GPU layers, but {why_not}: "
                                     "it runs on the CPU"))
    return notes
