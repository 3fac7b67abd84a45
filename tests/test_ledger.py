from __future__ import annotations

import contextlib
import sys
import threading
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from appliance.daemon.ledger import MAX_BYTES, Ledger, LedgerSnapshot, Reservation, compute_cap, external_used
from appliance.errors import ApplianceError

GIB = 2**30


def test_reserve_and_release_arithmetic() -> None:
    ledger = Ledger(10 * GIB)
    r1 = ledger.try_reserve("a", 3 * GIB)
    r2 = ledger.try_reserve("b", 4 * GIB)
    assert (r1.key, r1.nbytes, r2.key, r2.nbytes) == ("a", 3 * GIB, "b", 4 * GIB)
    assert r1.token != r2.token
    assert ledger.allocated == 7 * GIB
    assert ledger.free == 3 * GIB
    assert ledger.cap == 10 * GIB
    assert ledger.reservations() == {"a": 3 * GIB, "b": 4 * GIB}
    assert ledger.release("a") == 3 * GIB
    assert ledger.allocated == 4 * GIB
    assert ledger.release("a") == 0  # unknown / already released: a no-op
    assert ledger.release("never") == 0
    assert ledger.reservations() == {"b": 4 * GIB}
    ledger.try_reserve("c", 6 * GIB)  # exactly fills the cap
    assert ledger.free == 0
    assert ledger.allocated == ledger.cap


def test_reservations_returns_a_copy() -> None:
    ledger = Ledger(100)
    ledger.try_reserve("a", 10)
    ledger.reservations()["a"] = 99
    ledger.reservations()["zzz"] = 1
    assert ledger.reservations() == {"a": 10}


def test_held_sums_the_given_keys_and_counts_absent_ones_as_nothing() -> None:
    ledger = Ledger(100)
    ledger.try_reserve("a", 10)
    ledger.try_reserve("b", 25)
    ledger.try_reserve("c", 40)
    assert ledger.held(("a", "c", "never")) == 50
    assert ledger.held(["b"]) == 25
    assert ledger.held(()) == 0
    ledger.release("c")
    assert ledger.held(("a", "c")) == 10


def test_refusal_changes_nothing_and_carries_exact_details() -> None:
    ledger = Ledger(1000)
    ledger.try_reserve("a", 600)
    before = ledger.snapshot()
    with pytest.raises(ApplianceError) as info:
        ledger.try_reserve("b", 401)
    err = info.value
    assert err.code == "VRAM_LEDGER_DENY"
    assert err.retryable and err.http_status == 503
    assert list(err.details.items()) == [
        ("code", "CAP"), ("ledger_max_bytes", 1000), ("ledger_allocated_bytes", 600),
        ("requested_table_bytes", 401)]
    assert "'b'" in err.message and "401" in err.message
    assert ledger.snapshot() == before
    assert "b" not in ledger.reservations()
    ledger.try_reserve("b", 400)  # the exact remainder still fits
    assert ledger.allocated == 1000


def test_line_protocol_rendering_of_details() -> None:
    ledger = Ledger(5)
    with pytest.raises(ApplianceError) as info:
        ledger.try_reserve("m", 6)
    line = "ERR VRAM_LEDGER_DENY " + " ".join(f"{k}={v}" for k, v in info.value.details.items())
    assert line == ("ERR VRAM_LEDGER_DENY code=CAP ledger_max_bytes=5 ledger_allocated_bytes=0 "
                    "requested_table_bytes=6")


@pytest.mark.parametrize("nbytes", [-1, 1.5, 2.0, "10", None, True, MAX_BYTES + 1, 10**30])
def test_bad_sizes_are_bad_requests_and_change_nothing(nbytes: object) -> None:
    ledger = Ledger(MAX_BYTES)
    ledger.try_reserve("a", 7)
    with pytest.raises(ApplianceError) as info:
        ledger.try_reserve("b", nbytes)  # type: ignore[arg-type]
    assert info.value.code == "BAD_REQUEST"
    assert ledger.reservations() == {"a": 7}
    assert ledger.allocated == 7


@pytest.mark.parametrize("key", ["", None, 3, b"a"])
def test_bad_keys_are_bad_requests(key: object) -> None:
    ledger = Ledger(100)
    with pytest.raises(ApplianceError) as info:
        ledger.try_reserve(key, 1)  # type: ignore[arg-type]
    assert info.value.code == "BAD_REQUEST"
    assert ledger.allocated == 0


def test_duplicate_key_is_refused_and_changes_nothing() -> None:
    ledger = Ledger(100)
    ledger.try_reserve("a", 10)
    with pytest.raises(ApplianceError) as info:
        ledger.try_reserve("a", 5)
    assert info.value.code == "BAD_REQUEST"
    assert info.value.details == {"key": "a", "reserved_bytes": 10}
    assert ledger.reservations() == {"a": 10}
    assert ledger.allocated == 10


