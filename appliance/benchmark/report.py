"""What ``appliance benchmark`` prints from its result document: the seed's table (fixed against adaptive), the
measurements behind the advice, the advice with its reasons, and one ``HEADLINE:`` line. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.benchmark import quality

MIB = 1024 * 1024
ROWS = (
    ("ttft_avg_ms", "TTFT avg (ms)", 1.0, ".1f"),
    ("ttft_p99_ms", "TTFT P99 (ms)", 1.0, ".1f"),
    ("tokens_per_s", "tokens/s", 1.0, ".1f"),
    ("peak_memory_bytes", "peak memory (MiB)", MIB, ".0f"),
    ("memory_growth_bytes", "memory growth (MiB)", MIB, ".0f"),
)
"""The seed's table: each figure's key, label, unit and format."""


def shown(value: float | None, scale: float, spec: str) -> str:
    return "-" if value is None else format(value / scale, spec)


def change(gain: float | None) -> str:
    return "-" if gain is None else f"{gain:+.0%}"


def table_lines(result: Mapping[str, Any]) -> list[str]:
    """The seed's table: one row per figure, fixed / adaptive / improvement (positive = adaptive better)."""
    table = result["table"]
    repeats = result.get("repeats", 1)
    lines = [f"{'figure':<20} {'fixed':>10} {'adaptive':>10} {'adaptive better by':>19}"
             + (f"  (medians of {repeats} runs each)" if repeats > 1 else "")]
    for key, label, scale, spec in ROWS:
        lines.append(f"{label:<20} {shown(table['fixed'][key], scale, spec):>10} "
                     f"{shown(table['adaptive'][key], scale, spec):>10} {change(table['improvement'][key]):>19}")
    return lines


def sweep_lines(result: Mapping[str, Any]) -> list[str]:
    lines = [f"hot_pool_slack sweep ({result['sweep']['rounds']} rounds each): "
             f"{'slack':>6} {'TTFT avg ms':>12} {'TTFT P99 ms':>12} {'peak MiB':>9} {'tokens/s':>9}"]
    for point in result["slack_sweep"]:
        lines.append(f"{'':<46}{point['slack']:>6.2f} {shown(point['ttft_avg_ms'], 1.0, '.1f'):>12} "
                     f"{shown(point['ttft_p99_ms'], 1.0, '.1f'):>12} "
                     f"{shown(point['peak_memory_bytes'], MIB, '.0f'):>9} "
                     f"{shown(point['tokens_per_s'], 1.0, '.1f'):>9}")
    return lines


def curve_line(result: Mapping[str, Any]) -> str:
    points = ", ".join(f"{point['threads']}: {point['tokens_per_s']:.1f}" for point in result["thread_curve"])
    decode = result["decode"]
    return f"decode tokens/s by thread count ({decode['tokens']} tokens, median of {decode['repeats']}): " + (
        points or "not measured")


def streams_line(result: Mapping[str, Any]) -> str:
    """The concurrency curve (absent from results older than it)."""
    points = ", ".join(f"{point['streams']}: {point['tokens_per_s']:.1f}"
                       for point in result.get("concurrency_curve") or [])
    return "aggregate decode tokens/s by streams decoded together: " + (points or "not measured")


def caveat_lines(result: Mapping[str, Any]) -> list[str]:
    """What the result's figures are worth: each caveat on its line, or that there are none."""
    found = quality.result_caveats(result)
    if not found:
        return ["caveats: none (a full run, repeated, on an uncontended box)"]
    return [f"caveats ({quality.labels(found)}): measure again before acting on this advice",
            *(f"  {caveat.text}" for caveat in found)]


def advice_lines(result: Mapping[str, Any]) -> list[str]:
    device = result["device_class"]
    lines = [f"device class: {device['name']} ({device['reason']})"]
    for entry in result["advice"]:
        if entry["key"] is None:
            lines.append(f"  {entry['reason']}")
            continue
        if entry["value"] == entry["current"]:
            verdict = f"{entry['key']}: keep {entry['value']}"
        else:
            verdict = f"{entry['key']}: {entry['current']} -> {entry['value']}"
        lines.append(f"  {verdict}: {entry['reason']}")
    return lines


def median_note(result: Mapping[str, Any]) -> str:
    repeats = result.get("repeats", 1)
    return f", medians of {repeats} runs" if repeats > 1 else ""


def headline(result: Mapping[str, Any]) -> str:
    gain = result["table"]["improvement"]
    model = result["model"]
    workload = result["workload"]
    applicable = [entry for entry in result["advice"] if entry["key"] is not None and
                  entry["value"] != entry["current"]]
    text = (f"HEADLINE: appliance benchmark ({model['name']}, {workload['agents']} agents x {workload['rounds']} "
            f"rounds{median_note(result)}) adaptive vs fixed: TTFT avg {change(gain['ttft_avg_ms'])}, "
            f"P99 {change(gain['ttft_p99_ms'])}, tokens/s {change(gain['tokens_per_s'])}, "
            f"peak memory {change(gain['peak_memory_bytes'])} "
            f"(+ = adaptive better); device class {result['device_class']['name']}; {len(applicable)} setting(s) "
            f"to change")
    found = quality.result_caveats(result)
    if found:
        text += f"; CAVEATS: {quality.labels(found)}"
    if not result["complete"]:
        text += f"; INCOMPLETE: {len(result['errors'])} failed turn(s)"
    return text


def text(result: Mapping[str, Any]) -> str:
    """The whole printed report."""
    model = result["model"]
    machine = result["machine"]
    lines = [f"model {model['name']} ({model['path']}, n_ctx {model['n_ctx']}); {result['workload']['description']}",
             f"box: {machine['cores']} cores, {machine['memory_bytes'] / 2**30:.1f} GiB RAM, device "
             f"{machine['device_kind']} {machine['device_total_bytes'] / 2**30:.1f} GiB; "
             f"fixed = {result['strategies']['fixed']['label']}", *caveat_lines(result),
             "", *table_lines(result), "", *sweep_lines(result), curve_line(result), streams_line(result),
             f"most requests in flight at once during the session: {result['concurrency']['max_in_flight']}", "",
             *advice_lines(result)]
    for problem in result["errors"]:
        lines.append(f"failed: {problem}")
    for skipped in result["models_skipped"]:
        lines.append(f"not in the advice (file unreadable): {skipped}")
    lines.append(result["headline"])
    return "\n".join(lines)
