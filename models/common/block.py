"""The SwiGLU feed-forward and the pre-norm transformer block that holds one
attention and one feed-forward; families change either through the block's
``make_attention`` and ``make_ffn``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from composer.models.common.args import DecoderArgs
from composer.models.common.attention import Attention
from composer.models.common.init import residual_std, trunc_normal_
from composer.models.common.norm import RMSNorm


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float):
        trunc_normal_(self.w1.weight, 0.02)
        trunc_normal_(self.w2.weight, out_std)
        trunc_normal_(self.w3.weight, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual stream.
    Families change the attention (``make_attention``) or the feed-forward
    (``make_ffn``, which also names it: ``feed_forward``, or e.g. ``moe``)."""

    def __init__(self, layer_id: int, args: DecoderArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = self.make_attention(args)
        self.ffn_name, ffn = self.make_ffn(layer_id, args)
        self.add_module(self.ffn_name, ffn)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def make_attention(self, args: DecoderArgs) -> nn.Module:
        return Attention(args)

    def make_ffn(self, layer_id: int, args: DecoderArgs) -> tuple[str, nn.Module]:
        return "feed_forward", FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + getattr(self, self.ffn_name)(self.ffn_norm(h))

    def init_weights(self):
        out_std = residual_std(self.layer_id)
        self.attention.init_weights(out_std)
        getattr(self, self.ffn_name).init_weights(out_std)
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
