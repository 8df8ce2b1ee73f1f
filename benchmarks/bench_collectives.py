"""gloo's collectives on this machine by rank count, beside the cpu cluster profile.

Each rank count runs in its own ``torch.multiprocessing.spawn`` (one thread a rank):
an all-reduce, an all-gather and a reduce-scatter of a large float32 tensor, each as the
ring's bytes per second (what a rank sends in the ring algorithm, 2(n-1)/n of the tensor
for an all-reduce, (n-1)/n for the other two, over the median time). Beside each figure
stands the rate the planner's ``cpu`` profile prices every collective at
(``composer.planner.time.comm_seconds``: the link rate times ``comm_efficiency``, fitted
on a 2-rank all-reduce), whatever its kind and rank count: the reference column, and
their ratio.

    OMP_NUM_THREADS=1 python benchmarks/bench_collectives.py [--ranks 2 4 8] [--mib 64] [--json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from composer.planner.cluster import load_cluster
from composer.testing.report import bench_parser, emit

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
REPEATS = 7


def ring_fraction(kind: str, n: int) -> float:
    """What one rank sends of the whole tensor in the ring algorithm."""
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _worker(rank: int, n: int, mib: int, store_file: str, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)  # the *_into_tensor names' deprecation
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=n)
    whole = torch.ones(mib * 2**20 // 4)
    part = torch.ones(whole.numel() // n)
    ops = {"all_reduce": lambda: dist.all_reduce(whole),
           "all_gather": lambda: dist.all_gather_into_tensor(whole, part),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole)}
    seconds = {kind: _timed(op, REPEATS) for kind, op in ops.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def measure(n: int, mib: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.spawn(_worker, args=(n, mib, os.path.join(tmp, "store"), out), nprocs=n)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mib", type=int, default=64, help="the large tensor's MiB")
    opts = parser.parse_args(argv)
    cpu = load_cluster("cpu")
    rate = cpu.intra_node_gbps * cpu.comm_efficiency
    if not opts.json:
        print(f"cpu profile: {cpu.intra_node_gbps} GB/s x comm_efficiency {cpu.comm_efficiency} "
              f"= {rate:.2f} GB/s a rank, {cpu.cores_per_node} cores; {os.cpu_count()} cores "
              f"here\n")
    rows = []
    for n in opts.ranks:
        seconds = measure(n, opts.mib)
        planned = rate
        for kind in KINDS:
            gbps = ring_fraction(kind, n) * opts.mib * 2**20 / seconds[kind] / 1e9
            rows.append({"ranks": n, "collective": kind, "MiB": opts.mib, "measured GB/s": gbps,
                         "planned GB/s": planned, "measured / planned": gbps / planned})
    emit(rows, ["ranks", "collective", "MiB", "measured GB/s", "planned GB/s",
                "measured / planned"], opts.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
