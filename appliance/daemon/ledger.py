"""The VRAM ledger (SPEC L3, R2): a lock-protected account of the device bytes the daemon has promised away.

Pure: no asyncio, sockets, llama_cpp or NVML here. The daemon feeds it figures (the VRAM table estimate, a
measured figure, a device reading turned into a cap by :func:`compute_cap`) and asks it one question
atomically: "does this fit?".

Invariants, all kept under one :class:`threading.Lock`:

* ``allocated == sum(reservations().values())``, and every figure is an ``int`` in ``[0, MAX_BYTES]``.
* :meth:`Ledger.try_reserve` admits a reservation only when ``allocated + nbytes <= cap``, comparing and
  adding in one critical section, so concurrent callers can never push ``allocated`` over ``cap``.
* Only :meth:`Ledger.set_cap` (lowering the cap) and :meth:`Ledger.adjust` (recording a measured figure) may
  leave ``allocated > cap``; nothing already reserved is evicted, but every new reservation is refused until
  enough is released.
* A refusal or a rejected argument changes nothing.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType, TracebackType
from typing import Any

from appliance.errors import ApplianceError

MAX_BYTES = 2**63 - 1
"""The largest byte figure the ledger accepts (fits a signed 64-bit integer on every wire and metric)."""


@dataclass(frozen=True)
class Reservation:
    """Proof of a granted reservation; ``nbytes`` is the figure granted, not a later :meth:`Ledger.adjust`."""

    key: str
    nbytes: int
    token: int


@dataclass(frozen=True)
class LedgerSnapshot:
    """A consistent copy of the ledger taken inside its lock; ``reservations`` is a read-only mapping."""

    cap: int
    allocated: int
    reservations: Mapping[str, int]

    @property
    def free(self) -> int:
        """Bytes a new reservation could still take: ``max(0, cap - allocated)``."""
        return max(0, self.cap - self.allocated)


def _check_bytes(name: str, value: object) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``) in ``[0, MAX_BYTES]``, else raise BAD_REQUEST."""
    if type(value) is not int:
        raise ApplianceError("BAD_REQUEST", f"{name} must be an integer number of bytes, got {value!r}",
                             {"field": name, "value": repr(value)})
    if not 0 <= value <= MAX_BYTES:
        raise ApplianceError("BAD_REQUEST", f"{name} must be between 0 and {MAX_BYTES} bytes, got {value}",
                             {"field": name, "value": value})
    return value


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ApplianceError("BAD_REQUEST", f"a ledger key must be a non-empty string, got {key!r}",
                             {"field": "key", "value": repr(key)})
    return key


