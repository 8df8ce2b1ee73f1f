"""The mask a forward builds once for all its attention cores: each query sees the
keys at or before it, and with packed documents only those of its own document.
A module of its own, so that a pass can put another in its place (context
parallel) or switch it to FlexAttention's block masks (``flex``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


@dataclass(frozen=True)
class LowerRight:
    """The mask of queries that are the last of the keys: each sees the keys at or
    before it, aligned to the lower right (a context-parallel chunk over the keys of
    the sequence up to its end). Its sizes are those of the queries and keys."""


LOWER_RIGHT = LowerRight()


@dataclass(frozen=True)
class Documents:
    """Packed documents as spans, for SDPA without any mask of queries x keys: each
    batch row's documents as (start, end) positions of the whole sequence (numbered in
    order, each one run), and ``start``, the position of the first query (the keys are
    the sequence from 0, in order, up to the last query)."""

    spans: tuple[tuple[tuple[int, int], ...], ...]
    start: int = 0

    @staticmethod
    def of(documents: torch.Tensor) -> Documents:
        """The spans of ``documents`` [B, S] (each position's document number)."""
        if (documents[:, 1:] < documents[:, :-1]).any():
            raise ValueError("documents must be numbered in order along the sequence")
        seq = documents.shape[1]
        rows = []
        for row in documents:
            starts = [0, *((row[1:] != row[:-1]).nonzero().flatten() + 1).tolist()]
            rows.append(tuple(zip(starts, [*starts[1:], seq])))
        return Documents(tuple(rows))

    def at(self, start: int) -> Documents:
        """The same documents for queries from ``start`` on."""
        return Documents(self.spans, start)


@torch.compiler.disable  # one call per document: a compiled graph would fix the spans
def attend_documents(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, documents: Documents) -> torch.Tensor:
    """Causal attention of queries [B, H, L, E] at positions ``documents.start`` on
    over keys [B, H, >= start + L, E] from 0, each query seeing only its own
    document's keys: ``attend(q, k, v, LOWER_RIGHT)`` on each document's piece,
    exactly the keys the dense mask would allow."""
    first, end = documents.start, documents.start + q.shape[-2]
    rows = []
    # split, never slice: a slice's backward writes a zero tensor the size of the whole
    # input per piece; a split's backward is one concatenation
    for qb, kb, vb, spans in zip(q.split(1), k.split(1), v.split(1), documents.spans):
        spans = [(start, min(stop, end)) for start, stop in spans if stop > first and start < end]
        queries = qb.split([stop - max(start, first) for start, stop in spans], dim=2)
        sizes = [spans[0][0], *(stop - start for start, stop in spans), kb.shape[2] - end]
        keys, values = kb.split(sizes, dim=2)[1:-1], vb.split(sizes, dim=2)[1:-1]
        rows.append(torch.cat([attend(*piece, LOWER_RIGHT)
                               for piece in zip(queries, keys, values)], dim=2))
    return torch.cat(rows)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in ``dtype``: SDPA keeps a mask of its
    query's dtype for backward as it is, where it would save a copy of a boolean one."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


class DocumentMask(nn.Module):
    """documents [B, S] -> the mask every attention core of one forward is given:
    None (causal) without documents; with them, their ``Documents`` spans (SDPA per
    document, no mask held), with ``flex`` a FlexAttention BlockMask, or with
    ``dense`` (compiled blocks, whose one graph cannot loop over data-dependent
    spans) ``document_mask`` as an additive mask of ``like``'s dtype (the hidden
    states). Built once per forward, so every layer (and its backward) shares one. A
    module of its own (no weights), so that a pass can put another in its place
    (context parallel: ``ModelSpec.parallel.attention_mask``) or set ``flex`` and
    ``dense`` (the attention pass)."""

    def __init__(self, flex: bool = False, dense: bool = False):
        super().__init__()
        self.flex, self.dense = flex, dense

    def forward(self, documents: torch.Tensor | None, like: torch.Tensor):
        if documents is None:
            return None
        if self.flex:
            return flex_document_mask(documents)
        if self.dense:
            return additive_mask(document_mask(documents), like.dtype)
        return Documents.of(documents)
