"""RMSNorm, computed in float32 or wider whatever the model's dtype."""
from __future__ import annotations

import torch
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, float64 stays float64 (parity runs need exactness)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension; the root mean square in
    ``compute_dtype``, so half-precision inputs do not lose it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight

    def init_weights(self):
        nn.init.ones_(self.weight)
