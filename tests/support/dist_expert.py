"""Run under torchrun: one MoE layer with expert parallel over every rank against
the same layer run whole on the concatenated batch, in float64, for a balanced
and a skewed router. Writes ``{out}/rank{r}.json`` with the largest differences
and the all-to-all bytes counted next to their analytic values.

    torchrun --nproc_per_node=2 tests/support/dist_expert.py OUT_FOLDER
"""
from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from composer.mesh import ParallelDims
from composer.models.moe import MoE, flavors
from composer.observe.comm import CommCounter
from composer.parallel.expert import apply_ep

TOKENS_PER_RANK = (3, 8)  # batch, seq
SKEWED_BIAS = 100.0       # on experts 0 and 1: every token picks both


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest reference value (exact zeros: 0)."""
    return (a - b).abs().max().item() / (b.abs().max().item() or 1.0)


def compare(rank: int, world: int, dims: ParallelDims, skewed: bool) -> dict:
    args = flavors["debug"]
    torch.manual_seed(0)
    whole = MoE(args).double()
    whole.init_weights(0.02)
    if skewed:
        whole.router.expert_bias[:2] = SKEWED_BIAS
    whole.aux_loss_scale = 1.0
    sharded = copy.deepcopy(whole)
    apply_ep([sharded], dims.mesh("ep"))

    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(*TOKENS_PER_RANK, args.dim, dtype=torch.float64, generator=gen)
          for _ in range(world)]
    grads = [torch.randn_like(x) for x in xs]  # d loss / d output, per rank

    x_all = torch.cat(xs).requires_grad_()
    y_all = whole(x_all)
    (y_all * torch.cat(grads)).sum().backward()

    x = xs[rank].clone().requires_grad_()
    counter = CommCounter(dims.groups())
    with counter:
        with counter.in_phase("forward"):
            y = sharded(x)
        with counter.in_phase("backward"):
            (y * grads[rank]).sum().backward()
    gate_grad = sharded.router.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)  # each rank's router saw its own tokens only

    per_rank = args.n_experts // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    rows = slice(rank * TOKENS_PER_RANK[0], (rank + 1) * TOKENS_PER_RANK[0])
    expert_diff = max(
        # the local gradient is 1/ep of the whole one; data parallel's averaging restores it
        max_diff(getattr(sharded.experts, w).grad.to_local() * world,
                 getattr(whole.experts, w).grad[mine]) for w in ("w1", "w2", "w3"))
    load = whole.tokens_per_expert
    sent = x[..., 0].numel() * args.top_k
    received = load[mine].sum().item()
    row_bytes = args.dim * 8
    table = counter.table()
    a2a = {phase: sum(kinds.get("all_to_all", {}).get("bytes", 0) for kinds in dims_.values())
           for phase, dims_ in table.items()}
    return {
        "output": max_diff(y.detach(), y_all.detach()[rows]),
        "input_grad": max_diff(x.grad, x_all.grad[rows]),
        "expert_grad": expert_diff,
        "gate_grad": max_diff(gate_grad, whole.router.gate.weight.grad),
        "load": load.tolist(),
        "received": received,
        "a2a_forward": a2a.get("forward", 0),
        "a2a_backward": a2a.get("backward", 0),
        # counts (int64 per expert), tokens out, results back
        "analytic_forward": args.n_experts * 8 + (sent + received) * row_bytes,
        "analytic_backward": (sent + received) * row_bytes,
    }


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world,
                        world_size=world)
    dims.build_mesh("cpu")
    result = {name: compare(rank, world, dims, name == "skewed") for name in ("balanced", "skewed")}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
