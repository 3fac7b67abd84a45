"""The Benchmarks tab: the saved results (JSON files under ``<data_dir>/benchmarks/``, each with its ``benchmark``
name and ``headline``, newest first), a run of ``appliance benchmark`` started from the page with its progress
(:class:`~appliance.benchmark.jobs.BenchmarkJob`, polled by htmx every second while it runs), one result's page
(the fixed-against-adaptive table, per-round charts, the slack sweep, the thread curve, the device class and the
advice), and "Apply advice": the same path as ``appliance benchmark --apply`` (the advised keys written into the
running config's file, comments kept), then a reload recorded as coming from the benchmark.

A result is read leniently: an older benchmark's JSON (``agent_session``, ``http`` ...) or one without advice shows
what it has.
"""

from __future__ import annotations

import asyncio
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from appliance.benchmark import quality
from appliance.config.secrets import redact, values_of
from appliance.errors import ApplianceError
from appliance.http.admin import charts, figures, pickers, render

if TYPE_CHECKING:
    from appliance.app import Appliance
    from appliance.benchmark.apply import Applied
    from appliance.benchmark.jobs import BenchmarkJob

MAX_RESULTS = 200
MAX_RESULT_BYTES = 4 * 1024 * 1024
"""A larger file is listed without reading it."""
RESULT_NAME = re.compile(r"[A-Za-z0-9._-]+\.json")
"""The names a result page is served for (no path separators, nothing to escape in a URL)."""
STRATEGIES = ("fixed", "adaptive")
RELOAD_OUTCOMES = {"applied": "ok", "unchanged": "ok", "invalid": "CONFIG_INVALID", "failed": "INTERNAL"}
"""The ``X-Appliance-Outcome`` of "Apply advice" for each reload result (the file is written either way)."""
EMPTY = "\u2014"
MIB = 1024**2


def summary(path: Path) -> dict[str, Any]:
    """One saved result: its file, time and size, and its benchmark name and headline when it has them."""
    stat = path.stat()
    row: dict[str, Any] = {"file": path.name, "at": stat.st_mtime, "bytes": stat.st_size, "benchmark": None,
                           "headline": None, "problem": None, "quick": False,
                           "linked": RESULT_NAME.fullmatch(path.name) is not None}
    if stat.st_size > MAX_RESULT_BYTES:
        row["problem"] = f"larger than {MAX_RESULT_BYTES} bytes: not read"
        return row
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        row["problem"] = f"not readable JSON ({type(exc).__name__})"
        return row
    if isinstance(document, dict):
        row["benchmark"] = document.get("benchmark") if isinstance(document.get("benchmark"), str) else None
        row["headline"] = document.get("headline") if isinstance(document.get("headline"), str) else None
        row["quick"] = document.get("quick") is True
    return row


def saved_results(folder: Path) -> list[dict[str, Any]]:
    """The result files in ``folder``, newest first (at most :data:`MAX_RESULTS`); none when it does not exist."""
    if not folder.is_dir():
        return []
    rows = []
    for path in folder.glob("*.json"):
        try:
            if path.is_file():
                rows.append(summary(path))
        except OSError:
            continue  # removed meanwhile
    rows.sort(key=operator.itemgetter("at"), reverse=True)
    return rows[:MAX_RESULTS]


def read_result(folder: Path, name: str) -> dict[str, Any]:
    """The saved result ``name`` in ``folder`` as a JSON object. ``NOT_FOUND`` for a name outside
    :data:`RESULT_NAME` or no such file; ``BAD_REQUEST`` for a file too large or not a JSON object."""
    if RESULT_NAME.fullmatch(name) is None:
        raise ApplianceError("NOT_FOUND", f"{name!r} is not the name of a saved result (letters, digits, '.', '_' "
                             "and '-', ending in .json)", {"file": name[:100]})
    path = folder / name
    try:
        size = path.stat().st_size if path.is_file() else None
    except OSError:
        size = None
    if size is None:
        raise ApplianceError("NOT_FOUND", f"no saved result {name} in {folder}", {"file": name})
    if size > MAX_RESULT_BYTES:
        raise ApplianceError("BAD_REQUEST", f"{name} is larger than {MAX_RESULT_BYTES} bytes: not read",
                             {"file": name, "bytes": size})
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ApplianceError("BAD_REQUEST", f"{name} is not readable JSON ({type(exc).__name__})",
                             {"file": name}) from None
    if not isinstance(document, dict):
        raise ApplianceError("BAD_REQUEST", f"{name} holds JSON that is not an object", {"file": name})
    return document


