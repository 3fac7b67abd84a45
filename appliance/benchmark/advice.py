"""The tuning advice of ``appliance benchmark``: what this box's measurements say the settings should be. Pure: no
IO, no clock.

The runner hands in :class:`Measurements`; each function turns some of them into :class:`Recommendation` s, one
per advised key (``key`` None: advice that is not a config key, e.g. how many copies of a model the device holds).
Every reason is one line that quotes the measured figures it rests on. :func:`advise` runs them all in a fixed
order and :func:`changes` picks what ``--apply`` writes: the keyed recommendations that differ from the config.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from appliance.config.schema import BY_KEY, show
from appliance.engine.adaptive import PRESETS

KIB = 1024
MIB = 1024**2
GIB = 1024**3

SLACK_KEY = "engine.hot_pool_slack"
THRESHOLDS_KEY = "engine.thread_idle_thresholds"
THREADS_KEY = "engine.threads"
SLOTS_KEY = "engine.live_slots"
CONTEXTS_KEY = "engine.live_contexts"
PRESET_KEYS = ("engine.adaptive_window_size", "engine.adaptive_sample_rate")
AUTO = "auto"

PRESET = "preset"
INTEGER = "integer"
NUMBER = "number"
PAIR = "pair"
COUNT_OR_AUTO = "count_or_auto"


@dataclass(frozen=True)
class AdvisedValues:
    """The values the advice can give one key: ``kind`` :data:`PRESET` (one of ``choices``), :data:`INTEGER` or
    :data:`NUMBER` (from ``minimum`` to ``maximum``), :data:`PAIR` (``[high, low]``: integers from ``minimum`` to
    ``maximum``, high above low) or :data:`COUNT_OR_AUTO` (``auto``, or an integer from ``minimum`` to the number of
    configured models: one live context per model at most)."""

    kind: str
    minimum: float = 0
    maximum: float = 0
    choices: tuple[int, ...] = ()

    def admits(self, value: Any, models: int) -> bool:
        """``value`` (as a result file's JSON holds it) is one of these; ``models``: how many the config has."""
        if self.kind == PRESET:
            return _is_integer(value) and value in self.choices
        if self.kind == INTEGER:
            return _is_integer(value) and self.minimum <= value <= self.maximum
        if self.kind == NUMBER:
            return _is_number(value) and self.minimum <= value <= self.maximum
        if self.kind == PAIR:
            return (isinstance(value, list | tuple) and len(value) == 2 and all(map(_is_integer, value))
                    and self.minimum <= value[1] < value[0] <= self.maximum)
        if self.kind == COUNT_OR_AUTO:
            return value == AUTO or (_is_integer(value) and self.minimum <= value <= max(1, models))
        raise ValueError(f"unknown kind of advised values {self.kind!r}")

    def describe(self, models: int) -> str:
        if self.kind == PRESET:
            return f"one of {', '.join(map(str, self.choices))} (the device classes' presets)"
        if self.kind == INTEGER:
            return f"an integer from {self.minimum:g} to {self.maximum:g}"
        if self.kind == NUMBER:
            return f"a number from {self.minimum:g} to {self.maximum:g}"
        if self.kind == PAIR:
            return f"[high, low]: two integers from {self.minimum:g} to {self.maximum:g}, the first above the second"
        return f"{AUTO} or an integer from {self.minimum:g} to {max(1, models)}, the configured models"


def _preset_values(setting: str) -> tuple[int, ...]:
    return tuple(sorted({preset[setting] for preset in PRESETS.values()}))


def _schema_range(key: str) -> tuple[float, float]:
    setting = BY_KEY[key]
    if setting.minimum is None or setting.maximum is None:
        raise ValueError(f"{key} has no range in the schema")
    return setting.minimum, setting.maximum


ADVISED: dict[str, AdvisedValues] = {
    PRESET_KEYS[0]: AdvisedValues(PRESET, choices=_preset_values("adaptive_window_size")),
    PRESET_KEYS[1]: AdvisedValues(PRESET, choices=_preset_values("adaptive_sample_rate")),
    SLACK_KEY: AdvisedValues(NUMBER, *_schema_range(SLACK_KEY)),
    THRESHOLDS_KEY: AdvisedValues(PAIR, 0, 100),
    THREADS_KEY: AdvisedValues(INTEGER, 0, 1),
    SLOTS_KEY: AdvisedValues(INTEGER, *_schema_range(SLOTS_KEY)),
    CONTEXTS_KEY: AdvisedValues(COUNT_OR_AUTO, 1),
}
"""The allow-list of ``--apply`` and the admin page's "Apply advice": every config key the advice may change, in
the order :func:`advise` gives them, with the values its functions can produce (the presets; the slack sweep's
range; the thresholds :func:`thread_advice` keeps within ``0 <= low < high <= 100``; ``engine.threads`` 1 (pinned
to one) or 0 (the engine chooses) from :func:`pin_advice`; the slots capped at the schema's maximum; the live
contexts that fit). A result file is untrusted: anything else in it is refused
(:func:`refusal`)."""
ADVISED_KEYS = tuple(ADVISED)
"""Every config key the advice may change, in the order :func:`advise` gives them."""


def key_refusal(key: Any) -> str | None:
    """Why a result's advice entry for ``key`` cannot be applied (a key outside :data:`ADVISED`), or None."""
    if key in ADVISED:
        return None
    return (f"{key}: not a key the advice sets (it sets only {', '.join(ADVISED)}); a result of appliance "
            f"benchmark never advises it, so the result file was edited or crafted")


def refusal(key: Any, value: Any, models: int) -> str | None:
    """Why ``value`` for ``key`` cannot be applied (a key outside :data:`ADVISED`, a value the advice cannot give
    with ``models`` configured models), or None."""
    problem = key_refusal(key)
    if problem is not None:
        return problem
    values = ADVISED[key]
    if values.admits(value, models):
        return None
    return f"{key}: {show(_json_value(value))} is not a value the advice gives ({values.describe(models)})"

SLACK_TOLERANCE = 0.05
"""A slack whose TTFT is within this share of the sweep's best counts as near-best."""
THREAD_TOLERANCE = 0.03
"""A thread count within this share of the curve's best tokens/s counts as best."""
SLOTS_TOLERANCE = 0.05
"""A count of streams decoded together whose aggregate tokens/s is within this share of the curve's best counts as
best: past it more slots add no throughput."""
DEVICE_SHARE = Fraction(9, 10)
"""The share of the device's memory that models may fill (the ledger's admission, at its default)."""
THREAD_BANDS = (4, 3)
"""The thread counts above the high idle threshold and between the two (SPEC E4)."""
ENGINE_LEAST_THREADS = 2
"""The fewest threads the adaptive engine picks by itself (below the low idle threshold): only ``engine.threads: 1``
runs one."""
RECOMMENDATION_FIELDS = ("key", "value", "current", "reason", "model")


@dataclass(frozen=True)
class ClassThreshold:
    """One figure of the device class rule: a box is ``low`` when it is below ``low_below``, and ``high`` needs
    it (with every other figure) at least ``high_from``."""

    figure: str  # the Machine field, or "tokens_per_s"
    label: str
    low_below: float
    high_from: float


DEVICE_CLASS_THRESHOLDS: tuple[ClassThreshold, ...] = (
    ClassThreshold("cores", "cores", 3, 8),
    ClassThreshold("memory_bytes", "memory", 8 * GIB, 32 * GIB),
    ClassThreshold("tokens_per_s", "tokens/s", 10, 40),
)
"""SPEC E8: low when cores <= 2, memory < 8 GiB or tokens/s < 10; high when cores >= 8, memory >= 32 GiB and
tokens/s >= 40; else mid."""


@dataclass(frozen=True)
class Machine:
    """The box: its usable cores, physical memory, the accelerator's kind and memory."""

    cores: int
    memory_bytes: int
    device_kind: str
    device_total_bytes: int

    def __post_init__(self) -> None:
        _check_int("cores", self.cores, 1)
        _check_int("memory_bytes", self.memory_bytes, 0)
        _check_int("device_total_bytes", self.device_total_bytes, 0)
        if not isinstance(self.device_kind, str) or not self.device_kind:
            raise ValueError(f"device_kind must be a non-empty string, got {self.device_kind!r}")


@dataclass(frozen=True)
class SlackPoint:
    """One run of the slack sweep: ``engine.hot_pool_slack`` and what it measured (None: not measured)."""

    slack: float
    ttft_avg_ms: float | None
    ttft_p99_ms: float | None
    peak_memory_bytes: int | None
    tokens_per_s: float | None

    def __post_init__(self) -> None:
        setting = BY_KEY[SLACK_KEY]
        if not _is_number(self.slack) or not setting.minimum <= self.slack <= setting.maximum:
            raise ValueError(f"slack must be a number from {setting.minimum:g} to {setting.maximum:g} "
                             f"({SLACK_KEY}'s range), got {self.slack!r}")
        _check_optional_figure("ttft_avg_ms", self.ttft_avg_ms)
        _check_optional_figure("ttft_p99_ms", self.ttft_p99_ms)
        _check_optional_figure("tokens_per_s", self.tokens_per_s)
        if self.peak_memory_bytes is not None:
            _check_int("peak_memory_bytes", self.peak_memory_bytes, 0)


@dataclass(frozen=True)
class ThreadPoint:
    """One point of the thread curve: tokens/s with ``threads`` threads."""

    threads: int
    tokens_per_s: float

    def __post_init__(self) -> None:
        _check_int("threads", self.threads, 1)
        _check_figure("tokens_per_s", self.tokens_per_s)


@dataclass(frozen=True)
class ConcurrencyPoint:
    """One point of the concurrency curve: the aggregate tokens/s of ``streams`` greedy streams decoded together."""

    streams: int
    tokens_per_s: float

    def __post_init__(self) -> None:
        _check_int("streams", self.streams, 1)
        _check_figure("tokens_per_s", self.tokens_per_s)


@dataclass(frozen=True)
class ModelFootprint:
    """A configured model's device memory: its weights and its KV cache at its ``n_ctx``."""

    name: str
    weights_bytes: int
    kv_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        _check_int("weights_bytes", self.weights_bytes, 0)
        _check_int("kv_bytes", self.kv_bytes, 0)
        if self.total_bytes < 1:
            raise ValueError(f"model {self.name}: weights_bytes + kv_bytes must be at least 1, got 0")

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes


@dataclass(frozen=True)
class Measurements:
    """Everything the advice rests on (one benchmark session on this box)."""

    machine: Machine
    tokens_per_s: float | None  # the adaptive session's tokens/s
    slack_sweep: tuple[SlackPoint, ...]
    thread_curve: tuple[ThreadPoint, ...]
    concurrency_curve: tuple[ConcurrencyPoint, ...]  # aggregate tokens/s by streams decoded together
    models: tuple[ModelFootprint, ...]  # every configured model (weights + KV at its n_ctx)
    max_connections: int
    current: Mapping[str, Any]  # the config's current value of each advised key (dotted keys)

    def __post_init__(self) -> None:
        _check_optional_figure("tokens_per_s", self.tokens_per_s)
        _check_int("max_connections", self.max_connections, 1)


@dataclass(frozen=True)
class Recommendation:
    """One piece of advice: ``key`` (dotted config key, None: not a config key) should be ``value`` (it is
    ``current``), because of ``reason`` (one line quoting the figures); ``model`` names the model it is about."""

    key: str | None
    value: Any
    current: Any
    reason: str
    model: str | None = None

    def __post_init__(self) -> None:
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise ValueError(f"key must be a dotted config key or None, got {self.key!r}")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"reason must be a non-empty string, got {self.reason!r}")
        if "\n" in self.reason or "\r" in self.reason:
            raise ValueError(f"reason must be one line, got {self.reason!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a model name or None, got {self.model!r}")

    @property
    def differs(self) -> bool:
        """The value is not the current one (a pair compares equal as a list or a tuple; None is "auto")."""
        return _comparable(self.value) != _comparable(self.current)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (schema13's ``advice`` entries): ``model`` only when set, pairs as lists."""
        doc: dict[str, Any] = {
            "key": self.key,
            "value": _json_value(self.value),
            "current": _json_value(self.current),
            "reason": self.reason,
        }
        if self.model is not None:
            doc["model"] = self.model
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Recommendation:
        """The recommendation of a JSON ``advice`` entry; a malformed one raises ``ValueError`` saying what."""
        if not isinstance(doc, Mapping):
            raise ValueError(f"an advice entry must be a mapping, got {type(doc).__name__}")
        missing = [name for name in RECOMMENDATION_FIELDS[:4] if name not in doc]
        if missing:
            raise ValueError(f"an advice entry needs {', '.join(missing)} (got keys {sorted(map(str, doc))})")
        unknown = sorted(str(name) for name in doc if name not in RECOMMENDATION_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) in an advice entry: {', '.join(unknown)}")
        return cls(doc["key"], doc["value"], doc["current"], doc["reason"], doc.get("model"))


# --- the recommendations ---------------------------------------------------------------------------------------------


def device_class(machine: Machine, tokens_per_s: float | None) -> tuple[str, str]:
    """The device class (SPEC E8: "low", "mid" or "high", :data:`DEVICE_CLASS_THRESHOLDS`) and why, naming
    the figure that decided it. Without tokens/s (None) cores and memory decide alone (the reason says so)."""
    _check_optional_figure("tokens_per_s", tokens_per_s)
    figures = {"cores": machine.cores, "memory_bytes": machine.memory_bytes, "tokens_per_s": tokens_per_s}
    measured = [rule for rule in DEVICE_CLASS_THRESHOLDS if figures[rule.figure] is not None]
    unmeasured = "" if tokens_per_s is not None else "; tokens/s not measured: decided by cores and memory only"
    for rule in measured:
        value = figures[rule.figure]
        if value < rule.low_below:
            return "low", (f"low: {_figure_text(rule, value)}, below {_figure_text(rule, rule.low_below)}"
                           f"{unmeasured}")
    for rule in measured:
        value = figures[rule.figure]
        if value < rule.high_from:
            return "mid", (f"mid: {_figure_text(rule, value)}, below the {_figure_text(rule, rule.high_from)} "
                           f"a high box needs{unmeasured}")
    parts = [f"{_figure_text(rule, figures[rule.figure])} (at least {_figure_text(rule, rule.high_from)})"
             for rule in measured]
    return "high", f"high: {', '.join(parts)}{unmeasured}"


def preset_advice(name: str, current: Mapping[str, Any]) -> list[Recommendation]:
    """``engine.adaptive_window_size`` and ``engine.adaptive_sample_rate`` from the device class's preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown device class {name!r}: must be one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    recommendations = []
    for key in PRESET_KEYS:
        setting = key.removeprefix("engine.")
        value = preset[setting]
        reason = (f"the {name} device class's preset: window {preset['adaptive_window_size']} requests, "
                  f"profiling every {_ordinal(preset['adaptive_sample_rate'])} request")
        recommendations.append(Recommendation(key, value, current.get(key), reason))
    return recommendations


def slack_advice(points: Iterable[SlackPoint], current: Mapping[str, Any]) -> list[Recommendation]:
    """``engine.hot_pool_slack`` at the sweep's knee: of the slacks whose TTFT average is within
    :data:`SLACK_TOLERANCE` of the sweep's best, the one with the least measured peak memory (the smaller slack on
    a tie: the pool grows with slack, but on a noisy box the measured peak need not). Points without a TTFT average
    or a peak memory are skipped; fewer than two usable points advise nothing."""
    usable = sorted((point for point in points if _slack_usable(point)), key=_slack_of)
    if len(usable) < 2:
        return []
    best = min(usable, key=_ttft_of)
    limit = best.ttft_avg_ms * (1 + SLACK_TOLERANCE)
    knee = min((point for point in usable if point.ttft_avg_ms <= limit), key=_memory_then_slack)
    largest = usable[-1]
    saved = largest.peak_memory_bytes - knee.peak_memory_bytes
    if knee is largest:
        memory = f"peak memory {_size_text(knee.peak_memory_bytes)} (it is the sweep's largest slack)"
    elif saved >= 0:
        memory = (f"{_size_text(saved)} less peak memory ({_size_text(knee.peak_memory_bytes)} vs "
                  f"{_size_text(largest.peak_memory_bytes)} at the largest slack {largest.slack:g})")
    else:
        memory = (f"{_size_text(-saved)} more peak memory ({_size_text(knee.peak_memory_bytes)} vs "
                  f"{_size_text(largest.peak_memory_bytes)} at the largest slack {largest.slack:g})")
    reason = (f"TTFT avg {knee.ttft_avg_ms:.0f} ms at {knee.slack:g}, within {SLACK_TOLERANCE:.0%} of the sweep's "
              f"best ({best.ttft_avg_ms:.0f} ms at {best.slack:g}) with {memory}; {len(usable)} slacks measured")
    return [Recommendation(SLACK_KEY, knee.slack, current.get(SLACK_KEY), reason)]


def _memory_then_slack(point: SlackPoint) -> tuple[int, float]:
    assert point.peak_memory_bytes is not None
    return point.peak_memory_bytes, point.slack


def thread_advice(curve: Iterable[ThreadPoint], cores: int, current: Mapping[str, Any]) -> list[Recommendation]:
    """``engine.thread_idle_thresholds`` [high, low] for ``cores`` cores.

    The band of k threads (4 above high, 3 between) is worth entering when k threads' share of the box is idle:
    ``100 * k / cores`` percent, rounded half up, clamped to 1..100. When the curve shows more threads getting
    slower (the first count slower than the one before it, ``k_slow``), every band of ``k_slow`` threads or more
    is made unreachable: 100 for the 4-band, 99 for the 3-band. The pair always passes the schema check
    (``0 <= low < high <= 100``). Fewer than two points advise nothing."""
    _check_int("cores", cores, 1)
    points = sorted(curve, key=_threads_of)
    if len(points) < 2:
        return []
    counts = [point.threads for point in points]
    if len(set(counts)) != len(counts):
        raise ValueError(f"the thread curve must measure each thread count once, got {counts}")
    high_band, low_band = THREAD_BANDS
    high = _idle_share(high_band, cores)
    low = _idle_share(low_band, cores)
    slower = _first_slower(points)
    if slower is not None and slower[1].threads <= high_band:
        high = 100
    if slower is not None and slower[1].threads <= low_band:
        low = 99
    if low >= high:
        low = high - 1
    fastest = max(point.tokens_per_s for point in points)
    best = next(point for point in points if point.tokens_per_s >= fastest * (1 - THREAD_TOLERANCE))
    reason = (f"best count {best.threads} threads ({best.tokens_per_s:.1f} tokens/s, within {THREAD_TOLERANCE:.0%} "
              f"of the curve's best {fastest:.1f}); on {cores} cores {high_band} threads are "
              f"{_idle_share(high_band, cores)}% of the box, {low_band} threads {_idle_share(low_band, cores)}%")
    if slower is not None:
        before, after = slower
        reason += (f"; {after.threads} threads were slower than {before.threads} ({after.tokens_per_s:.1f} vs "
                   f"{before.tokens_per_s:.1f} tokens/s)")
        closed = [str(band) for band in reversed(THREAD_BANDS) if band >= after.threads]
        if closed:
            reason += f": the {' and '.join(closed)}-thread band{'s' if len(closed) > 1 else ''} made unreachable"
        if after.threads <= ENGINE_LEAST_THREADS:
            reason += f" ({ENGINE_LEAST_THREADS} threads is the engine's least: {THREADS_KEY} is advised apart)"
    return [Recommendation(THRESHOLDS_KEY, [high, low], current.get(THRESHOLDS_KEY), reason)]


def pin_advice(curve: Iterable[ThreadPoint], current: Mapping[str, Any]) -> list[Recommendation]:
    """``engine.threads``: 1 when the curve's best count is one thread (the first count within
    :data:`THREAD_TOLERANCE` of its fastest: more threads buy nothing, and the adaptive engine never goes below
    :data:`ENGINE_LEAST_THREADS` by itself); 0 (the engine chooses) when the config pins 1 and the curve's best is
    more. Any other pin is the operator's and is left alone, as is 0 when one thread is not best. Fewer than two
    points advise nothing."""
    points = sorted(curve, key=_threads_of)
    if len(points) < 2:
        return []
    fastest = max(point.tokens_per_s for point in points)
    best = next(point for point in points if point.tokens_per_s >= fastest * (1 - THREAD_TOLERANCE))
    now = current.get(THREADS_KEY)
    shown = ", ".join(f"{point.threads}: {point.tokens_per_s:.1f}" for point in points)
    measured = f"single-stream decode tokens/s by threads {shown}"
    if best.threads == 1:
        reason = (f"{measured}: one thread is within {THREAD_TOLERANCE:.0%} of the best ({fastest:.1f}), so more "
                  f"threads buy nothing here; the adaptive engine never picks fewer than {ENGINE_LEAST_THREADS} by "
                  f"itself, so pin one")
        return [Recommendation(THREADS_KEY, 1, now, reason)]
    if now == 1:
        reason = (f"{measured}: {best.threads} threads beat one by more than {THREAD_TOLERANCE:.0%}, so the pin to "
                  f"one thread costs speed; 0 lets the engine choose from the CPU it can get")
        return [Recommendation(THREADS_KEY, 0, now, reason)]
    return []


def slots_advice(curve: Iterable[ConcurrencyPoint], current: Mapping[str, Any]) -> list[Recommendation]:
    """``engine.live_slots`` at the concurrency curve's knee: the fewest streams decoded together whose aggregate
    tokens/s is within :data:`SLOTS_TOLERANCE` of the curve's best (more slots add KV cells, not throughput), at
    most the schema's maximum. The session's own agent count is never the advice: every agent of the session sends
    its turn at once, so the requests it had in flight only echo ``--agents``. Fewer than two points advise
    nothing."""
    points = sorted(curve, key=_streams_of)
    if len(points) < 2:
        return []
    counts = [point.streams for point in points]
    if len(set(counts)) != len(counts):
        raise ValueError(f"the concurrency curve must measure each stream count once, got {counts}")
    maximum = int(BY_KEY[SLOTS_KEY].maximum)
    best = max(points, key=_rate_of)
    knee = next(point for point in points if point.tokens_per_s >= best.tokens_per_s * (1 - SLOTS_TOLERANCE))
    value = min(knee.streams, maximum)
    shown = ", ".join(f"{point.streams}: {point.tokens_per_s:.1f}" for point in points)
    reason = f"aggregate decode tokens/s by streams decoded together {shown}; "
    largest = points[-1]
    if knee is largest:
        reason += (f"still rising at {largest.streams} streams, the most measured: {largest.streams} slots, and "
                   f"more may help")
    else:
        reason += (f"{knee.streams} reach within {SLOTS_TOLERANCE:.0%} of the best ({best.tokens_per_s:.1f} at "
                   f"{best.streams}): more slots add KV memory, not throughput (agents past the slots wait parked "
                   f"in host RAM)")
    if value < knee.streams:
        reason += f" (capped at {SLOTS_KEY}'s maximum {maximum})"
    return [Recommendation(SLOTS_KEY, value, current.get(SLOTS_KEY), reason)]


def contexts_advice(
    models: Sequence[ModelFootprint], machine: Machine, current: Mapping[str, Any]
) -> list[Recommendation]:
    """``engine.live_contexts``: "auto" when every model's weights + KV fit in :data:`DEVICE_SHARE` of the device
    together; else how many fit together, smallest footprints first (at least 1). No models advise nothing."""
    if not models:
        return []
    now = file_value(current.get(CONTEXTS_KEY))
    budget = _device_budget(machine)
    total = sum(model.total_bytes for model in models)
    need = f"the {len(models)} models need {_size_text(total)} together"
    room = f"{float(DEVICE_SHARE):.0%} of the {machine.device_kind} device's {_size_text(machine.device_total_bytes)}"
    if total <= budget:
        reason = f"{need}, within {room} ({_size_text(int(budget))}): all can stay live"
        return [Recommendation(CONTEXTS_KEY, AUTO, now, reason)]
    fitting = 0
    filled = 0
    for model in sorted(models, key=_total_of):
        if filled + model.total_bytes > budget:
            break
        filled += model.total_bytes
        fitting += 1
    if fitting == 0:
        smallest = min(models, key=_total_of)
        reason = (f"{need}, more than {room} ({_size_text(int(budget))}); not even the smallest "
                  f"({smallest.name}, {_size_text(smallest.total_bytes)}) fits: one live context at a time")
        return [Recommendation(CONTEXTS_KEY, 1, now, reason)]
    reason = (f"{need}, more than {room} ({_size_text(int(budget))}); the {fitting} smallest fit together "
              f"({_size_text(filled)})")
    return [Recommendation(CONTEXTS_KEY, fitting, now, reason)]


def instance_advice(
    models: Sequence[ModelFootprint], machine: Machine, max_connections: int
) -> list[Recommendation]:
    """Per model (key None): how many copies of it the device could hold, ``floor(0.9 * device / (weights +
    KV))``, at most ``max_connections``."""
    _check_int("max_connections", max_connections, 1)
    budget = _device_budget(machine)
    recommendations = []
    for model in models:
        fit = math.floor(budget / model.total_bytes)
        copies = min(fit, max_connections)
        capped = f", capped by max_connections {max_connections}" if copies < fit else ""
        reason = (f"model {model.name}: {copies} instances fit ({_size_text(model.weights_bytes)} weights + "
                  f"{_size_text(model.kv_bytes)} KV each in {float(DEVICE_SHARE):.0%} of the {machine.device_kind} "
                  f"device's {_size_text(machine.device_total_bytes)}{capped}) (not a config key: how many copies "
                  f"of this model the device could hold)")
        recommendations.append(Recommendation(None, copies, None, reason, model.name))
    return recommendations


def advise(m: Measurements) -> tuple[tuple[str, str], list[Recommendation]]:
    """The device class (name, reason) and every recommendation, in a fixed order: the preset's window and sample
    rate, slack, thread thresholds, the thread pin, live slots, live contexts, then each model's instance count."""
    name, why = device_class(m.machine, m.tokens_per_s)
    recommendations = [
        *preset_advice(name, m.current),
        *slack_advice(m.slack_sweep, m.current),
        *thread_advice(m.thread_curve, m.machine.cores, m.current),
        *pin_advice(m.thread_curve, m.current),
        *slots_advice(m.concurrency_curve, m.current),
        *contexts_advice(m.models, m.machine, m.current),
        *instance_advice(m.models, m.machine, m.max_connections),
    ]
    return (name, why), recommendations