def test_max_bytes_is_the_largest_figure_accepted() -> None:
    ledger = Ledger(MAX_BYTES)
    ledger.try_reserve("all", MAX_BYTES)
    assert ledger.free == 0
    with pytest.raises(ApplianceError) as info:
        ledger.try_reserve("one", 1)
    assert info.value.code == "VRAM_LEDGER_DENY"
    with pytest.raises(ApplianceError):
        Ledger(MAX_BYTES + 1)
    with pytest.raises(ApplianceError):
        Ledger(-1)


def test_zero_byte_reservation() -> None:
    ledger = Ledger(10)
    assert ledger.try_reserve("z", 0).nbytes == 0
    assert ledger.reservations() == {"z": 0}
    assert ledger.release("z") == 0
    assert ledger.reservations() == {}


def test_set_cap_keeps_existing_and_refuses_new() -> None:
    ledger = Ledger(100)
    ledger.try_reserve("a", 60)
    ledger.try_reserve("b", 30)
    ledger.set_cap(50)
    assert ledger.cap == 50
    assert ledger.reservations() == {"a": 60, "b": 30}  # nothing evicted
    assert ledger.allocated == 90
    assert ledger.free == 0
    with pytest.raises(ApplianceError) as info:
        ledger.try_reserve("c", 0)
    assert info.value.details["ledger_allocated_bytes"] == 90
    assert info.value.details["ledger_max_bytes"] == 50
    ledger.release("a")
    ledger.try_reserve("c", 20)
    assert ledger.allocated == 50
    ledger.set_cap(200)
    assert ledger.free == 150
    with pytest.raises(ApplianceError):
        ledger.set_cap(-5)
    assert ledger.cap == 200


def test_adjust_replaces_bytes_without_cap_check() -> None:
    ledger = Ledger(100)
    r = ledger.try_reserve("m", 40)
    assert ledger.adjust("m", 70) == 30
    assert ledger.allocated == 70
    assert ledger.adjust("m", 130) == 60  # the measurement wins, even above the cap
    assert ledger.allocated == 130
    assert ledger.free == 0
    with pytest.raises(ApplianceError):
        ledger.try_reserve("n", 1)
    assert ledger.adjust("m", 10) == -120
    assert ledger.reservations() == {"m": 10}
    assert r.nbytes == 40  # the grant record is not rewritten
    assert ledger.release("m") == 10  # release returns the adjusted figure
    with pytest.raises(KeyError):
        ledger.adjust("m", 5)
    ledger.try_reserve("m", 1)
    with pytest.raises(ApplianceError):
        ledger.adjust("m", -1)
    assert ledger.reservations() == {"m": 1}


def test_adjust_cannot_overflow_the_total() -> None:
    ledger = Ledger(MAX_BYTES)
    ledger.try_reserve("a", MAX_BYTES)
    ledger.try_reserve("b", 0)
    with pytest.raises(ApplianceError) as info:
        ledger.adjust("b", 1)
    assert info.value.code == "BAD_REQUEST"
    assert ledger.reservations() == {"a": MAX_BYTES, "b": 0}


def test_cancel_only_drops_its_own_grant() -> None:
    ledger = Ledger(100)
    first = ledger.try_reserve("m", 10)
    assert ledger.release("m") == 10
    ledger.try_reserve("m", 20)  # a new grant under the same key
    assert ledger.cancel(first) == 0
    assert ledger.reservations() == {"m": 20}


def test_reservation_guard_commit_keeps() -> None:
    ledger = Ledger(100)
    with ledger.reservation("m", 40) as r:
        assert ledger.reservations() == {"m": 40}
        assert r.reservation.nbytes == 40
        r.commit()
    assert r.committed
    assert ledger.reservations() == {"m": 40}


def test_reservation_guard_rolls_back_on_exception() -> None:
    ledger = Ledger(100)
    with pytest.raises(RuntimeError, match="load failed"), ledger.reservation("m", 40) as r:
        r.commit()  # even committed: an exception after commit still rolls back
        raise RuntimeError("load failed")
    assert not r.committed
    assert ledger.reservations() == {}
    assert ledger.allocated == 0


def test_reservation_guard_rolls_back_without_commit() -> None:
    ledger = Ledger(100)
    with ledger.reservation("m", 40):
        pass
    assert ledger.reservations() == {}


def test_reservation_guard_refusal_raises_before_body() -> None:
    ledger = Ledger(10)
    ledger.try_reserve("other", 5)
    ran = []
    with pytest.raises(ApplianceError) as info, ledger.reservation("m", 6):
        ran.append(True)
    assert info.value.code == "VRAM_LEDGER_DENY"
    assert ran == []
    assert ledger.reservations() == {"other": 5}


