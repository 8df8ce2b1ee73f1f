"""Build this rank's model parts for a plan: meta build -> pipeline stages ->
parallelize passes -> real weights that are the same on every layout."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from composer.init import materialize
from composer.parallel import parallelize
from composer.parallel.pipeline import prune
from composer.plan import Plan


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_meta(plan: Plan) -> nn.Module:
    with default_dtype(plan.dtype):
        return plan.spec.build_meta(plan.args)


def build_model(plan: Plan) -> list[nn.Module]:
    """Meta build -> [pipeline stages] -> passes -> real weights, identical on
    every layout. Returns this rank's model parts (one unless pipelined)."""
    pipe = plan.pipeline
    if pipe is None:
        parts = [build_meta(plan)]
    else:
        parts = [prune(build_meta(plan), pipe.units, pipe.stage_units[i]) for i in pipe.ids]
    t, p = plan.cfg.training, plan.cfg.parallelism
    for part in parts:
        parallelize(part, plan.dims, plan.spec, zero_stage=p.zero_stage,
                    sequence_parallel=p.sequence_parallel, loss_parallel=plan.loss_parallel,
                    param_dtype=plan.mixed_dtype(t.mixed_precision_param),
                    reduce_dtype=plan.mixed_dtype(t.mixed_precision_reduce))
        # A stage drawing its own weights would draw the full model's stream
        # from its first layer on; it takes its slice of the full model instead.
        materialize(part, lambda: build_meta(plan), plan.device, plan.cfg.job.seed,
                    from_replica=pipe is not None)
    return parts
