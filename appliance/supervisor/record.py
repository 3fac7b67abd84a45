"""The reload record (SPEC C3): each reload's time, trigger, result, diff, what was applied and what waits for a
restart, and how long it took; the last :data:`KEEP` in memory. Pure."""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass
from typing import Any, Literal

KEEP = 50

Trigger = Literal["start", "file", "SIGHUP", "api", "benchmark", "tune"]
"""What asked for a reload: ``benchmark`` is ``appliance benchmark --apply`` or the admin page's Apply advice,
``tune`` a socket connection's ``TUNE`` (set, cleared, or let go when the connection closed)."""
Result = Literal["applied", "unchanged", "invalid", "failed"]


@dataclass(frozen=True)
class Reload:
    at: float  # wall-clock time the reload started
    trigger: Trigger
    result: Result
    diff: str  # ConfigDiff.summary(), or "" when the file was invalid
    applied: str  # ReloadPlan.summary() of what was carried out
    restart_needed: tuple[str, ...]
    duration_ms: float
    problems: tuple[str, ...] = ()  # the validation report of an invalid file, one problem per entry
    error: str = ""  # why a valid plan failed to apply (partly applied: see ``applied``)

    def line(self) -> str:
        """One log line."""
        text = f"reload ({self.trigger}) {self.result} in {self.duration_ms:.0f} ms"
        if self.result == "invalid":
            return f"{text}: {'; '.join(self.problems)}"
        if self.diff:
            text += f": {self.diff}"
        if self.applied and self.applied != "no changes":
            text += f"; applied: {self.applied}"
        if self.error:
            text += f"; error: {self.error}"
        return text

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["restart_needed"] = list(self.restart_needed)
        doc["problems"] = list(self.problems)
        return doc


class ReloadHistory:
    """The last :data:`KEEP` reloads, oldest first."""

    def __init__(self, keep: int = KEEP) -> None:
        self._reloads: collections.deque[Reload] = collections.deque(maxlen=keep)

    def add(self, reload: Reload) -> None:
        self._reloads.append(reload)

    @property
    def last(self) -> Reload | None:
        return self._reloads[-1] if self._reloads else None

    def __len__(self) -> int:
        return len(self._reloads)

    def to_list(self) -> list[dict[str, Any]]:
        return [reload.to_dict() for reload in self._reloads]