def test_reservation_guard_rollback_spares_a_later_grant() -> None:
    ledger = Ledger(100)
    with ledger.reservation("m", 10):
        ledger.release("m")
        ledger.try_reserve("m", 30)  # someone else's grant under the same key
    assert ledger.reservations() == {"m": 30}


def test_reservation_guard_misuse() -> None:
    ledger = Ledger(100)
    guard = ledger.reservation("m", 1)
    with pytest.raises(RuntimeError):
        guard.commit()
    with pytest.raises(RuntimeError):
        _ = guard.reservation
    assert ledger.reservations() == {}  # not reserved until entered
    with guard:
        guard.commit()
    with pytest.raises(RuntimeError):
        guard.commit()
    with pytest.raises(RuntimeError), guard:
        pass


def test_snapshot_is_frozen_and_consistent() -> None:
    ledger = Ledger(100)
    ledger.try_reserve("a", 30)
    snap = ledger.snapshot()
    assert isinstance(snap, LedgerSnapshot)
    assert (snap.cap, snap.allocated, dict(snap.reservations), snap.free) == (100, 30, {"a": 30}, 70)
    ledger.try_reserve("b", 5)
    assert dict(snap.reservations) == {"a": 30}
    with pytest.raises(TypeError):
        snap.reservations["c"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        snap.cap = 5  # type: ignore[misc]


def test_concurrent_reservations_never_exceed_cap() -> None:
    size, threads, cap = 7 * 2**20, 200, 7 * 2**20 * 37 + 123  # fits 37 of 200
    ledger = Ledger(cap)
    barrier = threading.Barrier(threads)
    admitted: list[str] = []
    refused: list[ApplianceError] = []
    other: list[BaseException] = []
    snapshots: list[LedgerSnapshot] = []
    done = threading.Event()

    def worker(i: int) -> None:
        barrier.wait()
        try:
            ledger.try_reserve(f"agent-{i}", size)
            admitted.append(f"agent-{i}")
        except ApplianceError as exc:
            refused.append(exc)
        except BaseException as exc:  # pragma: no cover - reported below
            other.append(exc)

    def observer() -> None:
        try:
            while not done.is_set():
                snapshots.append(ledger.snapshot())
        except BaseException as exc:  # pragma: no cover - reported below
            other.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so they really interleave
    try:
        watchers = [threading.Thread(target=observer) for _ in range(2)]
        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in watchers + workers:
            t.start()
        for t in workers:
            t.join()
        done.set()
        for t in watchers:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)

    assert other == []
    assert len(snapshots) > 0
    assert len(admitted) + len(refused) == threads
    assert len(admitted) == cap // size == 37
    assert ledger.allocated == 37 * size <= cap
    assert sorted(ledger.reservations()) == sorted(admitted)
    assert all(e.code == "VRAM_LEDGER_DENY" and e.details["requested_table_bytes"] == size for e in refused)
    assert all(e.details["ledger_allocated_bytes"] + size > cap for e in refused)
    snapshots.append(ledger.snapshot())
    for snap in snapshots:
        assert snap.allocated == sum(snap.reservations.values()) <= snap.cap
        assert snap.allocated == len(snap.reservations) * size


def test_concurrent_guards_roll_back_failed_loads() -> None:
    ledger = Ledger(1000)
    barrier = threading.Barrier(50)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            with ledger.reservation(f"m{i}", 30) as r:
                if i % 2:
                    raise OSError("load failed")
                r.commit()
        except (OSError, ApplianceError):
            pass

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(50)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    kept = ledger.reservations()
    assert all(int(key[1:]) % 2 == 0 for key in kept)
    assert ledger.allocated == 30 * len(kept) <= 1000
    assert len(kept) >= 1