class Ledger:
    """Device bytes reserved per key (a model name), admitted against a cap; thread-safe, calls atomic."""

    def __init__(self, cap_bytes: int) -> None:
        self._lock = threading.Lock()
        self._cap = _check_bytes("cap_bytes", cap_bytes)
        self._allocated = 0
        self._entries: dict[str, tuple[int, int]] = {}  # key -> (nbytes, token)
        self._tokens = itertools.count(1)

    # -- reading ------------------------------------------------------------------------------------------
    @property
    def cap(self) -> int:
        """The admission cap in bytes."""
        return self._cap

    @property
    def allocated(self) -> int:
        """The sum of all reservations (may exceed :attr:`cap` after :meth:`set_cap` / :meth:`adjust`)."""
        return self._allocated

    @property
    def free(self) -> int:
        """``max(0, cap - allocated)``: the largest reservation :meth:`try_reserve` would admit now."""
        with self._lock:
            return max(0, self._cap - self._allocated)

    def reservations(self) -> dict[str, int]:
        """A fresh ``{key: bytes}`` copy, in reservation order."""
        with self._lock:
            return {key: nbytes for key, (nbytes, _) in self._entries.items()}

    def held(self, keys: Iterable[str]) -> int:
        """The bytes reserved under ``keys`` together (a key without a reservation holds 0), read in one critical
        section without copying the ledger (it runs at the end of every request)."""
        with self._lock:
            entries = self._entries
            return sum(entries[key][0] for key in keys if key in entries)

    def snapshot(self) -> LedgerSnapshot:
        """Cap, allocated and reservations read together in one critical section."""
        with self._lock:
            entries = {key: nbytes for key, (nbytes, _) in self._entries.items()}
            return LedgerSnapshot(self._cap, self._allocated, MappingProxyType(entries))

    # -- changing -----------------------------------------------------------------------------------------
    def try_reserve(self, key: str, nbytes: int) -> Reservation:
        """Reserve ``nbytes`` for ``key`` if ``allocated + nbytes <= cap``, comparing and adding atomically.

        Raises ``ApplianceError("BAD_REQUEST")`` for a bad key or byte figure, or when ``key`` already holds
        a reservation (release it, or :meth:`adjust` it, first). Raises
        ``ApplianceError("VRAM_LEDGER_DENY")`` when it does not fit; its ``details`` are exactly
        ``{"code": "CAP", "ledger_max_bytes": cap, "ledger_allocated_bytes": allocated,
        "requested_table_bytes": nbytes}``, in that order, as read at the refusal. Any refusal leaves the
        ledger unchanged. A zero-byte reservation is allowed (and refused only while over cap).
        """
        _check_key(key)
        _check_bytes("nbytes", nbytes)
        with self._lock:
            if key in self._entries:
                held = self._entries[key][0]
                raise ApplianceError("BAD_REQUEST", f"ledger key {key!r} already holds {held} bytes",
                                     {"key": key, "reserved_bytes": held})
            if self._allocated + nbytes > self._cap:
                details: dict[str, Any] = {"code": "CAP", "ledger_max_bytes": self._cap,
                                           "ledger_allocated_bytes": self._allocated,
                                           "requested_table_bytes": nbytes}
                free = max(0, self._cap - self._allocated)
                raise ApplianceError(
                    "VRAM_LEDGER_DENY",
                    f"cannot reserve {nbytes} bytes for {key!r}: {self._allocated} of {self._cap} bytes "
                    f"allocated, {free} free",
                    details)
            token = next(self._tokens)
            self._entries[key] = (nbytes, token)
            self._allocated += nbytes
            return Reservation(key, nbytes, token)

    def release(self, key: str) -> int:
        """Drop ``key``'s reservation and return its bytes.

        Releasing a key that holds no reservation is a no-op that returns 0 (so rollback paths may call it
        unconditionally).
        """
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return 0
            self._allocated -= entry[0]
            return entry[0]

    def cancel(self, reservation: Reservation) -> int:
        """Release ``reservation`` only if it is still the one held under its key (same grant); else return 0.

        Safer than :meth:`release` for rollback: it never drops a later reservation made under the same key.
        """
        with self._lock:
            entry = self._entries.get(reservation.key)
            if entry is None or entry[1] != reservation.token:
                return 0
            del self._entries[reservation.key]
            self._allocated -= entry[0]
            return entry[0]

    def adjust(self, key: str, nbytes: int) -> int:
        """Replace ``key``'s reserved bytes with ``nbytes`` WITHOUT the cap check; return ``new - old``.

        For recording a measured figure after a load: the measurement is the truth, even if it pushes
        ``allocated`` over ``cap`` (new reservations are then refused until bytes are released). Raises
        ``KeyError`` if ``key`` holds no reservation, ``BAD_REQUEST`` for a bad figure or if the total would
        exceed :data:`MAX_BYTES`.
        """
        _check_bytes("nbytes", nbytes)
        with self._lock:
            if key not in self._entries:
                raise KeyError(f"ledger key {key!r} holds no reservation")
            old, token = self._entries[key]
            delta = nbytes - old
            if self._allocated + delta > MAX_BYTES:
                raise ApplianceError("BAD_REQUEST",
                                     f"adjusting {key!r} to {nbytes} bytes overflows the ledger",
                                     {"field": "nbytes", "value": nbytes})
            self._entries[key] = (nbytes, token)
            self._allocated += delta
            return delta

    def rename(self, key: str, new_key: str) -> None:
        """Move ``key``'s reservation (its bytes and grant) to ``new_key``, which must hold none; the allocated
        total does not change. Raises ``KeyError`` if ``key`` holds no reservation."""
        _check_key(new_key)
        with self._lock:
            if key not in self._entries:
                raise KeyError(f"ledger key {key!r} holds no reservation")
            if new_key in self._entries:
                raise ApplianceError("BAD_REQUEST", f"ledger key {new_key!r} already holds a reservation",
                                     {"key": new_key})
            self._entries[new_key] = self._entries.pop(key)

    def set_cap(self, new_cap: int) -> None:
        """Set the cap. Existing reservations stay even if they now add up to more than the cap; new ones are
        refused until ``allocated + nbytes <= cap`` again."""
        _check_bytes("new_cap", new_cap)
        with self._lock:
            self._cap = new_cap

    def reservation(self, key: str, nbytes: int) -> PendingReservation:
        """A rollback guard: ``with ledger.reservation(key, n) as r: load(); r.commit()``.

        The reservation is made on entering the ``with`` (so a refusal raises before the body runs); on
        leaving, it is cancelled unless :meth:`PendingReservation.commit` was called and no exception
        (``asyncio.CancelledError`` and ``KeyboardInterrupt`` included) is propagating.
        """
        return PendingReservation(self, key, nbytes)

    def __repr__(self) -> str:
        snap = self.snapshot()
        return f"Ledger(cap={snap.cap}, allocated={snap.allocated}, reservations={dict(snap.reservations)})"


