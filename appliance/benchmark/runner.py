"""One ``appliance benchmark`` run (SPEC B1, B2): the agent session on a configured model, fixed against adaptive,
then the measurements the advice rests on (a ``hot_pool_slack`` sweep, the thread-count curve and the concurrency
curve), then the advice and the run's caveats (:mod:`appliance.benchmark.quality`: the CPU other processes used
meanwhile is read from ``/proc/stat`` around the whole run, less the ticks of the run's own processes).

Every measurement runs ``appliance run`` in a process of its own (:mod:`appliance.benchmark.servers`) with a config
the run writes: the operator's config with the chosen model only, its own state folder, socket and port, and the
engine settings of the measurement on top of the operator's. So each peak memory is its own, and the appliance that
may be running on the same config is not touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import yaml

from appliance.app import ensure_demo_models
from appliance.benchmark import advice, inplace, quality, report
from appliance.benchmark.inplace import RunningAppliance
from appliance.benchmark.progress import Progress
from appliance.benchmark.servers import appliance_process, free_port, state_folder
from appliance.benchmark.session import (
    DOCUMENT_PHASE_INPUT,
    FIGURE_KEYS,
    LONG_OUTPUT,
    PROMPT_WORDS,
    ROLLOVER_MARGIN,
    SESSION_INPUT,
    RoundSample,
    Served,
    Workload,
    completion_chunks,
    figures,
    fixed_strategy,
    improvement,
    max_in_flight,
    median_figures,
    round_figures,
    run_session,
    session_workload,
)
from appliance.client.lines import request as line_request
from appliance.config.types import Config, ModelConfig
from appliance.config.validate import ConfigInvalid, load_config
from appliance.daemon import statefiles
from appliance.daemon.adaptive import usable_cores
from appliance.daemon.devices import physical_memory
from appliance.engine.gguf_meta import estimate, read_model_shape
from appliance.engine.tuning import parse_proc_stat
from appliance.errors import ApplianceError
from appliance.protocol.lines import parse_fields, parse_reply

NAME = "appliance_benchmark"
NEEDED_N_CTX = DOCUMENT_PHASE_INPUT[1] + LONG_OUTPUT + ROLLOVER_MARGIN
"""The smallest model ``n_ctx`` that holds one turn of the session (the longest input and answer)."""
FULL_SLACKS = (1.0, 1.05, 1.1, 1.2, 1.5)
QUICK_SLACKS = (1.0, 1.2, 1.5)
MAX_THREAD_POINTS = 8
FULL_STREAMS = (1, 2, 4, 8, 16)
QUICK_STREAMS = (1, 2, 4)
"""The concurrency curve's counts of streams decoded together (the ``engine.live_slots`` advice rests on it)."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
"""The unit of /proc's CPU times (USER_HZ)."""
DECODE_PROMPT_WORDS = 16
SWEEP_KEYS = ("ttft_avg_ms", "ttft_p99_ms", "peak_memory_bytes", "tokens_per_s")
SWEEP_SAMPLE_RATE = 1
"""The sweep's ``engine.adaptive_sample_rate``: every request profiled, so that the pool follows a short session."""


class BenchmarkError(Exception):
    """The run cannot go on: a one-line reason for the operator."""


@dataclass(frozen=True)
class Options:
    config_path: Path
    model: str | None = None
    agents: int | None = None
    rounds: int | None = None
    quick: bool = False
    seed: int = 0
    running: RunningAppliance | None = None  # --socket: measure this appliance in place
    repeats: int = 1  # each session and sweep point this many times, the medians reported


@dataclass(frozen=True)
class Scale:
    """How much a run measures."""

    agents: int
    rounds: int
    slacks: tuple[float, ...]
    sweep_rounds: int
    thread_counts: tuple[int, ...]
    decode_tokens: int
    decode_repeats: int
    repeats: int = 1
    stream_counts: tuple[int, ...] = QUICK_STREAMS

    @property
    def steps(self) -> int:
        """Progress steps: every round of the two strategies and of the sweep (each repetition), every thread
        count and every stream count."""
        return (self.repeats * (2 * self.rounds + len(self.slacks) * self.sweep_rounds) + len(self.thread_counts)
                + len(self.stream_counts))


