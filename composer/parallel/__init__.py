"""Parallelize passes: each file holds one pass, each pass is a function.

``parallelize`` is the one place that knows their order; the trainer and
users' own scripts both call it.
"""
from __future__ import annotations

import torch
from torch import nn

from composer.mesh import ParallelDims
from composer.parallel.data import apply_data_parallel
from composer.parallel.expert import apply_ep
from composer.parallel.tensor import apply_tp
from composer.spec import ModelSpec


def parallelize(model: nn.Module, dims: ParallelDims, spec: ModelSpec, *, zero_stage: int = 3,
                sequence_parallel: bool = True, loss_parallel: bool = False,
                param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None) -> None:
    """Apply tensor parallel (if ``dims.tp`` > 1), expert parallel (if ``dims.ep``
    > 1), then data parallel, to a model (or a pipeline stage of it) that may
    still be on the meta device. ``dims.build_mesh`` must have run."""
    if dims.tp > 1:
        if spec.tp_plan is None:
            raise ValueError(f"model {spec.name!r} has no tensor-parallel plan (ModelSpec.tp_plan)")
        # A pipeline stage lacks some modules of the plan; a whole model must match all.
        apply_tp(model, dims.mesh("tp"), spec.tp_plan(sequence_parallel, loss_parallel),
                 strict=dims.pp == 1, optional=spec.tp_optional)
    experts = []
    if dims.ep > 1:
        if spec.moe_modules is None:
            raise ValueError(f"model {spec.name!r} has no experts (ModelSpec.moe_modules)")
        moe_layers = list(spec.moe_modules(model).values())
        apply_ep(moe_layers, dims.mesh("ep"))
        experts = [m.experts for m in moe_layers]
    apply_data_parallel(model, spec.blocks(model), dims, zero_stage, param_dtype, reduce_dtype,
                        experts)
