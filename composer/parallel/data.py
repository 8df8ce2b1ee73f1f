"""Data parallelism: DDP (ZeRO-0), DDP + sharded optimizer state (ZeRO-1),
FSDP2 without (ZeRO-2) or with (ZeRO-3) resharding after forward, and HSDP.

ZeRO-1's optimizer sharding lives in composer/trainer/optim.py; here the model is only
wrapped. All wrappers accept a model still on the meta device.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from composer import torch_compat
from composer.mesh import ParallelDims

log = logging.getLogger(__name__)


def apply_ddp(model: nn.Module, blocks: list[nn.Module], dims: ParallelDims,
              mp: MixedPrecisionPolicy) -> None:
    """Replicate the model over every data-parallel rank; each block's gradients
    are all-reduced as soon as its backward is done, overlapping the rest.

    This is FSDP2's replicate: parameters are DTensors replicated over dp, so it
    composes with tensor parallel (its weights become 2D DTensors) and takes the
    same mixed-precision policy as FSDP."""
    for block in blocks:
        torch_compat.replicate_fsdp(block, mesh=dims.mesh(dims.ddp_dim), mp_policy=mp)
    torch_compat.replicate_fsdp(model, mesh=dims.mesh(dims.ddp_dim), mp_policy=mp)
    log.info("applied DDP over %d ranks to %d blocks + root", dims.replicas, len(blocks))


def apply_ddp_zero1(model: nn.Module, dims: ParallelDims) -> None:
    """Classic DDP (bucketed all-reduce, built lazily at the first forward once the
    weights are real) on plain tensors, which ZeRO-1's sharded optimizer needs."""
    # Buffers (rotary tables) are computed identically on every rank: no need to
    # broadcast them before every forward.
    # Gradients live in DDP's buckets (no second copy of every gradient).
    torch_compat.replicate_ddp(model, device_mesh=dims.mesh(dims.ddp_dim), bucket_cap_mb=100,
                         broadcast_buffers=False, gradient_as_bucket_view=True)
    log.info("applied DDP (for ZeRO-1) over %d ranks", dims.replicas)


def _fsdp_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2 shards dim 0, except where tensor parallel packs parts into it (a strided
    shard): FSDP2 would take that for a plain shard and lose the packing, so the first
    dim no packing uses (a packed linear's dim 1; stacked experts pack dim 1 and keep 0)."""
    if not isinstance(param, DTensor):
        return None
    packed = {p.dim for p in param.placements if torch_compat.is_strided_shard(p)}
    return Shard(min(set(range(param.dim())) - packed)) if 0 in packed else None


def one_dtype(module: nn.Module) -> int:
    """Cast the parameters of another dtype than most of ``module``'s to that one: FSDP2
    flattens one dtype per group (transformers keeps some routers in float32, which differ
    from the rest only where the model is held in another dtype). Returns how many."""
    counts = Counter(p.dtype for p in module.parameters())
    if len(counts) < 2:
        return 0
    common = counts.most_common(1)[0][0]
    cast = 0
    for owner in module.modules():
        for name, p in list(owner.named_parameters(recurse=False)):
            if p.dtype != common:
                owner.register_parameter(name, nn.Parameter(p.detach().to(common),
                                                             p.requires_grad))
                cast += 1
    return cast


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], dims: ParallelDims,
               param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
               reshard_after_forward: bool, experts: list[nn.Module] = ()) -> None:
    """Shard the expert-parallel experts over ``efsdp``, each block, then the root
    (embeddings, norm, output) with FSDP2.

    With a replicate degree above 1 the mesh is 2D and FSDP2 runs as HSDP:
    shards within a group, all-reduce of gradients across groups.
    """
    hsdp = dims.dp_replicate > 1
    mesh = dims.mesh("dp_replicate", dims.fsdp_dim) if hsdp else dims.mesh(dims.fsdp_dim)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in experts:
        fully_shard(module, mesh=dims.mesh("dp_replicate", "efsdp") if hsdp else dims.mesh("efsdp"),
                    mp_policy=mp, reshard_after_forward=reshard_after_forward)
    cast = sum(one_dtype(block) for block in blocks) + one_dtype(model)
    if cast:
        log.info("FSDP2: %d parameters of another dtype than their block's cast to it (one "
                 "dtype per group)", cast)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=_fsdp_placement)
    # The root is used last in forward and first in backward, so keeping it
    # gathered saves one all-gather at no memory cost worth mentioning.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False,
                shard_placement_fn=_fsdp_placement)
    shard = dims.dp_shard * dims.cp
    kind = f"HSDP {dims.dp_replicate}x{shard}" if hsdp else f"FSDP2 x{shard}"
    log.info("applied %s to %d blocks + root (reshard_after_forward=%s, param %s, reduce %s)",
             kind, len(blocks), reshard_after_forward, param_dtype, reduce_dtype)


def apply_data_parallel(model: nn.Module, blocks: list[nn.Module], dims: ParallelDims,
                        zero_stage: int, param_dtype: torch.dtype | None,
                        reduce_dtype: torch.dtype | None, experts: list[nn.Module] = ()) -> None:
    """Choose the data-parallel wrapper for ``parallelism.zero_stage``; one rank needs
    none. ``experts``: expert-parallel modules (FSDP only, checked at validation)."""
    if not dims.dp_enabled:
        return
    if zero_stage >= 2:
        apply_fsdp(model, blocks, dims, param_dtype, reduce_dtype,
                   reshard_after_forward=zero_stage == 3, experts=experts)
    elif zero_stage == 1:
        apply_ddp_zero1(model, dims)
    else:
        apply_ddp(model, blocks, dims, MixedPrecisionPolicy(param_dtype, reduce_dtype))


def accumulate(model: nn.Module, last: bool) -> None:
    """Tell the data-parallel wrapper whether this microbatch's backward is the step's
    last. FSDP2 reduce-scatters every microbatch, so gradients stay sharded (deferring
    it would hold an unsharded fp32 copy of every gradient on each rank); only the
    all-reduce across replicas (HSDP's, replicate's) waits for the last one. Classic DDP
    (ZeRO-1) holds full gradients in its buckets either way and all-reduces once."""
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(last)
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)


def reshard(parts: list[nn.Module]) -> None:
    """Free the gathered parameters FSDP2 still holds on this rank: a forward without a
    backward (validation) leaves the root's gathered. Every rank of a group calls it at
    the same point, so that a state dict taken on some ranks only (a torchft heal's
    source, whose state-dict hook reshards) leaves them all alike for the next forward's
    all-gathers."""
    for unit in _fsdp_units(parts):
        unit.reshard()


def _fsdp_units(parts: list[nn.Module]) -> list[FSDPModule]:
    return [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]


def hook_all_reduce(parts: list[nn.Module], hook: Callable[[torch.Tensor], None]) -> set[int]:
    """Run ``hook`` on every FSDP2 unit's reduced gradient shard as its backward produces
    it (FSDP2's all-reduce hook: after the reduce-scatter, after HSDP's all-reduce), so
    that a reduction across something no mesh holds overlaps the backward. Under
    accumulation a 1-D FSDP2 unit calls it every microbatch (a sum: the same mean).
    Returns the ids of the parameters whose gradients it sees: every parameter of a part
    whose root FSDP2 shards."""
    sharded = [part for part in parts if isinstance(part, FSDPModule)]
    for unit in _fsdp_units(sharded):
        unit.set_all_reduce_hook(hook)
    return {id(p) for part in sharded for p in part.parameters()}
