"""Qwen3, dense and mixture-of-experts, as plain nn.Modules, and their flavors.

Qwen3 is the shared decoder's block (``composer.models.common``, as Llama
uses it) with two changes to attention: each head of q and of k
goes through an RMSNorm over its ``head_dim`` features before the rotary
embedding, and ``head_dim`` is given (``n_heads * head_dim`` is not ``dim`` in
general). There are no biases. Qwen3-MoE puts an MoE layer in every block:
softmax scores, top-k weights renormalised to sum to one, no shared experts.

Module names stay Llama's (``attention.wq``..., ``feed_forward.w1``...,
``layers.N.moe``), so Llama's and the MoE family's tensor-parallel plans,
LoRA targets and float8 filters apply unchanged. Nothing here knows about
distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from composer.models.common.attention import Attention
from composer.models.common.block import TransformerBlock
from composer.models.common.decoder import Transformer
from composer.models.common.norm import RMSNorm
from composer.models.llama.model import LlamaArgs
from composer.models.moe.model import MoEArgs, MoEBlock


def _check_head_dim(head_dim: int) -> None:
    # the rotary embedding turns pairs of features
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be positive and even")


@dataclass(frozen=True)
class Qwen3Args(LlamaArgs):
    """Llama's arguments with Qwen3's defaults. ``head_dim`` and
    ``ffn_hidden_dim`` (config.json's ``intermediate_size``) are given, not
    derived from ``dim``: these fields replace Llama's properties of the same
    names, so ``multiple_of`` and ``ffn_dim_multiplier`` are unused."""

    head_dim: int = 128
    ffn_hidden_dim: int = 3072
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_seq_len: int = 40960

    def __post_init__(self):
        super().__post_init__()
        _check_head_dim(self.head_dim)


@dataclass(frozen=True)
class Qwen3MoeArgs(MoEArgs):
    """The MoE family's arguments with Qwen3-MoE's defaults: the head size is
    ``attn_head_dim`` (MoEArgs' name for it), each expert's width
    ``moe_hidden_dim``; ``dense_hidden_dim`` is config.json's
    ``intermediate_size``, which only dense layers (none here) would use.
    ``aux_loss_coef`` is the published ``router_aux_loss_coef``, applied to
    this project's sequence-wise balancing loss."""

    attn_head_dim: int | None = 128
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_seq_len: int = 40960
    n_experts: int = 128
    top_k: int = 8
    moe_hidden_dim: int = 768
    route_norm: bool = True
    aux_loss_coef: float = 1e-3

    def __post_init__(self):
        super().__post_init__()
        _check_head_dim(self.head_dim)


class Qwen3Attention(Attention):
    """The shared attention with ``q_norm`` and ``k_norm``: one RMSNorm weight
    [head_dim] shared by all heads, applied to each head before rotary."""

    def __init__(self, args: Qwen3Args | Qwen3MoeArgs):
        super().__init__(args)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v

    def init_weights(self, out_std: float):
        super().init_weights(out_std)
        self.q_norm.init_weights()
        self.k_norm.init_weights()


class Qwen3Block(TransformerBlock):
    def make_attention(self, args: Qwen3Args) -> Qwen3Attention:
        return Qwen3Attention(args)


class Qwen3MoeBlock(Qwen3Block, MoEBlock):
    """Qwen3's attention (``Qwen3Block``) with the MoE family's feed-forward (``MoEBlock``)."""


class Qwen3Transformer(Transformer):
    block_class = Qwen3Block


class Qwen3MoeTransformer(Transformer):
    block_class = Qwen3MoeBlock


def _dense(dim: int, n_layers: int, n_heads: int, ffn_hidden_dim: int, tie: bool) -> Qwen3Args:
    # every published dense Qwen3 has 8 kv heads of 128 features, vocabulary 151936
    return Qwen3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8,
                     vocab_size=151936, ffn_hidden_dim=ffn_hidden_dim, tie_embeddings=tie)


def _moe(dim: int, n_layers: int, n_heads: int, moe_hidden_dim: int) -> Qwen3MoeArgs:
    # both published MoEs: 4 kv heads, 128 experts, top-8, intermediate_size 3 x dim
    return Qwen3MoeArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4,
                        vocab_size=151936, moe_hidden_dim=moe_hidden_dim,
                        dense_hidden_dim=3 * dim)


# The published configs (Qwen/Qwen3-*'s config.json); the small ones tie the
# output to the embedding. debug: CPU-sized, tied, with n_heads * head_dim =
# 256 != dim = 128 so that the difference is exercised.
flavors: dict[str, Qwen3Args] = {
    "debug": Qwen3Args(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
                       vocab_size=512, ffn_hidden_dim=384, max_seq_len=2048,
                       tie_embeddings=True),
    "0.6B": _dense(dim=1024, n_layers=28, n_heads=16, ffn_hidden_dim=3072, tie=True),
    "1.7B": _dense(dim=2048, n_layers=28, n_heads=16, ffn_hidden_dim=6144, tie=True),
    "4B": _dense(dim=2560, n_layers=36, n_heads=32, ffn_hidden_dim=9728, tie=True),
    "8B": _dense(dim=4096, n_layers=36, n_heads=32, ffn_hidden_dim=12288, tie=False),
    "14B": _dense(dim=5120, n_layers=40, n_heads=40, ffn_hidden_dim=17408, tie=False),
    "32B": _dense(dim=5120, n_layers=64, n_heads=64, ffn_hidden_dim=25600, tie=False),
}

# debug: CPU-sized (8 experts, top-2), untied like the published MoEs.
moe_flavors: dict[str, Qwen3MoeArgs] = {
    "debug": Qwen3MoeArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, attn_head_dim=32,
                          vocab_size=512, max_seq_len=2048, dense_hidden_dim=384,
                          n_experts=8, top_k=2, moe_hidden_dim=64),
    "30B-A3B": _moe(dim=2048, n_layers=48, n_heads=32, moe_hidden_dim=768),
    "235B-A22B": _moe(dim=4096, n_layers=94, n_heads=64, moe_hidden_dim=1536),
}
