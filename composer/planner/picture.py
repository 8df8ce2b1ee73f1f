"""Draw predicted (or measured) device memory as plain SVG: one horizontal bar per
layout, stacked by memory category, against a dashed line at the device's capacity,
over an axis in GiB; each bar's total (and its step time, where given) after it."""
from __future__ import annotations

import math
from xml.sax.saxutils import escape

# the categories of metrics.memory_breakdown, in stacking order
CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
COLOUR = {"params": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b",
          "activations": "#e45756", "other": "#9d9d9d"}
PLOT, ROW, BAR, TITLE, LEGEND, CHAR = 600, 26, 18, 28, 36, 7
AXIS = 44  # below the bars: the axis, its tick labels and its label


def memory_svg(rows: list[tuple[str, dict[str, float]]], capacity_gib: float,
               title: str = "", step_s: list[float] | None = None) -> str:
    """``rows`` is (label, {category: GiB}) per bar; a missing category is zero;
    ``step_s``: each row's step time in seconds, written after its total. The axis
    spans max(capacity, largest total) * 1.05, so a bar over capacity is drawn whole
    and visibly crosses the line."""
    if capacity_gib <= 0:
        raise ValueError(f"capacity_gib = {capacity_gib}: must be a positive number")
    if step_s is not None and len(step_s) != len(rows):
        raise ValueError(f"step_s has {len(step_s)} times for {len(rows)} rows")
    for label, parts in rows:
        _check_row(label, parts)
    totals = [sum(parts.values()) for _, parts in rows]
    ends = [f"{total:.2f} GiB" + ("" if step_s is None else f", step {step_s[i]:.3g} s")
            for i, total in enumerate(totals)]
    left = CHAR * max((len(label) for label, _ in rows), default=0) + 12
    span = max([capacity_gib, *totals]) * 1.05
    scale = PLOT / span
    top = TITLE + LEGEND
    bottom = top + ROW * len(rows)
    height = bottom + AXIS
    body = [_legend(left)]
    body += [_bar(label, parts, end, left, top + i * ROW, scale)
             for i, ((label, parts), end) in enumerate(zip(rows, ends))]
    body.append(_axis(span, left, bottom, scale))
    body.append(_capacity(capacity_gib, left + capacity_gib * scale, top, bottom))
    width = left + PLOT + CHAR * max([12, *map(len, ends)]) + 16  # 12: half the capacity's name
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="12">\n'
            f'<text class="title" x="{left}" y="18" font-size="14">{escape(title)}</text>\n'
            + "\n".join(body) + "\n</svg>\n")


def _check_row(label: str, parts: dict[str, float]) -> None:
    for category, gib in parts.items():
        if category not in CATEGORIES:
            raise ValueError(f"row {label!r}: unknown memory category {category!r}; "
                             f"allowed: {', '.join(CATEGORIES)}")
        if gib < 0:
            raise ValueError(f"row {label!r}: {category} = {gib}: must be >= 0 GiB")


def _legend(left: int) -> str:
    items, x = [], left
    for category in CATEGORIES:
        items.append(f'<rect x="{x}" y="{TITLE}" width="12" height="12" fill="{COLOUR[category]}"/>'
                     f'<text x="{x + 16}" y="{TITLE + 10}">{category}</text>')
        x += 16 + CHAR * len(category) + 14
    return '<g class="legend">' + "".join(items) + "</g>"


def _bar(label: str, parts: dict[str, float], end: str, left: int, y: int,
         scale: float) -> str:
    """One bar: its label right-aligned before it, segments in CATEGORIES order (a zero
    segment draws nothing), ``end`` (its total) after it."""
    text_y = y + BAR / 2 + 4
    items = [f'<text x="{left - 8}" y="{text_y:g}" text-anchor="end">{escape(label)}</text>']
    x = float(left)
    for category in CATEGORIES:
        width = parts.get(category, 0.0) * scale
        if width > 0:
            items.append(f'<rect class="{category}" x="{x:.2f}" y="{y}" width="{width:.2f}" '
                         f'height="{BAR}" fill="{COLOUR[category]}"/>')
        x += width
    items.append(f'<text class="total" x="{x + 6:.2f}" y="{text_y:g}">{escape(end)}</text>')
    return '<g class="bar">' + "".join(items) + "</g>"


def ticks(span: float) -> list[float]:
    """Round values from 0 up to ``span``, 4 to 9 of them: steps of 1, 2 or 5 x 10^k."""
    rough = span / 8  # the step is 1 to 2.5 times this
    power = 10.0 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= rough)
    return [round(i * step, 12) for i in range(int(span / step + 1e-9) + 1)]


def _axis(span: float, left: int, y: int, scale: float) -> str:
    """The x axis under the bars: a tick and its value at each of ``ticks(span)``, and
    the axis's name."""
    items = [f'<line x1="{left}" y1="{y}" x2="{left + PLOT}" y2="{y}" stroke="#000000"/>']
    for value in ticks(span):
        x = left + value * scale
        items.append(f'<line class="tick" x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 5}" '
                     f'stroke="#000000"/><text class="tick-label" x="{x:.2f}" y="{y + 18}" '
                     f'text-anchor="middle">{value:g}</text>')
    items.append(f'<text class="axis-label" x="{left + PLOT / 2:g}" y="{y + 36}" '
                 f'text-anchor="middle">memory per rank (GiB)</text>')
    return '<g class="axis">' + "".join(items) + "</g>"


def _capacity(capacity_gib: float, x: float, top: int, bottom: int) -> str:
    """The device's capacity: a dashed line across the bars, named above them."""
    return (f'<g class="capacity"><line x1="{x:.2f}" y1="{top - 4}" x2="{x:.2f}" '
            f'y2="{bottom}" stroke="#000000" stroke-dasharray="4 3"/>'
            f'<text x="{x:.2f}" y="{top - 8}" text-anchor="middle">'
            f'device memory {capacity_gib:g} GiB</text></g>')
