"""The burst gather: how long a request starting on an idle live context waits before its first step, so that
the prompts of agents that send together are evaluated in one step. Pure.

Agents of one burst reach the engine a few milliseconds apart (each request is read, parsed and routed on the one
event loop). Without a wait the first prompt is evaluated alone, and the others, arriving during that step, wait
for it before theirs: the slowest agent's first token comes one whole prefill later than with all the prompts in
one step, which is what ``llama-server`` does (its slot loop takes every task queued before it). Measured with
``benchmarks/concurrency.py`` (12x768 f16, 2 threads, 64-token prompts): 8 agents' first tokens came in two or
three groups, the last one 1.0-1.2 s after sending, against 0.85-0.95 s for ``llama-server``.

The wait is a share of the prompt's expected evaluation (:class:`~appliance.engine.pace.Pace`), capped: a lone
request's first token comes that share later at most, and a short prompt, whose evaluation costs less than the
loop's hops, never waits.

Each request that joins extends the window by its length from when it joined (:func:`extended`), within a span
from the opening (:func:`gather_span`). A start can outlast the window: one that parks an idle conversation to
make room copies its KV out first (6-7 ms for a 128-cell conversation of a 12x768 model), so in a burst after a
burst, eight starts take some 50 ms on the engine thread. So the first step also waits while starts of the model
are queued or running, and while agents are being registered on it (a new agent's first request), at most
:data:`GATHER_PENDING_MAX_S` from the opening (:func:`gather_wait`). Without both, the first step was queued while
some starts still waited, and the engine serving its queues in turn ran it between two of them: a burst of 8
was evaluated as 2 + 6, 4 + 4 or 5 + 3 prompts, the later group's first tokens one whole prefill later.
"""

from __future__ import annotations

GATHER_SHARE = 0.05
"""The wait, as a share of the first prompt's expected evaluation time."""
GATHER_MAX_S = 0.010
"""The longest wait."""
GATHER_MIN_S = 0.001
"""A shorter wait is none: the first step goes at once (a short prompt's first token is not delayed by a timer)."""
GATHER_SPAN_SHARE = 0.5
"""The longest a burst gathers from its opening, extensions included, as a share of the first prompt's expected
evaluation time (a request that misses the step waits all of it). Half: eight starts that each park an idle
conversation ran one after the other for 48-68 ms on the engine thread against a 116-138 ms prefill, and with a
quarter the last two or three missed the span (measured, 12x768 model, 64-token prompts)."""
GATHER_SPAN_MAX_S = 0.080
"""The longest a burst gathers from its opening, extensions included."""
GATHER_PENDING_MAX_S = 0.200
"""The longest a burst's first step waits from its opening while requests of the model are still on their way to
it: starts queued or running on the engine thread, agents being registered (their first request's start comes
next). Those are known arrivals: one that misses the step waits for the whole of it (every gathered prompt's
evaluation) before its own, while waiting costs the gathered ones only the arrivals' own work (a start that parks
an idle conversation: 6-18 ms; a registration: its store commit). Measured before this cap existed, when the
first step waited for queued starts within the span only (at most half the first prompt's expected evaluation,
some 25-30 ms for a 64-token prompt of the 12x768 model): 8 agents sending together, in bursts after the first,
reached the engine over 25-40 ms (their registrations, the parks), and their first tokens came in two groups (2 +
6, 1 + 7), the later group's one whole prefill later (``benchmarks/concurrency.py --keep-logs``)."""
GATHER_POLL_S = 0.001
"""How often the first step looks again whether the requests it waits for (starts, registrations) are on their way."""


def gather_window(expected_s: float | None) -> float:
    """Seconds a request starting alone waits for others before its first step, given its prompt's expected
    evaluation time (None: not measured yet, no wait)."""
    if expected_s is None:
        return 0.0
    window = min(GATHER_MAX_S, GATHER_SHARE * expected_s)
    if window < GATHER_MIN_S:
        return 0.0
    return window


def gather_span(expected_s: float | None) -> float:
    """Seconds from a burst's opening within which the requests that join it extend its window; never shorter than
    the window itself."""
    window = gather_window(expected_s)
    if window <= 0 or expected_s is None:
        return window
    return max(window, min(GATHER_SPAN_MAX_S, GATHER_SPAN_SHARE * expected_s))


def extended(until: float, limit: float, now: float, window: float) -> float:
    """The end of an open window (``until``) once a request joins it at ``now``: ``window`` from then, never
    earlier than it was, never past ``limit`` (the opening plus :func:`gather_span`)."""
    return max(until, min(limit, now + window))


def gather_wait(now: float, until: float, opened: float, pending: int) -> float:
    """Seconds the first step of a burst opened at ``opened`` waits from ``now`` before it looks again (0: it goes
    now): until the window's end (``until``), then while ``pending`` requests of the model are on their way (starts
    queued or running, agents being registered), :data:`GATHER_PENDING_MAX_S` from the opening at most."""
    if now < until:
        return until - now
    limit = opened + GATHER_PENDING_MAX_S
    if pending > 0 and now < limit:
        return min(GATHER_POLL_S, limit - now)
    return 0.0
