"""composer's attention inside a transformers model, without patching transformers.

transformers calls the attention function its config names (``attn_implementation``)
through its registry (``AttentionInterface``). The function registered here hands
q, k and v to a module of ours, ``core``, that every attention module of the model
holds: a module of its own (no weights), so that a pass can put another in its place
(context parallel), as with composer's own families. The mask of packed documents
reaches it as ``composer_mask``, built once per forward by ``DocumentMask`` and passed
down through the keyword arguments transformers hands every attention call. Since no
mask function is registered for it, transformers builds no S x S mask of its own.

Every argument transformers passes is honoured or refused: the scaling, dropout,
sliding window, logit soft-capping and attention sinks (``s_aux``) go to the core;
the positions (``position_ids``) have reached the rotary embedding already, and
packed documents come as ``composer_mask``; anything else, an attention mask built by
the model itself, or a bidirectional call (``is_causal=False``) is refused
(``Refused``): the model then runs transformers' own eager attention (``model.py``).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from composer.models.common.attention import lower_right
from composer.models.common.mask import (
    DocumentMask,
    Documents,
    LowerRight,
    additive_mask,
    attend_documents,
)

NAME = "composer"
# what transformers passes that the core has nothing to do with
IGNORED = frozenset({"position_ids", "use_cache", "output_attentions", "cache_position",
                     "output_router_logits", "logits_to_keep"})


class Refused(ValueError):
    """What a model passes attention that composer's attention cannot honour."""


class Core(nn.Module):
    """softmax(q k^T x scale, soft-capped, beside the sinks) v on [batch, heads, seq,
    head_dim]; kv heads may be fewer. Each query sees the keys at or before it, or
    with a ``mask`` (packed ``Documents``, ``LowerRight``, or an additive tensor)
    exactly those it allows (its queries and keys may then differ in number: context
    parallel's all-gather gives a rank's chunk the keys up to its end), and of
    those the ones less than ``window`` positions before it (keys the sequence in order,
    queries the last of them). ``sinks`` [heads]: one logit per head that takes part in
    the softmax with no value (attention sinks)."""

    takes_spans = True  # Documents and LowerRight, which context parallel then hands it

    def forward(self, q, k, v, mask=None, scale=None, window=None, softcap=None, sinks=None,
                dropout=0.0):
        if isinstance(mask, Documents):
            return attend_documents(functools.partial(
                self, scale=scale, window=window, softcap=softcap, sinks=sinks, dropout=dropout),
                q, k, v, mask)
        if isinstance(mask, LowerRight):  # the queries are the last of the keys
            if window is None and softcap is None and sinks is None:
                return lower_right(q, k, v, mask, scale, dropout)
            mask = None  # the causal masks below align to the lower right by index
        if window is not None:
            mask = _windowed(mask, window, q, k)
        if softcap is None and sinks is None:
            gqa = k.shape[1] != q.shape[1]
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                      dropout_p=dropout, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=scale,
                                                  dropout_p=dropout, enable_gqa=gqa)
        return _explicit(q, k, v, _near(q, k) if mask is None else mask.to(q.dtype), scale,
                         softcap, sinks, dropout)


def _near(q: torch.Tensor, k: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The additive causal mask by index, the keys the sequence in order and the
    queries the last of them (all; the newest few where a KV cache holds the others;
    a context-parallel chunk), hiding also the keys ``window`` or more positions
    before their query."""
    j = torch.arange(k.shape[-2], device=q.device)
    i = j[k.shape[-2] - q.shape[-2]:]
    seen = j[None, :] <= i[:, None]
    if window is not None:
        seen &= i[:, None] - j[None, :] < window
    return additive_mask(seen, q.dtype)


def _windowed(mask, window: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The additive mask that also hides the keys ``window`` or more positions
    before their query (``_near``)."""
    near = _near(q, k, window)
    return near if mask is None else mask.to(q.dtype) + near


def _explicit(q, k, v, mask, scale, softcap, sinks, dropout):
    """The attention written out, for what SDPA cannot take: scores soft-capped as
    ``softcap x tanh(scores / softcap)``, and sinks (a column of the softmax that is
    dropped after it)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + mask
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return F.dropout(weights, p=dropout) @ v


def attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              sliding_window=None, softcap=None, s_aux=None, is_causal=True, composer_mask=None,
              **kwargs):
    """The function transformers calls (``attn_implementation="composer"``): q, k, v
    [batch, heads, seq, head_dim] -> ([batch, seq, heads, head_dim], no weights)."""
    # an argument given as None (a decoder's absent encoder_hidden_states) asks nothing
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED and v is not None)
    name = type(module).__name__
    if unknown:
        raise Refused(f"{name} passes attention the argument {unknown[0]!r}, which "
                         f"composer's attention cannot honour")
    if attention_mask is not None:
        raise Refused(f"{name} builds an attention mask of its own, which composer's "
                      f"attention does not take")
    if is_causal is False:
        raise Refused(f"{name} asks for attention with is_causal=False (bidirectional); "
                         f"composer's attention is causal")
    out = module.core(query, key, value, composer_mask, scale=scaling, window=sliding_window,
                      softcap=softcap, sinks=s_aux, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="composer"`` known to transformers (once a process)."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention)


__all__ = ["Core", "DocumentMask", "NAME", "Refused", "attention", "register"]
