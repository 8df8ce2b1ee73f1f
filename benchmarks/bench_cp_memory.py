"""Context parallel's activation memory per rank against one process, at long sequences.

A tiny model (dim 32, one layer, batch 1) so that attention's per-sequence memory, and any
mask of queries x keys, shows: for seq 8192 and 16384, packed documents (masked) and
causal attention, cp 1, 2 and 4 with both methods, the largest rank's activations at the
step's peak (``metrics.memory_breakdown``, deterministic on CPU) in MiB and as a share of
one process's (cp1, the reference), next to the bound the tests hold (1.15 / cp). One
real launch per row.

    OMP_NUM_THREADS=1 python benchmarks/bench_cp_memory.py [SEQ ...] [--json]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from composer.testing.harness import ROOT
from composer.testing.report import bench_parser, emit

TINY = "dim=32,n_layers=1,n_heads=4,n_kv_heads=4,max_seq_len=16384"  # kv heads divide by cp
LIMIT = 1.15
LAYOUTS = {"cp1": (1, "allgather"), **{f"cp{cp} {method}": (cp, method) for cp in (2, 4)
                                       for method in ("allgather", "alltoall")}}


def args(seq_len: int, masked: bool, cp: int, method: str) -> list[str]:
    """composer.train's arguments for one row (the memory tracker on, one step)."""
    return ["--model.overrides", TINY, "--data.seq_len", str(seq_len),
            "--data.document_mask", str(masked).lower(), "--training.local_batch_size", "1",
            "--training.steps", "1", "--metrics.memory_breakdown", "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
            "--parallelism.context_parallel_degree", str(cp),
            "--parallelism.context_parallel_method", method]


def activations(folder: Path, nproc: int, argv: list[str]) -> float:
    """The largest rank's activations (GiB) at the peak of the run's last step."""
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*launcher, "-m", "composer.train", "--job.dump_folder", str(folder), *argv],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    last = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])
    return max(rank["activations"] for rank in last["memory"])


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("seqs", metavar="SEQ", type=int, nargs="*", default=[8192, 16384],
                        help="sequence lengths (default 8192 16384)")
    opts = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in opts.seqs:
            for masked in (True, False):
                alone = None
                for name, (cp, method) in LAYOUTS.items():
                    folder = Path(tmp) / f"{seq}_{masked}_{name.replace(' ', '_')}"
                    got = activations(folder, cp, args(seq, masked, cp, method))
                    alone = alone or got
                    rows.append({"seq": seq, "attention": "documents" if masked else "causal",
                                 "layout": name, "activations MiB": got * 1024,
                                 "cp1 MiB": alone * 1024, "share of cp1": got / alone,
                                 "bound 1.15/cp": LIMIT / cp})
    emit(rows, ["seq", "attention", "layout", "activations MiB", "cp1 MiB", "share of cp1",
                "bound 1.15/cp"], opts.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
