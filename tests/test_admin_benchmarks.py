"""The admin page's Benchmarks tab over real HTTP against a real appliance: the list links each result to its
page (the fixed / adaptive / improvement table, both per-round SVG charts, the slack sweep, the thread curve, the
device class and every advice line, the concurrency curve and the caveats of a quick, single or contended run), an
older benchmark's JSON shows what it has, bad names are 404; "Apply advice" writes a commented config (comments
kept) and the reload record says ``benchmark``, after a confirmation step for a result with caveats; a run
started from the page (a stand-in for ``appliance benchmark``: a small script printing PROGRESS lines) shows its
progress, refuses a second start, ends with a link to its result or with its error, and stopping the appliance
ends it. Also the
pure parts alone: the PROGRESS parser and the SVG charts (parsed with xml.etree)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import running

from appliance.benchmark import jobs
from appliance.benchmark.jobs import BenchmarkJob
from appliance.benchmark.progress import MAX_LABEL_CHARS, Step, parse_progress
from appliance.http.admin import charts

WAIT_S = 60.0  # a bound for a slow, shared 2-core box
SVG = "{http://www.w3.org/2000/svg}"
REPOSITORY = Path(__file__).resolve().parents[1]

SAMPLE: dict[str, Any] = {
    "benchmark": "appliance_benchmark",
    "headline": "HEADLINE: appliance benchmark (tiny, quick) adaptive vs fixed: TTFT avg +23.4%",
    "quick": True,
    "finished_at": 1764590000.0,
    "wall_s": 42.0,
    "config_path": "/somewhere/appliance.yaml",
    "model": {"name": "tiny", "path": "/somewhere/tiny.gguf", "n_ctx": 2048, "weights_bytes": 12345678,
              "kv_bytes": 33554432},
    "machine": {"cores": 2, "memory_bytes": 8 * 1024**3, "device_kind": "host", "device_total_bytes": 8 * 1024**3},
    "workload": {"agents": 2, "rounds": 3, "description": "a variable-length agent session"},
    "strategies": {"fixed": {"label": "engine.adaptive false"}, "adaptive": {"label": "the adaptive engine"}},
    "table": {
        "fixed": {"ttft_avg_ms": 320.0, "ttft_p99_ms": 680.0, "tokens_per_s": 18.2,
                  "peak_memory_bytes": 1536 * 1024**2, "memory_growth_bytes": 210 * 1024**2},
        "adaptive": {"ttft_avg_ms": 245.0, "ttft_p99_ms": 490.0, "tokens_per_s": 24.7,
                     "peak_memory_bytes": 1024 * 1024**2, "memory_growth_bytes": 45 * 1024**2},
        "improvement": {"ttft_avg_ms": 0.234, "ttft_p99_ms": 0.279, "tokens_per_s": 0.357,
                        "peak_memory_bytes": 0.333, "memory_growth_bytes": None},
    },
    "rounds": {
        "fixed": [{"round": 1, "ttft_avg_ms": 300.0, "ttft_max_ms": 500.0, "rss_bytes": 1000 * 1024**2,
                   "hwm_bytes": 1100 * 1024**2, "tokens_per_s": 18.0},
                  {"round": 2, "ttft_avg_ms": None, "ttft_max_ms": None, "rss_bytes": 1100 * 1024**2,
                   "hwm_bytes": 1200 * 1024**2, "tokens_per_s": None},
                  {"round": 3, "ttft_avg_ms": 340.0, "ttft_max_ms": 680.0, "rss_bytes": 1210 * 1024**2,
                   "hwm_bytes": 1300 * 1024**2, "tokens_per_s": 18.4}],
        "adaptive": [{"round": 1, "ttft_avg_ms": 250.0, "ttft_max_ms": 400.0, "rss_bytes": 900 * 1024**2,
                      "hwm_bytes": 950 * 1024**2, "tokens_per_s": 24.0},
                     {"round": 2, "ttft_avg_ms": 240.0, "ttft_max_ms": 490.0, "rss_bytes": 930 * 1024**2,
                      "hwm_bytes": 960 * 1024**2, "tokens_per_s": 25.0},
                     {"round": 3, "ttft_avg_ms": 245.0, "ttft_max_ms": 450.0, "rss_bytes": 945 * 1024**2,
                      "hwm_bytes": 970 * 1024**2, "tokens_per_s": 25.1}],
    },
    "slack_sweep": [{"slack": 1.0, "ttft_avg_ms": 260.0, "ttft_p99_ms": 500.0, "peak_memory_bytes": 1050 * 1024**2,
                     "tokens_per_s": 24.0},
                    {"slack": 1.1, "ttft_avg_ms": 245.0, "ttft_p99_ms": 490.0, "peak_memory_bytes": 1200 * 1024**2,
                     "tokens_per_s": 24.7}],
    "thread_curve": [{"threads": 1, "tokens_per_s": 10.0}, {"threads": 2, "tokens_per_s": 17.0}],
    "concurrency_curve": [{"streams": 1, "tokens_per_s": 10.0}, {"streams": 2, "tokens_per_s": 18.5}],
    "concurrency": {"max_in_flight": 2, "models_in_use": 1},
    "repeats": 1,
    "cpu": {"others_share": 0.27},
    "device_class": {"name": "low", "reason": "2 cores < 3: low"},
    "advice": [
        {"key": "engine.hot_pool_slack", "value": 1.1, "current": 1.2,
         "reason": "slack 1.1 is the knee: TTFT 245.0 ms against 260.0 ms at 1.0, for 150 MiB more"},
        {"key": "engine.adaptive_window_size", "value": 32, "current": 64, "reason": "low device class: window 32"},
        {"key": None, "value": 3, "current": None, "reason": "model tiny: 3 instances fit <in 8 GiB>",
         "model": "tiny"},
    ],
    "complete": True,
}

STAND_IN = """
import json, os, signal, sys, time
out, mode, gate, sample, pid_file = sys.argv[1:6]
def say(line):
    print(line, file=sys.stderr, flush=True)
