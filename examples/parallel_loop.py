"""Your own training loop on composer's public names: pipeline, context or expert
parallel composed with FSDP2 (and tensor parallel) on a model of your own.

    python examples/parallel_loop.py                                       # one process
    torchrun --nproc_per_node=4 examples/parallel_loop.py --pp 2           # PP2 x FSDP2
    torchrun --nproc_per_node=8 examples/parallel_loop.py --pp 2 --tp 2    # PP2 x FSDP2 x TP2
    torchrun --nproc_per_node=4 examples/parallel_loop.py --cp 2           # CP2 x FSDP2
    python examples/parallel_loop.py --experts 4                           # MoE, one process
    torchrun --nproc_per_node=2 examples/parallel_loop.py --experts 4 --ep 2   # EP2 x FSDP2
    torchrun --nproc_per_node=4 examples/parallel_loop.py --pp 2 --steps 2 --checkpoint ckpt
    torchrun --nproc_per_node=4 examples/parallel_loop.py --cp 2 --checkpoint ckpt  # steps 3, 4

The model is my_model.py's OPT-style decoder: plain PyTorch, whose ModelSpec says
what the passes need (its blocks, TP plan, pipeline units, attention core and mask).
With ``--experts`` every block's MLP becomes a small mixture of experts, written
below. Data parallel takes the ranks the other degrees leave. Every layout prints
the losses and gradient norms of one process (in float64, within a relative 1e-9,
as tests/integration/test_custom_model.py checks): the global batch, the weights drawn and the
loss are the same on each. A checkpoint of one layout resumes in any other.
"""
import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from my_model import TP_PLAN, MyArgs, MyModel, spec
from torch import nn

from composer import (
    Checkpointer,
    ModelSpec,
    ParallelDims,
    build_pipeline,
    clip_grad_norm_,
    find_resume,
    local_positions,
    materialize,
    parallelize,
    pipeline_stages,
)
from composer.data import DataLoader

ARGS = MyArgs(vocab_size=320, dim=64, n_heads=4, n_layers=2, hidden=128, max_seq_len=64,
              tied=False)  # a tied head would be one weight on two pipeline stages