class PendingReservation:
    """The guard made by :meth:`Ledger.reservation`; see there. Not reusable."""

    def __init__(self, ledger: Ledger, key: str, nbytes: int) -> None:
        self._ledger = ledger
        self._key = key
        self._nbytes = nbytes
        self._reservation: Reservation | None = None
        self._committed = False
        self._done = False

    @property
    def reservation(self) -> Reservation:
        """The granted reservation (once the ``with`` has been entered)."""
        if self._reservation is None:
            raise RuntimeError("the reservation is not held: use it inside its `with` block")
        return self._reservation

    @property
    def committed(self) -> bool:
        return self._committed

    def commit(self) -> None:
        """Keep the reservation when the ``with`` block ends (unless it ends with an exception)."""
        if self._reservation is None or self._done:
            raise RuntimeError("commit() must be called inside the reservation's `with` block")
        self._committed = True

    def __enter__(self) -> PendingReservation:
        if self._reservation is not None or self._done:
            raise RuntimeError("a PendingReservation can be entered only once")
        self._reservation = self._ledger.try_reserve(self._key, self._nbytes)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done = True
        if exc_type is not None or not self._committed:
            self._committed = False
            assert self._reservation is not None
            self._ledger.cancel(self._reservation)


def compute_cap(total_bytes: int, admission_percent: float, external_used_bytes: int = 0) -> int:
    """The admission cap: ``floor(admission_percent / 100 * total_bytes) - external_used_bytes``, at least 0.

    ``admission_percent`` (0..100, an int or a float read as its shortest decimal, so 33.3 means 333/10) is
    applied exactly, with no float rounding. ``external_used_bytes`` is device memory used by other processes
    (see :func:`external_used`); subtracting it re-bases the cap on RESYNC when they have grown, so the
    percentage stays a share of the whole device while our admissions shrink to what is really left.
    Raises ``ValueError`` for a negative / non-int byte figure or a percent outside 0..100.
    """
    for name, value in (("total_bytes", total_bytes), ("external_used_bytes", external_used_bytes)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if isinstance(admission_percent, bool) or not isinstance(admission_percent, int | float):
        raise ValueError(f"admission_percent must be a number, got {admission_percent!r}")
    if not math.isfinite(admission_percent) or not 0 <= admission_percent <= 100:
        raise ValueError(f"admission_percent must be between 0 and 100, got {admission_percent!r}")
    percent = Fraction(str(admission_percent)) if isinstance(admission_percent, float) \
        else Fraction(admission_percent)
    share = math.floor(percent * total_bytes / 100)
    return min(MAX_BYTES, max(0, share - external_used_bytes))


def external_used(device_used: int, process_used: int | None, ledger_allocated: int) -> int:
    """Device bytes used by other processes: ``device_used - own``, never below 0.

    ``own`` is ``process_used`` (this process's measured use of the device) when known, else
    ``ledger_allocated`` (assumes what we reserved is what we use; while a load is still in progress this
    under-counts others).
    """
    own = ledger_allocated if process_used is None else process_used
    return max(0, device_used - own)