with open(pid_file, "w") as f:
    f.write(str(os.getpid()))
say("starting the fixed run")
say("PROGRESS 1 3 fixed: round 1/3")
if mode == "fail":
    say("appliance: the model file tiny.gguf is missing")
    sys.exit(2)
if mode == "empty":
    sys.exit(0)
if mode == "hang":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)
deadline = time.monotonic() + 120
while not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.05)
say("PROGRESS 2 3 adaptive: round 1/3")
say("PROGRESS garbage")
say("PROGRESS 3 3 advice")
with open(sample) as f:
    text = f.read()
with open(out, "w") as f:
    f.write(text)
"""
"""Stands in for ``appliance benchmark --progress lines --out OUT``: ``mode`` is ``ok`` (waits for the ``gate``
file after the first step, then writes ``sample`` to ``out``), ``fail``, ``empty`` (exits 0 without a result) or
``hang`` (ignores SIGTERM)."""


class StandIn:
    """A stand-in command line for :class:`BenchmarkJob`, recording what each run was asked for."""

    def __init__(self, folder: Path, mode: str, sample: dict[str, Any] | None = None) -> None:
        self.script = folder / "stand_in.py"
        self.script.write_text(STAND_IN)
        self.gate = folder / "gate"
        self.sample = folder / "sample.json"
        self.sample.write_text(json.dumps(sample or SAMPLE))
        self.pid_file = folder / "stand_in.pid"
        self.mode = mode
        self.calls: list[tuple[Path, Path, bool]] = []

    def __call__(self, config_path: Path, out: Path, quick: bool) -> list[str]:
        self.calls.append((config_path, out, quick))
        return [sys.executable, str(self.script), str(out), self.mode, str(self.gate), str(self.sample),
                str(self.pid_file)]

    def pid(self) -> int:
        def written() -> str:
            return self.pid_file.read_text() if self.pid_file.exists() else ""

        return int(wait_for(written, "the stand-in's pid"))


def wait_for(condition: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def poll_run(app, needle: str) -> httpx.Response:  # type: ignore[no-untyped-def]
    """The progress area as its poll gets it, once it shows ``needle``."""
    answers: list[httpx.Response] = []

    def shows() -> bool:
        answers.append(get(app, "/admin/benchmarks/_run?polling=1"))
        return needle in answers[-1].text

    wait_for(shows, f"the progress area to show {needle!r}")
    return answers[-1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped) counts as gone
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def app(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], watch=True,
                 engine={"hot_pool_slack": 1.2}) as running_app:
        yield running_app


def post(app, path: str, data: dict[str, str] | None = None) -> httpx.Response:  # type: ignore[no-untyped-def]
    """A same-origin admin POST with the page's CSRF header, as htmx sends it."""
    url = app.appliance.http_url
    headers = {"Origin": url, "X-CSRF-Token": app.appliance.csrf_token, "HX-Request": "true"}
    return httpx.post(url + path, data=data, headers=headers, timeout=WAIT_S)


