"""How fast a context evaluates prompt tokens, read off its own steps: what a prompt's first step is expected to
cost (the daemon's burst gather, :mod:`appliance.daemon.burst`)."""

from __future__ import annotations

PROMPT_BATCH = 32
"""Steps of fewer tokens are not timed: a decode step's time is the weights' read, whatever its few tokens."""
WEIGHT = 0.25
"""The weight of the newest step in the running figure (the box's load changes; one outlier moves it little)."""


class Pace:
    """Seconds per prompt token of one context's steps of at least :data:`PROMPT_BATCH` tokens (an exponential
    moving average); None before the first such step."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None

    def observe(self, seconds: float, tokens: int) -> None:
        """A step of ``tokens`` tokens took ``seconds``."""
        if tokens < PROMPT_BATCH or seconds <= 0:
            return
        rate = seconds / tokens
        if self.seconds_per_token is None:
            self.seconds_per_token = rate
        else:
            self.seconds_per_token += WEIGHT * (rate - self.seconds_per_token)

    def seconds(self, tokens: int) -> float | None:
        """The expected time of evaluating ``tokens`` prompt tokens; None while unmeasured."""
        if self.seconds_per_token is None:
            return None
        return tokens * self.seconds_per_token
