"""A pipeline schedule as a timeline: torch's schedule built for stand-in stages, its
per-rank action table (forward, backward, input-grad, weight-grad of a stage and
microbatch) replayed at unit costs (forward 1, full backward 2, split backward
input-grad 1 + weight-grad 1) with no communication time: a rank runs its actions in
order, each as soon as the rank is free and its inputs exist. The planner prices a
schedule's bubble and in-flight activations from it; ``composer.tools.pipeline_report``
shows it."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from composer.config import PIPELINE_SCHEDULES as SCHEDULES
from composer.parallel.stages import stages_per_rank

COST = {"F": 1, "B": 2, "I": 1, "W": 1}


class ScheduleError(ValueError):
    """A one-line reason why a schedule cannot be reported (bad input, or torch refuses it)."""


class Op(NamedTuple):
    kind: str  # F, B (full backward), I (input-grad), W (weight-grad)
    stage: int
    mb: int


# A rank's program: its actions in order. An action is a tuple of ops because
# DualPipeV's OVERLAP_F_B runs a forward and a backward as one action.
Programs = dict[int, list[tuple[Op, ...]]]


@dataclass(frozen=True)
class Block:
    start: int
    ops: tuple[Op, ...]

    @property
    def end(self) -> int:
        return self.start + sum(COST[op.kind] for op in self.ops)


@dataclass
class Timeline:
    schedule: str
    ranks: int
    microbatches: int
    stages_per_rank: int
    programs: Programs
    blocks: dict[int, list[Block]]
    source: str

    @property
    def makespan(self) -> int:
        return max(b[-1].end for b in self.blocks.values() if b)

    def bubble(self) -> Fraction:
        busy = sum(b.end - b.start for blocks in self.blocks.values() for b in blocks)
        return 1 - Fraction(busy, self.ranks * self.makespan)


def peak_in_flight(programs: Programs) -> dict[int, int]:
    """Per rank, the most (stage, microbatch) pairs whose forward has run and
    whose backward (B, or I for a split backward) has not. W's smaller residue
    of saved inputs is not counted."""
    peaks = {}
    for rank, program in programs.items():
        live = peak = 0
        for op in (op for action in program for op in action):
            live += {"F": 1, "B": -1, "I": -1}.get(op.kind, 0)
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks


def fraction_text(x: Fraction | None) -> str:
    return "no closed form" if x is None else f"{x} = {float(x):.2%}"


def canonical(name: str) -> str:
    by_lower = {s.lower(): s for s in SCHEDULES}
    if name.lower() not in by_lower:
        close = difflib.get_close_matches(name, SCHEDULES, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ScheduleError(f"unknown schedule '{name}'{hint}; "
                            f"schedules are: {', '.join(SCHEDULES)}")
    return by_lower[name.lower()]


@dataclass
class _StageShape:
    """What the schedule constructors read from a stage: where it sits in the
    pipeline. No module, no process group; the constructor writes the mapping."""
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: None = None  # read by the torch.compile check of the split-backward schedules
    stage_index_to_group_rank: dict | None = None


def torch_schedule(schedule: str, ranks: int, microbatches: int, per_rank: int):
    """Construct torch's schedule class with stand-in stages, which builds every
    rank's action table. What torch refuses (its ValueErrors, and the
    AssertionErrors of its table validation) becomes one line."""
    cls = get_schedule_class(schedule)
    try:
        if issubclass(cls, PipelineScheduleSingle):
            return cls(_StageShape(ranks, ranks), microbatches)
        stages = [_StageShape(ranks * per_rank, ranks) for _ in range(per_rank)]
        return cls(stages, microbatches)
    except (ValueError, AssertionError) as err:
        reason = " ".join(str(err).strip().split("\n")[0].split())
        raise ScheduleError(f"torch rejects {schedule} with P={ranks}, M={microbatches}"
                            f"{_chunks(per_rank)}: {reason}") from None


def _chunks(per_rank: int) -> str:
    return f", {per_rank} stages per rank" if per_rank > 1 else ""


def programs_from_torch(pipeline_order: dict) -> Programs:
    """Compute actions only: None is torch's lock-step padding and REDUCE_GRAD
    is the cross-microbatch gradient reduction, neither of which is compute."""
    return {rank: [tuple(Op(a.computation_type.value, a.stage_index, a.microbatch_index)
                         for a in (action.sub_actions or (action,)))
                   for action in actions if action is not None and action.is_compute_op]
            for rank, actions in sorted(pipeline_order.items())}


def one_f_one_b_programs(ranks: int, microbatches: int) -> Programs:
    """The order torch's Schedule1F1B runs its microbatches in: min(M, P - r) warm-up
    forwards on rank r, then one backward and one forward in turn, then the
    remaining backwards. Built here because torch 2.13's Schedule1F1B
    ``pipeline_order`` numbers the last rank's forwards 1..M instead of 0..M-1."""
    programs: Programs = {}
    for rank in range(ranks):
        warmup = min(microbatches, ranks - rank)
        ops = [Op("F", rank, mb) for mb in range(warmup)]
        for mb in range(microbatches):
            ops.append(Op("B", rank, mb))
            if warmup + mb < microbatches:
                ops.append(Op("F", rank, warmup + mb))
        programs[rank] = [(op,) for op in ops]
    return programs