# -- one result, as the page shows it ---------------------------------------------------------------------------
def number(value: Any) -> float | None:
    """A finite number (not a bool), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def section(document: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = document.get(key)
    return value if isinstance(value, dict) else {}


def entries(value: Any) -> list[Mapping[str, Any]]:
    """The objects of a JSON list (anything else in it skipped); none when it is not a list."""
    if not isinstance(value, list):
        return []
    return [entry for entry in value if isinstance(entry, dict)]


def optional(form: Callable[[float], str], value: Any) -> str | None:
    """``form(value)`` for a finite number, else None (the fact is left out)."""
    figure = number(value)
    return None if figure is None else form(figure)


def text_of(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def milliseconds(value: Any) -> str:
    figure = number(value)
    return EMPTY if figure is None else f"{figure:.1f} ms"


def tokens_per_s(value: Any) -> str:
    figure = number(value)
    return EMPTY if figure is None else f"{figure:.1f} tokens/s"


def size(value: Any) -> str:
    figure = number(value)
    return EMPTY if figure is None else figures.format_bytes(int(figure))


def mebibytes(value: float) -> str:
    return f"{value:.1f} MiB"


def gain(value: Any) -> str:
    """An improvement (a fraction, positive = adaptive better) as ``+23.4%``."""
    figure = number(value)
    return EMPTY if figure is None else f"{figure:+.1%}"


def plain(value: Any) -> str:
    figure = number(value)
    return EMPTY if figure is None else f"{figure:g}"


def setting(value: Any, *, keyed: bool = True) -> str:
    """An advised or current value: strings as they are, None as ``auto`` (a config key's) or a dash, others as
    JSON (``[60, 30]``)."""
    if value is None:
        return "auto" if keyed else EMPTY
    if isinstance(value, str):
        return value
    return json.dumps(value)


TABLE_ROWS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("ttft_avg_ms", "TTFT average", milliseconds),
    ("ttft_p99_ms", "TTFT P99", milliseconds),
    ("tokens_per_s", "Throughput", tokens_per_s),
    ("peak_memory_bytes", "Peak memory", size),
    ("memory_growth_bytes", "Memory growth", size),
)
"""The fixed-against-adaptive table: each figure's key, name and format."""

ROUND_CHARTS: tuple[tuple[str, str, str, float, Callable[[float], str]], ...] = (
    ("ttft_avg_ms", "Time to first token per round (average)", "TTFT", 1.0, milliseconds),
    ("rss_bytes", "Memory (RSS) per round", "RSS", 1 / MIB, mebibytes),
)
"""The per-round charts, fixed against adaptive: the round figure, title, y axis name, the scale the chart draws
it at (memory in MiB, so that its ticks are round numbers of MiB) and the format."""

SLACK_COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("slack", "hot_pool_slack", plain),
    ("ttft_avg_ms", "TTFT average", milliseconds),
    ("ttft_p99_ms", "TTFT P99", milliseconds),
    ("peak_memory_bytes", "Peak memory", size),
    ("tokens_per_s", "Throughput", tokens_per_s),
)


def comparison_table(table: Mapping[str, Any]) -> list[dict[str, str]]:
    """The rows of the fixed / adaptive / improvement table; none when the result has no such table."""
    columns = {name: section(table, name) for name in (*STRATEGIES, "improvement")}
    if not any(columns.values()):
        return []
    rows = []
    for key, label, form in TABLE_ROWS:
        rows.append({"key": key, "label": label, "fixed": form(columns["fixed"].get(key)),
                     "adaptive": form(columns["adaptive"].get(key)),
                     "improvement": gain(columns["improvement"].get(key))})
    return rows


def round_series(rounds: Mapping[str, Any], key: str, scale: float = 1.0) -> dict[str, list[charts.Point]]:
    """``{"fixed": [(round, figure * scale)], "adaptive": [...]}`` for one per-round figure (rows without a round
    number are skipped; a missing figure is None, a gap in the line)."""
    series: dict[str, list[charts.Point]] = {}
    for name in STRATEGIES:
        points: list[charts.Point] = []
        for row in entries(rounds.get(name)):
            at = number(row.get("round"))
            if at is not None:
                figure = number(row.get(key))
                points.append((at, None if figure is None else figure * scale))
        if points:
            series[name] = points
    return series


def round_charts(rounds: Mapping[str, Any]) -> list[Markup]:
    """The per-round SVG charts the result has figures for."""
    drawn = []
    for key, title, y_label, scale, form in ROUND_CHARTS:
        series = round_series(rounds, key, scale)
        if any(y is not None for points in series.values() for _, y in points):
            drawn.append(Markup(charts.line_chart(series, title=title, x_label="round", y_label=y_label,
                                                  y_format=form)))
    return drawn


