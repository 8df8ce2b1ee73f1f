"""Attention: the causal core without weights, a module of its own so that a
pass can put another in its place (context parallel), and the grouped-query
attention module around it (q/k/v/o projections and the rotary embedding)."""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from composer import torch_compat
from composer.models.common.args import DecoderArgs
from composer.models.common.init import trunc_normal_
from composer.models.common.mask import (
    Documents,
    LowerRight,
    attend_documents,
    position_block_mask,
)
from composer.models.common.rotary import apply_rotary


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=8)
def causal_block_mask(seq: int, device: torch.device) -> BlockMask:
    """The causal BlockMask of ``seq`` positions: it depends on the length only, so one
    is built per length and device and kept."""
    every = torch.arange(seq, device=device)
    return position_block_mask(every, every)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """FlexAttention under ``mask``: compiled on CUDA (its fused kernel); eager
    elsewhere, where torch's unfused form is exact and trains with its CPU device
    check lifted."""
    gqa = k.shape[1] != q.shape[1]
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=gqa)
    with torch_compat.flex_backward_on_cpu(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)


def lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: LowerRight = None,
                scale=None, dropout: float = 0.0) -> torch.Tensor:
    """SDPA of queries that are the last of the keys (``LowerRight``: a
    context-parallel chunk over the keys before and in it, a document's piece). A piece
    with no keys before its queries is plain causal attention, one fused call. CUDA
    runs it in a fused kernel without a mask (torch's ``causal_lower_right``); the
    CPU's kernel aligns to the upper left only, so there the two parts are computed
    apart and merged (``torch_compat.cpu_lower_right``). Neither takes fewer kv heads: each
    group of q heads (those of one kv head, every ``groups``-th) is a call of its own,
    so the keys and values are never copied per q head."""
    groups = q.shape[1] // k.shape[1]
    if q.shape[-2] == k.shape[-2]:  # no keys before the queries (a whole document): causal
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              dropout_p=dropout, enable_gqa=groups > 1)
    if groups > 1:
        return torch.stack([lower_right(q[:, g::groups], k, v, mask, scale, dropout)
                            for g in range(groups)], dim=2).flatten(1, 2)
    if q.is_cuda or dropout:
        bias = torch_compat.lower_right_bias(q.shape[-2], k.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                              dropout_p=dropout)
    return torch_compat.cpu_lower_right(q, k, v, scale)


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v on [batch, heads, seq, head_dim], each query seeing
    the keys at or before it, and with a ``mask`` only those it allows: packed
    ``Documents`` (SDPA per document), a FlexAttention BlockMask, ``LowerRight``
    (queries that are the last of the keys) or an additive tensor. ``flex`` (set by the
    attention-backend pass): causal attention (no mask) runs through FlexAttention
    too, under the causal BlockMask of its length.
    A module of its own (no weights), so that a pass can put another in its place
    (context parallel: ``ModelSpec.parallel.attention_cores``)."""

    takes_spans = True  # Documents and LowerRight, which context parallel then hands it

    def __init__(self, flex: bool = False):
        super().__init__()
        self.flex = flex

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | Documents | BlockMask | LowerRight | None = None
                ) -> torch.Tensor:
        # each kv head serves its group of q heads without being copied for them
        gqa = k.shape[1] != q.shape[1]
        if mask is None and self.flex:
            mask = causal_block_mask(q.shape[-2], q.device)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if isinstance(mask, BlockMask):
            return flex(q, k, v, mask)
        if isinstance(mask, LowerRight):
            return lower_right(q, k, v, mask)
        if isinstance(mask, Documents):
            return attend_documents(lower_right, q, k, v, mask)
        # (autocast computes q in a lower dtype than the residual stream the mask was made for)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), enable_gqa=gqa)


class Attention(nn.Module):
    """Grouped-query attention: q/k/v projections, the rotary embedding on q and
    k, the core (``core``, which a pass may replace) and the output projection."""

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.core = CausalAttention()
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [batch, seq, heads, head_dim], before the rotary embedding
        (a family that transforms the heads first overrides this)."""
        bs, seqlen, _ = x.shape
        return tuple(w(x).view(bs, seqlen, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        # Shapes, not args, give the head counts and the sequence length: under
        # tensor parallelism a rank holds a slice of the heads, and under
        # sequence parallelism x here is already gathered to the full sequence.
        bs, seqlen, _ = x.shape
        q, k, v = self.project(x)
        cos, sin = cos[..., :seqlen, :], sin[..., :seqlen, :]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, out_std: float):
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, 0.02)
        trunc_normal_(self.wo.weight, out_std)
