"""The loss and what surrounds it: the summed cross-entropy, the autocast it
runs under, the reductions of its sums over ranks, and the pipeline's scaled
loss function."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from composer.data import IGNORE_INDEX
from composer.mesh import ParallelDims


def autocast(device: torch.device, dtype: torch.dtype, param_dtype: torch.dtype, fsdp: bool):
    """The context a forward runs in: autocast to ``param_dtype`` where the parameters are
    ``dtype`` and nothing casts them (FSDP2 and its replicate cast them themselves;
    classic DDP, ZeRO-1, and one process do not)."""
    if param_dtype == dtype or fsdp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=param_dtype)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy; half-precision logits are upcast, float64 stays float64.
    Vocabulary-sharded logits (loss parallel) give a DTensor loss. A model whose forward
    returns anything else than its logits (a tuple with an auxiliary loss, a dict) gets
    a TypeError that says what the trainer takes."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model's forward returned a {type(logits).__name__}; composer's "
                        f"trainer takes its logits, one tensor [batch, seq, vocab] (a loss "
                        f"term of its own: add it to the logits' graph inside the forward, "
                        f"scaled by ModelSpec.training.set_loss_scale)")
    logits = logits.flatten(0, 1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def all_reduce_sum(t: torch.Tensor, dims: ParallelDims, dim: str = "dp_cp") -> torch.Tensor:
    """Sum over ``dim``: by default the ranks that see different data."""
    if dist.is_initialized() and dims.mesh(dim).size() > 1:
        dist.all_reduce(t, group=dims.mesh(dim).get_group())
    return t


class ScaledLoss:
    """The pipeline schedule's loss function: the summed cross-entropy times
    ``scale``, which the trainer sets to each step's before the schedule runs."""

    def __init__(self, loss_fn):
        self.loss_fn, self.scale = loss_fn, 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, targets) * self.scale


def gather_small(t: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Every rank's copy of the small tensor ``t`` (on the CPU), through ``device``."""
    if not dist.is_initialized():
        return [t]
    t = t.to(device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.cpu() for o in out]