def get(app, path: str) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.get(app.appliance.http_url + path, timeout=WAIT_S)


def save(app, name: str, document: Any) -> Path:  # type: ignore[no-untyped-def]
    folder = app.appliance.config.data_dir / "benchmarks"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


# -- the pure parts ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("line", "expected"), [
    ("PROGRESS 2 7 fixed: round 2/3\n", Step(2, 7, "fixed: round 2/3")),
    ("PROGRESS 0 1", Step(0, 1, "")),
    ("  PROGRESS 3 3   advice  ", Step(3, 3, "advice")),
    ("PROGRESS 1 2 " + "x" * 500, Step(1, 2, "x" * MAX_LABEL_CHARS)),
])
def test_a_progress_line_is_parsed(line: str, expected: Step) -> None:
    assert parse_progress(line) == expected


@pytest.mark.parametrize("line", [
    "", "PROGRESS", "PROGRESS 1", "progress 1 2 x", "PROGRESSING 1 2 x", "PROGRESS a 2 x", "PROGRESS 1 b x",
    "PROGRESS -1 2 x", "PROGRESS 3 2 over", "PROGRESS 0 0 nothing", "PROGRESS 1.5 2 x", "PROGRESS \u0661 2 x",
    "PROGRESS " + "9" * 5000 + " 1 huge", "appliance: PROGRESS 1 2", "x PROGRESS 1 2 y",
])
def test_any_other_line_is_not_progress_and_never_raises(line: str) -> None:
    assert parse_progress(line) is None


def test_a_failure_is_told_by_the_cli_error_line_or_else_the_exit() -> None:
    assert jobs.failure_message(["noise", "appliance: no model", "Traceback"], 2) == "no model"
    assert jobs.failure_message(["last words"], 1) == "the benchmark exited with code 1: last words"
    assert jobs.failure_message([], -signal.SIGKILL) == "the benchmark was ended by SIGKILL"


def test_the_command_line_runs_the_cli_on_the_running_config(tmp_path: Path) -> None:
    out = jobs.result_path(tmp_path, 1764590000.0)
    assert out.name == "appliance-benchmark-20251201-115320.json"
    out.write_text("{}")
    assert jobs.result_path(tmp_path, 1764590000.0).name == "appliance-benchmark-20251201-115320-2.json"
    command = jobs.cli_command(Path("/etc/appliance.yaml"), out, True)
    assert command[:4] == [sys.executable, "-m", "appliance", "benchmark"]
    assert command[command.index("--config") + 1] == "/etc/appliance.yaml"
    assert command[command.index("--out") + 1] == str(out)
    assert command[command.index("--progress") + 1] == "lines" and "--quick" in command
    assert "--quick" not in jobs.cli_command(Path("/etc/appliance.yaml"), out, False)


def chart_points(svg: str) -> dict[str, list[tuple[float, float, float, float]]]:
    """{series: [(x, y, cx, cy)]} of a chart's points, from the parsed SVG."""
    root = ET.fromstring(svg)
    found: dict[str, list[tuple[float, float, float, float]]] = {}
    for group in root.iter(f"{SVG}g"):
        name = group.get("data-series")
        if name is None:
            continue
        found[name] = [(float(c.get("data-x", "nan")), float(c.get("data-y", "nan")), float(c.get("cx", "nan")),
                        float(c.get("cy", "nan"))) for c in group.iter(f"{SVG}circle")]
    return found