class Experts(nn.Module):
    """``n`` ReLU MLPs with stacked weights [n, ...], called with the tokens sorted by
    expert and the count per expert: the form expert parallel spreads over ranks
    (each keeps n / ep of them and trades tokens with the others)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Parameter(torch.empty(n, hidden, dim))
        self.down = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(self, tokens, counts):
        groups = tokens.split(counts.tolist())
        return torch.cat([F.relu(x @ up.T) @ down.T
                          for x, up, down in zip(groups, self.up, self.down)])


class MoE(nn.Module):
    """Each token goes to its ``top_k`` experts, their outputs weighted by the router."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int = 2):
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden)
        self.n_experts, self.top_k = n_experts, top_k

    def forward(self, x):
        flat = x.flatten(0, 1)
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k)
        order = chosen.flatten().argsort(stable=True)  # the (token, choice) pairs by expert
        counts = chosen.flatten().bincount(minlength=self.n_experts)
        out = self.experts(flat[order // self.top_k], counts)[order.argsort()]
        return (out.view(-1, self.top_k, x.shape[-1]) * weights[..., None]).sum(1).view_as(x)


class MoEModel(MyModel):
    """my_model's decoder with a mixture of experts in place of every MLP."""

    def __init__(self, a: MyArgs, n_experts: int):
        super().__init__(a)
        for block in self.blocks.values():
            block.mlp = MoE(a.dim, a.hidden, n_experts)

    def init_weights(self):
        super().init_weights()  # the linears, routers among them
        for block in self.blocks.values():
            for weight in block.mlp.experts.parameters():
                nn.init.normal_(weight, std=0.02)


def moe_spec(n_experts: int) -> ModelSpec:
    """my_model's spec for MoEModel: ``moe_modules`` names the layers whose ``experts``
    expert parallel spreads; tensor parallel runs each on the whole sequence."""
    tp_plan = {k: v for k, v in TP_PLAN.items() if not k.startswith("blocks.*.mlp")}
    return dataclasses.replace(
        spec, name="my_moe", build=lambda a: MoEModel(a, n_experts),
        tp_plan={**tp_plan, "blocks.*.mlp": "gathered"},
        parallel=dataclasses.replace(spec.parallel, moe_modules=lambda model: {
            f"blocks.{k}.mlp": block.mlp for k, block in model.blocks.items()}))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel degree (1F1B)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    p.add_argument("--cp", type=int, default=1, help="context parallel degree")
    p.add_argument("--ep", type=int, default=1, help="expert parallel degree (with --experts)")
    p.add_argument("--experts", type=int, default=0, help="experts per block (0: an MLP)")
    p.add_argument("--ac", default="none", help="activation checkpointing: none, full, "
                                                "selective_layer or selective_op")
    p.add_argument("--compile", default=None, help="compile each block with this backend")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--checkpoint", help="a folder: start from its newest step, save the last")
    return p.parse_args(argv)


def build_parts(model_spec: ModelSpec, dims: ParallelDims, pp_rank: int, local_batch: int,
                a: argparse.Namespace):
    """This rank's pipeline stages (one, the whole model, without pipeline parallel),
    parallelized, with the weights one process would draw."""
    def build():
        return model_spec.build_meta(ARGS)

    plan, parts = pipeline_stages(model_spec, build, dims.pp, pp_rank, local_batch)
    for part in parts:
        parallelize(part, dims, model_spec, seq_len=a.seq_len, ac_mode=a.ac,
                    compile_backend=a.compile)
        materialize(part, build, torch.device("cpu"), seed=0, from_replica=dims.pp > 1)
    return plan, parts


def global_mean(loss: torch.Tensor, dims: ParallelDims, world: int) -> float:
    """The whole batch's loss: summed over the pipeline stages (only the last has it),
    averaged over the ranks that see different tokens (data and context parallel)."""
    if world > 1:
        dist.all_reduce(loss, group=dims.mesh("pp").get_group())
        dist.all_reduce(loss, group=dims.mesh("dp_cp").get_group())
        loss /= dims.replicas
    return loss.item()


def resume(saves: Checkpointer, folder: str) -> int:
    """The steps done: those of ``folder``'s newest step, loaded (weights, optimizer
    state), or none."""
    path = find_resume(folder)
    if path is None:
        return 0
    state = {"step": torch.tensor(0)}
    saves.load(path, state)
    return int(state["step"])


def loader(a: argparse.Namespace, dims: ParallelDims, rank: int, done: int) -> DataLoader:
    """This rank's share of every global batch (the same batches on every layout),
    starting after the batches of the ``done`` steps."""
    data = DataLoader("tinyshakespeare", "byte", seq_len=a.seq_len,
                      local_batch_size=a.batch // dims.dp, dp_rank=dims.dp_rank(rank),
                      dp_degree=dims.dp)
    for _ in range(done):
        data.next_batch()
    return data


def mean_loss(tokens: int):
    """The cross-entropy's mean over this rank's ``tokens``: every rank holds as many,
    so FSDP's average of the ranks' gradients is the global batch's, and a pipeline's
    microbatches add up to it."""
    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / tokens
    return loss_fn


def forward_backward(parts, pipe, loss_fn, inputs, targets) -> torch.Tensor:
    """One batch's forward and backward, through the pipeline's schedule (whose
    microbatches' losses only the last stage's ranks hold) or the one part."""
    if pipe is not None:
        return sum(pipe.run(inputs, targets), torch.zeros(()))
    loss = loss_fn(parts[0](inputs), targets)
    loss.backward()
    return loss


def train(a: argparse.Namespace, rank: int, world: int) -> list[dict]:
    """``a.steps`` steps as rank ``rank`` of ``world`` (whose process group exists
    when ``world`` > 1); returns every step's global loss and gradient norm."""
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=a.cp, tp=a.tp, pp=a.pp, ep=a.ep,
                        world_size=world)
    if world > 1:
        dims.build_mesh("cpu")
    where = dims.coords(rank)
    local_batch = a.batch // dims.dp
    plan, parts = build_parts(moe_spec(a.experts) if a.experts else spec, dims, where["pp"],
                              local_batch, a)
    params = [p for part in parts for p in part.parameters()]
    # one optimizer per part: a checkpoint keys each one's state by its part's names
    optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-3, fused=True) for part in parts]
    saves = Checkpointer(a.checkpoint, parts, optimizers) if a.checkpoint else None
    done = resume(saves, a.checkpoint) if saves else 0
    data = loader(a, dims, rank, done)
    columns = local_positions(a.seq_len, dims.cp, where["cp"])  # all of them without cp
    loss_fn = mean_loss(local_batch * len(columns))
    pp_group = dims.mesh("pp").get_group() if dims.pp > 1 else None
    pipe = (build_pipeline(parts, plan, loss_fn, torch.device("cpu"), pp_group)
            if dims.pp > 1 else None)
    rows = []
    for step in range(done + 1, a.steps + 1):
        inputs, targets = (t[:, columns] for t in data.next_batch())
        loss = forward_backward(parts, pipe, loss_fn, inputs, targets)
        grad_norm = clip_grad_norm_(params, max_norm=1.0, pp_group=pp_group)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        rows.append({"step": step, "loss": global_mean(loss.detach(), dims, world),
                     "grad_norm": grad_norm.item()})
    if saves:
        saves.save(a.steps, {"step": torch.tensor(a.steps)})
    return rows


def main():
    a = parse()
    torch.set_default_dtype(torch.float64)  # the parity setting
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    for row in train(a, rank, world):
        if rank == 0:
            print(json.dumps(row))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
