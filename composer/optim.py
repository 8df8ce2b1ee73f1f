"""Optimizer, learning-rate schedule and gradient clipping.

Clipping works on plain, DDP and FSDP/DTensor gradients alike and always sees
the norm of the whole model's gradient, so every layout clips identically.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from composer.config import LRScheduler, Optimizer
from composer.mesh import ParallelDims

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def _implementation(params: list[nn.Parameter], choice: str) -> dict:
    """Keyword arguments that pick the fused, foreach or for-loop kernels.

    auto: fused for plain tensors (one kernel per step), foreach for DTensors,
    whose fused path is not available on every backend.
    """
    if choice == "auto":
        choice = "foreach" if any(isinstance(p, DTensor) for p in params) else "fused"
    return {"fused": choice == "fused", "foreach": choice == "foreach"}


def build_optimizer(model: nn.Module, cfg: Optimizer, dims: ParallelDims,
                    zero_stage: int) -> torch.optim.Optimizer:
    """The optimizer over the trainable parameters; ZeRO-1 shards its state over dp."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps,
              "weight_decay": cfg.weight_decay, **_implementation(params, cfg.implementation)}
    cls = OPTIMIZERS[cfg.name]
    if zero_stage == 1 and dims.dp_enabled:
        return ZeroRedundancyOptimizer(params, optimizer_class=cls,
                                       process_group=dims.mesh("dp").get_group(), **kwargs)
    return cls(params, **kwargs)


def lr_factor(step: int, cfg: LRScheduler, total_steps: int) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based index ``step``.

    Linear warmup reaches the peak on the last warmup step; the remaining steps
    decay to ``min_lr_factor`` (wsd: flat, then linear over the last
    ``decay_ratio`` of them).
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(total_steps - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    low = cfg.min_lr_factor
    if cfg.decay_type == "constant":
        return 1.0
    if cfg.decay_type == "cosine":
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.decay_type == "wsd":
        stable = 1.0 - cfg.decay_ratio
        if progress <= stable:
            return 1.0
        progress = (progress - stable) / cfg.decay_ratio
    return 1.0 - (1.0 - low) * progress


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler,
                       total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to ``max_norm`` (0: only measure) and return the global 2-norm.

    Sharded gradients give a partial norm; ``full_tensor`` reduces it across
    the shards, so the result equals the one-process norm.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
