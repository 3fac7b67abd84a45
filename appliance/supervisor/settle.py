"""Whether a reload may go on with what it read of ``appliance.yaml`` (SPEC C3): :func:`decide`. Pure.

An editor or ``cat > appliance.yaml`` that writes in place can be read half-way: the part written so far may be a
valid config that lacks models or settings. So each reload reads the file, loads it, and reads it again
(:class:`Read`: its fingerprint and bytes, and when); :func:`decide` answers, from the first read since which the
file has not changed and the last one, and what the config read would do (:class:`Effect`):

* **wait** (and read again) while the file changes between the reads;
* **refuse** a file with no settings at all (empty, only whitespace or comments, a bare ``---``, ``null`` or
  ``{}``: all defaults, which would move the socket and HTTP to their default addresses and retire every model)
  once it has been stable for the settle period: it is never applied;
* **apply** at once a finished file (it ends with a newline) that is valid and removes nothing: no model retired,
  no listener moved;
* otherwise (a file that does not end with a newline, an invalid one, or one that retires a model or moves the
  socket or HTTP) **apply** only once it has been stable for the settle period, else **wait**: a half-written
  file changes again before then. An invalid file's "apply" reports its problems; a settled file that removes
  every model (``models: []`` written on purpose) is applied with a warning (:attr:`Decision.reason`).

The reloader (:mod:`appliance.supervisor.reloader`) does the reading and the waiting, with a deadline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import yaml
from yaml.events import (
    DocumentEndEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    StreamEndEvent,
    StreamStartEvent,
)

SETTLE_S = 1.0
"""How long a suspicious file must stay the same (the same bytes, size, mtime and inode) before it is decided."""

NULLS = ("", "~", "null", "Null", "NULL")
"""The plain YAML scalars that mean null (a document of only one of them has no settings)."""

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

Action = Literal["apply", "wait", "refuse"]


@dataclass(frozen=True)
class Read:
    """One look at the file: its fingerprint (:func:`appliance.supervisor.watch.fingerprint`: inode, size,
    mtime and a hash of the bytes; None when unreadable), its bytes (None when unreadable), and when (seconds of
    a monotonic clock)."""

    fingerprint: tuple[int, int, int, str] | None
    data: bytes | None
    at: float


@dataclass(frozen=True)
class Effect:
    """What the config read would do to the running one: ``valid`` False when it did not validate; the models it
    retires (``every_model``: all of them, leaving none) and the listeners it moves (``socket``, ``HTTP``)."""

    valid: bool
    retired: tuple[str, ...] = ()
    every_model: bool = False
    moved: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""  # why it waits or refuses; for an apply, what made it wait for the file to settle ("": nothing)


def blank(data: bytes) -> bool:
    """True when ``data`` holds no setting at all: nothing, whitespace, comments, document markers, a null, or
    an empty mapping. Reads parser events only and stops at the first setting, so a huge or deeply nested file
    costs no more than its first value; a file that does not parse is not blank (it is invalid)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    if not text.strip():
        return True
    root = False  # the document's root node was seen (a null, or the start of a mapping)
    try:
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, StreamStartEvent | StreamEndEvent | DocumentStartEvent | DocumentEndEvent):
                continue
            if not root and isinstance(event, MappingStartEvent):
                root = True
                continue
            if not root and isinstance(event, ScalarEvent) and _null(event):
                root = True
                continue
            if root and isinstance(event, MappingEndEvent):
                continue
            return False
    except yaml.YAMLError:
        return False
    return True


def _null(event: ScalarEvent) -> bool:
    plain = event.implicit[0] and not event.style  # no quotes (the C parser says "", the Python one None)
    return plain and event.tag is None and event.value in NULLS


def unfinished(data: bytes) -> bool:
    """True when ``data`` does not end with a line end: a writer stopped (or is) in the middle of a line."""
    return bool(data) and not data.endswith(b"\n")


def suspicions(data: bytes | None, effect: Effect) -> list[str]:
    """Why a read must wait for the file to settle before it is applied (empty: it need not)."""
    reasons = []
    if data is None:
        reasons.append("the file cannot be read")
    elif unfinished(data):
        reasons.append("it does not end with a newline")
    if not effect.valid:
        reasons.append("it is invalid")
    if effect.every_model:
        reasons.append("it removes every model")
    elif effect.retired:
        reasons.append(f"it removes model {', '.join(effect.retired)}")
    if effect.moved:
        reasons.append(f"it moves {' and '.join(effect.moved)}")
    return reasons


def decide(first: Read, last: Read, effect: Effect, settle_s: float = SETTLE_S) -> Decision:
    """Apply, wait and read again, or refuse (module docstring). ``first`` is the earliest read since which the
    file has not changed, ``last`` the read just after the load whose ``effect`` is given."""
    if first.fingerprint != last.fingerprint:
        return Decision("wait", "the file changed while it was read")
    stable = last.at - first.at >= settle_s
    if last.data is not None and blank(last.data):
        reason = "the file has no settings (empty, or only whitespace and comments)"
        return Decision("refuse" if stable else "wait", reason)
    reasons = suspicions(last.data, effect)
    if not reasons:
        return Decision("apply")
    return Decision("apply" if stable else "wait", "; ".join(reasons))
