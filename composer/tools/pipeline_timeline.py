"""A pipeline schedule as a timeline: each rank's actions (forward, backward,
input-grad, weight-grad of a stage and microbatch) placed at unit costs."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

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
