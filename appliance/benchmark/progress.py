"""How far a benchmark run is, told three ways: a progress bar on a terminal (tqdm), plain ``PROGRESS <done>
<total> <label>`` lines for a program reading them (the admin page runs the benchmark that way), or nothing."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

WORD = "PROGRESS"
MAX_COUNT_DIGITS = 12
"""A count with more digits is not a progress line (and never reaches ``int()``'s digit limit)."""
MAX_LABEL_CHARS = 200


@dataclass(frozen=True)
class Step:
    """One ``PROGRESS`` line: ``done`` of ``total`` steps, the last one ``label``."""

    done: int
    total: int
    label: str


def parse_progress(line: str) -> Step | None:
    """The step a ``PROGRESS <done> <total> <label>`` line tells, or None for any other line (never raises):
    counts are ASCII digits with ``0 <= done <= total`` and ``total >= 1``; the label is optional, cut to
    :data:`MAX_LABEL_CHARS`."""
    words = line.strip().split(maxsplit=3)
    if len(words) < 3 or words[0] != WORD:
        return None
    for count in words[1:3]:
        if not (count.isascii() and count.isdigit() and len(count) <= MAX_COUNT_DIGITS):
            return None
    done = int(words[1])
    total = int(words[2])
    if total < 1 or done > total:
        return None
    label = words[3].strip() if len(words) == 4 else ""
    return Step(done, total, label[:MAX_LABEL_CHARS])


def progress_line(step: Step) -> str:
    return f"{WORD} {step.done} {step.total} {step.label}".rstrip()


class Progress(Protocol):
    """Where the run tells how far it is: ``start`` once with the number of steps, ``advance`` after each."""

    def start(self, total: int) -> None: ...

    def advance(self, label: str) -> None: ...

    def close(self) -> None: ...


class LineProgress:
    """One ``PROGRESS`` line per step on ``stream`` (stderr), flushed at once."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = 0
        self.done = 0

    def start(self, total: int) -> None:
        self.total = total
        print(progress_line(Step(0, total, "starting")), file=self.stream, flush=True)

    def advance(self, label: str) -> None:
        self.done = min(self.done + 1, self.total)
        print(progress_line(Step(self.done, self.total, label)), file=self.stream, flush=True)

    def close(self) -> None:
        """Nothing to close."""


class BarProgress:
    """A tqdm bar on stderr; the label of the last step beside it."""

    def __init__(self) -> None:
        self.bar: tqdm[None] | None = None

    def start(self, total: int) -> None:
        from tqdm import tqdm  # lazy: the daemon imports this module for parse_progress, and tqdm is 2 MiB

        self.bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)

    def advance(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(label)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NoProgress:
    """Tells nothing."""

    def start(self, total: int) -> None:
        """Nothing to tell."""

    def advance(self, label: str) -> None:
        """Nothing to tell."""

    def close(self) -> None:
        """Nothing to close."""
