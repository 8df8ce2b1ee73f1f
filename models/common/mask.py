"""The mask a forward builds once for all its attention cores from packed
documents: each query sees only the keys of its own document at or before it.
A module of its own, so that a pass can put another in its place (context
parallel)."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


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
    None (causal) without documents, a FlexAttention BlockMask on CUDA (unless
    ``flex`` is False: for cores that take none), else ``document_mask`` as an
    additive mask of the dtype of ``like`` (the hidden states). Built once per
    forward, so every layer (and its backward) shares one. A module of its own (no
    weights), so that a pass can put another in its place (context parallel:
    ``ModelSpec.parallel.attention_mask``)."""

    def __init__(self, flex: bool = True):
        super().__init__()
        self.flex = flex

    def forward(self, documents: torch.Tensor | None, like: torch.Tensor):
        if documents is None:
            return None
        if documents.is_cuda and self.flex:
            return flex_document_mask(documents)
        return additive_mask(document_mask(documents), like.dtype)
