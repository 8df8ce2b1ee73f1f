"""Pipeline parallel: drive this rank's stages (cut by ``composer.parallel.stages``)
with a torch.distributed.pipelining schedule."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from composer.parallel.stages import is_single_stage

log = logging.getLogger(__name__)

@dataclass
class Pipeline:
    """This rank's stage modules and the schedule that runs them."""

    modules: list[nn.Module]
    stages: list[PipelineStage]
    schedule: object
    has_first: bool
    has_last: bool

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, extra: dict,
            train: bool) -> list[torch.Tensor]:
        """One batch through the schedule: forward and backward (``train``) or
        forward only; returns the microbatches' losses (on the last stage's ranks;
        none elsewhere). ``extra``: the model's keyword arguments, which reach every
        stage cut into the microbatches like the inputs."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses, **extra} if self.has_last else extra
        (self.schedule.step if train else self.schedule.eval)(*args, **kwargs)
        return losses


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
