"""Router statistics and load balancing of a model's MoE layers, per step.

Each MoE layer counts, on its own rank, the tokens it routed to each expert and
its auxiliary loss. After the step the counts are summed over the data ranks
(every layout then sees the same global load) and over the pipeline stages
(rank 0 reports layers it does not hold), the balancing biases move by the
global load, and the counters restart.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from composer.observe.base import Observer, StepInfo
from composer.spec import ModelSpec


class RouterStats(Observer):
    """``whole``: the whole model on the meta device (every MoE layer, for shapes);
    ``parts``: this rank's model parts, whose layers it updates. Routers count
    only inside ``forward()``: real batches, not a schedule's shape inference."""

    def __init__(self, spec: ModelSpec, whole: nn.Module, parts: list[nn.Module], reduce,
                 per_expert: bool = False):
        moe_modules = spec.parallel.moe_modules
        self.order = {fqn: m.tokens_per_expert.numel() for fqn, m in moe_modules(whole).items()}
        self.local = {fqn: m for part in parts for fqn, m in moe_modules(part).items()}
        self.reduce = reduce  # sum a tensor over the data ranks and the stages, in place
        self.per_expert = per_expert  # report every layer's load, not only its summary
        self.set_counting(False)

    def set_counting(self, enabled: bool) -> None:
        for layer in self.local.values():
            layer.count_tokens = enabled

    @contextlib.contextmanager
    def forward(self):
        """Count the forwards run inside (counting is off otherwise)."""
        self.set_counting(True)
        try:
            yield
        finally:
            self.set_counting(False)

    def reset(self) -> None:
        for layer in self.local.values():
            layer.reset_stats()

    def restarted(self) -> None:
        self.reset()

    def row(self, info: StepInfo) -> dict:
        return self.statistics(info.tokens, info.device)

    def summary(self, row: dict) -> str | None:
        if "moe_imbalance" not in row:
            return None
        return f"moe max/mean {row['moe_imbalance']:.2f}  aux {row['moe_aux_loss']:.4f}"

    @torch.no_grad()
    def statistics(self, tokens: int, device: torch.device) -> dict:
        """Reduce the step's counters, balance, reset; returns the metrics row part.
        ``tokens``: the step's global target tokens (the loss normaliser)."""
        experts = max(self.order.values())
        load = torch.zeros(len(self.order), experts, dtype=torch.float64, device=device)
        aux = torch.zeros(len(self.order), dtype=torch.float64, device=device)
        for i, fqn in enumerate(self.order):
            if fqn in self.local:
                load[i, :self.order[fqn]] = self.local[fqn].tokens_per_expert
                aux[i] = self.local[fqn].aux_loss_sum
        both = self.reduce(torch.cat([load.flatten(), aux]))
        load, aux = both[:load.numel()].view_as(load), both[load.numel():]
        for i, fqn in enumerate(self.order):
            if fqn in self.local:
                self.local[fqn].update_expert_bias(load[i, :self.order[fqn]])
        self.reset()
        mean = load.sum(1) / torch.tensor(list(self.order.values()), device=device)
        row = {"moe_aux_loss": aux.sum().item() / tokens,
               "moe_tokens_min": load.min().item(), "moe_tokens_mean": mean.mean().item(),
               "moe_tokens_max": load.max().item(),
               "moe_imbalance": (load.max(1).values / mean).max().item()}
        if self.per_expert:
            row["moe_tokens_per_expert"] = load.long().tolist()
        return row


def router_observer(view) -> RouterStats | None:
    plan = view.plan
    if plan.spec.parallel.moe_modules is None:
        return None
    whole = plan.spec.build_meta(plan.args)
    if not plan.spec.parallel.moe_modules(whole):  # a family of models with and without
        return None
    return RouterStats(plan.spec, whole, view.parts, view.sum_all, plan.cfg.metrics.expert_load)
