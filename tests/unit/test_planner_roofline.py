"""The planner's matmul roofline (composer/planner/roofline.py) on hand-computed cases:
one GEMM against a GPU profile, and the GEMMs of the debug model's step, with float8
per linear."""
from __future__ import annotations

import dataclasses

import pytest

from composer.config import parse_args
from composer.planner.cluster import CLUSTERS
from composer.planner.layout import layout_of, load_model
from composer.planner.roofline import efficiency, gemm_seconds, matmul_seconds, step_gemms
from composer.planner.time import (
    attention_flops_per_rank,
    matmul_time,
    model_flops_per_rank,
    optimizer_bytes,
)
from tests.integration.test_planner_trace import JOB, models

H100 = CLUSTERS["h100-80gb"]  # bfloat16 peak 989 TFLOP/s, 3350 GB/s, curve (0.75, 32, 2.2)
DEBUG = ["--config", "train_configs/debug_model.toml"]
# the debug Llama: dim 128, 4 blocks, q 8 x 16 wide, k and v 4 x 16, SwiGLU 384 wide,
# vocabulary 512; 8 sequences of 128 tokens a step, float32
BLOCK_LINEARS = [(128, 128), (128, 64), (128, 64), (128, 128),  # wq, wk, wv, wo (in, out)
                 (128, 384), (128, 384), (384, 128)]  # w1, w3, w2
TOKENS = 8 * 128


def test_a_big_square_gemm_is_compute_bound_at_the_ceiling():
    n = 16384
    gflop = 2 * n ** 3 / 1e9  # 8796.09
    eff = 0.75 * n / (n + 32) * gflop / (gflop + 2.2)
    assert eff == pytest.approx(0.7483, abs=1e-4)  # within 0.3% of matmul_efficiency
    assert efficiency(H100, n, n, n) == pytest.approx(eff, rel=1e-12)
    compute = gflop * 1e9 / (989e12 * eff)  # 11.88 ms
    memory = 3 * n * n * 2 / 3350e9  # operands and output in bfloat16: 0.48 ms
    assert compute > 20 * memory
    assert gemm_seconds(H100, n, n, n, 989.0, 2, 2) == pytest.approx(compute, rel=1e-12)


def test_a_thin_gemm_is_memory_bound():
    """16384 x 16384 by 16384 x 4: 2.1 GFLOP at 4.1% of peak would take 53 us; its
    537 MB of bfloat16 take 160 us at the HBM's 3350 GB/s."""
    m = k = 16384
    gflop = 2 * m * k * 4 / 1e9
    compute = gflop * 1e9 / (989e12 * 0.75 * 4 / 36 * gflop / (gflop + 2.2))
    memory = ((m * k + k * 4) * 2 + m * 4 * 2) / 3350e9
    assert compute == pytest.approx(52.7e-6, rel=1e-2)
    assert memory == pytest.approx(160.3e-6, rel=1e-3)
    assert gemm_seconds(H100, m, k, 4, 989.0, 2, 2) == pytest.approx(memory, rel=1e-12)


def _layout(*extra: str):
    cfg, _ = parse_args([*DEBUG, *extra])
    return layout_of(cfg, load_model(cfg), 1, "cuda")


# compute bound everywhere (memory at 1 PB/s), every GEMM at its dtype's peak
IDEAL = dataclasses.replace(H100, peak_tflops={"float32": 100.0, "float8": 200.0},
                            matmul_efficiency=1.0, matmul_half_dim=0.0, matmul_half_gflop=0.0,
                            memory_gbps=1e6)


def test_step_gemms_are_the_linears_three_gemms():
    """6 FLOPs per weight per token: forward, input gradient, weight gradient."""
    weights = 4 * sum(k * n for k, n in BLOCK_LINEARS) + 128 * 512  # blocks + the head
    assert sum(g.flops for g in step_gemms(_layout())) == 6 * weights * TOKENS
    seconds, ideal, casts = matmul_seconds(_layout(), IDEAL)
    assert seconds == pytest.approx(6 * weights * TOKENS / 100e12, rel=1e-12)
    assert (ideal, casts) == (pytest.approx(seconds, rel=1e-12), 0.0)


def test_full_ac_runs_the_blocks_forward_gemms_again():
    blocks = 4 * sum(k * n for k, n in BLOCK_LINEARS)
    full = sum(g.flops for g in step_gemms(_layout("--activation_checkpoint.mode", "full")))
    assert full == (6 * (blocks + 128 * 512) + 2 * blocks) * TOKENS


