"""Pipeline bubble report: analytic formulas, the replay of torch's action
tables, peak in-flight microbatches, the SVG and the command line."""
from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from fractions import Fraction
from pathlib import Path

import pytest

from composer.planner import schedule as sched
from composer.tools import pipeline_report as pr
from composer.tools.pipeline_svg import render_svg

ROOT = Path(__file__).resolve().parents[2]
DOC_SVG = ROOT / "docs" / "pipeline_1f1b_vs_interleaved.svg"


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_one_stage_schedules_match_the_formula_exactly(schedule):
    t = sched.build(schedule, 4, 8)
    assert pr.analytic_bubble(schedule, 4, 8, t.stages_per_rank)[0] == Fraction(3, 11)
    assert t.bubble() == Fraction(3, 11)
    assert abs(float(t.bubble()) - 3 / 11) < 1e-12
    assert t.makespan == 3 * (8 + 4 - 1)


def test_peak_in_flight_1f1b_is_p_and_gpipe_is_m():
    assert sched.peak_in_flight(sched.build("1F1B", 4, 8).programs) == {0: 4, 1: 3, 2: 2, 3: 1}
    assert sched.peak_in_flight(sched.build("GPipe", 4, 8).programs)[0] == 8


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                      "ZBVZeroBubble", "DualPipeV"])
def test_multi_stage_schedules_shrink_the_bubble(schedule):
    t = sched.build(schedule, 4, 8)
    assert t.stages_per_rank == 2
    assert t.bubble() < Fraction(3, 11)
    analytic = pr.analytic_bubble(schedule, 4, 8, 2)[0]
    assert analytic is None or analytic == t.bubble()


def test_interleaved_and_dualpipev_meet_their_published_formulas():
    assert sched.build("Interleaved1F1B", 4, 8).bubble() == Fraction(3, 2 * 8 + 3)
    assert sched.build("DualPipeV", 4, 8).bubble() == Fraction(3, 3 * 8 + 3)
    assert sched.build("InterleavedZeroBubble", 4, 8, per_rank=1).bubble() == Fraction(3, 3 * 8 + 3)


def test_1f1b_order_is_torchs_on_all_but_the_last_rank():
    own = sched.one_f_one_b_programs(4, 8)
    torch_order = sched.programs_from_torch(sched.torch_schedule("1F1B", 4, 8, 1).pipeline_order)
    assert {r: own[r] for r in range(3)} == {r: torch_order[r] for r in range(3)}
    # torch 2.13 numbers the last rank's forwards 1..M; the F/B pattern is the same
    assert [a[0].kind for a in own[3]] == [a[0].kind for a in torch_order[3]]


def test_simulator_waits_for_inputs_and_reports_a_deadlock():
    op = sched.Op
    programs = {0: [(op("F", 0, 0),), (op("I", 0, 0),), (op("W", 0, 0),)],
                1: [(op("F", 1, 0),), (op("B", 1, 0),)]}
    blocks = sched.simulate(programs, 2)
    assert [(b.start, b.end) for b in blocks[0]] == [(0, 1), (4, 5), (5, 6)]
    assert [(b.start, b.end) for b in blocks[1]] == [(1, 2), (2, 4)]
    stuck = {0: [(op("F", 0, 0),)], 1: [(op("B", 1, 0),), (op("F", 1, 0),)]}
    with pytest.raises(sched.ScheduleError, match="rank 1 waits forever at B0@stage1"):
        sched.simulate(stuck, 2)


def _blocks(svg: str, schedule: str) -> dict[str, int]:
    panel = next(g for g in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}g")
                 if g.get("data-schedule") == schedule)
    counts = {"rank": sum(1 for g in panel if g.get("class") == "rank")}
    for rect in panel.iter("{http://www.w3.org/2000/svg}rect"):
        counts[rect.get("class")] = counts.get(rect.get("class"), 0) + 1
    return counts


def test_svg_has_a_row_per_rank_and_a_block_per_action():
    svg = render_svg([sched.build(s, 4, 8) for s in ("1F1B", "ZBVZeroBubble", "DualPipeV")])
    assert _blocks(svg, "1F1B") == {"rank": 4, "idle": 4, "F": 32, "B": 32}
    assert _blocks(svg, "ZBVZeroBubble") == {"rank": 4, "idle": 4, "F": 64, "I": 64, "W": 64}
    dual = _blocks(svg, "DualPipeV")
    assert dual["F"] == 64 and dual["B"] + dual["I"] == 64 and dual["I"] == dual["W"]
    assert dual["overlap"] > 0