def changes(recommendations: Iterable[Recommendation]) -> dict[str, Any]:
    """{dotted key: value} of the keyed recommendations whose value differs from the current one: what
    ``--apply`` writes. Two different values for one key are an error."""
    wanted: dict[str, Any] = {}
    for recommendation in recommendations:
        key = recommendation.key
        if key is None:
            continue
        if key in wanted and _comparable(wanted[key]) != _comparable(recommendation.value):
            raise ValueError(f"two recommendations for {key}: {wanted[key]!r} and {recommendation.value!r}")
        if recommendation.differs:
            wanted[key] = recommendation.value
    return wanted


def current_settings(config: Any) -> dict[str, Any]:
    """{dotted key: value} of :data:`ADVISED_KEYS` from a validated config (:class:`~appliance.config.types.Config`),
    spelled as in the file: pairs as lists, ``live_contexts`` None as "auto"."""
    values = {}
    for key in ADVISED_KEYS:
        section, _, name = key.partition(".")
        values[key] = file_value(getattr(getattr(config, section), name))
    return values


# --- small pieces ----------------------------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer of at least {minimum}, got {value!r}")


def _check_figure(name: str, value: Any) -> None:
    if not _is_number(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of at least 0, got {value!r}")


def _check_optional_figure(name: str, value: Any) -> None:
    if value is not None:
        _check_figure(name, value)


def _comparable(value: Any) -> Any:
    """``value`` for comparison: tuples as lists, None as "auto" (how the config holds ``live_contexts: auto``)."""
    if value is None:
        return AUTO
    if isinstance(value, tuple | list):
        return [_comparable(item) for item in value]
    return value


def file_value(value: Any) -> Any:
    """A config value as the file spells it: None (``live_contexts: auto``) as "auto", tuples as lists."""
    if value is None:
        return AUTO
    return _json_value(value)


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_value(item) for item in value]
    return value


