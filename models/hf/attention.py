"""composer's attention inside a transformers model, without patching transformers.

transformers calls the attention function its config names (``attn_implementation``)
through its registry (``AttentionInterface``). The function registered here hands
q, k and v to a module of ours, ``core``, that every attention module of the model
holds: a module of its own (no weights), so that a pass can put another in its place
(context parallel), as with composer's own families. The mask of packed documents
reaches it as ``composer_mask``, built once per forward by ``DocumentMask`` and passed
down through the keyword arguments transformers hands every attention call. Since no
mask function is registered for it, transformers builds no S x S mask of its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from composer.models.common.mask import DocumentMask

NAME = "composer"
# what transformers passes that the core has nothing to do with
IGNORED = frozenset({"position_ids", "use_cache", "output_attentions", "cache_position",
                     "is_causal", "output_router_logits"})


class Core(nn.Module):
    """softmax(q k^T x scale + softcap) v on [batch, heads, seq, head_dim], each query
    seeing the keys at or before it (and within ``window`` of it), and with a ``mask``
    (packed documents) only those it allows; kv heads may be fewer."""

    def forward(self, q, k, v, mask=None, scale=None, window=None, softcap=None, dropout=0.0):
        gqa = k.shape[1] != q.shape[1]
        if window is None and softcap is None:
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                      dropout_p=dropout, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=scale,
                                                  dropout_p=dropout, enable_gqa=gqa)
        return _explicit(q, k, v, mask, scale, window, softcap, dropout)


def _explicit(q, k, v, mask, scale, window, softcap, dropout):
    """The attention written out, for what SDPA cannot take: a sliding window, and
    scores soft-capped as ``softcap x tanh(scores / softcap)``."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seq = q.shape[-2]
    i = torch.arange(seq, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        scores = scores + mask.to(scores.dtype)
    weights = F.dropout(torch.softmax(scores, dim=-1), p=dropout)
    return weights @ v


def attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              sliding_window=None, softcap=None, composer_mask=None, **kwargs):
    """The function transformers calls (``attn_implementation="composer"``): q, k, v
    [batch, heads, seq, head_dim] -> ([batch, seq, heads, head_dim], no weights)."""
    unknown = sorted(set(kwargs) - IGNORED)
    if unknown:
        raise ValueError(f"{type(module).__name__} passes attention the argument "
                         f"{unknown[0]!r}, which composer's attention cannot honour")
    if attention_mask is not None:
        raise ValueError(f"{type(module).__name__} built an attention mask of its own; "
                         f"composer's attention takes packed documents instead")
    out = module.core(query, key, value, composer_mask, scale=scaling, window=sliding_window,
                      softcap=softcap, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="composer"`` known to transformers (once a process)."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention)


__all__ = ["Core", "DocumentMask", "NAME", "attention", "register"]
