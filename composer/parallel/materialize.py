"""Turn a meta-device model into real, initialised weights that are the same on
every parallel layout.

On CUDA, DTensor's random ops draw each shard from the offsets the full tensor
would use (the tracker starts from the seeded generator, the same on every
rank), so ``init_weights()`` on the sharded model is layout-independent. On
CPU they cannot (the CPU generator has no offsets): each shard would be drawn
from the same stream. There a full-size replica is initialised and each rank
keeps its own slice of every tensor.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from composer.parallel.tied import retie, tied_groups


def _has_dtensors(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: gathered if it is a DTensor (a collective over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full-size ``full`` into ``param`` (plain or a
    DTensor of any placements). Every rank holds ``full``, so each cuts its own
    slice locally (``src_data_rank=None``) and no communication happens."""
    value = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        value = distribute_tensor(value, param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(value)


def _copy_slices(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        copy_full_into(param, full[name])


def init_weights(model: nn.Module) -> None:
    """The model's own ``init_weights()``; a model without one is drawn as PyTorch
    draws each of its modules (every ``reset_parameters()``)."""
    if hasattr(model, "init_weights"):
        model.init_weights()
        return
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _to_empty(module: nn.Module, device) -> None:
    """``to_empty`` hands each owner of a shared Parameter its own copy: tie again."""
    ties = tied_groups(module)
    module.to_empty(device=device)
    retie(module, ties)


def _draw(model: nn.Module, init: Callable[[nn.Module], None], converters: Sequence) -> None:
    init(model)
    for converter in converters:
        converter.init_added(model)


def materialize(model: nn.Module, build_replica: Callable[[], nn.Module],
                device: torch.device, seed: int, from_replica: bool = False,
                init: Callable[[nn.Module], None] = init_weights,
                converters: Sequence = ()) -> None:
    """``to_empty`` + ``init(model)`` (default: its ``init_weights()``), then what each
    of the ``converters`` added (their ``init_added``), with weights that depend only
    on ``seed``: the same numbers on every layout. ``build_replica()``: a fresh meta
    model, converted as ``model`` is, from which a rank slices its weights on CPU
    (whose random draws cannot follow DTensor shards) and, ``from_replica``, always
    (a pipeline stage, which would otherwise draw the stream of the model's start).

    >>> import torch
    >>> from composer import materialize
    >>> build = lambda: torch.nn.Linear(4, 2, device="meta")
    >>> model = build()
    >>> materialize(model, build, torch.device("cpu"), seed=0)
    >>> again = build()
    >>> materialize(again, build, torch.device("cpu"), seed=0)
    >>> torch.equal(model.weight, again.weight), model.weight.device.type
    (True, 'cpu')
    """
    _to_empty(model, device)
    torch.manual_seed(seed)
    if not (from_replica or (device.type != "cuda" and _has_dtensors(model))):
        _draw(model, init, converters)
        return
    # sharded, each rank's random draws would not follow its shards; and a model's own
    # init may write whole tensors into them (transformers' copy_ of a sinusoidal table)
    replica = build_replica()
    _to_empty(replica, "cpu")
    torch.manual_seed(seed)
    _draw(replica, init, converters)
    _copy_slices(model, dict(replica.named_parameters()))
    drawn = dict(replica.named_buffers())  # rotary tables and the like
    for name, buffer in model.named_buffers():
        if name in drawn:  # not what a pass added
            copy_full_into(buffer, drawn[name])
