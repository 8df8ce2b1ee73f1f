"""Draw predicted (or measured) device memory as plain SVG: one horizontal bar per
layout, stacked by memory category, against a dashed line at the device's capacity."""
from __future__ import annotations

from xml.sax.saxutils import escape

# the categories of metrics.memory_breakdown, in stacking order
CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
COLOUR = {"params": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b",
          "activations": "#e45756", "other": "#9d9d9d"}
PLOT, ROW, BAR, TITLE, LEGEND, RIGHT, CHAR = 600, 26, 18, 28, 24, 90, 7


def memory_svg(rows: list[tuple[str, dict[str, float]]], capacity_gib: float,
               title: str = "") -> str:
    """``rows`` is (label, {category: GiB}) per bar; a missing category is zero. The
    axis spans max(capacity, largest total) * 1.05, so a bar over capacity is drawn
    whole and visibly crosses the line."""
    if capacity_gib <= 0:
        raise ValueError(f"capacity_gib = {capacity_gib}: must be a positive number")
    for label, parts in rows:
        _check_row(label, parts)
    totals = [sum(parts.values()) for _, parts in rows]
    left = CHAR * max((len(label) for label, _ in rows), default=0) + 12
    scale = PLOT / (max([capacity_gib, *totals]) * 1.05)
    top = TITLE + LEGEND
    height = top + ROW * len(rows) + 20
    body = [_legend(left)]
    body += [_bar(label, parts, total, left, top + i * ROW, scale)
             for i, ((label, parts), total) in enumerate(zip(rows, totals))]
    body.append(_capacity(capacity_gib, left + capacity_gib * scale, top, height))
    width = left + PLOT + RIGHT
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


def _bar(label: str, parts: dict[str, float], total: float, left: int, y: int,
         scale: float) -> str:
    """One bar: its label right-aligned before it, segments in CATEGORIES order (a zero
    segment draws nothing), its total after it."""
    text_y = y + BAR / 2 + 4
    items = [f'<text x="{left - 8}" y="{text_y:g}" text-anchor="end">{escape(label)}</text>']
    x = float(left)
    for category in CATEGORIES:
        width = parts.get(category, 0.0) * scale
        if width > 0:
            items.append(f'<rect class="{category}" x="{x:.2f}" y="{y}" width="{width:.2f}" '
                         f'height="{BAR}" fill="{COLOUR[category]}"/>')
        x += width
    items.append(f'<text class="total" x="{x + 6:.2f}" y="{text_y:g}">{total:.2f} GiB</text>')
    return '<g class="bar">' + "".join(items) + "</g>"


def _capacity(capacity_gib: float, x: float, top: int, height: int) -> str:
    return (f'<g class="capacity"><line x1="{x:.2f}" y1="{top - 4}" x2="{x:.2f}" '
            f'y2="{height - 16}" stroke="#000000" stroke-dasharray="4 3"/>'
            f'<text x="{x:.2f}" y="{height - 4}" text-anchor="middle">'
            f'device memory {capacity_gib:g} GiB</text></g>')
