"""Expert parallel: each rank of the ``ep`` mesh holds n_experts / ep experts, and
tokens travel to their experts and back by all-to-all.

``apply_ep`` cuts each MoE layer's stacked expert weights along the expert dim
(DTensor ``Shard(0)`` over ``ep``, so checkpoints see whole tensors) and makes
the experts module dispatch around its own forward:

1. the caller hands it tokens sorted by expert with the count per expert;
2. all-to-all of the counts: each rank learns how many tokens every other rank
   sends to each of its experts;
3. all-to-all of the tokens (uneven splits), then a stable sort by local expert;
4. the local experts run on their contiguous groups, with local weights;
5. un-sort and all-to-all back, in the order the caller sent them.

The token all-to-alls are autograd functions whose backward is the reverse
all-to-all, so gradients take the same road home.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from composer import torch_compat

log = logging.getLogger(__name__)


def check_ep(ep: int, spec, model: nn.Module, label: str, zero_stage: int) -> None:
    """ValueError (naming the key) unless the experts of the meta ``model`` spread
    evenly over ``ep`` and FSDP can shard their weights."""
    key = f"parallelism.expert_parallel_degree={ep}"
    if spec.parallel.moe_modules is None:
        raise ValueError(f"{key}: model {spec.name!r} has no experts; allowed: 1")
    layers = spec.parallel.moe_modules(model).values()
    if not layers:
        raise ValueError(f"{key}: the model ({label}) has no experts; allowed: 1")
    for layer in layers:
        n = layer.tokens_per_expert.numel()
        if n % ep:
            raise ValueError(f"{key} does not divide the model's n_experts={n} ({label})")
    if zero_stage < 2:
        raise ValueError(f"{key}: parallelism.zero_stage={zero_stage}; expert parallel needs "
                         f"FSDP, allowed: zero_stage 2, 3")


def check_ep_tp(ep: int, tp: int, plan: dict) -> None:
    """ValueError where the tensor-parallel ``plan`` (as data) already cuts experts that
    expert parallel would spread: one of the two must leave them whole."""
    cut = [pattern for pattern, style in plan.items() if style == "experts"]
    if cut:
        raise ValueError(f"parallelism.expert_parallel_degree={ep} with "
                         f"tensor_parallel_degree={tp}: the tensor-parallel plan cuts the "
                         f"experts ({', '.join(cut)}); allowed: one of the two above 1")


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` go to the ranks of ``group``; ``recv`` rows
    come back from each. Backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def dispatch(x: torch.Tensor, counts: torch.Tensor, group) -> tuple:
    """Tokens ``x`` sorted by global expert, ``counts`` [n_experts] -> this rank's
    experts' tokens sorted by local expert, their counts, and the route back."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, -1)  # [source rank, local expert]
    send = counts.view(ep, -1).sum(1).tolist()
    recv = received.sum(1).tolist()
    tokens = _AllToAll.apply(x, send, recv, group)
    local_experts = torch.arange(received.shape[1], device=x.device).repeat(ep)
    order = local_experts.repeat_interleave(received.flatten()).argsort(stable=True)
    return tokens[order], received.sum(0), (order, send, recv)


def combine(y: torch.Tensor, route: tuple, group) -> torch.Tensor:
    """The inverse of ``dispatch`` for the experts' outputs."""
    order, send, recv = route
    return _AllToAll.apply(y[order.argsort()], recv, send, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


@contextlib.contextmanager
def local_parameters(module: nn.Module, grad_scale: float):
    """Let ``module``'s own forward see the local shards of its DTensor parameters
    (plain tensors, still differentiable back to the DTensors, their gradient
    times ``grad_scale``)."""
    own = torch_compat.own_parameters(module)
    saved = dict(own)
    for name, p in saved.items():
        if isinstance(p, DTensor):
            own[name] = _ScaleGrad.apply(p.to_local(), grad_scale)
    try:
        yield
    finally:
        own.update(saved)


class ExpertParallel:
    """Mixed into an experts module's class by ``apply_ep``."""

    ep_group: dist.ProcessGroup

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        tokens, local_counts, route = dispatch(x, counts, self.ep_group)
        # Each rank's loss is scaled up by the data-parallel degree, which data
        # parallel's averaging undoes; an expert sums the tokens of all ep ranks
        # but FSDP averages its gradient over the other dp / ep ranks only.
        with local_parameters(self, 1 / dist.get_world_size(self.ep_group)):
            y = super().forward(tokens, local_counts)
        return combine(y, route, self.ep_group)


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
    return _CLASSES[cls]


def apply_ep(moe_layers: list[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Spread the experts of each MoE layer over ``ep_mesh`` (works on the meta
    device). The number of experts must divide by the mesh size."""
    for moe in moe_layers:
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(p.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, p.requires_grad))
        experts.__class__ = _expert_parallel_class(type(experts))
        experts.ep_group = ep_mesh.get_group()
    log.info("applied expert parallel x%d to %d MoE layers", ep_mesh.size(), len(moe_layers))
