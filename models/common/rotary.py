"""Rotary position embeddings: the frequencies (with Llama-3.1's long-context
scaling), their cos/sin tables and the rotation of q and k."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from composer.models.common.args import DecoderArgs
from composer.models.common.norm import compute_dtype


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 rotary frequency scaling for long context."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(args: DecoderArgs) -> torch.Tensor:
    """Inverse frequencies (float64, one per pair) with Llama-3.1 scaling if configured.

    Wavelengths shorter than original_len/high_freq_factor are kept, those longer
    than original_len/low_freq_factor are divided by ``factor``, and those between
    are interpolated linearly in original_len/wavelength.
    """
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim
    inv_freq = 1.0 / args.rope_theta**exponents
    s = args.rope_scaling
    if s is None:
        return inv_freq
    ratio = s.original_max_position_embeddings * inv_freq / (2 * math.pi)
    smooth = ((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq


def rope_tables(args: DecoderArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq, shape [max_seq_len, head_dim // 2], float64."""
    positions = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, rope_inv_freq(args))
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs (0,1), (2,3), ... of x [B, S, H, D] by position.

    cos/sin are [S, D/2], or [B, S, D/2] where each sequence has positions of its
    own; real arithmetic instead of complex numbers because DTensor and
    torch.compile handle real tensors better.
    """
    dtype = compute_dtype(x.dtype)
    pairs = x.to(dtype).unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)
    rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
