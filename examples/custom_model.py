"""Parallelize a model composer has never seen, with tensor parallel + FSDP2.

    torchrun --nproc_per_node=4 examples/custom_model.py --tp 2   # TP2 x FSDP2
    python examples/custom_model.py                                # one process

A GPT-2-style model with its own attribute names, LayerNorm (with bias),
learned positional embeddings and tied input/output embeddings. The model is
plain PyTorch; everything composer needs comes from the ModelSpec below.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from composer import ModelSpec, ParallelDims, clip_grad_norm_, materialize, parallelize
from composer.data import DataLoader


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape  # heads come from the shapes: TP leaves a rank some of them
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), SelfAttention(dim, heads)
        self.ln_2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, n_layers: int, max_len: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx):
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))

    def init_weights(self):
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    """Megatron-style: q/k/v and fc_in column-wise, proj and fc_out row-wise.
    The embeddings stay replicated in their output (the positional one is added
    to it); the first block then takes its sequence slice."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,),
                                       use_local_output=True),
        "blocks.*.attn": PrepareModuleInput(input_layouts=(seq,),
                                            desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.query": ColwiseParallel(),
        "blocks.*.attn.key": ColwiseParallel(),
        "blocks.*.attn.value": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=seq),
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(seq,),
                                           desired_input_layouts=(Replicate(),)),
        "blocks.*.mlp.fc_in": ColwiseParallel(),
        "blocks.*.mlp.fc_out": RowwiseParallel(output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan.update({"blocks.*.ln_1": SequenceParallel(), "blocks.*.ln_2": SequenceParallel(),
                     "ln_f": SequenceParallel()})
    return plan


spec = ModelSpec(
    name="tinygpt",
    flavors={"tiny": dict(vocab=320, dim=64, heads=4, n_layers=2, max_len=64)},
    build=lambda kw: TinyGPT(**kw),
    blocks=lambda model: list(model.blocks),
    tp_plan=tp_plan,
)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--dtype", default="float64")
    a = p.parse_args()
    torch.set_default_dtype(getattr(torch, a.dtype))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=a.tp, pp=1, ep=1, world_size=world)
    if world > 1:
        dist.init_process_group("gloo")
        dims.build_mesh("cpu")

    args = spec.flavors["tiny"]
    model = spec.build_meta(args)
    parallelize(model, dims, spec, zero_stage=3, sequence_parallel=True)
    materialize(model, lambda: spec.build_meta(args), torch.device("cpu"), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = DataLoader("tinyshakespeare", "byte", seq_len=32, local_batch_size=a.batch // dims.dp,
                      dp_rank=dims.dp_rank(rank), dp_degree=dims.dp)

    for step in range(1, a.steps + 1):
        inputs, targets = data.next_batch()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()  # FSDP averages the per-rank means over dp: the global mean
        grad_norm = clip_grad_norm_(list(model.parameters()), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if world > 1:
            dist.all_reduce(loss := loss.detach(), group=dims.mesh("dp").get_group())
            loss /= dims.dp
        if rank == 0:
            print(json.dumps({"step": step, "loss": loss.item(), "grad_norm": grad_norm.item()}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
