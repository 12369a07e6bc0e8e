"""Small inline-SVG drawing helpers for the report: rectangles, text, axes. No scripts, no network."""

from __future__ import annotations

import math
from html import escape

# One colour per stage (cycled), readable on white; idle time and unused devices are grey.
STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                 "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#8cd17d")  # fmt: skip
KIND_COLOURS = {
    "F": "#4e79a7",
    "B": "#59a14f",
    "W": "#8cd17d",  # a zero-bubble schedule's deferred weight gradient
    "SEND_F": "#f28e2b",
    "SEND_B": "#e15759",
    "ALLREDUCE": "#b07aa1",
}
VENDOR_COLOURS = {"nvidia": "#76b900", "amd": "#ed1c24", "cpu": "#888888"}
IDLE = "#eeeeee"


def stage_colour(stage: int) -> str:
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def svg(width: float, height: float, body: list[str], label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(label)}">'
        + "".join(body)
        + "</svg>"
    )


def rect(x, y, w, h, fill, title: str = "", stroke: str = "none", dash: bool = False, extra: str = "") -> str:
    dashes = ' stroke-dasharray="4 3"' if dash else ""
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (
        f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{max(h, 0):.2f}" fill="{fill}" '
        f'stroke="{stroke}"{dashes}{extra}>{tip}</rect>'
    )


def text(
    x, y, content: str, size: int = 11, anchor: str = "start", fill: str = "#222", bold: bool = False
) -> str:
    weight = ' font-weight="bold"' if bold else ""
    return (
        f'<text x="{x:.2f}" y="{y:.2f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}"{weight}>'
        f"{escape(content)}</text>"
    )


def line(x1, y1, x2, y2, stroke: str = "#222", width: float = 1, dash: bool = False) -> str:
    dashes = ' stroke-dasharray="5 3"' if dash else ""
    return (
        f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" stroke="{stroke}" '
        f'stroke-width="{width}"{dashes}/>'
    )


def nice_ticks(maximum: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``maximum``."""
    if not maximum > 0 or math.isinf(maximum):
        return [0.0]
    raw = maximum / count
    step = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * step:
            step *= factor
            break
    return [i * step for i in range(int(math.ceil(maximum / step)) + 1)]


def x_axis(x0: float, y: float, width: float, maximum: float, unit: str, scale: float = 1.0) -> list[str]:
    """Ticks along y from x0 for values 0..maximum, labelled in ``unit`` (values times ``scale``)."""
    ticks = nice_ticks(maximum)
    top = ticks[-1] or 1.0
    body = [line(x0, y, x0 + width, y, "#999")]
    for tick in ticks:
        x = x0 + width * tick / top
        body.append(line(x, y, x, y + 4, "#999"))
        body.append(text(x, y + 15, f"{tick * scale:g}", 10, "middle", "#555"))
    body.append(text(x0 + width, y + 28, unit, 10, "end", "#555"))
    return body


def axis_top(maximum: float) -> float:
    """The value the axis of ``x_axis`` ends at (its last tick)."""
    return nice_ticks(maximum)[-1] or 1.0