def _size_text(n: float) -> str:
    """Bytes in the largest binary unit that keeps a figure of at least 1 (``38 MiB``, ``7.2 GiB``)."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:.0f} MiB"
    if n >= KIB:
        return f"{n / KIB:.0f} KiB"
    return f"{n:.0f} bytes"


def _figure_text(rule: ClassThreshold, value: float) -> str:
    if rule.figure == "memory_bytes":
        return f"{_size_text(value)} {rule.label}"
    if rule.figure == "tokens_per_s":
        return f"{value:.1f} {rule.label}"
    return f"{value:g} {rule.label}"


def _ordinal(n: int) -> str:
    if n == 1:
        return "1st"
    if n == 2:
        return "2nd"
    if n == 3:
        return "3rd"
    return f"{n}th"


def _slack_usable(point: SlackPoint) -> bool:
    return point.ttft_avg_ms is not None and point.peak_memory_bytes is not None


def _slack_of(point: SlackPoint) -> float:
    return point.slack


def _ttft_of(point: SlackPoint) -> float:
    return point.ttft_avg_ms


def _threads_of(point: ThreadPoint) -> int:
    return point.threads


def _streams_of(point: ConcurrencyPoint) -> int:
    return point.streams


def _rate_of(point: ConcurrencyPoint) -> float:
    return point.tokens_per_s


def _total_of(model: ModelFootprint) -> int:
    return model.total_bytes


def _idle_share(threads: int, cores: int) -> int:
    """The percent of the box ``threads`` threads stand for, rounded half up, clamped to 1..100."""
    share = math.floor(Fraction(100 * threads, cores) + Fraction(1, 2))
    return max(1, min(100, share))


def _first_slower(points: Sequence[ThreadPoint]) -> tuple[ThreadPoint, ThreadPoint] | None:
    """The first (previous, point) of the curve (sorted by threads) whose tokens/s is below the previous one's."""
    for before, after in zip(points, points[1:], strict=False):
        if after.tokens_per_s < before.tokens_per_s:
            return before, after
    return None


def _device_budget(machine: Machine) -> Fraction:
    return DEVICE_SHARE * machine.device_total_bytes
