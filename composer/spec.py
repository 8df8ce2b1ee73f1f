"""What a model tells the parallelize passes about itself.

A model file stays free of distributed code; everything a pass needs to know
about a model (its blocks, its sizes, its cost) comes through a ModelSpec.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class ModelSpec:
    """How to build, cut and cost one family of models.

    flavors: flavor name -> model arguments (any object ``build`` accepts).
    build: model arguments -> module; called under ``torch.device("meta")``,
        so it must not touch parameter values (``init_weights()`` does that).
    blocks: module -> the repeated units (transformer blocks) that FSDP,
        activation checkpointing and compile wrap one by one.
    flops_per_token: (model arguments, seq_len) -> training FLOPs per token
        (forward + backward); optional for a custom model (MFU is then null).
    tp_plan: (sequence_parallel, loss_parallel) -> {module FQN pattern:
        ParallelStyle}; ``*`` matches one name. None: no tensor parallel.
    tp_divisible: model arguments -> {size name: size} of every size that
        tensor parallel splits (heads, vocabulary, hidden features), so a bad
        degree is caught before any collective.
    pipeline_units: module -> FQNs of the modules a pipeline cut may fall
        between, in forward order (the blocks among them). A stage keeps some
        and the others are removed, so the model's forward must skip missing
        ones. None: no pipeline parallel.
    tp_optional: keys of the tensor-parallel plan that may match no module
        (layers some flavors lack); every other key must match one.
    moe_modules: module -> {FQN: MoE layer} it holds. An MoE layer has
        ``experts`` (stacked weights [n_experts, ...], called as
        ``experts(tokens sorted by expert, tokens per expert)``),
        ``tokens_per_expert``, ``aux_loss_sum``, ``aux_loss_scale``,
        ``update_expert_bias`` and ``reset_stats``. None: no experts.
    """

    name: str
    flavors: dict[str, Any]
    build: Callable[[Any], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    flops_per_token: Callable[[Any, int], float] = lambda args, seq_len: 0.0
    tp_plan: Callable[[bool, bool], dict] | None = None
    tp_divisible: Callable[[Any], dict[str, int]] = field(default=lambda args: {})
    pipeline_units: Callable[[nn.Module], list[str]] | None = None
    tp_optional: tuple[str, ...] = ()
    moe_modules: Callable[[nn.Module], dict[str, nn.Module]] | None = None

    def block_names(self, model: nn.Module) -> list[str]:
        names = {id(m): name for name, m in model.named_modules()}
        return [names[id(b)] for b in self.blocks(model)]

    def build_meta(self, args: Any) -> nn.Module:
        with torch.device("meta"):
            return self.build(args)

    def num_params(self, args: Any) -> int:
        """Parameter count of a flavor, without allocating it (tied weights count once)."""
        return sum(p.numel() for p in self.build_meta(args).parameters())