def test_a_chart_maps_points_monotonically_and_breaks_the_line_at_none() -> None:
    series = {"fixed": [(1, 300.0), (2, None), (3, 340.0), (4, 310.0)],
              "adaptive": [(3, 245.0), (1, 250.0), (2, 240.0)]}
    svg = charts.line_chart(series, title="TTFT <per round>", x_label="round", y_label="TTFT",
                            y_format="{:.0f} ms".format)
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg" and root.get("role") == "img" and root.get("viewBox") == "0 0 640 320"
    assert root.get("aria-label") == "TTFT <per round>: TTFT by round"  # escaped in the markup, intact when parsed
    assert "TTFT &lt;per round&gt;" in svg and "style=" not in svg
    points = chart_points(svg)
    assert [(x, y) for x, y, _, _ in points["fixed"]] == [(1, 300), (3, 340), (4, 310)]  # no point for None
    every = points["fixed"] + points["adaptive"]
    for (x1, y1, cx1, cy1) in every:
        for (x2, y2, cx2, cy2) in every:
            if x1 < x2:
                assert cx1 < cx2
            if y1 < y2:
                assert cy1 > cy2  # SVG's y grows downwards
            if y1 == y2:
                assert cy1 == cy2
    lines = {group.get("data-series"): [line.get("points") for line in group.iter(f"{SVG}polyline")]
             for group in root.iter(f"{SVG}g") if group.get("data-series")}
    assert len(lines["fixed"]) == 1 and len(lines["fixed"][0].split()) == 2  # round 1 stands alone after the gap
    assert len(lines["adaptive"]) == 1 and len(lines["adaptive"][0].split()) == 3
    classes = {group.get("data-series"): group.get("class") for group in root.iter(f"{SVG}g")
               if group.get("data-series")}
    assert classes == {"fixed": "series series-fixed", "adaptive": "series series-adaptive"}
    hovers = [title.text for circle in root.iter(f"{SVG}circle") for title in circle.iter(f"{SVG}title")]
    assert "fixed: round 3: 340 ms" in hovers and len(hovers) == 6
    legend = [node.text for node in root.iter(f"{SVG}text") if node.get("class") == "legend-text"]
    assert legend == ["fixed", "adaptive"]


def test_a_chart_without_figures_says_so_and_ticks_are_round() -> None:
    svg = charts.line_chart({"fixed": [(1, None)], "adaptive": []}, title="Empty", x_label="round", y_label="ms")
    root = ET.fromstring(svg)
    assert not list(root.iter(f"{SVG}circle")) and "no figures to draw" in svg
    assert charts.axis_ticks(1, 3, whole=True) == [1, 2, 3]
    assert charts.axis_ticks(0.5, 7.3) == [0, 2, 4, 6, 8]
    single = charts.axis_ticks(5, 5)
    assert single[0] < 5 < single[-1]
    with pytest.raises(ValueError, match="finite"):
        charts.axis_ticks(2, 1)


