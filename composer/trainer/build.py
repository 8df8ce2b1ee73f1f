"""Build this rank's model parts for a plan: meta build -> pipeline stages ->
parallelize passes -> real weights that are the same on every layout."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from composer.job.plan import Plan
from composer.parallel import Passes, apply_passes
from composer.parallel.attention import choose_attention
from composer.parallel.materialize import materialize


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
    """The meta model with the job's converters applied (they swap modules, so
    they run before any pipeline cut or parallelize pass)."""
    model = build_meta(plan)
    for converter in plan.converters:
        converter.convert(model)
    return model


def parallelized(plan: Plan) -> list[nn.Module]:
    """Meta build -> converters -> [pipeline stages] -> passes: this rank's model parts
    (one unless pipelined), still on meta."""
    pipe = plan.pipeline
    parts = [build_converted(plan)] if pipe is None else pipe.stage_modules(
        lambda: build_converted(plan))
    options = passes(plan, choose_attention(plan.cfg.model.attention, plan.device, parts[0],
                                            plan.spec))
    for part in parts:
        apply_passes(part, plan.dims, plan.spec, options)
    return parts


def passes(plan: Plan, attention: str) -> Passes:
    """The job's settings of the parallelize passes."""
    cfg = plan.cfg
    t, p = cfg.training, cfg.parallelism
    return Passes(zero_stage=p.zero_stage, sequence_parallel=p.sequence_parallel,
                  loss_parallel=plan.loss_parallel,
                  param_dtype=plan.mixed_dtype(t.mixed_precision_param),
                  reduce_dtype=plan.mixed_dtype(t.mixed_precision_reduce),
                  ac_mode=cfg.activation_checkpoint.mode, ac_every=cfg.activation_checkpoint.every,
                  compile_backend=cfg.compile.backend if cfg.compile.enable else None,
                  converters=tuple(plan.converters), seq_len=cfg.data.seq_len,
                  cp_method=p.context_parallel_method, attention=attention)


def with_weights(plan: Plan, parts: list[nn.Module]) -> list[nn.Module]:
    """The parallelized meta ``parts`` with real weights, identical on every layout."""
    for part in parts:
        # A stage drawing its own weights would draw the full model's stream
        # from its first layer on; it takes its slice of the full model instead.
        materialize(part, lambda: build_converted(plan), plan.device, plan.cfg.job.seed,
                    from_replica=plan.pipeline is not None, converters=plan.converters)
    for converter in plan.converters:
        converter.built(parts)
    return parts


def build_model(plan: Plan) -> list[nn.Module]:
    """Meta build -> converters -> [pipeline stages] -> passes -> real weights,
    identical on every layout. Returns this rank's model parts (one unless pipelined)."""
    return with_weights(plan, parallelized(plan))
