"""Fit the cpu cluster profile's matmul constants on GEMM micro-benchmarks.

Times ``torch.matmul`` of an ``m x k`` by a ``k x n`` matrix on one thread at a grid of
shapes (every dimension among 8, 32, 128, 512 and 2048; thin, small and large), in
float32 and float64: each shape the minimum over ``--repeats`` runs of a loop of calls
long enough to time, in the thread's CPU time (``time.thread_time``: the machine may be
shared, and time spent descheduled is not the matmul's; the minimum is the least
disturbed run, the spread, median over minimum, says how disturbed). It then fits the
roofline's constants (``composer.planner.roofline``): the peak of each dtype (the
profile's ``matmul_efficiency`` stays 1.0 on the CPU, whose peak is an achieved rate),
``matmul_half_dim`` and ``matmul_half_gflop``, by least squares on the log of
predicted over measured, the profile's ``memory_gbps`` and ``op_overhead_us`` (the host
cost of the call, counted once per op by the step model) held as they are. The thin
GEMMs whose operands stay in the caches run faster than the DRAM rate ``memory_gbps``
that bounds them in the roofline: they are the ratios well above 1. It prints
each shape's measured and predicted time and their ratio, then the constants.

Reference: the roofline's prediction with the fitted constants (``predicted us``) beside
each measured time, and their ratio predicted / measured.

Only these GEMMs are fitted: the training layouts of benchmarks/bench_planner.py judge
the result and are never fitted on. ``--out PATH`` writes the measured rows and the fit;
``--measured PATH`` fits such a file's rows instead of timing again.

    OMP_NUM_THREADS=1 python benchmarks/bench_gemm.py [--repeats 7] [--out PATH]
        [--measured PATH] [--json]
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from composer.planner.cluster import CLUSTERS, Cluster
from composer.planner.roofline import gemm_seconds
from composer.testing.report import bench_parser, emit

SIZES = (8, 32, 128, 512, 2048)
MAX_GFLOP = 5.0  # leaves out 2048^3 (17 GFLOP): seconds a call, and nothing new
DTYPES = {"float32": torch.float32, "float64": torch.float64}
LOOP_S = 0.005  # one timed run lasts at least this long
FITTED = ("float32", "float64", "matmul_half_dim", "matmul_half_gflop")
COLUMNS = ["dtype", "m", "k", "n", "GFLOP", "measured us", "spread", "predicted us", "ratio"]


def shapes() -> list[tuple[int, int, int]]:
    return [s for s in itertools.product(SIZES, repeat=3) if 2 * math.prod(s) / 1e9 <= MAX_GFLOP]


def time_matmul(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """(the fastest run's seconds a call, median over minimum of the runs)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.matmul(a, b)
    start = time.thread_time()
    torch.matmul(a, b)
    calls = max(1, int(LOOP_S / max(time.thread_time() - start, 1e-7)))
    runs = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            torch.matmul(a, b)
        runs.append((time.thread_time() - start) / calls)
    return min(runs), statistics.median(runs) / min(runs)


def predicted(cluster: Cluster, m: int, k: int, n: int, dtype: str) -> float:
    """The roofline's time of the kernel plus the host's cost of one op."""
    size = DTYPES[dtype].itemsize
    return (gemm_seconds(cluster, m, k, n, cluster.peak_tflops[dtype], size, size)
            + cluster.op_overhead_us * 1e-6)


def with_constants(cluster: Cluster, values: dict[str, float]) -> Cluster:
    peaks = {**cluster.peak_tflops, "float32": values["float32"], "float64": values["float64"]}
    return dataclasses.replace(cluster, peak_tflops=peaks, matmul_efficiency=1.0,
                               matmul_half_dim=values["matmul_half_dim"],
                               matmul_half_gflop=values["matmul_half_gflop"])


def loss(cluster: Cluster, rows: list[dict]) -> float:
    return sum(math.log(predicted(cluster, r["m"], r["k"], r["n"], r["dtype"]) / r["seconds"]) ** 2
               for r in rows)


def fit(base: Cluster, rows: list[dict]) -> dict[str, float]:
    """Coordinate descent on the logs of the constants, the step halving when no
    move helps (the loss is smooth and has one valley here)."""
    values = {"float32": base.peak_tflops["float32"], "float64": base.peak_tflops["float64"],
              "matmul_half_dim": 4.0, "matmul_half_gflop": 1e-4}
    best, step = loss(with_constants(base, values), rows), 1.0
    while step > 1e-3:
        moved = False
        for key, sign in itertools.product(FITTED, (1, -1)):
            trial = {**values, key: values[key] * math.exp(sign * step)}
            value = loss(with_constants(base, trial), rows)
            if value < best:
                values, best, moved = trial, value, True
        step = step if moved else step / 2
    return values


def table(cluster: Cluster, rows: list[dict]) -> list[dict]:
    """Each measured GEMM beside the roofline's time, and predicted / measured."""
    out = []
    for r in rows:
        p = predicted(cluster, r["m"], r["k"], r["n"], r["dtype"])
        out.append({"dtype": r["dtype"], "m": r["m"], "k": r["k"], "n": r["n"],
                    "GFLOP": 2 * r["m"] * r["k"] * r["n"] / 1e9,
                    "measured us": r["seconds"] * 1e6, "spread": r["spread"],
                    "predicted us": p * 1e6, "ratio": p / r["seconds"]})
    return out


def measure(repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for dtype, (m, k, n) in itertools.product(DTYPES, shapes()):
        seconds, spread = time_matmul(m, k, n, DTYPES[dtype], repeats)
        rows.append({"dtype": dtype, "m": m, "k": k, "n": n, "seconds": seconds,
                     "spread": spread})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=7, help="runs per shape; the fastest counts")
    parser.add_argument("--out", type=Path, metavar="PATH",
                        help="write the measured rows and the fit here (as JSON)")
    parser.add_argument("--measured", type=Path, metavar="PATH",
                        help="fit the rows of an earlier --out instead of timing again")
    opts = parser.parse_args(argv)
    rows = json.loads(opts.measured.read_text())["rows"] if opts.measured else measure(opts.repeats)
    base = CLUSTERS["cpu"]
    values = fit(base, rows)
    results = table(with_constants(base, values), rows)
    emit(results, COLUMNS, opts.json)
    ratios = [r["ratio"] for r in results]
    worst = max(ratios, key=lambda r: abs(math.log(r)))
    spreads = [r["spread"] for r in rows]
    if not opts.json:
        print(f"\nfitted on {len(rows)} GEMMs: peak float32 {values['float32']:.4f} TFLOP/s, "
              f"float64 {values['float64']:.4f}, matmul_half_dim {values['matmul_half_dim']:.2f}, "
              f"matmul_half_gflop {values['matmul_half_gflop']:.2e} (matmul_efficiency 1.0; "
              f"memory_gbps {base.memory_gbps}, op_overhead_us {base.op_overhead_us} held)")
        print(f"ratio predicted / measured: median {statistics.median(ratios):.2f}, "
              f"worst {worst:.2f}, {sum(0.8 <= r <= 1.25 for r in ratios)} of {len(ratios)} "
              f"within 0.8-1.25; spread of the runs: median {statistics.median(spreads):.2f}, "
              f"max {max(spreads):.2f}")
    if opts.out:
        opts.out.write_text(json.dumps({"rows": rows, "fit": values}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
