"""Pipeline parallel: cut a model into stages by its units, place the stages on
the ``pp`` ranks, and drive them with a torch.distributed.pipelining schedule.

A stage is the whole model built again on the meta device with every unit it
does not own removed (a block deleted from ``layers``, an embedding/norm/output
set to None), so parameter FQNs are the same on every layout. Looped schedules
put stage s on rank s % pp; V-shaped ones give rank r stages r and 2pp-1-r.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

log = logging.getLogger(__name__)

V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def is_single_stage(schedule: str) -> bool:
    return issubclass(get_schedule_class(schedule), PipelineScheduleSingle)


def stages_per_rank(schedule: str, requested: int) -> int:
    """1 for single-stage schedules, 2 for V shapes, else ``requested`` (0: 2)."""
    if is_single_stage(schedule):
        return 1
    if schedule in V_SHAPED:
        return 2
    return requested or 2


def stage_ids(rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


def split_units(units: list[str], blocks: list[str], stages: int, first_less: int = 0,
                last_less: int = 0) -> list[list[str]]:
    """Deal the blocks evenly over the stages (the first and last stage may take
    ``first_less``/``last_less`` fewer, to make room for the embedding and the
    output); units before the first block go to stage 0, after the last to the
    last stage. Raises ValueError when a stage would get no block."""
    total = len(blocks) + first_less + last_less
    sizes = [total // stages + (1 if i < total % stages else 0) for i in range(stages)]
    sizes[0] -= first_less
    sizes[-1] -= last_less
    if min(sizes) < 1:
        raise ValueError(f"{len(blocks)} blocks cannot fill {stages} stages "
                         f"(fewer by {first_less} first, {last_less} last): sizes {sizes}")
    start, end = units.index(blocks[0]), units.index(blocks[-1]) + 1
    parts, at = [], start
    for size in sizes:
        parts.append(units[at:at + size])
        at += size
    parts[0] = units[:start] + parts[0]
    parts[-1] = parts[-1] + units[end:]
    return parts


def parse_stage_fqns(text: str, units: list[str], stages: int) -> list[list[str]]:
    """'a,b;c;d,e' -> [[a, b], [c], [d, e]]: every unit once, in model order."""
    parts = [[u.strip() for u in stage.split(",") if u.strip()] for stage in text.split(";")]
    if len(parts) != stages:
        raise ValueError(f"{len(parts)} stages given, the layout has {stages}")
    if [u for p in parts for u in p] != units:
        raise ValueError(f"stages must list every unit once, in order: {', '.join(units)}")
    return parts


def prune(model: nn.Module, units: list[str], keep: list[str]) -> nn.Module:
    """Remove every unit not in ``keep``: blocks leave their container, other
    modules become None (the model's forward skips them)."""
    for unit in units:
        if unit in keep:
            continue
        parent_name, _, name = unit.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(parent, (nn.ModuleDict, nn.ModuleList)):
            del parent[name if isinstance(parent, nn.ModuleDict) else int(name)]
        else:
            setattr(parent, name, None)
    return model


@dataclass
class Pipeline:
    """This rank's stage modules and the schedule that runs them."""

    modules: list[nn.Module]
    stages: list[PipelineStage]
    schedule: object
    has_first: bool
    has_last: bool


class Stage(PipelineStage):
    """A stage that runs each real microbatch's forward inside ``context()``
    (not the extra forwards torch runs to infer shapes)."""

    def __init__(self, *args, context: Callable | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.context = context or contextlib.nullcontext

    def forward_one_chunk(self, *args, **kwargs):
        with self.context():
            return super().forward_one_chunk(*args, **kwargs)


def build_pipeline(modules: list[nn.Module], ids: list[int], num_stages: int,
                   schedule_name: str, microbatches: int, loss_fn: Callable,
                   device: torch.device, group,
                   spec_blocks: Callable[[nn.Module], list[nn.Module]],
                   forward_context: Callable | None = None) -> Pipeline:
    stages = [Stage(m, i, num_stages, device, group=group, context=forward_context)
              for m, i in zip(modules, ids)]
    cls = get_schedule_class(schedule_name)
    # Our loss is already normalised by the global token count: no extra scaling.
    schedule = cls(stages[0] if is_single_stage(schedule_name) else stages,
                   n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    held = ", ".join(f"{i} ({len(spec_blocks(m))} blocks)" for i, m in zip(ids, modules))
    log.info("pipeline: %s, %d stages, %d microbatches; this rank holds stage %s",
             schedule_name, num_stages, microbatches, held)
    return Pipeline(modules, stages, schedule, 0 in ids, num_stages - 1 in ids)
