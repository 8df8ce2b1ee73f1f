"""Weight initialisation shared by the decoder's modules."""
from __future__ import annotations

import math

import torch
from torch import nn


def residual_std(layer_id: int) -> float:
    """Init std of the projections writing into the residual stream: it shrinks
    with depth so the stream's variance does not grow with the number of layers."""
    return 0.02 / math.sqrt(2 * (layer_id + 1))


def trunc_normal_(weight: torch.Tensor, std: float):
    """Normal(0, std) truncated at +-3 std."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
