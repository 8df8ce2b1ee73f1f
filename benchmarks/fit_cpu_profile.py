"""Fit the cpu cluster profile to the machine this runs on, on micro-benchmarks alone.

The built-in ``cpu`` profile (``composer/planner/cluster.py``) holds the constants of the
machine they were measured on (docs/planner_cpu_profile.md); a CPU of another make moves
every one of them (a GEMM at twice the rate, a shorter hop between two ranks). This
script measures them again here, in the order each fit needs the last one's answer:

1. element-wise: ``a * b`` of 1 Mi to 16 Mi elements (float32 and float64; each product
   a new tensor, as a training step's are: its pages are touched for the first time),
   the thread's CPU time, best of ``--repeats``: ``memory_gbps`` by least squares on the
   relative error of ``seconds = kernel call + 3 x bytes / memory_gbps``;
   ``op_overhead_us``, what the step model charges each op of a training step, from
   ``h = h + 1.0`` 100 times on an 8-element leaf and ``h.sum().backward()`` (200 ops
   and autograd nodes), per op;
2. matmuls: benchmarks/bench_gemm.py's 248 GEMMs and its fit (the peaks,
   ``matmul_half_dim``, ``matmul_half_gflop``), with step 1's two constants;
3. attention: benchmarks/bench_attention.py's 36 SDPA calls and its fit, with step 2's peaks;
4. latency inside a step: two gloo ranks, each 50 x (four 256 x 256 matmuls, then a
   256 KiB ``all_reduce``) against the same without the all-reduces: the extra wall time
   per all-reduce, less its ring bytes at the profile's link rate, is one ring step's
   ``intra_node_latency_us`` (and ``inter_node_latency_us``: one machine).

It writes a profile TOML that the planner reads (``--cluster FILE``) and
benchmarks/bench_planner.py judges (``--cluster FILE``): the training layouts judge these
constants and are never fitted on.

    OMP_NUM_THREADS=1 python benchmarks/fit_cpu_profile.py [--repeats 5] [--out cpu_here.toml]
                                                           [--json]

Its table holds each fitted constant beside the micro-benchmark it was fitted on, with
the reference column the built-in ``cpu`` profile's value and the ratio fitted / built-in.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from composer.planner.cluster import CLUSTERS, Cluster
from composer.testing.report import bench_parser, emit

ELEMENTS = tuple(2 ** 20 * 2 ** i for i in range(5))  # 1 Mi .. 16 Mi: past the caches
ALL_REDUCE_BYTES, ROUNDS = 256 * 1024, 50


def sibling(name: str) -> ModuleType:
    """benchmarks/NAME.py (benchmarks/ is no package: loaded by its path, once)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def time_mul(n: int, dtype: torch.dtype, repeats: int) -> float:
    """The least thread CPU seconds of one ``a * b`` of ``n`` elements."""
    a, b = (torch.randn(n, dtype=dtype) for _ in range(2))
    calls = max(1, int(sibling("bench_gemm").LOOP_S * 1e8 / n))
    runs = []
    for _ in range(repeats + 1):
        start = time.thread_time()
        for _ in range(calls):
            a * b
        runs.append((time.thread_time() - start) / calls)
    return min(runs[1:])


def op_seconds(repeats: int) -> float:
    """The least thread CPU seconds per op of a small autograd chain, forward and backward."""
    leaf = torch.zeros(8, requires_grad=True)
    runs = []
    for _ in range(repeats + 1):
        start = time.thread_time()
        h = leaf
        for _ in range(100):
            h = h + 1.0
        h.sum().backward()
        runs.append((time.thread_time() - start) / 200)
    return min(runs[1:])


