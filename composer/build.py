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


def build_converted(plan: Plan) -> nn.Module:
    """The meta model with ``model.converters`` applied (they swap modules, so
    they run before any pipeline cut or parallelize pass)."""
    model = build_meta(plan)
    if "float8" in plan.cfg.model.converters:
        from composer.converters.float8 import convert_float8  # imports torchao
        convert_float8(model, plan.cfg.float8, plan.device)
    if "lora" in plan.cfg.model.converters:  # after float8: a float8 base gets adapters
        from composer.converters.lora import convert_lora
        convert_lora(model, plan.cfg.lora)
    return model


def build_model(plan: Plan) -> list[nn.Module]:
    """Meta build -> converters -> [pipeline stages] -> passes -> real weights,
    identical on every layout. Returns this rank's model parts (one unless pipelined)."""
    pipe = plan.pipeline
    if pipe is None:
        parts = [build_converted(plan)]
    else:
        parts = [prune(build_converted(plan), pipe.units, pipe.stage_units[i]) for i in pipe.ids]
    cfg = plan.cfg
    t, p = cfg.training, cfg.parallelism
    if "lora" in cfg.model.converters:
        from composer.converters.lora import log_trainable
        log_trainable(parts, cfg.lora)
    for part in parts:
        parallelize(part, plan.dims, plan.spec, zero_stage=p.zero_stage,
                    sequence_parallel=p.sequence_parallel, loss_parallel=plan.loss_parallel,
                    param_dtype=plan.mixed_dtype(t.mixed_precision_param),
                    reduce_dtype=plan.mixed_dtype(t.mixed_precision_reduce),
                    ac_mode=cfg.activation_checkpoint.mode, ac_every=cfg.activation_checkpoint.every,
                    compile_backend=cfg.compile.backend if cfg.compile.enable else None)
        # A stage drawing its own weights would draw the full model's stream
        # from its first layer on; it takes its slice of the full model instead.
        materialize(part, lambda: build_converted(plan), plan.device, plan.cfg.job.seed,
                    from_replica=pipe is not None)
    return parts