# -- the pages -----------------------------------------------------------------------------------------------------
def test_the_list_links_to_a_result_page_with_its_table_charts_and_advice(app) -> None:  # type: ignore[no-untyped-def]
    save(app, "appliance-benchmark-20251201-115320.json", SAMPLE)
    listing = get(app, "/admin/benchmarks")
    assert listing.status_code == 200
    assert '<a href="/admin/benchmarks/result/appliance-benchmark-20251201-115320.json">' in listing.text
    assert '<form id="benchmark-form" hx-post="/admin/benchmarks/run"' in listing.text
    assert re.search(r'<input type="checkbox" name="quick" value="on" checked>', listing.text)

    page = get(app, "/admin/benchmarks/result/appliance-benchmark-20251201-115320.json")
    assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
    html = page.text
    assert SAMPLE["headline"] in html
    rows = {
        "ttft_avg_ms": ["TTFT average", "320.0 ms", "245.0 ms", "+23.4%"],
        "ttft_p99_ms": ["TTFT P99", "680.0 ms", "490.0 ms", "+27.9%"],
        "tokens_per_s": ["Throughput", "18.2 tokens/s", "24.7 tokens/s", "+35.7%"],
        "peak_memory_bytes": ["Peak memory", "1.5 GiB", "1.0 GiB", "+33.3%"],
        "memory_growth_bytes": ["Memory growth", "210.0 MiB", "45.0 MiB", "\u2014"],
    }
    for key, cells in rows.items():
        assert f'<tr data-figure="{key}"><td>' + "</td><td>".join(cells) + "</td></tr>" in html, key
    svgs = re.findall(r'<svg xmlns="http://www.w3.org/2000/svg" class="chart".*?</svg>', html, re.DOTALL)
    assert len(svgs) == 3  # TTFT and memory per round, and the thread curve
    ttft, memory = (ET.fromstring(svg) for svg in svgs[:2])
    assert ttft.get("aria-label").startswith("Time to first token per round")
    assert memory.get("aria-label").startswith("Memory (RSS) per round")
    assert len(chart_points(svgs[1])["fixed"]) == 3 and len(chart_points(svgs[0])["fixed"]) == 2
    assert "<td>1.1</td><td>245.0 ms</td><td>490.0 ms</td><td>1.2 GiB</td><td>24.7 tokens/s</td>" in html
    assert "<tr><td>2</td><td>17.0 tokens/s</td></tr>" in html
    assert "Device class: <strong>low</strong> (2 cores &lt; 3: low)" in html
    assert '<li data-key="engine.hot_pool_slack">' in html and "1.2 &rarr; <strong>1.1</strong>" in html
    assert "model tiny: 3 instances fit &lt;in 8 GiB&gt;" in html and "Model tiny: <strong>3</strong>" in html
    assert 'hx-post="/admin/benchmarks/result/appliance-benchmark-20251201-115320.json/apply"' in html
    assert "<tr><td>2</td><td>18.5 tokens/s</td></tr>" in html  # the concurrency curve
    caveats = re.search(r'<div class="warn" id="benchmark-caveats">(.*?)</div>', html, re.DOTALL)
    assert caveats is not None, "a quick, single, contended run is marked"
    assert "a quick run (--quick)" in caveats.group(1) and "each measurement ran once" in caveats.group(1)
    assert "other processes used 27% of the CPU during the run" in caveats.group(1)
    assert "<dt>Caveats</dt><dd>quick, single run, contended</dd>" in html
    assert re.search(r"This run has caveats \(above\): Apply asks\s+you to confirm first", html)
    trusted = {**SAMPLE, "quick": False, "repeats": 3, "cpu": {"others_share": 0.02}}
    save(app, "trusted.json", trusted)
    calm = get(app, "/admin/benchmarks/result/trusted.json").text
    assert "benchmark-caveats" not in calm and "<dt>Caveats</dt><dd>none</dd>" in calm


def test_an_older_result_or_one_without_advice_shows_what_it_has(app) -> None:  # type: ignore[no-untyped-def]
    save(app, "agent_session.json", json.loads((REPOSITORY / "benchmarks/results/agent_session.json").read_text()))
    save(app, "bare.json", {"benchmark": "http", "headline": "HEADLINE: http <fast>", "rounds": 3, "table": [1],
                            "advice": "none", "model": "tiny", "quick": [1]})
    save(app, "broken.json", "{not json")
    save(app, "list.json", "[1, 2]")
    older = get(app, "/admin/benchmarks/result/agent_session.json")
    assert older.status_code == 200 and "HEADLINE: agent_session" in older.text
    assert "apply-advice" not in older.text and "benchmark-table" not in older.text
    bare = get(app, "/admin/benchmarks/result/bare.json")
    assert bare.status_code == 200 and "HEADLINE: http &lt;fast&gt;" in bare.text and "<svg" not in bare.text
    for name in ("broken.json", "list.json"):
        refused = get(app, f"/admin/benchmarks/result/{name}")
        assert refused.status_code == 400 and name in refused.json()["error"]["message"], name
    listing = get(app, "/admin/benchmarks").text
    assert 'href="/admin/benchmarks/result/bare.json"' in listing
    assert 'href="/admin/benchmarks/result/broken.json"' not in listing  # not readable: listed, not linked


def test_bad_result_names_are_404(app) -> None:  # type: ignore[no-untyped-def]
    save(app, "real.json", SAMPLE)
    (app.appliance.config.data_dir / "benchmarks" / "notes.txt").write_text("not a result")
    for name in ("nope.json", "notes.txt", "real", "a%20b.json", "..%2Fappliance.yaml", "%2E%2E.json", "r%C3%A9.json"):
        response = get(app, f"/admin/benchmarks/result/{name}")
        assert response.status_code == 404, name
        assert response.json()["error"]["code"] == "NOT_FOUND", name
    message = get(app, "/admin/benchmarks/result/notes.txt").json()["error"]["message"]
    assert "not the name of a saved result" in message
    assert "no saved result nope.json" in get(app, "/admin/benchmarks/result/nope.json").json()["error"]["message"]
    assert post(app, "/admin/benchmarks/result/nope.json/apply").status_code == 200  # a result area's answer
    assert post(app, "/admin/benchmarks/result/nope.json/apply").headers["x-appliance-outcome"] == "NOT_FOUND"