def test_float8_speeds_only_the_linear_gemms_and_adds_their_casts():
    """The blocks' linears at the float8 rate, the head at float32's; each GEMM's two
    operands cast at 2 x 4 + 1 bytes an element (amax read, cast read, one byte
    written): over a linear's three GEMMs 2 (T (k + n) + k n) elements."""
    blocks = 4 * sum(k * n for k, n in BLOCK_LINEARS)
    seconds, _, casts = matmul_seconds(_layout("--model.converters", "float8"), IDEAL)
    assert seconds == pytest.approx(6 * TOKENS * (blocks / 200e12 + 128 * 512 / 100e12),
                                    rel=1e-12)
    elements = 4 * sum(2 * (TOKENS * (k + n) + k * n) for k, n in BLOCK_LINEARS)
    assert casts == pytest.approx(9 * elements / 1e15, rel=1e-12)
    head = [g for g in step_gemms(_layout("--model.converters", "float8")) if 512 in (g.k, g.n)]
    assert [(g.dtype, g.cast_bytes) for g in head] == [("float32", 0.0)] * 3


def test_float8_without_float8_units_runs_at_the_compute_dtypes_rate():
    """A100 has no float8 peak: the GEMMs stay at float32's, the casts still cost."""
    no_fp8 = dataclasses.replace(IDEAL, peak_tflops={"float32": 100.0})
    seconds, _, casts = matmul_seconds(_layout("--model.converters", "float8"), no_fp8)
    assert seconds == pytest.approx(matmul_seconds(_layout(), no_fp8)[0], rel=1e-12)
    assert casts > 0


def test_a_traced_model_runs_its_matmul_flops_at_the_efficiency_of_its_width():
    """No shape, no GEMMs to enumerate: the traced FLOPs less attention's, at the
    efficiency of a square GEMM of the width (128) over the rank's 4 x 512 tokens:
    128 / (128 + 32) = 0.8 here."""
    name, model = models("llama3", "debug")["traced"]
    cfg, _ = parse_args(["--model.name", name, "--model.flavor", "debug", *JOB])
    layout = layout_of(cfg, model, 1, "cuda")
    curve = dataclasses.replace(IDEAL, matmul_half_dim=32.0)
    matmul_flops = model_flops_per_rank(layout) - attention_flops_per_rank(layout)
    assert matmul_time(layout, curve) == (pytest.approx(matmul_flops / (100e12 * 0.8),
                                                        rel=1e-12), pytest.approx(0.8))


def test_the_optimizer_step_moves_ten_passes_over_the_trainable_parameters():
    """float32 AdamW: 7 passes (both moments and the parameter read and written, the
    gradient read), clipping 3 (the norm reads the gradient, the scaling reads and
    writes it): 10 x 4 bytes a parameter on one rank, half that on two ZeRO-3 ranks."""
    n = _layout().model.spec.num_params(_layout().model.args)
    assert optimizer_bytes(_layout()) == 40 * n
    cfg, _ = parse_args([*DEBUG, "--parallelism.zero_stage", "3"])
    assert optimizer_bytes(layout_of(cfg, load_model(cfg), 2, "cuda")) == 20 * n


def test_the_traced_ops_and_their_bytes_are_a_real_steps():
    """The planner's trace of the debug model's step on fake tensors (its ops launched and
    the bytes its memory-bound ops move, per piece) against a real float32 step of the same
    model on CPU, counted by a dispatch mode of this test: the same ops, the same bytes,
    each block alike, and the pieces sum to the step."""
    import torch
    import torch.nn.functional as F

    from composer import torch_compat
    from composer.models.llama import Transformer, flavors
    from composer.planner.trace import tensors_in

    batch, seq = 2, 32
    cfg, _ = parse_args([*DEBUG, "--training.local_batch_size", str(batch),
                         "--data.seq_len", str(seq)])
    traced = load_model(cfg).traced
    pieces = [traced.first, *traced.blocks, traced.last]
    assert len({(b.launches, b.traffic) for b in traced.blocks}) == 1

    priced = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
              *torch_compat.attention_kernels()}

    class Count(torch_compat.TorchDispatchMode):
        launches, moved = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = tensors_in(out)
            if outs and not func.is_view and func not in torch_compat.untracked_views():
                self.launches += 1
                if func not in priced:
                    ins = tensors_in((args, kwargs))
                    self.moved += sum(t.numel() * t.element_size() for t in ins + outs)
            return out

    torch.manual_seed(0)
    model = Transformer(flavors["debug"])
    model.init_weights()
    tokens = torch.randint(0, 256, (batch, seq))
    with Count() as count:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(), reduction="sum").backward()
    # 466: the embedding's 2, 109 a block, 28 for the head and the loss
    assert sum(p.launches for p in pieces) == count.launches == 466
    bytes_traced = sum(p.traffic.share(1, False) for p in pieces) * batch * seq
    assert bytes_traced == pytest.approx(count.moved, rel=0.02)
    # the blocks' backward ops are the blocks' own (by their autograd nodes): most of the bytes
    assert traced.blocks[0].traffic.share(1, False) * 4 > 0.5 * bytes_traced / (batch * seq)