def scale_of(options: Options, cores: int) -> Scale:
    """The run's size: the seed's session (4 agents, 20 rounds) or ``--quick`` (2 agents, 3 rounds, three slacks,
    one and two threads, 1 to 4 streams), each overridable by ``--agents`` / ``--rounds``."""
    if options.quick:
        agents = options.agents or 2
        rounds = options.rounds or 3
        return Scale(agents, rounds, QUICK_SLACKS, rounds, tuple(sorted({1, min(2, cores)})), 32, 1, options.repeats,
                     QUICK_STREAMS)
    agents = options.agents or 4
    rounds = options.rounds or 20
    counts = tuple(range(1, min(cores, MAX_THREAD_POINTS) + 1))
    return Scale(agents, rounds, FULL_SLACKS, max(4, rounds // 2), counts, 64, 3, options.repeats, FULL_STREAMS)


def configured(path: Path) -> Config:
    """The operator's config, validated; model files may be missing (the demo models are written next)."""
    try:
        return load_config(path, check_files=False)
    except ConfigInvalid as exc:
        first = exc.problems[0] if exc.problems else "invalid"
        raise BenchmarkError(f"cannot use the config {path}: {first}") from None


def chosen_model(config: Config, name: str | None) -> ModelConfig:
    """The model the session runs on: ``name``, else the first configured one."""
    if not config.models:
        raise BenchmarkError("the config declares no models: add one under models:")
    if name is None:
        return config.models[0]
    model = config.model(name)
    if model is None:
        names = ", ".join(m.name for m in config.models)
        raise BenchmarkError(f"no model named {name!r} in the config (configured: {names})")
    return model


def engine_settings(config: Config) -> dict[str, Any]:
    """The operator's ``engine:`` section as the file spells it."""
    return {name: advice.file_value(value) for name, value in dataclasses.asdict(config.engine).items()}


def child_config(config: Config, model: ModelConfig, state: Path, port: int, engine: Mapping[str, Any]) -> str:
    """The config of one measurement's appliance: the operator's device, admission and engine settings with
    ``engine`` on top, the chosen model alone (never unloaded), and its own state folder, socket and port."""
    entry: dict[str, Any] = {"name": model.name, "path": str(model.path), "n_ctx": model.n_ctx,
                             "n_gpu_layers": "auto" if model.n_gpu_layers is None else model.n_gpu_layers,
                             "idle_ttl_s": 0, "cache_type": model.cache_type}
    if model.vram_bytes is not None:
        entry["vram_bytes"] = model.vram_bytes
    document = {
        "data_dir": str(state), "device": config.device, "admission_percent": config.admission_percent,
        "model_dirs": [str(model.path.parent)], "socket": {"path": str(state / "a.sock")},
        "http": {"host": "127.0.0.1", "port": port}, "resync_interval_s": 0, "log_level": "warning",
        "host_kv_budget": "auto" if config.host_kv_budget is None else config.host_kv_budget,
        "engine": {**engine_settings(config), **engine}, "models": [entry],
    }
    return yaml.safe_dump(document, sort_keys=False)


@contextmanager
def measured_appliance(config: Config, model: ModelConfig, engine: Mapping[str, Any], what: str) -> Iterator[Served]:
    state = state_folder()
    port = free_port()
    text = child_config(config, model, state, port, engine)
    with appliance_process(state, text, port, model.name, what) as served:
        yield served


class Place(Protocol):
    """Where the measurements run: appliance processes of the run's own, or the running appliance in place."""

    prefix: str
    """Before the session's conversation names (apart from other clients' on a shared appliance)."""
    lifetime_peak: bool
    """Whether the process's peak memory (VmHWM) is the measurement's own; else the most RSS seen during it."""

    def measure(self, engine: Mapping[str, Any], label: str) -> AbstractContextManager[Served]: ...


@dataclass
class OwnProcesses:
    """Each measurement in a fresh ``appliance run`` with the operator's config, the chosen model and ``engine``."""

    config: Config
    model: ModelConfig
    prefix: str = ""
    lifetime_peak: bool = True

    def measure(self, engine: Mapping[str, Any], label: str) -> AbstractContextManager[Served]:
        return measured_appliance(self.config, self.model, engine, f"the appliance ({label})")


def session_prefix() -> str:
    """The in-place session's conversation names start ``bench<pid>-``."""
    return f"bench{os.getpid()}-"


@dataclass
class InPlace:
    """Each measurement on the running appliance with ``engine`` held over its file's settings (``TUNE``)."""

    control: inplace.Control
    target: RunningAppliance
    model: ModelConfig
    prefix: str = field(default_factory=session_prefix)
    lifetime_peak: bool = False

    def measure(self, engine: Mapping[str, Any], label: str) -> AbstractContextManager[Served]:
        return inplace.tuned(self.control, self.target, self.model.name, engine)


def measurement_peaks(samples: list[RoundSample]) -> list[RoundSample]:
    """The rounds with the most RSS seen so far as their peak (a shared process's VmHWM is its lifetime's)."""
    peaks = []
    most = None
    for sample in samples:
        if sample.rss_bytes is not None:
            most = sample.rss_bytes if most is None else max(most, sample.rss_bytes)
        peaks.append(dataclasses.replace(sample, hwm_bytes=most))
    return peaks


@dataclass(frozen=True)
class SessionRun:
    """One session on a fresh appliance: its figures, its rounds (what the charts draw), the most turns in flight at
    once, its failed turns, and the appliance's memory device (kind, total bytes)."""

    figures: dict[str, Any]
    rounds: list[dict[str, Any]]
    in_flight: int
    errors: list[str]
    device: tuple[str, int]


def run_measured_session(place: Place, model: ModelConfig, engine: Mapping[str, Any], workload: Workload,
                         progress: Progress, label: str) -> SessionRun:
    rounds = len(workload.turns)

    def on_round(done: int) -> None:
        progress.advance(f"{label}: round {done}/{rounds}")

    with place.measure(engine, label) as served:
        device = device_of(served)
        results, samples, _ = run_session(served, workload, model.n_ctx, on_round, place.prefix)
    if not place.lifetime_peak:
        samples = measurement_peaks(samples)
    errors = [f"{label}: agent {r.agent} round {r.round + 1}: {r.error}" for r in results if r.error is not None]
    for _ in range(rounds - len(samples)):  # a failed round ends the session: its steps are done all the same
        progress.advance(f"{label}: stopped")
    return SessionRun(figures(results, samples, 0, rounds), round_figures(results, samples), max_in_flight(results),
                      errors, device)


def decode_tokens_per_s(served: Served, tokens: int, repeats: int) -> float | None:
    """The median decode speed of a greedy ``tokens``-token stream (first token to last), or None when the model
    stopped before two tokens."""
    prompt = " ".join(PROMPT_WORDS[:DECODE_PROMPT_WORDS])
    body = {"model": served.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    rates = []
    for _ in range(repeats):
        rate = aggregate_tokens_per_s([stream_timing(served.base_url, body)])
        if rate is not None:
            rates.append(rate)
    return statistics.median(rates) if rates else None


@dataclass(frozen=True)
class StreamTiming:
    """One stream of the concurrency curve as the client saw it: its first and last text (``time.perf_counter``)
    and the tokens it generated (None: it produced no text)."""

    first: float | None
    last: float | None
    generated: int


def aggregate_tokens_per_s(streams: list[StreamTiming]) -> float | None:
    """The streams' aggregate decode speed: the tokens after each stream's first, over the time from the first
    stream's first text to the last one's last; None when a stream produced fewer than two tokens."""
    if not streams or any(s.first is None or s.last is None or s.generated < 2 for s in streams):
        return None
    start = min(s.first for s in streams if s.first is not None)
    end = max(s.last for s in streams if s.last is not None)
    if end <= start:
        return None
    return sum(s.generated - 1 for s in streams) / (end - start)


def stream_timing(base_url: str, body: Mapping[str, Any]) -> StreamTiming:
    """One greedy completion streamed on a connection of its own (the engine takes turns between connections)."""
    first = None
    last = None
    generated = 0
    with httpx.Client(base_url=base_url, timeout=600) as http:
        for chunk in completion_chunks(http, body):
            usage = chunk.get("usage")
            if usage:
                generated = int(usage.get("completion_tokens", 0))
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
    return StreamTiming(first, last, generated)


def concurrent_tokens_per_s(served: Served, streams: int, tokens: int, repeats: int) -> float | None:
    """The median aggregate decode speed of ``streams`` greedy ``tokens``-token completions sent at once (stateless,
    each on its own connection), or None when a repetition failed or stopped early."""
    prompt = " ".join(PROMPT_WORDS[:DECODE_PROMPT_WORDS])
    body = {"model": served.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    rates = []
    for _ in range(repeats):
        rate = streams_at_once(served.base_url, body, streams)
        if rate is None:
            return None
        rates.append(rate)
    return statistics.median(rates) if rates else None


def streams_at_once(base_url: str, body: Mapping[str, Any], streams: int) -> float | None:
    """:func:`aggregate_tokens_per_s` of ``streams`` copies of ``body`` sent at once; None when one failed."""
    timings: list[StreamTiming | None] = [None] * streams

    def one(index: int) -> None:
        with contextlib.suppress(RuntimeError, httpx.HTTPError):  # a failed stream leaves None: no figure
            timings[index] = stream_timing(base_url, body)

    workers = [threading.Thread(target=one, args=(index,), daemon=True) for index in range(streams)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    done = [timing for timing in timings if timing is not None]
    return aggregate_tokens_per_s(done) if len(done) == streams else None


def own_ticks(target: int | None, in_place: bool) -> int | None:
    """The clock ticks the benchmark's own processes used so far: this one and the appliance processes it started
    and waited for (``os.times``), and in place the running appliance (``target``, its process id); None when that
    process cannot be read (its id unknown, or it is gone)."""
    times = os.times()
    ticks = round((times.user + times.system + times.children_user + times.children_system) * CLOCK_TICKS)
    if not in_place:
        return ticks
    if target is None:
        return None
    try:
        with open(f"/proc/{target}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return ticks + sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime (proc(5) 14-17)


def proc_stat() -> tuple[int, ...]:
    with open("/proc/stat") as fh:
        return parse_proc_stat(fh.read())


def device_of(served: Served) -> tuple[str, int]:
    """The measured appliance's memory device: its kind and total bytes (STATUS ``device`` record)."""
    reply = parse_reply(line_request(served.socket, "STATUS", timeout=30))
    if reply.error is not None:
        raise BenchmarkError(f"STATUS failed: {reply.error.message}")
    for line in (reply.body or "").splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "device":
            fields = parse_fields(rest)
            return fields.get("kind", "unknown"), int(fields["total_bytes"])
    raise BenchmarkError("STATUS has no device record")


def footprints(config: Config) -> tuple[list[advice.ModelFootprint], list[str]]:
    """Every configured model's weights and KV at its ``n_ctx`` (the ledger's estimate from the GGUF file), and the
    models that could not be read (with why)."""
    found = []
    skipped = []
    for model in config.models:
        try:
            shape = read_model_shape(model.path)
        except ApplianceError as exc:
            skipped.append(f"{model.name}: {exc.message}")
            continue
        figure = estimate(shape, model.n_ctx, model.cache_type)
        found.append(advice.ModelFootprint(model.name, figure.weights, figure.kv))
    return found, skipped


def comparison(fixed: Mapping[str, Any], adaptive: Mapping[str, Any]) -> dict[str, Any]:
    """The seed's table: each figure fixed and adaptive, and how much better adaptive is (positive = better)."""
    return {"fixed": {key: fixed[key] for key in FIGURE_KEYS},
            "adaptive": {key: adaptive[key] for key in FIGURE_KEYS},
            "improvement": {key: improvement(key, fixed[key], adaptive[key]) for key in FIGURE_KEYS}}


def run(options: Options, progress: Progress) -> dict[str, Any]:
    """The whole benchmark; its result document (the saved JSON)."""
    started = time.perf_counter()
    config = configured(options.config_path)
    model = chosen_model(config, options.model)
    ensure_demo_models(config)
    if not model.path.is_file():
        raise BenchmarkError(f"model {model.name}'s file {model.path} does not exist")
    if model.n_ctx < NEEDED_N_CTX:
        raise BenchmarkError(f"model {model.name}'s n_ctx {model.n_ctx} cannot hold one turn of the session (at "
                             f"least {NEEDED_N_CTX} tokens): pick another with --model")
    if options.running is None:
        return measurements(options, config, model, OwnProcesses(config, model), progress, started)
    try:
        control = inplace.Control(options.running.socket)
    except OSError as exc:
        raise BenchmarkError(f"no appliance answers on {options.running.socket}: {exc.strerror or exc}") from None
    try:
        return measurements(options, config, model, InPlace(control, options.running, model), progress, started)
    except inplace.TuneFailed as exc:
        raise BenchmarkError(str(exc)) from None
    finally:
        control.close()  # the appliance gets its own settings back


def measurements(options: Options, config: Config, model: ModelConfig, place: Place, progress: Progress,
                 started: float) -> dict[str, Any]:
    """Every measurement at ``place``, the advice, and the result document."""
    cores = usable_cores()
    scale = scale_of(options, cores)
    target = None if options.running is None else options.running.pid
    in_place = options.running is not None
    cpu_before, ticks_before = proc_stat(), own_ticks(target, in_place)
    workload = session_workload(scale.agents, scale.rounds, options.seed)
    fixed = fixed_strategy(model.n_ctx)
    progress.start(scale.steps)
    adaptive_engine = {"adaptive": True}
    strategies = {"fixed": fixed.engine, "adaptive": adaptive_engine}
    runs: dict[str, list[SessionRun]] = {"fixed": [], "adaptive": []}
    for repeat in range(scale.repeats):
        order = ["fixed", "adaptive"] if repeat % 2 == 0 else ["adaptive", "fixed"]  # neither always goes first
        for name in order:
            label = name if scale.repeats == 1 else f"{name} {repeat + 1}/{scale.repeats}"
            runs[name].append(run_measured_session(place, model, strategies[name], workload, progress, label))
    fixed_figures = median_figures([run.figures for run in runs["fixed"]])
    adaptive_figures = median_figures([run.figures for run in runs["adaptive"]])
    in_flight = max(run.in_flight for run in runs["adaptive"])

    sweep = []
    sweep_errors: list[str] = []
    sweep_workload = session_workload(scale.agents, scale.sweep_rounds, options.seed + 1)
    for slack in scale.slacks:
        engine = {"adaptive": True, "hot_pool_slack": slack, "adaptive_sample_rate": SWEEP_SAMPLE_RATE}
        points = []
        for repeat in range(scale.repeats):
            label = f"slack {slack}" if scale.repeats == 1 else f"slack {slack} {repeat + 1}/{scale.repeats}"
            point = run_measured_session(place, model, engine, sweep_workload, progress, label)
            sweep_errors.extend(point.errors)
            points.append(point.figures)
        medians = median_figures(points)
        sweep.append({"slack": slack, **{key: medians[key] for key in SWEEP_KEYS}})

    curve = []
    for threads in scale.thread_counts:
        with place.measure({"adaptive": False, "threads": threads}, f"{threads} threads") as served:
            rate = decode_tokens_per_s(served, scale.decode_tokens, scale.decode_repeats)
        progress.advance(f"threads {threads}: {'-' if rate is None else f'{rate:.1f}'} tokens/s")
        if rate is not None:
            curve.append({"threads": threads, "tokens_per_s": rate})

    streams_curve = []
    counts = scale.stream_counts
    if in_place:  # a loaded model keeps the live_slots it was loaded with: measure within them
        counts = tuple(count for count in counts if count <= config.engine.live_slots)
    engine = {"adaptive": False} if in_place else {"adaptive": False, "live_slots": max(counts)}
    with place.measure(engine, "concurrency") as served:
        for streams in scale.stream_counts:
            rate = None
            if streams in counts:
                rate = concurrent_tokens_per_s(served, streams, scale.decode_tokens, scale.decode_repeats)
            progress.advance(f"{streams} streams: {'-' if rate is None else f'{rate:.1f}'} tokens/s")
            if rate is not None:
                streams_curve.append({"streams": streams, "tokens_per_s": rate})
    ticks_after = own_ticks(target, in_place)
    cpu_after = proc_stat()
    cpu: dict[str, Any] = {"others_share": None, "contended_from": quality.CONTENDED_SHARE}
    if ticks_before is not None and ticks_after is not None:
        use = quality.cpu_use(cpu_before, cpu_after, max(0, ticks_after - ticks_before))
        cpu.update(others_share=use.others_share, total_ticks=use.total_ticks, busy_ticks=use.busy_ticks,
                   own_ticks=use.own_ticks)
    caveats = quality.caveats(quality.RunQuality(options.quick, scale.repeats, cpu["others_share"]))

    models, skipped = footprints(config)
    device_kind, device_total = runs["adaptive"][0].device
    machine = advice.Machine(cores=cores, memory_bytes=physical_memory(), device_kind=device_kind,
                             device_total_bytes=device_total)
    measurements = advice.Measurements(
        machine=machine, tokens_per_s=adaptive_figures["tokens_per_s"],
        slack_sweep=tuple(advice.SlackPoint(**point) for point in sweep),
        thread_curve=tuple(advice.ThreadPoint(**point) for point in curve),
        concurrency_curve=tuple(advice.ConcurrencyPoint(**point) for point in streams_curve), models=tuple(models),
        max_connections=config.max_connections,
        current=advice.current_settings(config))
    device_class, recommendations = advice.advise(measurements)
    errors = [error for name in ("fixed", "adaptive") for run in runs[name] for error in run.errors] + sweep_errors
    footprint = next((m for m in models if m.name == model.name), None)
    result = {
        "benchmark": NAME,
        "quick": options.quick,
        "finished_at": time.time(),
        "wall_s": time.perf_counter() - started,
        "config_path": str(options.config_path.resolve()),
        "place": "own processes" if options.running is None else f"in place: {options.running.socket}",
        "model": {"name": model.name, "path": str(model.path), "n_ctx": model.n_ctx,
                  "weights_bytes": None if footprint is None else footprint.weights_bytes,
                  "kv_bytes": None if footprint is None else footprint.kv_bytes},
        "machine": dataclasses.asdict(machine),
        "workload": {"agents": scale.agents, "rounds": scale.rounds, "seed": options.seed,
                     "description": f"{scale.agents} agents x {scale.rounds} rounds, inputs {SESSION_INPUT[0]}-"
                                    f"{SESSION_INPUT[1]} tokens, tool calls of 16 tokens or answers of 128"},
        "strategies": {"fixed": {"label": fixed.label, "engine": fixed.engine},
                       "adaptive": {"label": "engine.adaptive true, the config's other engine settings",
                                    "engine": adaptive_engine}},
        "repeats": scale.repeats,
        "table": comparison(fixed_figures, adaptive_figures),
        "rounds": {name: runs[name][0].rounds for name in ("fixed", "adaptive")},  # the first repetition
        "slack_sweep": sweep,
        "sweep": {"rounds": scale.sweep_rounds, "adaptive_sample_rate": SWEEP_SAMPLE_RATE},
        "thread_curve": curve,
        "decode": {"tokens": scale.decode_tokens, "repeats": scale.decode_repeats},
        "concurrency_curve": streams_curve,
        "concurrency": {"max_in_flight": in_flight, "models_in_use": 1},
        "cpu": cpu,
        "caveats": [{"label": caveat.label, "text": caveat.text} for caveat in caveats],
        "models_skipped": skipped,
        "device_class": {"name": device_class[0], "reason": device_class[1]},
        "advice": [recommendation.to_dict() for recommendation in recommendations],
        "errors": errors,
        "complete": not errors,
        "loadavg": list(os.getloadavg()),
    }
    result["headline"] = report.headline(result)
    return result


def results_folder(config_path: Path) -> Path:
    """Where results are saved: ``<data_dir>/benchmarks`` (the admin page's Benchmarks tab lists it)."""
    return configured(config_path).data_dir / "benchmarks"


def result_name(finished_at: float) -> str:
    return time.strftime("appliance-benchmark-%Y%m%d-%H%M%S.json", time.gmtime(finished_at))


def save(result: Mapping[str, Any], path: Path) -> None:
    """Write the result as JSON, atomically (a reader never sees half a file; a full disk leaves no partial one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    statefiles.write_atomically(path, json.dumps(result, indent=1).encode())

