"""Fit the cpu cluster profile's attention constants on SDPA micro-benchmarks.

Times ``F.scaled_dot_product_attention`` (causal, 8 query heads over 4 kv heads, the
CPU's fused flash kernel), its forward and backward, on one thread at a grid of
shapes: sequence 32 to 1024 at 2,048 tokens a call (the batch 2048 / seq), head_dim
16, 32 and 64, float32 and float64; each shape the minimum over ``--repeats`` runs of
the thread's CPU time (see benchmarks/bench_gemm.py). It then fits, by least squares on
the relative error, the three constants of the time model's attention term
(``composer/planner/time.py``):

    seconds = FLOPs / (peak x attention_efficiency)
              + scores x attention_score_passes x itemsize / memory_gbps
              + query rows x attention_row_us

with the FLOPs as the planner counts them (12 x heads x head_dim x seq a token,
forward and backward, the causal half not discounted), ``scores`` the query x key
products (heads x seq a token: what the kernel's softmax reads and writes, in the
caches, in passes of the compute dtype) and ``query rows`` heads x tokens (the
kernel's work per row, outside both). The profile's peaks and ``memory_gbps`` are
held as they are. It prints each shape's measured time beside the fitted model's
prediction (the reference column) and their ratio, then the constants.

Only these calls are fitted: the training layouts of benchmarks/bench_planner.py judge
the result and are never fitted on.

    OMP_NUM_THREADS=1 python benchmarks/bench_attention.py [--repeats 3] [--json]
"""
from __future__ import annotations

import itertools
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from composer.planner.cluster import CLUSTERS
from composer.testing.report import bench_parser, emit

TOKENS, HEADS, KV_HEADS = 2048, 8, 4
SEQS = (32, 64, 128, 256, 512, 1024)
HEAD_DIMS = (16, 32, 64)
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def measure(seq: int, head_dim: int, dtype: torch.dtype, repeats: int) -> float:
    """The least thread CPU seconds of a causal SDPA's forward and backward."""
    batch = TOKENS // seq
    q = torch.randn(batch, HEADS, seq, head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, KV_HEADS, seq, head_dim, dtype=dtype, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(batch, HEADS, seq, head_dim, dtype=dtype)

    def call():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)
    call()
    runs = []
    for _ in range(repeats):
        start = time.thread_time()
        call()
        runs.append(time.thread_time() - start)
    return min(runs)


def terms(seq: int, head_dim: int, dtype: str) -> tuple[float, float, float]:
    """(FLOPs, score element bytes, query rows) of one call."""
    flops = 12 * HEADS * head_dim * seq * TOKENS
    scores = HEADS * seq * TOKENS * torch.finfo(DTYPES[dtype]).bits // 8
    return flops, scores, HEADS * TOKENS


def fit(cpu, repeats: int) -> tuple[dict[str, float], list[tuple]]:
    """Time every shape and fit the three constants, ``cpu``'s peaks and ``memory_gbps``
    held: ({constant: value}, the rows (dtype, seq, head_dim, seconds, terms))."""
    torch.manual_seed(0)
    rows = []
    for dtype, seq, head_dim in itertools.product(DTYPES, SEQS, HEAD_DIMS):
        seconds = measure(seq, head_dim, DTYPES[dtype], repeats)
        flops, score_bytes, query_rows = terms(seq, head_dim, dtype)
        # seconds = x0 * flops / peak + x1 * score_bytes / bandwidth + x2 * rows (x2 in s)
        rows.append((dtype, seq, head_dim, seconds,
                     [flops / (cpu.peak_tflops[dtype] * 1e12),
                      score_bytes / (cpu.memory_gbps * 1e9), query_rows]))
    a = torch.tensor([[x / r[3] for x in r[4]] for r in rows], dtype=torch.float64)
    x = torch.linalg.lstsq(a, torch.ones(len(rows), 1, dtype=torch.float64)).solution.flatten()
    return {"attention_efficiency": 1 / x[0].item(), "attention_score_passes": x[1].item(),
            "attention_row_us": x[2].item() * 1e6}, rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    values, rows = fit(CLUSTERS["cpu"], args.repeats)
    efficiency, passes, row_s = (values["attention_efficiency"], values["attention_score_passes"],
                                 values["attention_row_us"] * 1e-6)
    table, ratios = [], []
    for dtype, seq, head_dim, seconds, x in rows:
        predicted = x[0] / efficiency + x[1] * passes + x[2] * row_s
        ratios.append(predicted / seconds)
        table.append({"dtype": dtype, "seq": seq, "head_dim": head_dim, "batch": TOKENS // seq,
                      "measured ms": seconds * 1e3, "predicted ms": predicted * 1e3,
                      "ratio": ratios[-1]})
    emit(table, ["dtype", "seq", "head_dim", "batch", "measured ms", "predicted ms", "ratio"],
         args.json)
    if not args.json:
        print(f"\nattention_efficiency = {efficiency:.3f}, "
              f"attention_score_passes = {passes:.2f}, attention_row_us = {row_s * 1e6:.3f}")
        print(f"ratios: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-"
              f"{max(ratios):.2f}, {sum(0.8 <= r <= 1.25 for r in ratios)} of {len(ratios)} "
              f"within 0.8-1.25")
    return 0


if __name__ == "__main__":
    sys.exit(main())