def _needs(op: Op, num_stages: int) -> list[tuple[Op, ...]]:
    """What must be done before ``op``: each entry is satisfied by any one of its ops."""
    if op.kind == "F":
        return [(Op("F", op.stage - 1, op.mb),)] if op.stage > 0 else []
    if op.kind == "W":
        return [(Op("I", op.stage, op.mb),)]
    needs = [(Op("F", op.stage, op.mb),)]
    if op.stage < num_stages - 1:
        needs.append((Op("B", op.stage + 1, op.mb), Op("I", op.stage + 1, op.mb)))
    return needs


def _ready_at(action: tuple[Op, ...], finish: dict[Op, int], num_stages: int) -> int | None:
    """When all of the action's inputs exist, or None while one is missing."""
    ready = 0
    for op in action:
        for options in _needs(op, num_stages):
            if any(o in action for o in options):
                continue
            done = [finish[o] for o in options if o in finish]
            if not done:
                return None
            ready = max(ready, min(done))
    return ready


def simulate(programs: Programs, num_stages: int) -> dict[int, list[Block]]:
    """Place every action at max(rank free, inputs ready). An overlapped
    action's outputs all appear at its end: torch sends them after it."""
    finish: dict[Op, int] = {}
    blocks: dict[int, list[Block]] = {rank: [] for rank in programs}
    progressed = True
    while progressed:
        progressed = False
        for rank, program in programs.items():
            placed = blocks[rank]
            while len(placed) < len(program):
                action = program[len(placed)]
                ready = _ready_at(action, finish, num_stages)
                if ready is None:
                    break
                placed.append(Block(max(ready, placed[-1].end if placed else 0), action))
                finish.update(dict.fromkeys(action, placed[-1].end))
                progressed = True
    _check_complete(programs, blocks)
    return blocks


def _check_complete(programs: Programs, blocks: dict[int, list[Block]]) -> None:
    for rank, program in programs.items():
        if len(blocks[rank]) < len(program):
            waiting = "+".join(f"{op.kind}{op.mb}@stage{op.stage}"
                               for op in program[len(blocks[rank])])
            raise ScheduleError(f"the action table deadlocks: rank {rank} waits forever "
                                f"at {waiting}")


def build(schedule: str, ranks: int, microbatches: int, per_rank: int = 2) -> Timeline:
    """Construct the torch schedule, take its action table and simulate it."""
    schedule = canonical(schedule)
    per_rank = stages_per_rank(schedule, per_rank)
    torch_sched = torch_schedule(schedule, ranks, microbatches, per_rank)
    if schedule == "1F1B":
        programs, source = one_f_one_b_programs(ranks, microbatches), (
            "generated here in Schedule1F1B's runtime order (torch 2.13's "
            "Schedule1F1B.pipeline_order misnumbers the last rank's forwards)")
    else:
        programs = programs_from_torch(torch_sched.pipeline_order)
        source = f"torch's own {type(torch_sched).__name__}.pipeline_order"
    try:
        blocks = simulate(programs, ranks * per_rank)
    except ScheduleError as err:
        raise ScheduleError(f"{schedule} with P={ranks}, M={microbatches}"
                            f"{_chunks(per_rank)}: {err}") from None
    return Timeline(schedule, ranks, microbatches, per_rank, programs, blocks, source)
