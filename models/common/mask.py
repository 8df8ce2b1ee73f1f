"""The mask a forward builds once for all its attention cores: each query sees the
keys at or before it, and with packed documents only those of its own document.
A module of its own, so that a pass can put another in its place (context
parallel) or switch it to FlexAttention's block masks (``flex``)."""
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


def position_block_mask(queries: torch.Tensor, keys: torch.Tensor,
                        documents: torch.Tensor | None = None, batch: int = 1) -> BlockMask:
    """FlexAttention's BlockMask of queries at global positions ``queries`` over keys
    at ``keys`` (any order): each sees the keys at or before it, and with
    ``documents`` ([B, S_whole]) only those of its own document. It holds a few
    integers per block of 128 x 128, never a score's worth per pair: FlexAttention
    skips the blocks it hides."""
    if documents is None:
        def allowed(b, h, q_idx, kv_idx):
            return keys[kv_idx] <= queries[q_idx]
    else:
        def allowed(b, h, q_idx, kv_idx):
            q, kv = queries[q_idx], keys[kv_idx]
            return (kv <= q) & (documents[b, q] == documents[b, kv])
        batch = documents.shape[0]
    return create_block_mask(allowed, batch if documents is not None else None, None,
                             len(queries), len(keys), device=queries.device)


def flex_document_mask(documents: torch.Tensor) -> BlockMask:
    """The block-causal mask of packed ``documents`` [B, S] as a BlockMask."""
    every = torch.arange(documents.shape[1], device=documents.device)
    return position_block_mask(every, every, documents)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in ``dtype``: SDPA keeps a mask of its
    query's dtype for backward as it is, where it would save a copy of a boolean one."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


class DocumentMask(nn.Module):
    """documents [B, S] -> the mask every attention core of one forward is given:
    None (causal) without documents; with them, ``document_mask`` as an additive
    mask of the dtype of ``like`` (the hidden states), or with ``flex`` a
    FlexAttention BlockMask. Built once per forward, so every layer (and its
    backward) shares one. A module of its own (no weights), so that
    a pass can put another in its place (context parallel:
    ``ModelSpec.parallel.attention_mask``) or set ``flex`` (the attention backend)."""

    def __init__(self, flex: bool = False):
        super().__init__()
        self.flex = flex

    def forward(self, documents: torch.Tensor | None, like: torch.Tensor):
        if documents is None:
            return None
        if self.flex:
            return flex_document_mask(documents)
        return additive_mask(document_mask(documents), like.dtype)
