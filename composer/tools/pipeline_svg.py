"""Draw pipeline timelines as plain SVG: ranks as rows, each named with the stages it
holds, F/B/I/W blocks coloured by kind, paler for a rank's later stages, and numbered
by microbatch, idle time visible as background."""
from __future__ import annotations

from xml.sax.saxutils import escape

from composer.planner.schedule import COST, Block, Timeline, fraction_text, peak_in_flight

COLOUR = {"F": "#4c78a8", "B": "#54a24b", "I": "#f58518", "W": "#b279a2"}
LABEL = {"F": "F forward (1)", "B": "B full backward (2)", "I": "I input-grad (1)",
         "W": "W weight-grad (1)"}
UNIT, ROW, LEFT, TITLE = 14, 22, 96, 26


def _block_svg(block: Block, y: int, scale: float, shade: dict[int, float]) -> list[str]:
    parts, x0 = [], LEFT + block.start * scale
    x = x0
    for op in block.ops:
        w = COST[op.kind] * scale
        parts.append(f'<rect class="{op.kind}" data-stage="{op.stage}" data-mb="{op.mb}" '
                     f'x="{x:g}" y="{y}" width="{w:g}" height="{ROW - 4}" fill="{COLOUR[op.kind]}" '
                     f'fill-opacity="{shade[op.stage]:.2f}" stroke="#ffffff" stroke-width="0.5"/>')
        parts.append(f'<text x="{x + w / 2:g}" y="{y + ROW / 2 - 1:g}">{op.mb}</text>')
        x += w
    if len(block.ops) > 1:  # one overlapped action: outline it as one
        parts.append(f'<rect class="overlap" x="{x0:g}" y="{y}" width="{x - x0:g}" '
                     f'height="{ROW - 4}" fill="none" stroke="#000000" stroke-width="1"/>')
    return parts


def _rank_svg(t: Timeline, rank: int, y: int, scale: float) -> list[str]:
    blocks = t.blocks[rank]
    stages = sorted({op.stage for b in blocks for op in b.ops})
    # Later stages on the same rank are paler, so interleaving stays readable.
    shade = {s: 1.0 - 0.45 * i / max(1, len(stages) - 1) for i, s in enumerate(stages)}
    names = ", ".join(f"s{s}" for s in stages)  # darkest first, as drawn
    parts = [f'<g class="rank" data-rank="{rank}" data-stages="{" ".join(map(str, stages))}">',
             f'<text class="label" x="{LEFT - 8}" y="{y + ROW / 2 - 1:g}">rank {rank}: '
             f'{names}</text>',
             f'<rect class="idle" x="{LEFT}" y="{y}" width="{t.makespan * scale:g}" '
             f'height="{ROW - 4}" fill="#e6e6e6"/>']
    for block in blocks:
        parts += _block_svg(block, y, scale, shade)
    return parts + ["</g>"]


def _panel_svg(t: Timeline, y: int, scale: float) -> list[str]:
    peak = max(peak_in_flight(t.programs).values())
    title = (f"{t.schedule}: P={t.ranks}, M={t.microbatches}, {t.stages_per_rank} stage(s) "
             f"per rank; bubble {fraction_text(t.bubble())}; peak in flight {peak} "
             f"stage-microbatches ({peak / t.stages_per_rank:g} whole-rank)")
    parts = [f'<g class="timeline" data-schedule="{t.schedule}">',
             f'<text class="title" x="{LEFT}" y="{y + 14}">{escape(title)}</text>']
    for rank in range(t.ranks):
        parts += _rank_svg(t, rank, y + TITLE + rank * ROW, scale)
    return parts + ["</g>"]


def _legend_svg(y: int, timelines: list[Timeline]) -> tuple[list[str], float]:
    """The legend, and how far right it reaches."""
    actions = [a for t in timelines for p in t.programs.values() for a in p]
    entries = [(COLOUR[k], LABEL[k]) for k in COLOUR
               if any(op.kind == k for a in actions for op in a)] + [("#e6e6e6", "idle")]
    note = "sN: the stages a rank holds, paler the later; numbers: microbatch"
    if any(len(a) > 1 for a in actions):
        note += "; outlined: one overlapped action"
    parts, x = ['<g class="legend">'], LEFT
    for colour, label in entries:
        parts.append(f'<rect x="{x}" y="{y}" width="{UNIT}" height="{UNIT}" fill="{colour}"/>')
        parts.append(f'<text class="label-left" x="{x + UNIT + 4}" y="{y + UNIT / 2:g}">'
                     f'{escape(label)}</text>')
        x += UNIT + 20 + 6 * len(label)
    parts.append(f'<text class="label-left" x="{x}" y="{y + UNIT / 2:g}">{note}</text>')
    return parts + ["</g>"], x + 6 * len(note)


def render_svg(timelines: list[Timeline]) -> str:
    """Stacked timelines on one wall-clock scale: an action on a rank with v
    stages runs 1/v of the rank's layers, so it is drawn 1/v as wide."""
    most = max(t.stages_per_rank for t in timelines)
    scales = [UNIT * most / t.stages_per_rank for t in timelines]
    body, y = [], 8
    for t, scale in zip(timelines, scales):
        body += _panel_svg(t, y, scale)
        y += TITLE + t.ranks * ROW + 12
    legend, legend_end = _legend_svg(y, timelines)
    span = max(t.makespan * scale for t, scale in zip(timelines, scales))
    width, height = int(max(LEFT + span, legend_end) + 16), y + UNIT + 12
    style = ("text{font-family:sans-serif;font-size:9px;fill:#ffffff;text-anchor:middle;"
             "dominant-baseline:middle}.label{fill:#000000;text-anchor:end}"
             ".label-left,.title{fill:#000000;text-anchor:start;font-size:11px}")
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
                      f'height="{height}" viewBox="0 0 {width} {height}">',
                      f"<style>{style}</style>", *body, *legend, "</svg>", ""])