def thread_chart(curve: Sequence[Mapping[str, Any]]) -> Markup | None:
    points: list[charts.Point] = []
    for row in curve:
        threads = number(row.get("threads"))
        if threads is not None:
            points.append((threads, number(row.get("tokens_per_s"))))
    if not any(y is not None for _, y in points):
        return None
    return Markup(charts.line_chart({"tokens/s": points}, title="Throughput by thread count", x_label="threads",
                                    y_label="tokens/s", y_format=plain))


def advice_rows(advice: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for entry in advice:
        key = text_of(entry.get("key"))
        rows.append({"key": key, "model": text_of(entry.get("model")),
                     "keep": key is not None and entry.get("value") == entry.get("current"),
                     "value": setting(entry.get("value"), keyed=key is not None),
                     "current": setting(entry.get("current"), keyed=key is not None),
                     "reason": text_of(entry.get("reason")) or EMPTY})
    return rows


def result_view(document: Mapping[str, Any]) -> dict[str, Any]:
    """What the result page shows of a saved result, each figure formatted; sections the result lacks are empty."""
    model = section(document, "model")
    machine = section(document, "machine")
    workload = section(document, "workload")
    strategies = section(document, "strategies")
    device_class = section(document, "device_class")
    concurrency = section(document, "concurrency")
    slack_sweep = entries(document.get("slack_sweep"))
    thread_curve = entries(document.get("thread_curve"))
    concurrency_curve = entries(document.get("concurrency_curve"))
    advice = advice_rows(entries(document.get("advice")))
    caveats = quality.result_caveats(document)
    facts = [
        ("Benchmark", text_of(document.get("benchmark"))),
        ("Finished", optional(figures.format_time, document.get("finished_at"))),
        ("Run", run_kind(document.get("quick"))),
        ("Caveats", quality.labels(caveats) or "none"),
        ("Took", optional(figures.format_seconds, document.get("wall_s"))),
        ("Config", text_of(document.get("config_path"))),
        ("Model", model_line(model)),
        ("Machine", machine_line(machine)),
        ("Workload", workload_line(workload)),
        ("Concurrency", concurrency_line(concurrency)),
        *[(f"Strategy {name}", text_of(section(strategies, name).get("label"))) for name in STRATEGIES],
    ]
    return {
        "headline": text_of(document.get("headline")),
        "facts": [(name, value) for name, value in facts if value],
        "complete": document.get("complete") is not False,
        "table": comparison_table(section(document, "table")),
        "charts": round_charts(section(document, "rounds")),
        "slack_columns": [label for _, label, _ in SLACK_COLUMNS],
        "slack_sweep": [[form(row.get(key)) for key, _, form in SLACK_COLUMNS] for row in slack_sweep],
        "thread_curve": [(plain(row.get("threads")), tokens_per_s(row.get("tokens_per_s"))) for row in thread_curve],
        "thread_chart": thread_chart(thread_curve),
        "concurrency_curve": [(plain(row.get("streams")), tokens_per_s(row.get("tokens_per_s")))
                              for row in concurrency_curve],
        "caveats": [caveat.text for caveat in caveats],
        "device_class": text_of(device_class.get("name")),
        "device_reason": text_of(device_class.get("reason")),
        "advice": advice,
        "appliable": any(row["key"] is not None for row in advice),
    }


def run_kind(quick: Any) -> str | None:
    if quick is True:
        return "quick"
    if quick is False:
        return "full"
    return None


def model_line(model: Mapping[str, Any]) -> str | None:
    name = text_of(model.get("name"))
    if name is None:
        return None
    parts = [name]
    if number(model.get("n_ctx")) is not None:
        parts.append(f"context {plain(model.get('n_ctx'))}")
    if number(model.get("weights_bytes")) is not None:
        parts.append(f"weights {size(model.get('weights_bytes'))}")
    if number(model.get("kv_bytes")) is not None:
        parts.append(f"KV {size(model.get('kv_bytes'))}")
    return ", ".join(parts)


def machine_line(machine: Mapping[str, Any]) -> str | None:
    parts = []
    if number(machine.get("cores")) is not None:
        parts.append(f"{plain(machine.get('cores'))} cores")
    if number(machine.get("memory_bytes")) is not None:
        parts.append(f"{size(machine.get('memory_bytes'))} memory")
    kind = text_of(machine.get("device_kind"))
    if kind is not None:
        parts.append(f"device {kind} ({size(machine.get('device_total_bytes'))})")
    return ", ".join(parts) or None


def workload_line(workload: Mapping[str, Any]) -> str | None:
    """The workload's description, else its agents and rounds."""
    description = text_of(workload.get("description"))
    if description is not None:
        return description
    parts = []
    if number(workload.get("agents")) is not None:
        parts.append(f"{plain(workload.get('agents'))} agents")
    if number(workload.get("rounds")) is not None:
        parts.append(f"{plain(workload.get('rounds'))} rounds")
    return ", ".join(parts) or None


def concurrency_line(concurrency: Mapping[str, Any]) -> str | None:
    if number(concurrency.get("max_in_flight")) is None:
        return None
    line = f"at most {plain(concurrency.get('max_in_flight'))} requests in flight"
    if number(concurrency.get("models_in_use")) is not None:
        line += f" on {plain(concurrency.get('models_in_use'))} model(s)"
    return line


# -- views ------------------------------------------------------------------------------------------------------
def folder_of(appliance: Appliance) -> Path:
    return appliance.config.data_dir / "benchmarks"


def job_of(appliance: Appliance) -> BenchmarkJob:
    """The appliance's one benchmark job (made with it, stopped with it: appliance/app.py)."""
    return appliance.benchmark_job


async def benchmarks(request: Request) -> Response:
    appliance = request.app.state.appliance
    folder = folder_of(appliance)
    results = await asyncio.to_thread(saved_results, folder)
    return render.page(request, "benchmarks.html", "benchmarks", folder=str(folder), results=results,
                       run=job_of(appliance).status(), can_run=appliance.config_path is not None,
                       model_groups=pickers.configured_names(appliance.config))


async def run_status(request: Request) -> Response:
    """The progress area. ``?polling=1`` is its poll while a run goes: the answer that first shows the run ended
    also sends ``HX-Trigger: appliance-changed``, so the list of results refreshes (once: the ended area no
    longer polls)."""
    run = job_of(request.app.state.appliance).status()
    headers = {}
    if request.query_params.get("polling") == "1" and not run.running:
        headers["HX-Trigger"] = render.CHANGED_EVENT
    return render.fragment("_benchmark_run.html", headers=headers, run=run)


async def start_run(request: Request) -> Response:
    appliance = request.app.state.appliance
    try:
        fields = await render.form_fields(request)
        quick = fields.get("quick", "") not in ("", "0", "off")
        in_place = fields.get("in_place", "") not in ("", "0", "off")
        socket = appliance.config.socket.path if in_place else None
        model = benchmark_model(appliance, fields.get("model", ""))
        run = await job_of(appliance).start(appliance.config_path, folder_of(appliance), quick=quick, socket=socket,
                                            model=model)
    except ApplianceError as error:
        return render.result("The benchmark did not start.", error)
    kind = "quick " if run.quick else ""
    where = " on this appliance in place" if run.in_place else ""
    return render.result(f"Started a {kind}benchmark run{where}; its result will be saved as {run.result_file}.")


def benchmark_model(appliance: Appliance, name: str) -> str | None:
    """The form's model: a configured model's name (the picker's), or None for the config's first when the form
    sends none; BAD_REQUEST for a name the config does not have."""
    if not name:
        return None
    if appliance.config.model(name) is None:
        raise ApplianceError("BAD_REQUEST", f"no model named {name[:64]!r} in the config",
                             {"field": "model", "known": [spec.name for spec in appliance.config.models]})
    return name


async def result_page(request: Request) -> Response:
    appliance = request.app.state.appliance
    name = request.path_params["file"]
    document = await asyncio.to_thread(read_result, folder_of(appliance), name)
    return render.page(request, "benchmark.html", "benchmarks", file=name, view=result_view(document), applied=None,
                       confirm=None)


def render_block(template: str, block: str, **context: Any) -> str:
    """One block of a page template alone (an htmx fragment that the page also renders in place)."""
    page = render.environment().get_template(template)
    return "".join(page.blocks[block](page.new_context(context)))


def write_advice(config_path: Path, document: Mapping[str, Any], result_file: Path, socket: Path) -> Applied:
    """Write the result's keyed advice that differs from the file's values now into ``config_path`` (the same path
    as ``appliance benchmark --apply``; a thread). The result file is untrusted: ``BAD_REQUEST`` for unreadable
    advice or advice the benchmark never gives (a key outside the advised ones, a value outside its range: named),
    ``CONFIG_INVALID`` for a change the config would refuse, ``FORBIDDEN`` when this process may not write the file
    (the message gives the command that applies ``result_file`` as root, then reloads through ``socket``) or it has
    other hard links, ``INTERNAL`` when the write fails; nothing is written in each case."""
    # lazy: the config writer (ruamel.yaml) is needed only when advice is applied, not by a serving process
    from appliance.benchmark.apply import (
        AdviceRefused,
        AdviceRejected,
        ConfigNotWritable,
        apply_changes,
        pending_changes,
        root_command,
    )

    advice = document.get("advice")
    if not isinstance(advice, list):
        raise ApplianceError("BAD_REQUEST", "this result has no advice to apply", {"advice": None})
    try:
        wanted = pending_changes(config_path, advice)
        return apply_changes(config_path, wanted)
    except AdviceRefused as exc:
        raise ApplianceError("BAD_REQUEST", f"the result's advice is refused: {exc.message}",
                             {"key": exc.key, "result": result_file.name}) from None
    except ValueError as exc:
        raise ApplianceError("BAD_REQUEST", f"the result's advice is not readable: {exc}") from None
    except AdviceRejected as exc:
        raise ApplianceError("CONFIG_INVALID", exc.message, {"file": str(config_path)}) from None
    except ConfigNotWritable as exc:
        if not exc.read_only:
            raise ApplianceError("FORBIDDEN", exc.message, {"file": str(config_path)}) from None
        command = root_command(result_file, config_path, socket)
        raise ApplianceError("FORBIDDEN", f"{exc.message}: the appliance cannot edit its own config here (the "
                             f"shipped systemd unit keeps /etc/appliance read-only to it); apply it as root: "
                             f"{command}", {"file": str(config_path), "command": command}) from None
    except OSError as exc:
        raise ApplianceError("INTERNAL", f"cannot write {config_path}: {exc.strerror or exc}",
                             {"file": str(config_path)}) from None


CONFIRMED = "yes"
"""The form's ``confirm`` value that applies the advice of a result with caveats."""


async def apply_advice(request: Request) -> Response:
    """Write the result's advised keys into the running config's file (comments kept), then reload it with the
    trigger ``benchmark``; answers the diff and the reload record. A result with caveats (a quick, single or
    contended run: :mod:`appliance.benchmark.quality`) is applied only with ``confirm=yes`` in the form: without
    it nothing is written and the answer (outcome ``confirm``) lists the caveats with the button that confirms."""
    appliance = request.app.state.appliance
    path = appliance.config_path
    try:
        fields = await render.form_fields(request)
        document = await asyncio.to_thread(read_result, folder_of(appliance), request.path_params["file"])
        if path is None or appliance.reloader is None:
            raise ApplianceError("BAD_REQUEST", "this appliance was started without a config file: there is no "
                                 "file to write the advice into", {"config_file": None})
        name = request.path_params["file"]
        caveats = quality.result_caveats(document)
        if caveats and fields.get("confirm") != CONFIRMED:
            html = render_block("benchmark.html", "confirm", file=name, confirm=[caveat.text for caveat in caveats],
                                confirmed=CONFIRMED)
            return HTMLResponse(html, headers={**render.HEADERS, render.OUTCOME_HEADER: "confirm"})
        applied = await asyncio.to_thread(write_advice, path, document, folder_of(appliance) / name,
                                          appliance.config.socket.path)
        if not applied.diff:
            return render.result(f"Nothing to apply: {path} already has every advised value.")
        record = await appliance.reloader.reload("benchmark")
    except ApplianceError as error:
        return render.result("The advice was not applied.", error)
    outcome = RELOAD_OUTCOMES[record.result]
    headers = {render.OUTCOME_HEADER: outcome}
    if outcome == "ok":
        headers["HX-Trigger"] = render.CHANGED_EVENT
    hidden = values_of(appliance.config)  # the diff's context lines may show a secret: never sent (as on Config)
    html = render_block("benchmark.html", "applied", applied={
        "outcome": outcome, "changed": list(applied.keys), "diff": redact(applied.diff, hidden), "file": str(path),
        "result": record.result, "trigger": record.trigger, "line": redact(record.line(), hidden)})
    return HTMLResponse(html, headers={**render.HEADERS, **headers})


routes = [
    Route("/admin/benchmarks", benchmarks, methods=["GET"]),
    Route("/admin/benchmarks/_run", run_status, methods=["GET"]),
    Route("/admin/benchmarks/run", start_run, methods=["POST"]),
    Route("/admin/benchmarks/result/{file}", result_page, methods=["GET"]),
    Route("/admin/benchmarks/result/{file}/apply", apply_advice, methods=["POST"]),
]
