"""FSDP2 flattens one dtype per group: a parameter of another dtype than most of its
block's (transformers keeps some MoE routers in float32 in a float64 model) is cast to
theirs before the block is sharded (``composer.parallel.data.one_dtype``)."""
from __future__ import annotations

import torch
from torch import nn

from composer.parallel.data import one_dtype


def test_a_parameter_of_another_dtype_is_cast_to_its_blocks():
    block = nn.Sequential(*(nn.Linear(4, 4, dtype=torch.float64) for _ in range(2)))
    assert one_dtype(block) == 0
    block.append(nn.Linear(4, 2, dtype=torch.float32))
    assert one_dtype(block) == 2
    assert {p.dtype for p in block.parameters()} == {torch.float64}
    assert block(torch.ones(1, 4, dtype=torch.float64)).dtype == torch.float64
