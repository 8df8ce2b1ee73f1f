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

from composer.parallel.stages import PipelinePlan, is_single_stage

log = logging.getLogger(__name__)

@dataclass
class Pipeline:
    """This rank's stage modules and the schedule that runs them."""

    modules: list[nn.Module]
    stages: list[PipelineStage]
    schedule: object
    has_first: bool
    has_last: bool

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, extra: dict | None = None,
            train: bool = True) -> list[torch.Tensor]:
        """One batch through the schedule: forward and backward (``train``) or
        forward only; returns the microbatches' losses (on the last stage's ranks;
        none elsewhere). ``extra``: the model's keyword arguments, which reach every
        stage cut into the microbatches like the inputs."""
        losses: list[torch.Tensor] = []
        extra = extra or {}
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


def build_pipeline(modules: list[nn.Module], plan: PipelinePlan, loss_fn: Callable,
                   device: torch.device, group,
                   forward_context: Callable | None = None) -> Pipeline:
    """The schedule ``plan.schedule`` over this rank's stage ``modules`` (from
    ``pipeline_stages``, parallelized and materialized), talking over ``group``
    (the ``pp`` mesh's: ``dims.mesh("pp").get_group()``). ``loss_fn(output,
    targets)`` is each microbatch's loss as it is: gradients are not scaled again,
    so a loss normalised by the batch's token count makes the microbatches add up
    to the batch. ``forward_context()``: held around each microbatch's forward.
    ``Pipeline.run(inputs, targets)`` steps it (forward and backward) and returns
    the microbatches' losses on the last stage's ranks.

    >>> import torch
    >>> import torch.distributed as dist
    >>> from torch import nn
    >>> from composer import ModelSpec, ParallelHooks, build_pipeline, materialize, pipeline_stages
    >>> class Net(nn.Module):
    ...     def __init__(self, dim):
    ...         super().__init__()
    ...         self.blocks = nn.ModuleDict({str(i): nn.Linear(dim, dim) for i in range(2)})
    ...     def forward(self, x):
    ...         for block in self.blocks.values():
    ...             x = block(x)
    ...         return x
    >>> spec = ModelSpec("net", {"tiny": 4}, build=Net, blocks=lambda m: list(m.blocks.values()),
    ...                  parallel=ParallelHooks(pipeline_units=lambda m: ["blocks.0", "blocks.1"]))
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> plan, stages = pipeline_stages(spec, lambda: spec.build_meta(4), pp=1, pp_rank=0,
    ...                                local_batch=4, schedule="GPipe", microbatches=2)
    >>> model = stages[0]  # the whole model: one stage
    >>> materialize(model, lambda: spec.build_meta(4), torch.device("cpu"), seed=0)
    >>> model = model.double()
    >>> mse = lambda out, target: (out - target).square().sum() / 4
    >>> pipe = build_pipeline(stages, plan, mse, torch.device("cpu"), dist.group.WORLD)
    >>> x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    >>> losses = pipe.run(x, y)
    >>> len(losses), torch.allclose(sum(losses), mse(model(x), y), rtol=1e-12)
    (2, True)
    >>> dist.destroy_process_group()
    """
    stages = [Stage(m, i, len(plan.stage_units), device, group=group, context=forward_context)
              for m, i in zip(modules, plan.ids)]
    cls = get_schedule_class(plan.schedule)
    # Our loss is already normalised by the global token count: no extra scaling.
    schedule = cls(stages[0] if is_single_stage(plan.schedule) else stages,
                   n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)
    held = ", ".join(f"{i} ({len(plan.stage_units[i])} units)" for i in plan.ids)
    log.info("pipeline: %s, %d stages, %d microbatches; this rank holds stage %s",
             plan.schedule, len(plan.stage_units), plan.microbatches, held)
    return Pipeline(modules, stages, schedule, 0 in plan.ids,
                    len(plan.stage_units) - 1 in plan.ids)