def fit_elementwise(repeats: int) -> dict[str, float]:
    """``memory_gbps`` from element-wise products, ``op_overhead_us`` from a chain of ops."""
    rows = [(3 * n * dtype.itemsize, time_mul(n, dtype, repeats))
            for dtype in (torch.float32, torch.float64) for n in ELEMENTS]
    # seconds = x0 + x1 * bytes, each row divided by its seconds: the relative error
    a = torch.tensor([[1 / s, b / s] for b, s in rows], dtype=torch.float64)
    x = torch.linalg.lstsq(a, torch.ones(len(rows), 1, dtype=torch.float64)).solution.flatten()
    return {"op_overhead_us": op_seconds(repeats) * 1e6, "memory_gbps": 1 / x[1].item() / 1e9}


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    w = torch.randn(256, 256)
    buf = torch.zeros(ALL_REDUCE_BYTES // 4)

    def rounds(reduce: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(ROUNDS):
            h = w
            for _ in range(4):
                h = h @ w / 16
            if reduce:
                dist.all_reduce(buf)
        return time.perf_counter() - start
    rounds(True)
    extra = statistics.median(rounds(True) - rounds(False) for _ in range(5)) / ROUNDS
    if rank == 0:
        Path(out).write_text(repr(extra))
    dist.destroy_process_group()


def fit_latency(cpu: Cluster) -> float:
    """One ring step's latency (us): two ranks' extra wall time per all-reduce inside a
    compute loop, less the all-reduce's ring bytes (the buffer, at 2 ranks) at the link."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "extra")
        mp.spawn(_rank, args=(port, out), nprocs=2)
        extra = float(Path(out).read_text())
    rate = cpu.intra_node_gbps * 1e9 * cpu.comm_efficiency
    return max(0.0, extra - ALL_REDUCE_BYTES / rate) * 1e6


def fitted(base: Cluster, repeats: int) -> Cluster:
    """``base`` with every constant above measured here."""
    torch.set_num_threads(1)
    bench_gemm, bench_attention = sibling("bench_gemm"), sibling("bench_attention")
    cpu = dataclasses.replace(base, **fit_elementwise(repeats))
    cpu = bench_gemm.with_constants(cpu, bench_gemm.fit(cpu, bench_gemm.measure(repeats)))
    cpu = dataclasses.replace(cpu, **bench_attention.fit(cpu, min(repeats, 3))[0])
    latency = fit_latency(cpu)
    return dataclasses.replace(cpu, intra_node_latency_us=latency, inter_node_latency_us=latency)


def toml(cluster: Cluster) -> str:
    lines = []
    for f in dataclasses.fields(cluster):
        value = getattr(cluster, f.name)
        if f.name != "peak_tflops":
            lines.append(f"{f.name} = {value!r}".replace("'", '"'))
    lines.append("\n[peak_tflops]")
    lines += [f"{dtype} = {value!r}" for dtype, value in cluster.peak_tflops.items()]
    return "\n".join(lines) + "\n"


# each fitted constant: the micro-benchmark it is fitted on
FITTED = {
    "peak_tflops.float32": "bench_gemm.py's GEMMs, float32",
    "peak_tflops.float64": "bench_gemm.py's GEMMs, float64",
    "op_overhead_us": "100 x h = h + 1.0 and its backward, per op",
    "memory_gbps": "a * b of 1-16 Mi elements, float32 and float64",
    "matmul_half_dim": "bench_gemm.py's GEMMs",
    "matmul_half_gflop": "bench_gemm.py's GEMMs",
    "attention_efficiency": "bench_attention.py's SDPA calls",
    "attention_score_passes": "bench_attention.py's SDPA calls",
    "attention_row_us": "bench_attention.py's SDPA calls",
    "intra_node_latency_us": f"2 gloo ranks, {ROUNDS} x 4 matmuls + a 256 KiB all_reduce",
}


def constant(cluster: Cluster, key: str) -> float:
    if key.startswith("peak_tflops."):
        return cluster.peak_tflops[key.split(".", 1)[1]]
    return getattr(cluster, key)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="runs per shape; the fastest counts")
    parser.add_argument("--out", type=Path, default=Path("cpu_here.toml"),
                        help="the fitted profile (a cluster TOML)")
    opts = parser.parse_args(argv)
    start = time.perf_counter()
    base = CLUSTERS["cpu"]
    here = dataclasses.replace(fitted(base, opts.repeats), name="cpu_here")
    rows = []
    for key, source in FITTED.items():
        ours, ref = constant(here, key), constant(base, key)
        rows.append({"constant": key, "fitted on": source, "fitted here": ours,
                     "built-in cpu": ref, "ratio": ours / ref if ref else None})
    emit(rows, ["constant", "fitted on", "fitted here", "built-in cpu", "ratio"], opts.json)
    opts.out.write_text(toml(here))
    print(f"\nwrote {opts.out} in {time.perf_counter() - start:.0f} s",
          file=sys.stderr if opts.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