def test_apply_writes_the_commented_config_and_reloads_with_the_benchmark_trigger(app) -> None:  # type: ignore[no-untyped-def]
    save(app, "advised.json", SAMPLE)
    config = app.config_file
    commented = "# the operator's notes: keep me\n" + config.read_text().replace(
        "hot_pool_slack: 1.2", "hot_pool_slack: 1.2  # tuned by hand")
    app.edit(commented)

    def reloaded() -> bool:
        return app.appliance.config_report().get("reloads", 0) >= 1

    wait_for(reloaded, "the edit's reload")

    asked = post(app, "/admin/benchmarks/result/advised.json/apply")  # a quick, single, contended run: asked first
    assert asked.status_code == 200 and asked.headers["x-appliance-outcome"] == "confirm", asked.text
    assert config.read_text() == commented and app.appliance.config.engine.hot_pool_slack == 1.2  # nothing written
    assert 'data-outcome="confirm"' in asked.text and "other processes used 27% of the CPU" in asked.text
    assert '<input type="hidden" name="confirm" value="yes">' in asked.text and "<html" not in asked.text
    assert 'hx-post="/admin/benchmarks/result/advised.json/apply"' in asked.text
    assert all(record["trigger"] != "benchmark" for record in app.appliance.reload_history())
    wrong = post(app, "/admin/benchmarks/result/advised.json/apply", {"confirm": "maybe"})
    assert wrong.headers["x-appliance-outcome"] == "confirm" and config.read_text() == commented

    response = post(app, "/admin/benchmarks/result/advised.json/apply", {"confirm": "yes"})
    assert response.status_code == 200 and response.headers["x-appliance-outcome"] == "ok", response.text
    assert response.headers["hx-trigger"] == "appliance-changed"
    text = config.read_text()
    assert text.startswith("# the operator's notes: keep me\n") and "hot_pool_slack: 1.1  # tuned by hand" in text
    assert "adaptive_window_size: 32" in text
    assert app.appliance.config.engine.hot_pool_slack == 1.1 and app.appliance.config.engine.adaptive_window_size == 32
    last = app.appliance.reloader.history.last
    assert last.trigger == "benchmark" and last.result == "applied"
    html = response.text
    assert '<pre class="diff-text" id="apply-diff">' in html
    assert "-  hot_pool_slack: 1.2  # tuned by hand\n+  hot_pool_slack: 1.1  # tuned by hand" in html
    assert 'data-result="applied" data-trigger="benchmark"' in html and "<html" not in html
    assert "<strong>applied</strong> (benchmark)" in get(app, "/admin/config").text

    again = post(app, "/admin/benchmarks/result/advised.json/apply", {"confirm": "yes"})
    assert again.headers["x-appliance-outcome"] == "ok" and "Nothing to apply" in again.text
    assert app.appliance.reloader.history.last == last  # no second reload


def test_apply_of_a_trusted_run_needs_no_confirmation(app) -> None:  # type: ignore[no-untyped-def]
    """A full run, repeated, on a quiet box: Apply writes at once."""
    save(app, "trusted.json", {**SAMPLE, "quick": False, "repeats": 3, "cpu": {"others_share": 0.02}})
    response = post(app, "/admin/benchmarks/result/trusted.json/apply")
    assert response.headers["x-appliance-outcome"] == "ok", response.text
    assert "hot_pool_slack: 1.1" in app.config_file.read_text()
    assert app.appliance.reloader.history.last.trigger == "benchmark"