def test_doc_svg_is_what_the_cli_draws(tmp_path, capsys):
    out = tmp_path / "t.svg"
    assert pr.main(["--schedule", "1F1B", "Interleaved1F1B", "--pp", "4",
                    "--microbatches", "8", "--svg", str(out)]) == 0
    assert "3/11 = 27.27%" in capsys.readouterr().out
    assert out.read_text() == DOC_SVG.read_text(), (
        "regenerate docs/pipeline_1f1b_vs_interleaved.svg with the command above")
    ET.parse(DOC_SVG)
    assert _blocks(DOC_SVG.read_text(), "1F1B") == {"rank": 4, "idle": 4, "F": 32, "B": 32}
    assert _blocks(DOC_SVG.read_text(), "Interleaved1F1B") == {"rank": 4, "idle": 4,
                                                               "F": 64, "B": 64}


def test_table_has_a_row_per_schedule_p_and_m(monkeypatch, capsys):
    rows = pr.benchmark_rows(ranks=(2, 4), factors=(1, 2))
    assert len(rows) == len(pr.SCHEDULES) * 4
    by_key = {(r.schedule, r.ranks, r.microbatches): r for r in rows}
    assert by_key[("1F1B", 4, 8)].simulated == Fraction(3, 11)
    assert by_key[("1F1B", 4, 8)].peak == 4
    assert by_key[("DualPipeV", 4, 4)].rejected.startswith("DualPipeV requires")
    # The full grid, with each row stubbed: P in {2,4,8}, M in {P,2P,4P,8P}
    monkeypatch.setattr(pr, "benchmark_row", lambda s, p, m: pr.Row(s, p, m, 1, None))
    assert pr.main(["--table"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")][2:]
    keys = {(ln.split(" | ")[0][2:], int(ln.split(" | ")[1]), int(ln.split(" | ")[2]))
            for ln in lines}
    assert len(lines) == len(keys) == 84
    assert keys == {(s, p, p * f) for s in pr.SCHEDULES for p in (2, 4, 8) for f in (1, 2, 4, 8)}


def test_bad_input_is_one_line_and_status_2(capsys):
    assert pr.main(["--schedule", "ZBV"]) == 2
    assert pr.main(["--schedule", "1F1B", "--microbatches", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: unknown schedule 'ZBV'; schedules are: " + ", ".join(pr.SCHEDULES),
                   "error: --microbatches must be at least 1, got 0"]


def test_combination_torch_rejects_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "composer.tools.pipeline_report", "--schedule",
                           "Interleaved1F1B", "--pp", "4", "--microbatches", "9"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: torch rejects Interleaved1F1B with P=4, M=9, 2 stages per rank: Interleaved 1F1B "
        "requires the number of microbatches to be a multiple of the number of rounds (2), "
        "but got 9."]


def test_each_rank_row_names_the_stages_it_holds():
    svg = ET.fromstring(render_svg([sched.build(s, 4, 8) for s in ("Interleaved1F1B",
                                                                "ZBVZeroBubble")]))
    ns = "{http://www.w3.org/2000/svg}"
    for schedule, stages in (("Interleaved1F1B", lambda r: [r, r + 4]),
                             ("ZBVZeroBubble", lambda r: [r, 7 - r])):
        panel = next(g for g in svg.iter(f"{ns}g") if g.get("data-schedule") == schedule)
        for row in (g for g in panel if g.get("class") == "rank"):
            rank = int(row.get("data-rank"))
            drawn = sorted({int(r.get("data-stage")) for r in row.iter(f"{ns}rect")
                            if r.get("data-stage") is not None})
            assert drawn == stages(rank)
            label = row.find(f"{ns}text[@class='label']").text
            assert label == f"rank {rank}: " + ", ".join(f"s{s}" for s in stages(rank))
            # a rank's stages are told apart by shade: one per stage, the first darkest
            shades = {int(r.get("data-stage")): float(r.get("fill-opacity"))
                      for r in row.iter(f"{ns}rect") if r.get("data-stage") is not None}
            assert shades[stages(rank)[0]] == 1.0 > shades[stages(rank)[1]]
