"""Flash attention (``engine.flash_attention``): its three modes, what llama.cpp is asked for, and what it chose.

``auto`` asks llama.cpp to turn flash attention on where the model's layers can run it (llama.cpp's own default,
``LLAMA_FLASH_ATTN_TYPE_AUTO``): it builds a test graph while it creates the context and keeps flash attention only
when every attention op stays on its layer's device. It reports the choice only in its log, so a context is built
inside :func:`~appliance.engine.llamalog.llama_log_lines` and :func:`resolved` reads the choice from those lines.

The KV cache's V layout follows what was asked, not what was chosen: llama.cpp allocates the cache before it
resolves ``auto``, transposed only when flash attention is ``off`` (:func:`v_transposed`). A sequence's saved state
holds that layout and llama.cpp refuses a state of the other one. Pure (llama.cpp's log is
:mod:`appliance.engine.llamalog`'s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from appliance.errors import ApplianceError

FlashMode = Literal["auto", "on", "off"]
MODES: tuple[FlashMode, ...] = get_args(FlashMode)

LLAMA_TYPES: dict[FlashMode, int] = {"auto": -1, "on": 1, "off": 0}
"""``llama_context_params.flash_attn_type`` for each mode (``llama.h``'s ``enum llama_flash_attn_type``)."""

DECISIONS: tuple[tuple[str, bool], ...] = (
    ("Flash Attention enabled", True),  # auto, every attention op on its layer's device
    ("Flash Attention not supported, set to disabled", False),  # auto, an op fell back to another device
    ("enabling flash_attn since it is required", True),  # auto with a quantized V cache
    ("flash_attn is not compatible", False),  # an architecture llama.cpp runs without it whatever was asked
)
"""What llama.cpp (the pinned version) logs when it decides, and the decision."""


def mode_of(value: object) -> FlashMode:
    """``value`` as a mode: a mode as it is, ``True`` -> ``on``, ``False`` -> ``off``; ``BAD_REQUEST`` otherwise."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    for mode in MODES:
        if value == mode:
            return mode
    raise ApplianceError("BAD_REQUEST", f"flash attention must be one of {', '.join(MODES)} or a boolean",
                         {"flash_attention": repr(value)})


def resolved(mode: FlashMode, lines: Sequence[str]) -> bool:
    """Whether a context asked for ``mode`` runs flash attention, from the ``lines`` llama.cpp logged while it
    built the context (the last decision wins). ``INTERNAL`` when ``auto`` was asked and llama.cpp said nothing:
    a llama.cpp whose words this module does not know."""
    decided: bool | None = None
    for line in lines:
        for words, decision in DECISIONS:
            if words in line:
                decided = decision
    if decided is not None:
        return decided
    if mode == "auto":
        raise ApplianceError("INTERNAL", "llama.cpp did not log whether it turned flash attention on",
                             {"flash_attention": mode, "logged": len(lines)})
    return mode == "on"


UNQUANTIZED = ("f32", "f16", "bf16")
"""The KV cache types llama.cpp stores without flash attention; a quantized V cache needs it."""


def check_cache_type(mode: FlashMode, cache_type: str) -> None:
    """``BAD_REQUEST`` for a quantized KV cache with flash attention ``off`` (llama.cpp would not build the
    context)."""
    if mode == "off" and cache_type not in UNQUANTIZED:
        raise ApplianceError("BAD_REQUEST", f"a {cache_type} KV cache needs flash attention, and flash_attn is off "
                             "(engine.flash_attention: false)", {"cache_type": cache_type, "flash_attention": mode})


def v_transposed(mode: FlashMode) -> bool:
    """Whether a context asked for ``mode`` stores its V cache transposed (the layout of its saved states)."""
    return mode == "off"
