"""Server-rendered SVG line charts for the admin page (the Benchmarks tab's per-round TTFT and memory). Pure: figures
in, markup out. The page's Content Security Policy allows no inline style, so the markup carries only presentation
attributes and classes (colours in web/admin.css): ``series-fixed`` and ``series-adaptive`` for the two strategies,
``series-0`` .. ``series-3`` for any other series."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping, Sequence

WIDTH = 640
HEIGHT = 320
LEFT = 92
RIGHT = 16
TOP = 36
BOTTOM = 76
"""The plot's margins inside the viewBox: the y ticks on the left, the x ticks, x label and legend below."""
TICKS = 5
"""About how many ticks each axis gets."""
POINT_RADIUS = 3.5
STRATEGY_CLASSES = {"fixed": "series-fixed", "adaptive": "series-adaptive"}
OTHER_CLASSES = 4
"""How many classes (``series-0`` ..) any other series cycles through."""
NAMESPACE = "http://www.w3.org/2000/svg"

Point = tuple[float, float | None]
Format = Callable[[float], str]


def plain_number(value: float) -> str:
    """``3.0`` -> ``3``, ``2.5`` -> ``2.5``: the default tick and hover format."""
    return f"{value:g}"


def series_class(name: str, index: int) -> str:
    """The CSS class that colours a series: fixed and adaptive have their own, others cycle."""
    return STRATEGY_CLASSES.get(name, f"series-{index % OTHER_CLASSES}")


def nice_step(span: float, count: int) -> float:
    """A tick step of 1, 2 or 5 times a power of ten giving about ``count`` ticks over ``span`` (> 0)."""
    rough = span / max(1, count)
    power = 10 ** math.floor(math.log10(rough))
    for factor in (1, 2, 5, 10):
        if factor * power >= rough:
            return factor * power
    return 10 * power


def axis_ticks(low: float, high: float, count: int = TICKS, *, whole: bool = False) -> list[float]:
    """Round tick values covering ``low`` .. ``high`` (the first tick at or below ``low``, the last at or above
    ``high``); a zero span is widened so that the one value sits between two ticks. ``whole``: ticks on whole
    numbers only (rounds, thread counts)."""
    if not (math.isfinite(low) and math.isfinite(high)) or high < low:
        raise ValueError(f"an axis needs finite low <= high, got {low!r} .. {high!r}")
    if high == low:
        pad = abs(low) * 0.1 or 1.0
        low, high = low - pad, high + pad
    step = nice_step(high - low, count)
    if whole:
        step = max(1.0, float(math.ceil(step)))
    first = math.floor(low / step)
    last = math.ceil(high / step)
    return [float(f"{index * step:.12g}") for index in range(first, last + 1)]  # without float noise


def finite_points(points: Sequence[Point]) -> list[Point]:
    """The points with a finite x, sorted by x; a y that is not a finite number becomes None (a gap)."""
    kept: list[Point] = []
    for x, y in points:
        if not is_number(x):
            continue
        kept.append((float(x), float(y) if is_number(y) else None))
    kept.sort(key=first_of)
    return kept


def first_of(point: Point) -> float:
    return point[0]


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def runs(points: Sequence[Point]) -> list[list[tuple[float, float]]]:
    """The stretches of consecutive points with a y: a None breaks the line."""
    stretches: list[list[tuple[float, float]]] = []
    current: list[tuple[float, float]] = []
    for x, y in points:
        if y is None:
            if current:
                stretches.append(current)
            current = []
            continue
        current.append((x, y))
    if current:
        stretches.append(current)
    return stretches


class Scale:
    """Maps a data range onto a pixel range (linear)."""

    def __init__(self, low: float, high: float, start: float, end: float) -> None:
        self.low = low
        self.high = high
        self.start = start
        self.end = end

    def __call__(self, value: float) -> float:
        share = (value - self.low) / (self.high - self.low)
        return round(self.start + share * (self.end - self.start), 1)


def text(x: float, y: float, content: str, css: str, anchor: str = "middle", extra: str = "") -> str:
    return (f'<text x="{x}" y="{y}" class="{css}" text-anchor="{anchor}"{extra}>'
            f"{html.escape(content, quote=False)}</text>")


