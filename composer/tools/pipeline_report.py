"""See the bubble: what a pipeline schedule leaves idle, from the formula, from
torch's own action table, and as a picture.

    python -m composer.tools.pipeline_report --schedule 1F1B --pp 4 --microbatches 8
    python -m composer.tools.pipeline_report --schedule 1F1B Interleaved1F1B --pp 4 \\
        --microbatches 8 --svg docs/pipeline_1f1b_vs_interleaved.svg
    python -m composer.tools.pipeline_report --table

The action table is the per-rank list of compute actions that
torch.distributed.pipelining builds for the schedule (``pipeline_order``; for
1F1B it is generated, see ``composer.planner.schedule``, which replays it at unit
costs). The bubble is the idle time of all ranks over P x makespan.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from composer.config import PIPELINE_SCHEDULES as SCHEDULES
from composer.parallel.stages import stages_per_rank
from composer.planner.schedule import (
    ScheduleError,
    Timeline,
    build,
    fraction_text,
    peak_in_flight,
)
from composer.tools.pipeline_svg import render_svg


def analytic_bubble(schedule: str, ranks: int, microbatches: int,
                    per_rank: int) -> tuple[Fraction | None, str]:
    """The literature's bubble fraction of a step at unit costs, and its formula.

    GPipe, 1F1B: (P-1)/(M+P-1) (Huang et al. 2019; Narayanan et al. 2021).
    Interleaved1F1B with v stages per rank: (P-1)/(v*M+P-1) for M >= P
    (Narayanan et al. 2021); LoopedBFS has the same bound (Lamy-Poirier 2023).
    InterleavedZeroBubble with v = 1 is ZB-H1: (P-1)(T_F+T_B-T_W) idle per
    rank, so (P-1)/(3M+P-1) for M >= P (Qi et al. 2023). DualPipeV:
    (PP/2-1)(F&B+B-3W) idle per rank with PP = 2P stages (DeepSeek-AI 2024);
    F&B = F+B here, as nothing overlaps, so (P-1)/(3M+P-1). No closed form for
    InterleavedZeroBubble with v > 1, for ZBVZeroBubble, or for looped
    schedules with M < P.
    """
    p, m, v = ranks, microbatches, per_rank
    if schedule in ("GPipe", "1F1B"):
        return Fraction(p - 1, m + p - 1), "(P-1)/(M+P-1): fill and drain around M microbatches"
    if schedule in ("Interleaved1F1B", "LoopedBFS") and (m >= p or v == 1):
        return Fraction(p - 1, v * m + p - 1), ("(P-1)/(v*M+P-1): v stages per rank cut the "
                                                "fill/drain by v")
    if schedule == "InterleavedZeroBubble" and v == 1 and m >= p:
        return Fraction(p - 1, 3 * m + p - 1), ("ZB-H1, (P-1)(T_F+T_B-T_W) idle per rank: "
                                                "(P-1)/(3M+P-1)")
    if schedule == "DualPipeV":
        return Fraction(p - 1, 3 * m + p - 1), ("(PP/2-1)(F&B+B-3W) idle per rank, PP = 2P stages, "
                                                "F&B = F+B (no overlap): (P-1)/(3M+P-1)")
    return None, NO_CLOSED_FORM[schedule]


NO_CLOSED_FORM = {
    "Interleaved1F1B": "for M < P: rank 0 idles until microbatch 0 comes back round the loop",
    "LoopedBFS": "for M < P: rank 0 idles until microbatch 0 comes back round the loop",
    "InterleavedZeroBubble": "for v > 1 (or M < P): Qi et al. 2023 give ZB-H1, one stage per "
                             "rank, only",
    "ZBVZeroBubble": "for one step: Qi et al. 2023 reach 0 with T_F=T_B=T_W counting each "
                     "rank from its own first to last action, the stagger between ranks "
                     "overlapping the next step",
}
CITATION = {
    "GPipe": "Huang et al. 2019, GPipe",
    "1F1B": "Narayanan et al. 2021, PipeDream-Flush / Megatron-LM",
    "Interleaved1F1B": "Narayanan et al. 2021, interleaved schedule",
    "LoopedBFS": "Lamy-Poirier 2023, Breadth-First Pipeline Parallelism",
    "InterleavedZeroBubble": "Qi et al. 2023, Zero Bubble Pipeline Parallelism",
    "ZBVZeroBubble": "Qi et al. 2023, Zero Bubble Pipeline Parallelism, section 6",
    "DualPipeV": "DeepSeek-AI 2024, DualPipe (DeepSeek-V3 report)",
}


def describe(t: Timeline) -> str:
    """The report of one schedule: formula, simulation, peak in flight, source."""
    value, formula = analytic_bubble(t.schedule, t.ranks, t.microbatches, t.stages_per_rank)
    peaks = peak_in_flight(t.programs)
    v = t.stages_per_rank
    return "\n".join([
        f"{t.schedule}: P={t.ranks} ranks, M={t.microbatches} microbatches, {v} stage(s) per rank",
        f"  analytic bubble   {fraction_text(value)}   {formula} [{CITATION[t.schedule]}]",
        f"  simulated bubble  {fraction_text(t.bubble())}   makespan {t.makespan} "
        f"(F=1 B=2 I=1 W=1 per stage action, no communication time)",
        "  peak in flight    " + ", ".join(f"rank {r}: {n}" for r, n in peaks.items())
        + f"   (stage-microbatches forwarded and not yet backwarded; /{v} for whole-rank ones)",
        f"  action table      {t.source}",
    ])


@dataclass
class Row:
    schedule: str
    ranks: int
    microbatches: int
    per_rank: int
    analytic: Fraction | None
    simulated: Fraction | None = None
    peak: int | None = None
    rejected: str = ""


def benchmark_row(schedule: str, ranks: int, microbatches: int) -> Row:
    per_rank = stages_per_rank(schedule, 2)
    row = Row(schedule, ranks, microbatches, per_rank,
              analytic_bubble(schedule, ranks, microbatches, per_rank)[0])
    try:
        t = build(schedule, ranks, microbatches, per_rank)
    except ScheduleError as err:
        # The row already names the schedule, P and M: keep torch's reason only.
        row.analytic, row.rejected = None, str(err).split(": ", 1)[-1]
        return row
    row.simulated, row.peak = t.bubble(), max(peak_in_flight(t.programs).values())
    return row


TABLE_RANKS, TABLE_FACTORS = (2, 4, 8), (1, 2, 4, 8)


def benchmark_rows(ranks=TABLE_RANKS, factors=TABLE_FACTORS) -> list[Row]:
    """A row per schedule, P in ``ranks`` and M = P x each of ``factors``."""
    return [benchmark_row(s, p, p * f) for s in SCHEDULES for p in ranks for f in factors]


def format_table(rows: list[Row]) -> str:
    """Markdown; peak in flight also as whole-rank microbatches (/ stages per
    rank), the activation memory 1F1B would hold for that many."""
    def pct(x: Fraction | None) -> str:
        return "-" if x is None else f"{float(x):.1%}"
    lines = ["| schedule | P | M | stages/rank | analytic bubble | simulated bubble "
             "| peak in flight | = whole-rank |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        simulated = f"rejected: {r.rejected}" if r.rejected else pct(r.simulated)
        peak = ("-", "-") if r.peak is None else (str(r.peak), f"{r.peak / r.per_rank:g}")
        lines.append(f"| {r.schedule} | {r.ranks} | {r.microbatches} | {r.per_rank} | "
                     f"{pct(r.analytic)} | {simulated} | {peak[0]} | {peak[1]} |")
    lines.append("\n-: no closed form, or rejected; `--schedule NAME` says which formula "
                 "applies and why.")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every composer error, not usage + line
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m composer.tools.pipeline_report",
                description="Bubble and in-flight microbatches of a pipeline schedule.")
    p.add_argument("--schedule", nargs="+", metavar="NAME",
                   help=f"one or more of: {', '.join(SCHEDULES)}")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks P (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches M (default 8)")
    p.add_argument("--stages-per-rank", type=int, default=2,
                   help="v for the looped schedules (default 2); GPipe/1F1B use 1, V shapes 2")
    p.add_argument("--svg", metavar="PATH", help="write the timelines, stacked, as SVG")
    p.add_argument("--table", action="store_true",
                   help="print the benchmark table: P in {2,4,8}, M in {P,2P,4P,8P}")
    return p


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches),
                        ("--stages-per-rank", args.stages_per_rank)):
        if value < 1:
            raise ScheduleError(f"{flag} must be at least 1, got {value}")
    if not args.schedule and not args.table:
        raise ScheduleError("give --schedule NAME [NAME ...] or --table")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_counts(args)
        if args.table:
            print(format_table(benchmark_rows()))
            return 0
        timelines = [build(name, args.pp, args.microbatches, args.stages_per_rank)
                     for name in args.schedule]
    except ScheduleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(describe(t) for t in timelines))
    if args.svg:
        Path(args.svg).write_text(render_svg(timelines))
        print(f"wrote {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