class LedgerMachine(RuleBasedStateMachine):
    """Random reserve / release / cancel / guard / set_cap / adjust sequences against a plain-dict model."""

    keys = st.sampled_from(["a", "b", "c", "d", "e"])
    sizes = st.integers(min_value=0, max_value=200)

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(500)
        self.model: dict[str, int] = {}
        self.cap = 500
        self.over_cap_allowed = False  # set_cap / adjust may leave allocated above the cap
        self.grants: list[Reservation] = []
        self.tokens: dict[str, int] = {}  # key -> token of the grant held now

    @rule(key=keys, nbytes=sizes)
    def reserve(self, key: str, nbytes: int) -> None:
        before = self.ledger.snapshot()
        try:
            grant = self.ledger.try_reserve(key, nbytes)
        except ApplianceError as exc:
            assert self.ledger.snapshot() == before
            if exc.code == "BAD_REQUEST":
                assert key in self.model
            else:
                assert exc.code == "VRAM_LEDGER_DENY"
                assert key not in self.model
                assert sum(self.model.values()) + nbytes > self.cap
                assert exc.details == {"code": "CAP", "ledger_max_bytes": self.cap,
                                       "ledger_allocated_bytes": sum(self.model.values()),
                                       "requested_table_bytes": nbytes}
            return
        assert key not in self.model
        assert (grant.key, grant.nbytes) == (key, nbytes)
        self.grants.append(grant)
        self.model[key] = nbytes
        self.tokens[key] = grant.token
        assert sum(self.model.values()) <= self.cap

    @rule(key=keys)
    def release(self, key: str) -> None:
        assert self.ledger.release(key) == self.model.pop(key, 0)
        self.tokens.pop(key, None)

    @precondition(lambda self: bool(self.grants))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        grant = data.draw(st.sampled_from(self.grants))
        held = self.tokens.get(grant.key) == grant.token
        assert self.ledger.cancel(grant) == (self.model[grant.key] if held else 0)
        if held:
            del self.model[grant.key], self.tokens[grant.key]

    @rule(key=keys, nbytes=sizes, fail=st.booleans())
    def guarded_load(self, key: str, nbytes: int, fail: bool) -> None:
        fits = key not in self.model and sum(self.model.values()) + nbytes <= self.cap
        try:
            with self.ledger.reservation(key, nbytes) as r:
                assert fits
                if fail:
                    raise OSError("load failed")
                r.commit()
        except (OSError, ApplianceError):
            return
        self.model[key] = nbytes
        self.tokens[key] = r.reservation.token

    @rule(cap=st.integers(min_value=0, max_value=1000))
    def set_cap(self, cap: int) -> None:
        self.ledger.set_cap(cap)
        self.cap = cap
        self.over_cap_allowed = True

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), nbytes=sizes)
    def adjust(self, data: st.DataObject, nbytes: int) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        assert self.ledger.adjust(key, nbytes) == nbytes - self.model[key]
        self.model[key] = nbytes
        self.over_cap_allowed = True

    @invariant()
    def matches_model(self) -> None:
        snap = self.ledger.snapshot()
        assert dict(snap.reservations) == self.model
        assert snap.allocated == sum(snap.reservations.values())
        assert snap.cap == self.cap
        if snap.allocated <= snap.cap:
            self.over_cap_allowed = False
        assert snap.allocated <= snap.cap or self.over_cap_allowed
        assert snap.free == max(0, snap.cap - snap.allocated)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abcdef"), st.integers(0, 2**40)), max_size=60),
       st.integers(0, 2**41))
def test_reserve_release_sequences_keep_the_invariant(ops: list[tuple[bool, str, int]], cap: int) -> None:
    ledger = Ledger(cap)
    for is_reserve, key, nbytes in ops:
        if is_reserve:
            with contextlib.suppress(ApplianceError):
                ledger.try_reserve(key, nbytes)
        else:
            ledger.release(key)
        snap = ledger.snapshot()
        assert snap.allocated == sum(snap.reservations.values()) <= cap


@pytest.mark.parametrize(("total", "percent", "external", "expected"), [
    (100, 90, 0, 90),
    (1000, 90, 100, 800),
    (999, 90, 0, 899),  # floor(899.1)
    (80 * GIB, 90, 0, 72 * GIB),
    (80 * GIB, 90, 10 * GIB, 62 * GIB),
    (100, 90, 95, 0),  # never below zero
    (100, 100, 0, 100),
    (100, 0, 0, 0),
    (0, 90, 0, 0),
    (1000, 33.3, 0, 333),  # exact decimal, not float rounding
    (10**12, 92.5, 0, 925 * 10**9),
    (3, 50, 0, 1),
])
def test_compute_cap(total: int, percent: float, external: int, expected: int) -> None:
    assert compute_cap(total, percent, external) == expected


@given(st.integers(0, 2**50), st.integers(0, 100), st.integers(0, 2**50))
def test_compute_cap_property(total: int, percent: int, external: int) -> None:
    cap = compute_cap(total, percent, external)
    assert cap == max(0, int(Fraction(percent * total, 100)) - external)
    assert 0 <= cap <= total


@pytest.mark.parametrize(("args"), [(-1, 90), (100, 101), (100, -0.5), (100, float("nan")), (100, "90"),
                                     (1.5, 90), (100, 90, -1), (100, True)])
def test_compute_cap_rejects_bad_arguments(args: tuple) -> None:
    with pytest.raises(ValueError):
        compute_cap(*args)


def test_external_used() -> None:
    assert external_used(10 * GIB, 3 * GIB, 5 * GIB) == 7 * GIB  # measured own use wins
    assert external_used(10 * GIB, None, 4 * GIB) == 6 * GIB  # else the ledger stands in for it
    assert external_used(1 * GIB, 2 * GIB, 0) == 0  # never negative
