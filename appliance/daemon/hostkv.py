"""Host RAM for parked KV state: the budget and which buffers to let go of (pure: no IO, no clocks).

Every agent's conversation that waits outside its model's live context keeps its KV state in a host buffer, and a
conversation restored into the context keeps that buffer for its next park while no other live conversation of the
context keeps one (a restore lets the others' go). ``host_kv_budget`` bounds the bytes of all those buffers together
(``auto``: a quarter of physical RAM).

Policy: **drop, never deny.** Before a KV swap parks the live conversation, the daemon makes room for it (its
size estimated from the model's earlier swaps, :func:`parked_estimate`), and after the swap it checks the real
figure; each time it frees buffers until the total fits: first the reuse buffers of live conversations (nothing is
lost), then the parked states of the least recently used agents, the one being attached last (when it and the
state being parked do not fit together, it is rebuilt rather than restored). A dropped agent keeps its tokens; its
next decode re-evaluates them in the context (prompt-speed work, the same continuation) instead of restoring the
saved state. Nothing is refused, so ``HOST_KV_DENY`` is not raised by this policy; each drop is logged and counted
(``host_kv`` in STATUS and health), and the decode that re-evaluates says so (``DecodeResult.rebuilt``). So the
bytes held never exceed the budget, except during a model's first swap (no estimate yet), when the state it parks
may overshoot until the check after it.

A model whose live context is an adaptive pool has a second, tighter bound on its own agents' buffers
(:func:`pool_cap`): its pool and its parked states together hold no more KV cache than the fixed strategy would
(its one context of ``n_ctx`` cells, and the conversations that do not fit in its sequences or its cells, parked),
so that parking in host RAM never makes the adaptive engine's memory pass the fixed strategy's. The same order lets
go of what passes it (to disk first, where there is a disk tier).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

AUTO_SHARE = 4
"""``auto`` budget: physical RAM divided by this."""


@dataclass(frozen=True)
class HeldState:
    """One conversation's host buffer, as the policy sees it."""

    key: str
    nbytes: int  # the buffer's allocated length
    parked: bool  # True: the KV state lives only in this buffer; False: a reuse buffer of a live conversation
    last_used: float  # when its agent last registered or decoded


def auto_budget(physical_bytes: int) -> int:
    """The ``auto`` budget for a machine with ``physical_bytes`` of RAM."""
    return physical_bytes // AUTO_SHARE


def meminfo_total(text: str) -> int | None:
    """``MemTotal`` in bytes from the text of ``/proc/meminfo`` (None when it is not there)."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() != "MemTotal":
            continue
        fields = rest.split()
        if not fields or not fields[0].isascii() or not fields[0].isdigit():
            return None
        unit = fields[1].lower() if len(fields) > 1 else "b"
        return int(fields[0]) * (1024 if unit == "kb" else 1)
    return None


def parked_estimate(bytes_per_token: int, n_tokens: int, reused: int) -> int:
    """An upper bound of the host bytes a conversation of ``n_tokens`` evaluated tokens will hold once parked,
    from the largest bytes-per-token ratio its model's saves showed so far (0 = none yet: no estimate): a saved
    state is its tokens' KV plus a header smaller than one token's, and a save keeps a larger buffer it reuses."""
    return max(reused, bytes_per_token * (n_tokens + 1))


def per_token(nbytes: int, n_tokens: int) -> int:
    """The bytes-per-token ratio of one saved state, rounded up (0 for an empty one)."""
    return -(-nbytes // n_tokens) if n_tokens > 0 else 0


def pool_cap(n_ctx: int, pool_cells: int, conversations: Sequence[int], live_slots: int, bytes_per_token: int) -> int:
    """The most host RAM the parked states of a model whose live context is an adaptive pool of ``pool_cells``
    cells may hold, at ``bytes_per_token`` a cell (the largest ratio its saved states showed): the cells of the
    fixed strategy's context (``n_ctx``) that the pool does not take, plus the cells the fixed strategy would park
    at least of the model's ``conversations`` (their cells, wherever they are): all but the ``live_slots`` largest,
    within ``n_ctx``, that its context could hold. So the pool and its parked states together never hold more KV
    cache than the fixed strategy would, one context and its parked states."""
    if min(n_ctx, pool_cells, bytes_per_token, *conversations) < 0 or live_slots < 1:
        raise ValueError(f"n_ctx, pool_cells, bytes_per_token and the conversations' cells must be at least 0 and "
                         f"live_slots at least 1, got {n_ctx}, {pool_cells}, {bytes_per_token}, {list(conversations)}, "
                         f"{live_slots}")
    live = min(n_ctx, sum(sorted(conversations, reverse=True)[:live_slots]))
    return (max(0, n_ctx - pool_cells) + sum(conversations) - live) * bytes_per_token


def held_bytes(states: Iterable[HeldState]) -> int:
    return sum(state.nbytes for state in states)


def to_drop(states: Iterable[HeldState], budget: int, last: frozenset[str] = frozenset()) -> list[str]:
    """The keys whose buffers to free, in order, so that the rest fits in ``budget`` bytes (empty when it fits):
    reuse buffers before parked states, the least recently used first; the states in ``last`` only when nothing
    else is left."""

    def order(state: HeldState) -> tuple[bool, bool, float, str]:
        return (state.key in last, state.parked, state.last_used, state.key)

    ordered = sorted(states, key=order)
    total = held_bytes(ordered)
    dropped: list[str] = []
    for state in ordered:
        if total <= budget:
            break
        if state.nbytes == 0:
            continue
        dropped.append(state.key)
        total -= state.nbytes
    return dropped
