"""Transformers written the ways people write them, each with the ``ModelSpec`` a user
would write for it: its blocks, a tensor-parallel plan and the pipeline's split points,
nothing more. Train one as ``--model.name examples.own_models:<style>`` (from the
repository's root). tests/integration/test_own_models.py trains each on every layout,
plans it and dry-runs it; ``benchmarks/bench_own_models.py`` prints the table in
docs/your_own_model.md.

The styles:

- ``plain_loop``: blocks in an nn.ModuleList, run by ``for block in self.blocks``;
- ``sequential``: the blocks as an nn.Sequential trunk, called once;
- ``module_dict``: blocks in an nn.ModuleDict with names of its own;
- ``tied``: the head's weight is the token embedding's;
- ``gpt2``: learned positions, biases, LayerNorm, GELU, one fused q/k/v linear;
- ``parallel``: attention and MLP side by side in one residual (GPT-J, PaLM);
- ``gqa``: grouped-query attention, kv heads repeated to the q heads;
- ``moe``: a block with its own router over a list of expert MLPs (top-2);
- ``kwargs``: Hugging Face's way: ``forward(input_ids, attention_mask=None,
  position_ids=None)``, rotary positions from the position ids, the blocks called
  with keyword arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from composer import ModelSpec, ParallelHooks


@dataclass(frozen=True)
class Args:
    vocab_size: int = 512
    dim: int = 32
    n_heads: int = 4
    n_kv_heads: int = 4
    n_layers: int = 4
    hidden: int = 64
    max_seq_len: int = 128
    n_experts: int = 4
    top_k: int = 2


SMALL = Args(vocab_size=4096, dim=256, n_heads=8, n_kv_heads=8, n_layers=4, hidden=768,
             max_seq_len=1024)
FLAVORS = {"tiny": Args(), "small": SMALL}  # small: the planner's check


def init_weights(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            m.reset_parameters()


class Attention(nn.Module):
    """Causal SDPA; the heads come from the shapes (tensor parallel leaves a rank some)."""

    def __init__(self, a: Args, bias: bool = False):
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.q = nn.Linear(a.dim, a.dim, bias=bias)
        self.k = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=bias)
        self.o = nn.Linear(a.dim, a.dim, bias=bias)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.gate = nn.Linear(a.dim, a.hidden, bias=False)
        self.up = nn.Linear(a.dim, a.hidden, bias=False)
        self.down = nn.Linear(a.hidden, a.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(a.dim), Attention(a)
        self.mlp_norm, self.mlp = nn.RMSNorm(a.dim), SwiGLU(a)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


# ---- plain_loop: an nn.ModuleList run by a plain loop

class PlainLoop(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.blocks = nn.ModuleList([Block(a) for _ in range(a.n_layers)])
        self.norm = nn.RMSNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def init_weights(self):
        init_weights(self)


def block_plan(prefix: str) -> dict:
    """The plan of ``Block``s under ``prefix`` (``blocks.*``)."""
    return {f"{prefix}.attn_norm": "norm", f"{prefix}.mlp_norm": "norm",
            f"{prefix}.attn": "replicate_input", f"{prefix}.mlp": "replicate_input",
            **{f"{prefix}.attn.{n}": "colwise" for n in "qkv"}, f"{prefix}.attn.o": "rowwise",
            f"{prefix}.mlp.gate": "colwise", f"{prefix}.mlp.up": "colwise",
            f"{prefix}.mlp.down": "rowwise"}


def divisible(a: Args) -> dict:
    return {"n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads, "hidden": a.hidden,
            "vocab_size": a.vocab_size}


PLAIN_PLAN = {"embed": "embedding", **block_plan("blocks.*"), "norm": "norm", "head": "output"}

plain_loop = ModelSpec(
    name="plain_loop", flavors=FLAVORS, build=PlainLoop,
    blocks=lambda m: list(m.blocks), tp_plan=PLAIN_PLAN,
    parallel=ParallelHooks(
        tp_divisible=divisible,
        pipeline_units=lambda m: ["embed", *(f"blocks.{i}" for i in range(len(m.blocks))),
                                  "norm", "head"]))


# ---- sequential: the blocks as an nn.Sequential trunk

class Sequential(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.trunk = nn.Sequential(*(Block(a) for _ in range(a.n_layers)))
        self.norm = nn.RMSNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.trunk(self.embed(tokens))))

    def init_weights(self):
        init_weights(self)


sequential = ModelSpec(
    name="sequential", flavors=FLAVORS, build=Sequential,
    blocks=lambda m: list(m.trunk),
    tp_plan={"embed": "embedding", **block_plan("trunk.*"), "norm": "norm", "head": "output"},
    parallel=ParallelHooks(
        tp_divisible=divisible,
        pipeline_units=lambda m: ["embed", *(f"trunk.{i}" for i in range(len(m.trunk))),
                                  "norm", "head"]))


# ---- module_dict: blocks in an nn.ModuleDict, run in its order

class ModuleDictModel(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({f"layer{i}": Block(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for name in self.layers:
            h = self.layers[name](h)
        return self.head(self.norm(h))

    def init_weights(self):
        init_weights(self)


module_dict = ModelSpec(
    name="module_dict", flavors=FLAVORS, build=ModuleDictModel,
    blocks=lambda m: list(m.layers.values()),
    tp_plan={"embed": "embedding", **block_plan("layers.*"), "norm": "norm", "head": "output"},
    parallel=ParallelHooks(
        tp_divisible=divisible,
        pipeline_units=lambda m: ["embed", *(f"layers.{k}" for k in m.layers), "norm", "head"]))


# ---- tied: the head's weight is the token embedding's

class Tied(PlainLoop):
    def __init__(self, a: Args):
        super().__init__(a)
        self.head.weight = self.embed.weight


tied = ModelSpec(
    name="tied", flavors=FLAVORS, build=Tied,
    blocks=lambda m: list(m.blocks), tp_plan=PLAIN_PLAN,
    parallel=ParallelHooks(
        tp_divisible=divisible,
        pipeline_units=lambda m: ["embed", *(f"blocks.{i}" for i in range(len(m.blocks))),
                                  "norm", "head"]))


# ---- gpt2: learned positions, biases, LayerNorm, GELU, a fused q/k/v linear

class GPT2Attention(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.n_heads = a.n_heads
        self.c_attn = nn.Linear(a.dim, 3 * a.dim)
        self.c_proj = nn.Linear(a.dim, a.dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, d))


class GPT2MLP(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(a.dim, 4 * a.dim), nn.Linear(4 * a.dim, a.dim)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(a.dim), GPT2Attention(a)
        self.ln_2, self.mlp = nn.LayerNorm(a.dim), GPT2MLP(a)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.wte = nn.Embedding(a.vocab_size, a.dim)
        self.wpe = nn.Embedding(a.max_seq_len, a.dim)
        self.h = nn.ModuleList([GPT2Block(a) for _ in range(a.n_layers)])
        self.ln_f = nn.LayerNorm(a.dim)
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)[None]
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def init_weights(self):
        init_weights(self)


gpt2 = ModelSpec(
    name="gpt2", flavors=FLAVORS, build=GPT2,
    blocks=lambda m: list(m.h),
    # the fused q/k/v runs whole on each rank (its output gathered), its projection
    # splits that input; the MLP is cut as usual
    tp_plan={"wte": "embedding", "wpe": "embedding", "h.*.ln_1": "norm", "h.*.ln_2": "norm",
             "h.*.attn": "replicate_input", "h.*.mlp": "replicate_input",
             "h.*.attn.c_attn": "colwise_gathered", "h.*.attn.c_proj": "rowwise_split_input",
             "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise",
             "ln_f": "norm", "lm_head": "output"},
    parallel=ParallelHooks(
        tp_divisible=lambda a: {"n_heads": a.n_heads, "vocab_size": a.vocab_size,
                                "max_seq_len": a.max_seq_len},
        pipeline_units=lambda m: ["wte", "wpe", *(f"h.{i}" for i in range(len(m.h))), "ln_f",
                                  "lm_head"]))


# ---- parallel: attention and MLP side by side in one residual

class ParallelBlock(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(a.dim), Attention(a), SwiGLU(a)

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h) + self.mlp(h)


class ParallelModel(PlainLoop):
    def __init__(self, a: Args):
        super().__init__(a)
        self.blocks = nn.ModuleList([ParallelBlock(a) for _ in range(a.n_layers)])


parallel = ModelSpec(
    name="parallel", flavors=FLAVORS, build=ParallelModel,
    blocks=lambda m: list(m.blocks),
    tp_plan={"embed": "embedding", "blocks.*.norm": "norm",
             "blocks.*.attn": "replicate_input", "blocks.*.mlp": "replicate_input",
             **{f"blocks.*.attn.{n}": "colwise" for n in "qkv"}, "blocks.*.attn.o": "rowwise",
             "blocks.*.mlp.gate": "colwise", "blocks.*.mlp.up": "colwise",
             "blocks.*.mlp.down": "rowwise", "norm": "norm", "head": "output"},
    parallel=ParallelHooks(
        tp_divisible=divisible,
        pipeline_units=lambda m: ["embed", *(f"blocks.{i}" for i in range(len(m.blocks))),
                                  "norm", "head"]))


# ---- gqa: grouped-query attention

gqa = ModelSpec(
    name="gqa", flavors={"tiny": Args(n_heads=8, n_kv_heads=2),
                             "small": replace(SMALL, n_kv_heads=2)}, build=PlainLoop,
    blocks=lambda m: list(m.blocks), tp_plan=PLAIN_PLAN,
    parallel=ParallelHooks(
        tp_divisible=divisible,
        pipeline_units=lambda m: ["embed", *(f"blocks.{i}" for i in range(len(m.blocks))),
                                  "norm", "head"]))


# ---- moe: a block with its own router over a list of expert MLPs

class MoE(nn.Module):
    """Top-k routing, each expert run on the tokens it was given (Mixtral's loop)."""

    def __init__(self, a: Args):
        super().__init__()
        self.top_k = a.top_k
        self.router = nn.Linear(a.dim, a.n_experts, bias=False)
        self.experts = nn.ModuleList([SwiGLU(a) for _ in range(a.n_experts)])

    def forward(self, x):
        b, s, d = x.shape
        x = x.reshape(-1, d)
        weights, chosen = torch.topk(F.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == i)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(b, s, d)


class MoEBlock(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(a.dim), Attention(a)
        self.moe_norm, self.moe = nn.RMSNorm(a.dim), MoE(a)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoEModel(PlainLoop):
    def __init__(self, a: Args):
        super().__init__(a)
        self.blocks = nn.ModuleList([MoEBlock(a) for _ in range(a.n_layers)])


moe = ModelSpec(
    name="moe", flavors={"tiny": Args(n_layers=2), "small": replace(SMALL, n_layers=2)},
    build=MoEModel,
    blocks=lambda m: list(m.blocks),
    # attention is cut; the router and experts run whole on each rank, on the whole
    # sequence (its output sliced back to the stream)
    tp_plan={"embed": "embedding", "blocks.*.attn_norm": "norm", "blocks.*.moe_norm": "norm",
             "blocks.*.attn": "replicate_input",
             **{f"blocks.*.attn.{n}": "colwise" for n in "qkv"}, "blocks.*.attn.o": "rowwise",
             "blocks.*.moe": "gathered", "norm": "norm", "head": "output"},
    parallel=ParallelHooks(
        tp_divisible=lambda a: {"n_heads": a.n_heads, "vocab_size": a.vocab_size},
        pipeline_units=lambda m: ["embed", *(f"blocks.{i}" for i in range(len(m.blocks))),
                                  "norm", "head"]))


# ---- kwargs: forward(input_ids, attention_mask=None, position_ids=None), rotary positions

def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class RotaryAttention(Attention):
    def forward(self, hidden_states, cos=None, sin=None, attention_mask=None):
        b, s, _ = hidden_states.shape
        q, k, v = (f(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class KwargsBlock(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.input_layernorm, self.self_attn = nn.RMSNorm(a.dim), RotaryAttention(a)
        self.post_attention_layernorm, self.mlp = nn.RMSNorm(a.dim), SwiGLU(a)

    def forward(self, hidden_states, *, cos, sin, attention_mask=None):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos=cos,
                                           sin=sin, attention_mask=attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class KwargsModel(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.embed_tokens = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList([KwargsBlock(a) for _ in range(a.n_layers)])
        self.norm = nn.RMSNorm(a.dim)
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=h.device)[None]
        half = self.head_dim // 2
        inv = 1.0 / (10000 ** (torch.arange(half, device=h.device, dtype=torch.float64) / half))
        angles = position_ids[..., None].to(inv.dtype) * inv
        cos = torch.cat([angles.cos()] * 2, dim=-1)[:, None].to(h.dtype)
        sin = torch.cat([angles.sin()] * 2, dim=-1)[:, None].to(h.dtype)
        mask = None
        if attention_mask is not None:  # [batch, seq] of 1 (attend) / 0 (padding)
            seq = input_ids.shape[1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=h.device).tril()
            mask = causal & attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            h = layer(h, cos=cos, sin=sin, attention_mask=mask)
        return self.lm_head(self.norm(h))

    def init_weights(self):
        init_weights(self)


kwargs = ModelSpec(
    name="kwargs", flavors=FLAVORS, build=KwargsModel,
    blocks=lambda m: list(m.layers),
    tp_plan={"embed_tokens": "embedding", "layers.*.input_layernorm": "norm",
             "layers.*.post_attention_layernorm": "norm",
             "layers.*.self_attn": "replicate_input", "layers.*.mlp": "replicate_input",
             **{f"layers.*.self_attn.{n}": "colwise" for n in "qkv"},
             "layers.*.self_attn.o": "rowwise", "layers.*.mlp.gate": "colwise",
             "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise",
             "norm": "norm", "lm_head": "output"},
    parallel=ParallelHooks(
        tp_divisible=divisible,
        pipeline_units=lambda m: ["embed_tokens", *(f"layers.{i}" for i in range(len(m.layers))),
                                  "norm", "lm_head"]))


STYLES = ("plain_loop", "sequential", "module_dict", "tied", "gpt2", "parallel", "gqa", "moe",
          "kwargs")
