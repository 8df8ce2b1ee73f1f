"""Learning-rate schedules and gradient clipping, checked against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from composer.config import LRScheduler
from composer.trainer.optim import clip_grad_norm_, lr_factor


def factors(total: int, **kw) -> list[float]:
    cfg = LRScheduler(**kw)
    return [lr_factor(s, cfg, total) for s in range(total)]


def test_warmup_then_linear_decay():
    f = factors(10, warmup_steps=4, decay_type="linear", min_lr_factor=0.0)
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4:] == pytest.approx([1 - k / 6 for k in range(6)])


def test_cosine_reaches_the_floor_halfway_value():
    f = factors(12, warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)
    assert f[2] == pytest.approx(1.0)
    # progress 0.5 is the cosine midpoint: halfway between peak and floor
    assert f[2 + 5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(f[2:], f[3:]))


def test_wsd_is_flat_then_decays_over_the_last_share():
    f = factors(12, warmup_steps=2, decay_type="wsd", decay_ratio=0.5, min_lr_factor=0.0)
    assert f[2:8] == pytest.approx([1.0] * 6)       # progress 0 .. 0.5 stays flat
    assert f[8:] == pytest.approx([0.8, 0.6, 0.4, 0.2])


def test_constant_after_warmup():
    assert factors(5, warmup_steps=1, decay_type="constant") == [1.0] * 5


def test_clip_matches_the_norm_of_all_gradients():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    expected = torch.cat([p.grad.flatten() for p in params]).norm()
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, max_norm=0.5)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-12)
    for p, g in zip(params, before):
        torch.testing.assert_close(p.grad, g * (0.5 / (expected + 1e-6)), rtol=1e-12, atol=0)


def test_zero_max_norm_only_measures():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    p.grad = torch.full((4,), 3.0, dtype=torch.float64)
    assert clip_grad_norm_([p], max_norm=0.0).item() == pytest.approx(6.0)
    assert torch.equal(p.grad, torch.full((4,), 3.0, dtype=torch.float64))

