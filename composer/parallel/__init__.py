"""Parallelize passes: each file holds one pass, each pass is a function.

``parallelize`` is the one place that knows their order; the trainer and
users' own scripts both call it.
"""
from __future__ import annotations

import torch
from torch import nn

from composer.mesh import ParallelDims
from composer.parallel.activation import apply_ac
from composer.parallel.compile import apply_compile
from composer.parallel.data import apply_data_parallel
from composer.parallel.expert import apply_ep
from composer.parallel.tensor import apply_tp
from composer.spec import ModelSpec


def parallelize(model: nn.Module, dims: ParallelDims, spec: ModelSpec, *, zero_stage: int = 3,
                sequence_parallel: bool = True, loss_parallel: bool = False,
                param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, ac_mode: str = "none", ac_every: int = 2,
                compile_backend: str | None = None) -> None:
    """Apply tensor parallel (if ``dims.tp`` > 1), expert parallel (if ``dims.ep``
    > 1), activation checkpointing (``ac_mode``), compile (if ``compile_backend``),
    then data parallel, to a model (or a pipeline stage of it) that may still be
    on the meta device. ``dims.build_mesh`` must have run."""
    if dims.tp > 1:
        if spec.tp_plan is None:
            raise ValueError(f"model {spec.name!r} has no tensor-parallel plan (ModelSpec.tp_plan)")
        plan = spec.tp_plan(sequence_parallel, loss_parallel)
        if any(type(m).__name__ == "Float8Linear" for m in model.modules()):
            from composer.converters.float8 import float8_tp_plan
            plan = float8_tp_plan(model, plan, sequence_parallel)
        from composer.converters.lora import lora_tp_plan  # (composer.converters.lora imports composer.init)
        plan = lora_tp_plan(model, plan)  # unchanged without adapters
        # A pipeline stage lacks some modules of the plan; a whole model must match all.
        apply_tp(model, dims.mesh("tp"), plan, strict=dims.pp == 1, optional=spec.tp_optional)
    experts = []
    if dims.ep > 1:
        if spec.moe_modules is None:
            raise ValueError(f"model {spec.name!r} has no experts (ModelSpec.moe_modules)")
        moe_layers = list(spec.moe_modules(model).values())
        apply_ep(moe_layers, dims.mesh("ep"))
        experts = [m.experts for m in moe_layers]
    routers = list(spec.moe_modules(model).values()) if spec.moe_modules else []
    apply_ac(spec.blocks(model), ac_mode, ac_every,
             lambda block: [m for m in block.modules() if any(m is r for r in routers)])
    if compile_backend:
        apply_compile(spec.blocks(model), compile_backend, per_submodule=dims.tp > 1,
                      fullgraph=spec.moe_modules is None)
    apply_data_parallel(model, spec.blocks(model), dims, zero_stage, param_dtype, reduce_dtype,
                        experts)