def test_apply_refuses_advice_the_config_would_refuse(app) -> None:  # type: ignore[no-untyped-def]
    before = app.config_file.read_text()
    bad = {**SAMPLE, "advice": [{"key": "engine.hot_pool_slack", "value": 99.0, "current": 1.2, "reason": "r"}]}
    save(app, "bad.json", bad)
    refused = post(app, "/admin/benchmarks/result/bad.json/apply", {"confirm": "yes"})
    assert refused.headers["x-appliance-outcome"] == "CONFIG_INVALID" and "hot_pool_slack" in refused.text
    malformed = {**SAMPLE, "advice": [{"key": "engine.hot_pool_slack", "value": 1.1}]}
    save(app, "malformed.json", malformed)
    unreadable = post(app, "/admin/benchmarks/result/malformed.json/apply", {"confirm": "yes"})
    assert unreadable.headers["x-appliance-outcome"] == "BAD_REQUEST" and "advice entry 1" in unreadable.text
    assert app.config_file.read_text() == before
    assert all(record["trigger"] != "benchmark" for record in app.appliance.reload_history())


def test_a_run_in_place_measures_this_appliance_through_its_own_socket(
        app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stand_in = StandIn(tmp_path, "ok")
    app.appliance.benchmark_job = BenchmarkJob(stand_in)
    started = post(app, "/admin/benchmarks/run", {"quick": "on", "in_place": "on"})
    assert started.headers["x-appliance-outcome"] == "ok" and "in place" in started.text
    argv = app.appliance.benchmark_job.argv
    assert argv[-2:] == ["--socket", str(app.appliance.config.socket.path)]
    assert "(in place)" in poll_run(app, "1 of 3 steps").text
    stand_in.gate.touch()
    poll_run(app, 'data-state="finished"')
    post(app, "/admin/benchmarks/run", {"quick": "on"})
    assert "--socket" not in app.appliance.benchmark_job.argv  # unticked: processes of the run's own
    stand_in.gate.touch()
    poll_run(app, 'data-state="finished"')


def test_the_run_form_picks_a_configured_model(app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    page = get(app, "/admin/benchmarks").text
    picker = page[page.index('<select name="model" id="benchmark-model" required>'):]
    assert re.findall(r'<option value="([^"]+)"', picker[:picker.index("</select>")]) == ["tiny"]
    stand_in = StandIn(tmp_path, "ok")
    app.appliance.benchmark_job = BenchmarkJob(stand_in)
    unknown = post(app, "/admin/benchmarks/run", {"quick": "on", "model": "nope"})
    assert unknown.headers["x-appliance-outcome"] == "BAD_REQUEST" and "no model named" in unknown.text
    assert stand_in.calls == []  # nothing started
    started = post(app, "/admin/benchmarks/run", {"quick": "on", "model": "tiny"})
    assert started.headers["x-appliance-outcome"] == "ok"
    assert app.appliance.benchmark_job.argv[-2:] == ["--model", "tiny"]
    stand_in.gate.touch()
    poll_run(app, 'data-state="finished"')


def test_a_run_shows_its_progress_refuses_a_second_start_then_links_its_result(
        app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stand_in = StandIn(tmp_path, "ok")
    app.appliance.benchmark_job = BenchmarkJob(stand_in)
    idle = get(app, "/admin/benchmarks/_run")
    assert 'data-state="idle"' in idle.text and 'hx-trigger="appliance-changed from:body"' in idle.text

    started = post(app, "/admin/benchmarks/run", {"quick": "on"})
    assert started.headers["x-appliance-outcome"] == "ok" and started.headers["hx-trigger"] == "appliance-changed"
    (config_path, out, quick), = stand_in.calls
    assert config_path == app.config_file and quick is True
    assert out.parent == app.appliance.config.data_dir / "benchmarks" and out.name in started.text

    running_html = poll_run(app, "1 of 3 steps").text
    assert 'hx-trigger="every 1s"' in running_html and '<progress id="benchmark-progress" max="3" value="1">' \
        in running_html and "fixed: round 1/3" in running_html
    assert "hx-trigger" not in get(app, "/admin/benchmarks/_run?polling=1").headers  # still running: no refresh
    page = get(app, "/admin/benchmarks").text
    assert 'data-state="running"' in page

    second = post(app, "/admin/benchmarks/run", {"quick": "on"})
    assert second.headers["x-appliance-outcome"] == "BENCHMARK_RUNNING" and "already running" in second.text
    assert len(stand_in.calls) == 1

    stand_in.gate.touch()
    finished = poll_run(app, 'data-state="finished"')
    assert finished.headers["hx-trigger"] == "appliance-changed"  # the list refreshes, once
    assert f'<a id="benchmark-result-link" href="/admin/benchmarks/result/{out.name}">' in finished.text
    assert "every 1s" not in finished.text and "hx-trigger" not in get(app, "/admin/benchmarks/_run").headers
    assert json.loads(out.read_text())["headline"] == SAMPLE["headline"]
    assert f'href="/admin/benchmarks/result/{out.name}"' in get(app, "/admin/benchmarks").text
    status = app.appliance.benchmark_job.status()
    assert status.state == "finished" and status.exit_code == 0 and (status.done, status.total) == (3, 3)
    assert status.tail == ("starting the fixed run", "PROGRESS garbage")  # not progress lines: kept

    unchecked = post(app, "/admin/benchmarks/run", {})  # the quick box unticked
    assert unchecked.headers["x-appliance-outcome"] == "ok" and stand_in.calls[-1][2] is False


def test_a_failing_run_shows_its_error(app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    app.appliance.benchmark_job = BenchmarkJob(StandIn(tmp_path, "fail"))
    assert post(app, "/admin/benchmarks/run", {"quick": "on"}).headers["x-appliance-outcome"] == "ok"
    failed = poll_run(app, 'data-state="failed"').text
    assert "(exit code 2)" in failed and '<span id="benchmark-error">the model file tiny.gguf is missing</span>' \
        in failed
    assert "starting the fixed run" in failed  # its last output
    assert not list((app.appliance.config.data_dir / "benchmarks").glob("*.json"))

    app.appliance.benchmark_job = BenchmarkJob(StandIn(tmp_path, "empty"))
    assert post(app, "/admin/benchmarks/run", {"quick": "on"}).headers["x-appliance-outcome"] == "ok"
    empty = poll_run(app, 'data-state="failed"').text
    assert "(exit code 0)" in empty and "exited 0 but wrote no result" in empty

    def missing_program(config_path: Path, out: Path, quick: bool) -> list[str]:
        return [str(tmp_path / "no-such-program")]

    app.appliance.benchmark_job = BenchmarkJob(missing_program)
    unstartable = post(app, "/admin/benchmarks/run", {"quick": "on"})
    assert unstartable.headers["x-appliance-outcome"] == "INTERNAL" and "cannot start the benchmark" in unstartable.text
    assert "cannot start the benchmark" in get(app, "/admin/benchmarks/_run").text
    assert app.appliance.benchmark_job.status().state == "failed"  # a new start is allowed


def test_a_run_needs_a_config_file_and_the_csrf_header(tiny_model: Path, tmp_path: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        stand_in = StandIn(tmp_path, "ok")
        app.appliance.benchmark_job = BenchmarkJob(stand_in)
        assert "started without a config file" in get(app, "/admin/benchmarks").text
        refused = post(app, "/admin/benchmarks/run", {"quick": "on"})
        assert refused.headers["x-appliance-outcome"] == "BAD_REQUEST" and "config file" in refused.text
        url = app.appliance.http_url
        forged = httpx.post(url + "/admin/benchmarks/run", data={"quick": "on"}, headers={"Origin": url})
        assert forged.status_code == 403 and forged.json()["error"]["code"] == "FORBIDDEN"
        assert not stand_in.calls


def test_stopping_the_appliance_stops_the_run(tiny_model: Path, tmp_path: Path) -> None:
    stand_in = StandIn(tmp_path, "hang")  # ignores SIGTERM: killed after the grace period
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], watch=True) as app:
        assert isinstance(app.appliance.benchmark_job, BenchmarkJob)  # the appliance's own job (appliance/app.py)
        app.appliance.benchmark_job = BenchmarkJob(stand_in, stop_grace_s=0.5)
        assert post(app, "/admin/benchmarks/run", {"quick": "on"}).headers["x-appliance-outcome"] == "ok"
        pid = stand_in.pid()
        poll_run(app, "1 of 3 steps")
        assert alive(pid)
        app.call(app.appliance.stop())
        assert not alive(pid)
        status = app.appliance.benchmark_job.status()
        assert status.state == "failed" and status.error == "stopped: the appliance is shutting down"
        assert status.exit_code == -signal.SIGKILL
