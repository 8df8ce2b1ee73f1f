"""Parallelize passes: each file holds one pass, each pass is a function.

``parallelize`` is the one place that knows their order; the trainer and
users' own scripts both call it.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from composer.mesh import ParallelDims
from composer.parallel.activation import apply_ac
from composer.parallel.compile import apply_compile
from composer.parallel.context import apply_cp
from composer.parallel.data import apply_data_parallel
from composer.parallel.expert import apply_ep
from composer.parallel.tensor import apply_tp, resolve_plan
from composer.spec import ModelSpec


def tensor_parallel(model: nn.Module, dims: ParallelDims, spec: ModelSpec, sequence_parallel: bool,
                    loss_parallel: bool, converters: Sequence = ()) -> None:
    """The spec's plan as styles, adjusted by each converter, applied over ``tp``."""
    if spec.tp_plan is None:
        raise ValueError(f"model {spec.name!r} has no tensor-parallel plan (ModelSpec.tp_plan)")
    plan = resolve_plan(model, spec.tp_plan, sequence_parallel, loss_parallel)
    for converter in converters:
        plan = converter.tp_styles(model, plan, sequence_parallel)
    # A pipeline stage lacks some modules of the plan; a whole model must match all.
    apply_tp(model, dims.mesh("tp"), plan, strict=dims.pp == 1, optional=spec.parallel.tp_optional)


def expert_parallel(model: nn.Module, dims: ParallelDims, spec: ModelSpec) -> list[nn.Module]:
    """Experts spread over ``ep``; returns the expert modules (FSDP shards them apart)."""
    if spec.parallel.moe_modules is None:
        raise ValueError(f"model {spec.name!r} has no experts (ModelSpec.parallel.moe_modules)")
    moe_layers = list(spec.parallel.moe_modules(model).values())
    apply_ep(moe_layers, dims.mesh("ep"))
    return [m.experts for m in moe_layers]


def parallelize(model: nn.Module, dims: ParallelDims, spec: ModelSpec, *, zero_stage: int = 3,
                sequence_parallel: bool = True, loss_parallel: bool = False,
                param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, ac_mode: str = "none", ac_every: int = 2,
                compile_backend: str | None = None, converters: Sequence = (),
                seq_len: int | None = None, cp_method: str = "allgather") -> None:
    """Apply tensor parallel (if ``dims.tp`` > 1), context parallel (if ``dims.cp``
    > 1; ``seq_len``: the sequence it cuts, ``cp_method`` how), expert parallel
    (if ``dims.ep`` > 1), activation checkpointing (``ac_mode``), compile (if
    ``compile_backend``), then data parallel, to a model (or a pipeline stage of
    it) that may still be on the meta device. ``dims.build_mesh`` must have run.
    ``converters``: those that converted the model (``composer.converters``),
    asked for their TP styles."""
    if dims.tp > 1:
        tensor_parallel(model, dims, spec, sequence_parallel, loss_parallel, converters)
    if dims.cp > 1:
        if spec.parallel.attention_cores is None or seq_len is None:
            raise ValueError("context parallel needs ModelSpec.parallel.attention_cores "
                             "and seq_len")
        apply_cp(model, spec, dims.mesh("cp"), seq_len, cp_method)
    experts = expert_parallel(model, dims, spec) if dims.ep > 1 else []
    apply_ac(spec.blocks(model), ac_mode, ac_every, spec.parallel.recompute_context)
    if compile_backend:
        apply_compile(spec.blocks(model), compile_backend, per_submodule=dims.tp > 1,
                      fullgraph=spec.parallel.compile_fullgraph)
    with contextlib.ExitStack() as views:  # what converters store in a form of their own
        for converter in converters:
            views.enter_context(converter.fsdp_view(model))
        apply_data_parallel(model, spec.blocks(model), dims, zero_stage, param_dtype,
                            reduce_dtype, experts)
