"""Tensor parallel, sequence parallel and loss parallel, from a model's plan.

The plan maps module FQNs (``*`` matches any one name, e.g. ``layers.*.attention.wq``)
to DTensor ParallelStyles. Column-wise linears shard their output features,
row-wise ones their input features and end in a reduction; with sequence
parallel the norms work on a 1/tp slice of the sequence, which turns each
all-reduce into a reduce-scatter plus an all-gather. With loss parallel the
logits stay sharded on the vocabulary and the cross-entropy is computed
without gathering them (``torch.distributed.tensor.parallel.loss_parallel``).
"""
from __future__ import annotations

import fnmatch
import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from composer.parallel.tied import retie, tied_groups

log = logging.getLogger(__name__)


def matching(model: nn.Module, pattern: str) -> list[nn.Module]:
    """The modules a plan key names (``*`` matches any one name)."""
    parts = pattern.split(".")
    return [m for name, m in model.named_modules() if len(name.split(".")) == len(parts) and
            all(fnmatch.fnmatchcase(n, p) for n, p in zip(name.split("."), parts))]


def _matches(model: nn.Module, pattern: str) -> bool:
    return bool(matching(model, pattern))


def check_plan(model: nn.Module, plan: dict[str, ParallelStyle], optional: tuple = ()) -> None:
    """Every plan key but the ``optional`` ones must name a module: a typo would
    silently leave it unsharded."""
    missing = [key for key in plan if key not in optional and not _matches(model, key)]
    if missing:
        raise ValueError(f"tensor-parallel plan entries match no module: {', '.join(missing)}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle],
             strict: bool = True, optional: tuple = ()) -> None:
    """Shard ``model`` over ``tp_mesh`` as ``plan`` says; tied weights stay tied.
    ``strict``: every entry but the ``optional`` ones must match; entries that
    match nothing are dropped."""
    if strict:
        check_plan(model, plan, optional)
    plan = {key: style for key, style in plan.items() if _matches(model, key)}
    groups = tied_groups(model)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    parallelize_module(model, tp_mesh, plan)
    # torch 2.13's SequenceParallel makes every parameter it replaces trainable
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    for names in groups:
        layouts = {str(getattr(model.get_parameter(n), "placements", None)) for n in names}
        if len(layouts) > 1:
            raise ValueError(f"tied parameters {', '.join(names)} get different tensor-parallel "
                             f"layouts ({', '.join(sorted(layouts))}); shard them alike")
    retie(model, groups)
    log.info("applied tensor parallel x%d to %d plan entries", tp_mesh.size(), len(plan))


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Reduce gradients DTensor left as partial sums (weights replicated over tp
    whose inputs were sharded, e.g. sequence-parallel norms) once, here: left
    partial, every optimizer op that reads them would reduce them again."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)