def line_chart(series: Mapping[str, Sequence[Point]], *, title: str, x_label: str, y_label: str,
               y_format: Format = plain_number, x_format: Format = plain_number) -> str:
    """An SVG line chart: one polyline and its points per series (a None y breaks the line), axes with round
    ticks, a legend, a ``<title>`` on every point for hover, ``role="img"`` and an ``aria-label``. Every text is
    escaped. A chart without any point says so instead of drawing axes."""
    cleaned = {name: finite_points(points) for name, points in series.items()}
    xs = [x for points in cleaned.values() for x, _ in points]
    ys = [y for points in cleaned.values() for _, y in points if y is not None]
    label = f"{title}: {y_label} by {x_label}"
    parts = [f'<svg xmlns="{NAMESPACE}" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'aria-label="{html.escape(label)}">',
             f"<title>{html.escape(label, quote=False)}</title>",
             text(WIDTH / 2, 20, title, "chart-title")]
    if not ys:
        parts.append(text(WIDTH / 2, HEIGHT / 2, "no figures to draw", "chart-empty"))
        parts.append("</svg>")
        return "".join(parts)
    x_ticks = axis_ticks(min(xs), max(xs), whole=all(x.is_integer() for x in xs))
    y_ticks = axis_ticks(min(ys), max(ys))
    plot_bottom = HEIGHT - BOTTOM
    x_scale = Scale(x_ticks[0], x_ticks[-1], LEFT, WIDTH - RIGHT)
    y_scale = Scale(y_ticks[0], y_ticks[-1], plot_bottom, TOP)
    parts.append('<g class="grid">')
    for tick in y_ticks:
        y = y_scale(tick)
        parts.append(f'<line x1="{LEFT}" y1="{y}" x2="{WIDTH - RIGHT}" y2="{y}"/>')
    parts.append("</g>")
    parts.append(f'<g class="axis"><line x1="{LEFT}" y1="{plot_bottom}" x2="{WIDTH - RIGHT}" y2="{plot_bottom}"/>'
                 f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{plot_bottom}"/></g>')
    for tick in y_ticks:
        parts.append(text(LEFT - 6, y_scale(tick) + 4, y_format(tick), "tick", "end"))
    for tick in x_ticks:
        parts.append(text(x_scale(tick), plot_bottom + 16, x_format(tick), "tick"))
    parts.append(text(LEFT + (WIDTH - RIGHT - LEFT) / 2, plot_bottom + 34, x_label, "axis-label"))
    middle = TOP + (plot_bottom - TOP) / 2
    parts.append(text(16, middle, y_label, "axis-label", "middle", f' transform="rotate(-90 16 {middle})"'))
    legend_x = float(LEFT)
    for index, (name, points) in enumerate(cleaned.items()):
        css = series_class(name, index)
        parts.append(f'<g class="series {css}" data-series="{html.escape(name)}">')
        for stretch in runs(points):
            if len(stretch) > 1:
                coordinates = " ".join(f"{x_scale(x)},{y_scale(y)}" for x, y in stretch)
                parts.append(f'<polyline class="line {css}" fill="none" points="{coordinates}"/>')
        for x, y in points:
            if y is None:
                continue
            hover = f"{name}: {x_label} {x_format(x)}: {y_format(y)}"
            parts.append(f'<circle class="point {css}" cx="{x_scale(x)}" cy="{y_scale(y)}" r="{POINT_RADIUS}" '
                         f'data-x="{x!r}" data-y="{y!r}"><title>{html.escape(hover, quote=False)}</title></circle>')
        parts.append("</g>")
        legend_y = HEIGHT - 14
        parts.append(f'<g class="legend-entry"><rect class="key {css}" x="{legend_x}" y="{legend_y - 9}" '
                     f'width="12" height="12"/>')
        parts.append(text(legend_x + 18, legend_y + 1, name, "legend-text", "start") + "</g>")
        legend_x += 30 + 8 * len(name)
    parts.append("</svg>")
    return "".join(parts)
