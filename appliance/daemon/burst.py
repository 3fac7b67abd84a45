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
"""

from __future__ import annotations

GATHER_SHARE = 0.05
"""The wait, as a share of the first prompt's expected evaluation time."""
GATHER_MAX_S = 0.010
"""The longest wait."""
GATHER_MIN_S = 0.001
"""A shorter wait is none: the first step goes at once (a short prompt's first token is not delayed by a timer)."""


def gather_window(expected_s: float | None) -> float:
    """Seconds a request starting alone waits for others before its first step, given its prompt's expected
    evaluation time (None: not measured yet, no wait)."""
    if expected_s is None:
        return 0.0
    window = min(GATHER_MAX_S, GATHER_SHARE * expected_s)
    if window < GATHER_MIN_S:
        return 0.0
    return window
