"""Table-driven unit tests of the pure daemon policies (L4, L7, L11, R4, and the idle release of HTTP agents): no
models, no clocks, no sleeps."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from appliance.daemon.policy import (
    AgentView,
    HolderView,
    ModelView,
    dozing,
    expired,
    idle_agents,
    inside,
    sweep_period,
    unload_on_release,
)


def view(key: str = "m", *, loaded: bool = True, refcount: int = 0, inflight: int = 0, last_used: float = 100.0,
         ttl: float = 60.0) -> ModelView:
    return ModelView(key, loaded, refcount, inflight, last_used, ttl)


# -- expired (L7) ------------------------------------------------------------------------------------------

EXPIRED_ONE = [
    # (model, now, expired?)
    (view(), 160.0, True),  # idle exactly its TTL
    (view(), 1e9, True),  # idle far past it
    (view(), 159.999, False),  # a hair short
    (view(), 100.0, False),  # just used
    (view(loaded=False), 1e9, False),  # nothing to unload
    (view(refcount=1), 1e9, False),  # an agent holds it (L4 frees it on the last UNREGISTER instead)
    (view(inflight=1), 1e9, False),  # a stateless request runs on it
    (view(refcount=2, inflight=3), 1e9, False),
    (view(ttl=0), 1e9, False),  # a TTL of 0 = never
    (view(ttl=0.5, last_used=0.0), 0.5, True),  # sub-second TTLs work
    (view(last_used=200.0), 150.0, False),  # a last use "in the future" is not idle
]


@pytest.mark.parametrize(("model", "now", "want"), EXPIRED_ONE)
def test_expired_single_model(model: ModelView, now: float, want: bool) -> None:
    assert expired([model], now) == (["m"] if want else [])


def test_expired_picks_the_idle_ones_in_order() -> None:
    models = [view("a", last_used=0), view("b", last_used=150), view("c", last_used=10, ttl=0),
              view("d", last_used=50, ttl=100), view("e", last_used=0, refcount=1), view("f", last_used=40)]
    assert expired(models, 150.0) == ["a", "d", "f"]
    assert expired(models, 0.0) == []
    assert expired([], 1e9) == []
    assert expired(iter(models), 1e9) == ["a", "b", "d", "f"]  # any iterable


# -- unload_on_release (L4) --------------------------------------------------------------------------------

RELEASE = [
    # (loaded, refcount, inflight, unload?)
    (True, 0, 0, True),  # the last agent left: free it now
    (True, 1, 0, False),  # another agent still uses it
    (True, 0, 1, False),  # an anonymous request still runs: the idle TTL frees it later
    (True, 3, 2, False),
    (False, 0, 0, False),  # not loaded (a failed load, or already unloaded)
]


@pytest.mark.parametrize(("loaded", "refcount", "inflight", "want"), RELEASE)
def test_unload_on_release(loaded: bool, refcount: int, inflight: int, want: bool) -> None:
    assert unload_on_release(view(loaded=loaded, refcount=refcount, inflight=inflight)) is want


def test_unload_on_release_ignores_idle_time() -> None:
    assert unload_on_release(view(last_used=0, ttl=0))
    assert unload_on_release(view(last_used=1e9, ttl=1e9))


# -- inside (R4) -------------------------------------------------------------------------------------------

P = PurePosixPath

INSIDE = [
    # (path, folders, inside?)
    ("/models/a.gguf", ["/models"], True),
    ("/models/sub/deep/a.gguf", ["/models"], True),
    ("/models", ["/models"], True),  # the folder itself
    ("/models2/a.gguf", ["/models"], False),  # a sibling sharing the prefix is outside
    ("/modelsa.gguf", ["/models"], False),
    ("/a.gguf", ["/models"], False),  # the parent
    ("/", ["/models"], False),
    ("/other/a.gguf", ["/models", "/other"], True),  # any of several folders
    ("/other/a.gguf", ["/models", "/elsewhere"], False),
    ("/models/a.gguf", [], False),  # no folders: nothing is inside
    ("/models/a.gguf", ["/"], True),  # the root holds everything
]


@pytest.mark.parametrize(("path", "folders", "want"), INSIDE)
def test_inside(path: str, folders: list[str], want: bool) -> None:
    assert inside(P(path), [P(f) for f in folders]) is want


def test_inside_takes_resolved_paths_only() -> None:
    """``..`` is not interpreted: callers resolve first (the daemon does), so an unresolved escape is not
    mistaken for a path inside."""
    assert inside(P("/models/../etc/passwd"), [P("/models")]) is True  # lexically inside: resolve first!
    assert inside(P("/etc/passwd"), [P("/models")]) is False


# -- idle agents (L11) -------------------------------------------------------------------------------------

IDLE_AGENT = [
    # (last_used, busy, now, ttl, expired?)
    (100.0, False, 160.0, 60.0, True),  # idle exactly its TTL
    (100.0, False, 159.999, 60.0, False),  # a hair short
    (100.0, True, 1e9, 60.0, False),  # a command runs or waits on it
    (100.0, False, 1e9, 0.0, False),  # 0 = agents never expire (the default)
    (200.0, False, 150.0, 60.0, False),  # a use "in the future" is not idle
    (0.0, False, 0.25, 0.25, True),  # sub-second TTLs work
]


@pytest.mark.parametrize(("last_used", "busy", "now", "ttl", "want"), IDLE_AGENT)
def test_idle_agents_single(last_used: float, busy: bool, now: float, ttl: float, want: bool) -> None:
    assert idle_agents([AgentView("a", last_used, busy)], now, ttl) == (["a"] if want else [])


def test_idle_agents_picks_the_idle_ones_in_order() -> None:
    agents = [AgentView("old", 0.0, False), AgentView("fresh", 90.0, False), AgentView("busy", 0.0, True),
              AgentView("older", -5.0, False)]
    assert idle_agents(agents, 100.0, 60.0) == ["old", "older"]


# -- the sweep period ----------------------------------------------------------------------------------------

SWEEP = [
    ([], 5.0),  # nothing expires: the longest period
    ([0.0, 0.0], 5.0),  # 0 = off
    ([8.0], 2.0),  # a quarter of the TTL
    ([3600.0, 8.0, 0.0], 2.0),  # the shortest TTL that is on
    ([0.1], 0.05),  # never busier than 20 sweeps a second
    ([1e9], 5.0),  # never lazier than one sweep every 5 s
]


@pytest.mark.parametrize(("ttls", "want"), SWEEP)
def test_sweep_period(ttls: list[float], want: float) -> None:
    assert sweep_period(ttls) == want


# -- dozing: idle HTTP agents let their model go (issue #26) ----------------------------------------------------


def holder(agent: str, model: str = "m", *, dormant: bool = False, releases: bool = True,
           busy: bool = False) -> HolderView:
    return HolderView(agent, model, dormant, releases, busy)


DOZING = [
    # (model, holders, now, agents that go dormant or None)
    (view(refcount=1), [holder("u@m")], 160.0, ["u@m"]),  # idle its TTL, held by one HTTP agent
    (view(refcount=2), [holder("v@m"), holder("u@m")], 160.0, ["u@m", "v@m"]),
    (view(refcount=1), [holder("u@m")], 159.9, None),  # not idle long enough
    (view(refcount=1, ttl=0.0), [holder("u@m")], 1e9, None),  # a TTL of 0: never
    (view(refcount=1, inflight=1), [holder("u@m")], 160.0, None),  # a stateless request runs
    (view(refcount=1), [holder("u@m", busy=True)], 160.0, None),  # its agent decodes or waits
    (view(refcount=2), [holder("u@m"), holder("line", releases=False)], 160.0, None),  # a REGISTER holds it
    (view(refcount=2), [holder("u@m")], 160.0, None),  # a registration in progress holds a count too
    (view(refcount=0), [holder("u@m", dormant=True)], 160.0, None),  # nobody holds it: `expired` decides
    (view(refcount=1), [holder("u@m", dormant=True), holder("w@m")], 160.0, ["w@m"]),
    (view(refcount=1, loaded=False), [holder("u@m")], 160.0, None),
    (ModelView("m", True, 1, 0, 100.0, 60.0, retired=True), [holder("u@m")], 160.0, None),  # retiring decides
    (view(refcount=1), [holder("u@m", model="other")], 160.0, None),  # that agent holds another model
]


@pytest.mark.parametrize(("model", "holders", "now", "want"), DOZING)
def test_dozing(model: ModelView, holders: list[HolderView], now: float, want: list[str] | None) -> None:
    assert dozing([model], holders, now) == ({} if want is None else {"m": want})


def test_dozing_decides_each_model_on_its_own() -> None:
    models = [view("a", refcount=1), view("b", refcount=2), view("c", refcount=1, last_used=150.0)]
    holders = [holder("u@a", "a"), holder("u@b", "b"), holder("line", "b", releases=False), holder("u@c", "c")]
    assert dozing(models, holders, 160.0) == {"a": ["u@a"]}
