"""Parallelize passes: each file holds one pass, each pass is a function.

``parallelize`` is the one place that knows their order; the trainer and
users' own scripts both call it.

Imports: torch_compat, spec, config, mesh, models.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from composer.mesh import ParallelDims
from composer.parallel.activation import apply_ac
from composer.parallel.attention import apply_attention
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


@dataclass(frozen=True)
class Passes:
    """The settings of ``parallelize``'s passes (the trainer builds one from the job)."""

    zero_stage: int = 3
    sequence_parallel: bool = True
    loss_parallel: bool = False
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    ac_mode: str = "none"
    ac_every: int = 2
    compile_backend: str | None = None
    converters: tuple = ()
    seq_len: int | None = None
    cp_method: str = "allgather"
    attention: str = "sdpa"


def parallelize(model: nn.Module, dims: ParallelDims, spec: ModelSpec, *, zero_stage: int = 3,
                sequence_parallel: bool = True, loss_parallel: bool = False,
                param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, ac_mode: str = "none", ac_every: int = 2,
                compile_backend: str | None = None, converters: Sequence = (),
                seq_len: int | None = None, cp_method: str = "allgather",
                attention: str = "sdpa") -> None:
    """Apply, in this order, to a model (or a pipeline stage of it) that may still
    be on the meta device:

    - the attention backend, ``attention`` ``"sdpa"`` or ``"flex"`` (FlexAttention with
      block masks; ``choose_attention`` resolves ``model.attention``), on the model's
      mask module and attention cores where they take it (compiled blocks under SDPA
      get dense masks of packed documents: one graph cannot loop over their spans);
    - tensor parallel, if ``dims.tp`` > 1: ``spec.tp_plan``; ``sequence_parallel``
      shards the norms' sequence, ``loss_parallel`` leaves the logits sharded on
      the vocabulary (the loss then runs under torch's ``loss_parallel()``);
    - context parallel, if ``dims.cp`` > 1: ``seq_len`` is the sequence cut over
      ``cp`` (each rank feeds the model its ``local_positions``), ``cp_method``
      ``"allgather"`` (keys and values gathered) or ``"alltoall"`` (Ulysses); needs
      ``spec.parallel.attention_cores`` and ``attention_mask``;
    - expert parallel, if ``dims.ep`` > 1: the experts of each of
      ``spec.parallel.moe_modules`` spread over ``ep`` (their ``experts`` module holds
      stacked weights [n_experts, ...] and is called as ``experts(tokens sorted by
      expert, tokens per expert)``); needs FSDP (``zero_stage`` 2 or 3);
    - activation checkpointing of the blocks held (``spec.held_blocks``): ``ac_mode``
      ``"none"``, ``"full"``, ``"selective_layer"`` (every ``ac_every``-th block) or
      ``"selective_op"`` (matmul and attention outputs kept);
    - compile of each block, with ``compile_backend`` (None: eager);
    - data parallel over the ranks left: FSDP2 (``zero_stage`` 3, or 2: no reshard
      after forward), DDP (0) or DDP with a sharded optimizer (1), in
      ``param_dtype`` and ``reduce_dtype`` (None: the parameters').

    ``dims.build_mesh`` must have run where any degree is above 1. ``converters``:
    those that converted the model (``build_converters``), asked for their TP
    styles and what FSDP2 gathers.

    >>> import torch
    >>> from torch import nn
    >>> from composer import ModelSpec, ParallelDims, materialize, parallelize
    >>> class Block(nn.Module):
    ...     def __init__(self, dim):
    ...         super().__init__()
    ...         self.linear = nn.Linear(dim, dim)
    ...     def forward(self, x):
    ...         return x + self.linear(x).relu()
    >>> spec = ModelSpec("residual", {"tiny": 8}, build=lambda d: nn.Sequential(Block(d), Block(d)),
    ...                  blocks=lambda model: list(model))
    >>> dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    >>> model = spec.build_meta(8)
    >>> parallelize(model, dims, spec, ac_mode="full", compile_backend="eager")
    >>> materialize(model, lambda: spec.build_meta(8), torch.device("cpu"), seed=0)
    >>> model(torch.ones(2, 8)).sum().backward()  # each block compiled, recomputed in backward
    >>> model[1].linear.weight.grad.shape
    torch.Size([8, 8])
    """
    apply_passes(model, dims, spec, Passes(
        zero_stage, sequence_parallel, loss_parallel, param_dtype, reduce_dtype, ac_mode,
        ac_every, compile_backend, tuple(converters), seq_len, cp_method, attention))


def apply_passes(model: nn.Module, dims: ParallelDims, spec: ModelSpec, o: Passes) -> None:
    """``parallelize`` with its settings in one object: the passes, in their order."""
    apply_attention(model, spec, o.attention, compiled=o.compile_backend is not None)
    if dims.tp > 1:
        tensor_parallel(model, dims, spec, o.sequence_parallel, o.loss_parallel, o.converters)
    if dims.cp > 1:
        if spec.parallel.attention_cores is None or o.seq_len is None:
            raise ValueError("context parallel needs ModelSpec.parallel.attention_cores "
                             "and seq_len")
        apply_cp(model, spec, dims.mesh("cp"), o.seq_len, o.cp_method,
                 flex=o.attention == "flex", dense=o.compile_backend is not None)
    experts = expert_parallel(model, dims, spec) if dims.ep > 1 else []
    apply_ac(spec.held_blocks(model), o.ac_mode, o.ac_every, spec.parallel.recompute_context)
    if o.compile_backend:
        apply_compile(spec.held_blocks(model), o.compile_backend, per_submodule=dims.tp > 1,
                      fullgraph=spec.parallel.compile_fullgraph)
    with contextlib.ExitStack() as views:  # what converters store in a form of their own
        for converter in o.converters:
            views.enter_context(converter.fsdp_view(model))
        apply_data_parallel(model, spec.held_blocks(model), dims, o.zero_stage, o.param_dtype,
                            o.reduce_dtype, experts)
