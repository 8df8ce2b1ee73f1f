"""Attention without weights: the causal core every layer calls, and the mask a
forward builds once for all of them from packed documents. Both are modules of
their own so that a pass can put others in their place (context parallel)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i sees key j where j <= i and both are of one document
    (``documents`` [B, S] holds each position's document number)."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]


def flex_document_mask(documents: torch.Tensor) -> BlockMask:
    """The block-causal mask as FlexAttention's BlockMask (CUDA): its kernel skips
    the blocks the mask hides instead of computing and discarding them."""
    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    batch, seq = documents.shape
    return create_block_mask(same_document_causal, batch, None, seq, seq, device=documents.device)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in ``dtype``: SDPA keeps a mask of its
    query's dtype for backward as it is, where it would save a copy of a boolean one."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


class DocumentMask(nn.Module):
    """documents [B, S] -> the mask every attention core of one forward is given:
    None (causal) without documents, a FlexAttention BlockMask on CUDA, else
    ``document_mask`` as an additive mask of the dtype of ``like`` (the hidden
    states). Built once per forward, so every layer (and its backward) shares
    one. A module of its own (no weights), so that a pass can put another in its
    place (context parallel: ``ModelSpec.attention_mask``)."""

    def forward(self, documents: torch.Tensor | None, like: torch.Tensor):
        if documents is None:
            return None
        if documents.is_cuda:
            return flex_document_mask(documents)
        return additive_mask(document_mask(documents), like.dtype)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v on [batch, heads, seq, head_dim], each query seeing
    the keys at or before it, and with a ``mask`` (packed documents) only those it
    allows. A module of its own (no weights), so that a pass can put another in
    its place (context parallel: ``ModelSpec.attention_cores``)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        # each kv head serves its group of q heads without being copied for them
        gqa = k.shape[1] != q.shape[1]
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if isinstance(mask, BlockMask):
            return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=gqa)
        # (autocast computes q in a lower dtype than the residual stream the mask was made for)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), enable_gqa=gqa)
