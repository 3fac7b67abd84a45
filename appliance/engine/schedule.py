"""Which sequences advance in one batched decode step, and by how many tokens. Pure: no llama.cpp.

:class:`~appliance.engine.batched.BatchedContext` asks :func:`plan_step` once per step. The rule keeps streams
smooth (issue #11, continuous batching): every generating sequence gets its one decode token first, then the
sequences still prefilling their prompts share what is left of the batch in the order they joined, each a chunk
of at most what remains. So a long prompt is prefilled over several steps, between the other sequences' decode
tokens, and never stalls their streams for long.

``prefill_limit`` bounds each prefilling sequence's chunk in a step in which some sequence is generating (a step's
time grows with its tokens, and that time is the streams' gap between two tokens): every sequence advances in
every step, a stream by its token, a prompt by up to ``prefill_limit`` tokens. Prompts that join together (a burst
of agents) are therefore evaluated together, in one step, not one prompt per step behind each other. Measured
(``benchmarks/concurrency.py``, 12x768 f16, 2 threads, 8 agents' 64-token prompts, one prompt per step before this):
a burst's first tokens came 100, 190, 285, 408, 547, 648, 779 and 913 ms after sending, one step apart, while
``llama-server`` evaluates them in one batch. A step's stall of the streams then grows with the prompts that
joined (at most ``n_batch`` tokens), and one larger ``llama_decode`` costs less than the same tokens in several
steps. With no stream waiting, prompts take the whole batch (the quickest first token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from appliance.engine.interface import StopReason, TokenLogprobs


@dataclass(frozen=True)
class Work:
    """A sequence's pending work: ``pending`` tokens not evaluated yet; a ``generating`` sequence has sampled
    at least one token, and its one pending token is that last sampled token."""

    seq_id: int
    pending: int
    generating: bool


@dataclass(frozen=True)
class Take:
    """``count`` of a sequence's pending tokens go into this step's batch; ``last``: they include its final
    pending token, so the batch outputs logits there and the sequence samples its next token after the step."""

    seq_id: int
    count: int
    last: bool


def plan_step(work: Sequence[Work], n_batch: int, prefill_limit: int | None = None) -> list[Take]:
    """The takes of one step for ``work`` (in join order), at most ``n_batch`` tokens in all: one token for each
    generating sequence first, then prompt chunks in join order with the room left (each at most ``prefill_limit``
    tokens if some sequence generates in this step). Sequences with nothing pending take nothing; generating
    sequences beyond ``n_batch`` wait for the next step."""
    if n_batch < 1:
        raise ValueError("n_batch must be at least 1")
    if prefill_limit is not None and prefill_limit < 1:
        raise ValueError("prefill_limit must be at least 1")
    takes: list[Take] = []
    room = n_batch
    for item in work:
        if item.generating and item.pending > 0 and room > 0:
            takes.append(Take(item.seq_id, 1, item.pending == 1))
            room -= 1
    chunk = n_batch
    if takes and prefill_limit is not None:
        chunk = prefill_limit
    for item in work:
        if not item.generating and item.pending > 0 and room > 0:
            count = min(item.pending, room, chunk)
            takes.append(Take(item.seq_id, count, count == item.pending))
            room -= count
    return takes


@dataclass(frozen=True)
class SeqEvent:
    """One sampled token of one sequence: ``piece`` its bytes (empty for an end-of-generation token); ``done``
    with ``stop_reason`` on its last (``"eos"``, ``"length"``, or ``"stop"`` when its grammar can go no further:
    then ``token`` may be -1, none sampled); ``logprobs`` when its request asked for them. Stop strings are the
    caller's (:class:`~appliance.engine.streamtext.StreamText`)."""

    seq_id: int
    token: int
    piece: bytes
    done: bool
    stop_reason: StopReason | None
    logprobs: TokenLogprobs | None = None
