"""Activation checkpointing: recompute a block's forward in backward instead of
keeping its activations.

Modes: ``full`` (every block), ``selective_layer`` (every ``every``-th block)
and ``selective_op`` (every block, but the outputs of matmuls, attention and
reduce-scatters are kept; only the cheap element-wise ops are recomputed).

The block's ``forward`` is replaced on the instance, so module names (and
checkpoint keys) stay the same, and passes applied later (compile, FSDP) wrap
around the checkpointed forward as they wrap any other.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from composer import torch_compat

log = logging.getLogger(__name__)

AC_MODES = ("none", "full", "selective_layer", "selective_op")


def _kept_ops() -> set:
    """Ops whose outputs selective-op AC keeps: the expensive ones."""
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            *torch_compat.attention_ops(),
            torch_compat.functional_collective("reduce_scatter_tensor"),
            *torch_compat.scaled_and_grouped_mm_ops()}


KEPT_OPS = _kept_ops()  # the planner's trace counts their outputs too


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_op_context():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _checkpointed(forward: Callable, selective_op: bool,
                  recompute: Callable[[], ContextManager]) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        first = [True]

        def body(*a, **k):
            # the second call of body is the recomputation in backward
            with contextlib.nullcontext() if first[0] else recompute():
                return forward(*a, **k)

        extra = {"context_fn": _selective_op_context} if selective_op else {}
        out = checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True,
                         **extra, **kwargs)
        first[0] = False
        return out
    return run


def apply_ac(blocks: list[nn.Module], mode: str, every: int = 2,
             recompute_context: Callable[[nn.Module], ContextManager] = (
                 lambda block: contextlib.nullcontext())) -> None:
    """Checkpoint ``blocks`` (in place) by ``mode``; ``every``: the period of
    ``selective_layer``. ``recompute_context(block)``: held while a block's
    forward is recomputed in backward (``ModelSpec.parallel.recompute_context``)."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode {mode!r}: allowed {AC_MODES}")
    if mode == "none":
        return
    chosen = [b for i, b in enumerate(blocks)
              if mode != "selective_layer" or i % every == every - 1]
    for block in chosen:
        block.forward = _checkpointed(block.forward, mode == "selective_op",
                                      functools.partial(recompute_context, block))
    log.info("activation checkpointing %s: %d of %d blocks", mode, len(chosen), len(blocks))
