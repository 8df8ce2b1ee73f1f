"""An autograd kernel over aten's private CPU attention ops: causal attention of queries
that are the last of the keys (context parallel's all-gather chunk) without a mask."""
from __future__ import annotations

import torch

from composer.torch_compat.names import _CPU_ATTENTION, resolved


def _cpu_attention(q, k, v, causal: bool, scale):
    return resolved("torch", f"ops.aten.{_CPU_ATTENTION}")(q, k, v, 0.0, causal, scale=scale)


class _CpuLowerRight(torch.autograd.Function):
    """Causal attention of queries that are the last of the keys, on CPU without a mask:
    the keys before the queries (all seen) and those beside them (causal, a square) in
    two calls of the CPU's fused kernel, merged by their log-sum-exps; backward runs the
    kernel's backward of each part against the merged output and log-sum-exp, which is
    what the softmax over all the keys has."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        before = k.shape[-2] - q.shape[-2]
        out, lse = _cpu_attention(q, k[..., before:, :], v[..., before:, :], True, scale)
        if before:
            seen, seen_lse = _cpu_attention(q, k[..., :before, :], v[..., :before, :], False,
                                            scale)
            merged = torch.logaddexp(lse, seen_lse)
            out = (out * (lse - merged).exp()[..., None]
                   + seen * (seen_lse - merged).exp()[..., None]).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.before = scale, before
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        before, grad = ctx.before, grad.contiguous()
        backward = resolved("torch", f"ops.aten.{_CPU_ATTENTION}_backward")
        dq, dk, dv = backward(grad, q, k[..., before:, :], v[..., before:, :], out, lse, 0.0,
                              True, scale=ctx.scale)
        if before:
            dq_seen, dk_seen, dv_seen = backward(grad, q, k[..., :before, :],
                                                 v[..., :before, :], out, lse, 0.0, False,
                                                 scale=ctx.scale)
            dq, dk, dv = dq + dq_seen, torch.cat([dk_seen, dk], -2), torch.cat([dv_seen, dv], -2)
        return dq, dk, dv, None


def cpu_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None):
    """SDPA on CPU of queries [B, H, L, E] that are the last L of the keys [B, H, S, E]
    (causal aligned to the lower right), exact and without an L x S mask; heads equal."""
    return _CpuLowerRight.apply(q, k, v, scale)
