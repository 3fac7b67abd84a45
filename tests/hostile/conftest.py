"""The hostile suite: the appliance tried the way an attacker, a careless operator and a new user would.

Each case runs against a real appliance (real socket, real HTTP server, real tiny models) started by the
:func:`hostile` fixture, which also runs two things in the background for the whole case:

* a **neighbour**: a well-behaved line-protocol client that decodes a few tokens on its own agent, over and over;
* a **prober**: ``GET /v1/health`` on a kept-alive HTTP connection every :data:`PROBE_PERIOD_S`, timing each answer,
  and sampling the process's RSS.

When the case's body is done the fixture checks what every case must end with: the daemon alive and answering,
the neighbour served during the case (a request it sent while the case ran may end just after it, within the hang
bound), ``/v1/health`` fast throughout, no file that existed before the case
deleted, and open file descriptors back to their baseline. Each case adds a row to the summary table printed at
the end of the run; a run of the whole suite also writes it to ``benchmarks/results/hostile.json``.

Cases that cannot use a running appliance (start-up failures, config files) record their row with
:func:`record_case`.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import Running, running
from hostile_checks import (
    FD_SLACK,
    HEALTH_BOUND_MS,
    HUNG_S,
    PROBE_PERIOD_S,
    Neighbour,
    Prober,
    alive,
    check_health,
    files_under,
    open_fds,
    rss_bytes,
    settled_fds,
)

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "hostile.json"

# -- the summary table ------------------------------------------------------------------------------------------------


@dataclass
class CaseRow:
    case: str
    passed: bool = False
    crashed: bool = False
    hung: bool = False
    lost_data: bool = False  # a file, an agent or an acknowledged result that was there before the case is gone
    max_health_ms: float | None = None
    health_samples: int = 0
    rss_growth_mb: float | None = None
    neighbour_served: int | None = None
    neighbour_max_ms: float | None = None


ROWS: dict[str, CaseRow] = {}
COLLECTED: set[str] = set()  # every test of this folder in the session
RAN: set[str] = set()  # those that ran to their end


def _row(nodeid: str) -> CaseRow:
    row = ROWS.get(nodeid)
    if row is None:
        row = ROWS[nodeid] = CaseRow(nodeid.split("::", 1)[-1] if "::" in nodeid else nodeid)
        row.case = f"{Path(nodeid.split('::')[0]).stem.removeprefix('test_hostile_')}::{row.case}"
    return row


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            COLLECTED.add(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if item.nodeid in COLLECTED and report.when == "teardown":
        RAN.add(item.nodeid)
    if item.nodeid in ROWS and report.when in ("call", "teardown"):  # a case: it used hostile or record_case
        row = ROWS[item.nodeid]
        if report.when == "call":
            row.passed = report.passed
        elif report.failed:
            row.passed = False
    return report


def summary() -> dict[str, Any]:
    rows = list(ROWS.values())
    health = [r.max_health_ms for r in rows if r.max_health_ms is not None]
    rss = [r.rss_growth_mb for r in rows if r.rss_growth_mb is not None]
    return {
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "cases": len(rows),
        "failed": sum(not r.passed for r in rows),
        "crashes": sum(r.crashed for r in rows),
        "hangs": sum(r.hung for r in rows),
        "lost_data": sum(r.lost_data for r in rows),
        "max_health_ms": max(health, default=None),
        "max_rss_growth_mb": max(rss, default=None),
        "health_bound_ms": HEALTH_BOUND_MS,
        "rows": [asdict(r) for r in rows],
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def summary_table(doc: dict[str, Any]) -> list[str]:
    header = ("case", "ok", "crashed", "hung", "lost data", "max health ms", "rss growth MB", "neighbour served")
    rows = [(r["case"], _cell(r["passed"]), _cell(r["crashed"]), _cell(r["hung"]), _cell(r["lost_data"]),
             _cell(r["max_health_ms"]),
             _cell(r["rss_growth_mb"]), _cell(r["neighbour_served"])) for r in doc["rows"]]
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)) for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines.append(f"{doc['cases']} cases, {doc['failed']} failed, {doc['crashes']} crashes, {doc['hangs']} hangs, "
                 f"{doc['lost_data']} lost data, "
                 f"max health {_cell(doc['max_health_ms'])} ms (bound {doc['health_bound_ms']:g}), "
                 f"max RSS growth {_cell(doc['max_rss_growth_mb'])} MB")
    return lines


def whole_suite_ran() -> bool:
    """Every test file of this folder was collected, and every collected test ran to its end."""
    files = {path.name for path in Path(__file__).parent.glob("test_*.py")}
    collected_files = {Path(nodeid.split("::")[0]).name for nodeid in COLLECTED}
    return bool(COLLECTED) and collected_files >= files and COLLECTED <= RAN


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not ROWS:
        return
    doc = summary()
    terminalreporter.section("hostile suite")
    for line in summary_table(doc):
        terminalreporter.write_line(line)
    if whole_suite_ran():
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
        terminalreporter.write_line(f"written to {RESULTS.relative_to(REPO)}")


@pytest.fixture
def record_case(request: pytest.FixtureRequest) -> Callable[..., CaseRow]:
    """For cases without a running appliance: ``record_case(crashed=..., hung=...)`` fills this case's row."""

    def record(*, crashed: bool = False, hung: bool = False, lost_data: bool = False,
               max_health_ms: float | None = None, rss_growth_mb: float | None = None) -> CaseRow:
        row = _row(request.node.nodeid)
        row.crashed = row.crashed or crashed
        row.hung = row.hung or hung
        row.lost_data = row.lost_data or lost_data
        row.max_health_ms = max_health_ms
        row.rss_growth_mb = rss_growth_mb
        return row

    return record


