"""Optimizer, learning-rate schedule and gradient clipping.

Clipping works on plain, DDP and FSDP/DTensor gradients alike and always sees
the norm of the whole model's gradient, so every layout clips identically.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from composer import torch_compat
from composer.config import JobConfig, LRScheduler, Optimizer
from composer.mesh import ParallelDims
from composer.parallel.tensor import reduce_partial_grads

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def _implementation(params: list[nn.Parameter], choice: str) -> dict:
    """Keyword arguments that pick the fused, foreach or for-loop kernels.

    auto: fused (one kernel per step) for plain tensors and DTensors of plain
    tensors on CPU or CUDA; foreach where a parameter is a tensor subclass of a
    converter's (float8's all-gather weights). On DTensors the fused kernel is
    also one sharding decision a step instead of one per foreach op, the cost that
    dominates the first step of a 2D (FSDP2 x TP2) job.
    """
    if choice == "auto":
        choice = "fused" if all(_fusable(p) for p in params) else "foreach"
    return {"fused": choice == "fused", "foreach": choice == "foreach"}


def _fusable(p: torch.Tensor) -> bool:
    local = p.to_local() if isinstance(p, DTensor) else p.data
    return type(local) is torch.Tensor and local.device.type in ("cpu", "cuda")


def build_optimizer(params: list[nn.Parameter], cfg: Optimizer, dims: ParallelDims,
                    zero_stage: int) -> torch.optim.Optimizer:
    """The optimizer over ``params``; ZeRO-1 shards its state over dp."""
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps,
              "weight_decay": cfg.weight_decay, **_implementation(params, cfg.implementation)}
    cls = OPTIMIZERS[cfg.name]
    if zero_stage == 1 and dims.dp_enabled:
        return ZeroRedundancyOptimizer(params, optimizer_class=cls,
                                       process_group=dims.mesh(dims.ddp_dim).get_group(), **kwargs)
    # One group per mesh: a foreach kernel cannot mix plain tensors and DTensors,
    # nor DTensors of different meshes.
    groups = _alike(params, lambda g: g.device_mesh)
    return cls([{"params": group} for group in groups], **kwargs)


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


def build_optimizers(parts: list[nn.Module], cfg: JobConfig, dims: ParallelDims
                     ) -> tuple[list[torch.optim.Optimizer], list[LambdaLR]]:
    """An optimizer and its lr schedule per model part (so each saves its state under its
    part's FQNs), over the part's trainable parameters."""
    optimizers = [build_optimizer([p for p in part.parameters() if p.requires_grad],
                                  cfg.optimizer, dims, cfg.parallelism.zero_stage)
                  for part in parts]
    return optimizers, [build_lr_scheduler(o, cfg.lr_scheduler, cfg.training.steps)
                        for o in optimizers]


def set_schedule_step(scheduler: LambdaLR, step: int) -> None:
    """Put a schedule (and its optimizer's lr) where it is after ``step`` steps."""
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    torch_compat.set_last_lr(scheduler, lrs)


def _alike(tensors: list[torch.Tensor], key) -> list[list[torch.Tensor]]:
    """Split by ``key(t)`` of the DTensors (plain tensors form their own group):
    tensor parallel shards some weights and leaves others (norms) replicated,
    and one foreach kernel cannot mix the two."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(key(t) if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Finish the gradients (reduce tensor parallel's partial sums), clip them to
    ``max_norm`` (0: only measure) and return their global 2-norm as one process
    would compute it: ``full_tensor`` reduces each layout's partial norm across
    its shards, and the squares are summed over the pipeline stages' ranks
    (``pp_group``: ``dims.mesh("pp").get_group()`` under pipeline parallel).

    >>> import torch
    >>> from composer import clip_grad_norm_
    >>> model = torch.nn.Linear(2, 1, bias=False)
    >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
    >>> clip_grad_norm_(list(model.parameters()), max_norm=1.0), model.weight.grad
    (tensor(5.), tensor([[0.6000, 0.8000]]))
    """
    reduce_partial_grads(params)
    with_grads = [p for p in params if p.grad is not None]
    groups = _alike(with_grads, lambda p: (p.grad.device_mesh, p.grad.placements))
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pp_group is not None:
        total = total.square()
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    if max_norm > 0:
        scale_grads_(with_grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


@torch.no_grad()
def scale_grads_(params: list[nn.Parameter], coef: torch.Tensor) -> None:
    """Multiply every gradient by ``coef`` (torch's clipping formula), shard by shard:
    the same numbers as DTensor's foreach multiply, without its sharding
    propagation, which dominates the first step on 2D meshes."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    for (device, _), ([same], _) in torch_compat.group_tensors_by_device_and_dtype([grads]).items():
        torch_compat.foreach_mul_(same, coef.to(device))