# -- the running appliance and its two background clients -------------------------------------------------------------


@dataclass
class Hostile:
    """What a hostile case gets: the running appliance, where to put files, and the background clients."""

    app: Running
    state: Path
    model_dir: Path
    models: dict[str, Path]
    prober: Prober
    neighbour: Neighbour

    @property
    def http(self) -> str:
        return self.app.appliance.http_url or ""

    @property
    def socket(self) -> Path:
        return self.app.socket

    def model_path(self, name: str) -> Path:
        return self.models[name]

    def neighbour_served_since(self, count: int, timeout: float = HUNG_S) -> bool:
        """Wait until the neighbour was served after it had ``count`` answers; True if it was."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.neighbour.served > count:
                return True
            time.sleep(0.02)
        return False


def _marker_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers("hostile_config"))):
        extra.update(marker.kwargs)
    return extra


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hostile_config(**settings): extra appliance.yaml settings for the case")


@pytest.fixture
def hostile(request: pytest.FixtureRequest, tiny_model: Path, tiny_model_b: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    """A real appliance with a neighbour and a prober; the end-of-case checks run at teardown (module docstring)."""
    model_dir = tmp_path_factory.mktemp("hostile-models")
    models = {"demo": tiny_model, "demo-b": tiny_model_b}
    specs = {"demo": {"path": str(tiny_model), "n_ctx": 1024}, "demo-b": {"path": str(tiny_model_b), "n_ctx": 512}}
    extra = _marker_config(request)
    row = _row(request.node.nodeid)
    with running(specs, model_dirs=[model_dir, tiny_model.parent], **extra) as app:
        state = app.appliance.config.data_dir
        host, port = "127.0.0.1", int((app.appliance.http_url or "").rsplit(":", 1)[1])
        prober = Prober(host, port)
        neighbour = Neighbour(app.socket, "demo")
        threads = [threading.Thread(target=prober.run, name="hostile-prober", daemon=True),
                   threading.Thread(target=neighbour.run, name="hostile-neighbour", daemon=True)]
        for thread in threads:
            thread.start()
        h = Hostile(app, state, model_dir, models, prober, neighbour)
        assert h.neighbour_served_since(0), f"the neighbour was never served: {neighbour.errors}"
        time.sleep(PROBE_PERIOD_S * 3)  # the prober's connection is open: count it in the baseline
        before = files_under(state, model_dir)
        fds = open_fds()
        rss = rss_bytes()
        prober.rss_peak = rss
        served_at_start = neighbour.served
        yield h
        # A neighbour request that arrived while the case ran may end just after it (the case's own requests can
        # hold every sequence of the model for one batch): wait for it, within the hang bound.
        h.neighbour_served_since(served_at_start)
        served_during = neighbour.served - served_at_start
        try:
            answered = alive(app)
            fds_after = settled_fds(fds)
        finally:
            prober.stop.set()
            neighbour.stop.set()
            for thread in threads:
                thread.join(HUNG_S)
        row.neighbour_served = served_during
        row.max_health_ms = max(prober.latencies_ms, default=None)
        row.health_samples = len(prober.latencies_ms)
        row.neighbour_max_ms = max(neighbour.latencies_ms, default=None)
        row.rss_growth_mb = (prober.rss_peak - rss) / 1e6
        row.crashed = answered is None
        row.hung = answered is False or any(t.is_alive() for t in threads) or \
            max(neighbour.latencies_ms, default=0) > HUNG_S * 1000
        assert answered, "the daemon did not answer STATUS after the case"
        check_health(prober)
        assert served_during > 0, f"the neighbour was not served during the case: {neighbour.errors[-3:]}"
        missing = sorted(str(p) for p in before - files_under(state, model_dir) if not p.name.startswith("."))
        row.lost_data = row.lost_data or bool(missing)
        assert not missing, f"files deleted during the case: {missing}"
        assert fds_after <= fds + FD_SLACK, f"{fds_after} fds open after the case, {fds} before"


