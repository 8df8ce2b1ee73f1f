"""Bytes each rank moves per training step, by mesh dim, measured against the
analytic value, for DDP, ZeRO-2, ZeRO-3, TP and TP + SP on the debug model,
and the all-to-all of expert parallel on the MoE debug model.

Each row is a real torchrun job of composer.train with ``--metrics.comm_stats``;
the measured figure sums, over every collective of step 2, what a ring
algorithm moves through one rank (all-reduce 2(n-1)/n of the tensor,
all-gather and reduce-scatter (n-1)/n of the full tensor). The MoE rows
compare rank 0's all-to-all payload (the tensors it hands to all-to-all) with
the value the step's routed token counts predict, and time every all-to-all
to give its share of the step time. The reference column is the analytic value,
beside it the ratio measured / analytic; a layout's traffic on its other mesh dims
gets a row of its own, with no analytic value.

    OMP_NUM_THREADS=1 python benchmarks/bench_comm.py [--ranks 4] [--batch 2] [--seq-len 64]
        [--json]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from composer.models.llama import flavors, spec
from composer.models.moe import flavors as moe_flavors
from composer.testing.harness import ROOT
from composer.testing.report import bench_parser, emit

BYTES = 4  # float32


def model_sizes() -> dict:
    args = flavors["debug"]
    model = spec.build_meta(args)
    params = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for b in spec.blocks(model) for p in b.parameters())
    return {"P": params * BYTES, "P_blocks": blocks * BYTES, "L": args.n_layers,
            "dim": args.dim, "vocab": args.vocab_size}


def analytic(row: str, n: int, batch: int, seq: int, m: dict) -> float:
    """Ring bytes per rank per step of the main terms (weights, activations)."""
    ring_ar, ring_ag = 2 * (n - 1) / n, (n - 1) / n
    act = batch * seq * m["dim"] * BYTES           # one [B, S, dim] activation
    tp_acts = 2 * (2 * m["L"] + 1) * act * ring_ar  # fwd + bwd: 2 per block + 1
    if row == "DDP":
        return ring_ar * m["P"]
    if row == "ZeRO-2":   # reduce-scatter grads + all-gather params once
        return 2 * ring_ag * m["P"]
    if row == "ZeRO-3":   # + blocks gathered again for backward (the root stays gathered)
        return ring_ag * (2 * m["P"] + m["P_blocks"])
    if row == "TP":       # + the logits gathered once
        return tp_acts + ring_ag * batch * seq * m["vocab"] * BYTES
    return tp_acts        # TP + SP: all-gather + reduce-scatter = all-reduce; logits sharded


ROWS = {"DDP": ["--parallelism.zero_stage", "0"],
        "ZeRO-2": ["--parallelism.zero_stage", "2"],
        "ZeRO-3": ["--parallelism.zero_stage", "3"],
        "TP": ["--parallelism.sequence_parallel", "false", "--parallelism.loss_parallel", "false"],
        "TP + SP": []}


def run(n: int, args: list[str]) -> tuple[list[dict], list[float]]:
    """composer.train on n ranks (through this script's worker mode, which times
    every all-to-all): metrics rows and rank 0's all-to-all seconds per step."""
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={n}", __file__, "--worker", "--job.dump_folder", folder,
               "--training.steps", "2", "--metrics.log_freq", "1", "--metrics.comm_stats",
               "--metrics.enable_tensorboard", "false", "--validation.enable", "false", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
        rows = [json.loads(line) for line in open(Path(folder) / "metrics.jsonl")]
        seconds = json.loads((Path(folder) / "all_to_all_seconds.json").read_text())
    return rows, seconds


def worker(argv: list[str]) -> int:
    """Train as composer.train does, timing each (blocking) all-to-all."""
    import time

    import torch.distributed as dist

    from composer.cli import run_argv
    from composer.trainer.trainer import Trainer
    seconds: list[float] = []
    all_to_all, train_step = dist.all_to_all_single, Trainer.train_step

    def timed_all_to_all(*args, **kwargs):
        start = time.perf_counter()
        try:
            return all_to_all(*args, **kwargs)
        finally:
            seconds[-1] += time.perf_counter() - start

    def step(self):
        seconds.append(0.0)
        return train_step(self)

    dist.all_to_all_single, Trainer.train_step = timed_all_to_all, step
    code = run_argv(argv)
    if os.environ.get("RANK", "0") == "0":
        folder = Path(argv[argv.index("--job.dump_folder") + 1])
        (folder / "all_to_all_seconds.json").write_text(json.dumps(seconds))
    return code


def measure(row: str, n: int, batch: int, seq: int) -> dict:
    tp = row.startswith("TP")
    rows, _ = run(n, ["--data.seq_len", str(seq), "--training.local_batch_size", str(batch),
                      "--parallelism.tensor_parallel_degree", str(n if tp else 1), *ROWS[row]])
    per_dim: dict = {}
    for dims in rows[-1]["comm"].values():  # step 2: no first-step-only traffic
        for dim, kinds in dims.items():
            per_dim[dim] = per_dim.get(dim, 0.0) + sum(k["ring_bytes"] for k in kinds.values())
    return per_dim


def moe_row(ep: int, n: int, batch: int, seq: int) -> tuple[float, float, float]:
    """Rank 0's all-to-all payload in step 2, its analytic value (ep must be n),
    and the share of step 2's time spent inside all-to-all."""
    args = moe_flavors["debug"]
    rows, seconds = run(n, ["--model.name", "moe", "--metrics.expert_load",
                            "--data.seq_len", str(seq),
                            "--training.local_batch_size", str(batch),
                            "--parallelism.expert_parallel_degree", str(ep)])
    row = rows[-1]
    measured = sum(kinds["all_to_all"]["bytes"] for dims in row["comm"].values()
                   for kinds in dims.values() if "all_to_all" in kinds)
    # per MoE layer: the counts (int64 per expert) out; forward its tokens' k
    # choices out and what the batch routed to its experts back, backward the same
    sent = batch * seq * args.top_k
    analytic = 0
    for load in row["moe_tokens_per_expert"]:
        own = load[:args.n_experts // ep]  # rank 0 holds the first experts
        analytic += args.n_experts * 8 + 2 * (sent + sum(own)) * args.dim * BYTES
    return measured, analytic, seconds[-1] / row["step_time_s"]


COLUMNS = ["model", "layout", "dim", "measured MiB", "analytic MiB", "ratio",
           "all-to-all % of step"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:  # one training job of a row, launched by run()
        return worker([arg for arg in argv if arg != "--worker"])
    p = bench_parser(__doc__)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="local batch")
    p.add_argument("--seq-len", type=int, default=64)
    a = p.parse_args(argv)
    m = model_sizes()
    moe = moe_flavors["debug"]
    if not a.json:
        print(f"debug model: {m['P'] // BYTES:,} params ({m['P'] / 2**20:.2f} MiB fp32), "
              f"{a.ranks} ranks, local batch {a.batch} x seq {a.seq_len}; MoE debug model "
              f"({moe.n_experts} experts, top-{moe.top_k}): rank 0's all-to-all payload per "
              f"step\n")
    rows, measured = [], {}
    for row in ROWS:
        per_dim = measure(row, a.ranks, a.batch, a.seq_len)
        dim = "tp" if row.startswith("TP") else "dp_shard"
        measured[row] = per_dim.get(dim, 0.0)
        want = analytic(row, a.ranks, a.batch, a.seq_len, m)
        rows.append({"model": "debug", "layout": row, "dim": dim,
                     "measured MiB": measured[row] / 2**20, "analytic MiB": want / 2**20,
                     "ratio": measured[row] / want})
        for other, value in per_dim.items():
            if other != dim and value:
                rows.append({"model": "debug", "layout": row, "dim": other,
                             "measured MiB": value / 2**20})
    # expert parallel over every rank, so the global routed counts give rank 0's share
    for ep in sorted({2, a.ranks}):
        got, want, share = moe_row(ep, ep, a.batch, a.seq_len)
        rows.append({"model": "moe debug", "layout": f"EP{ep} all-to-all",
                     "measured MiB": got / 2**20, "analytic MiB": want / 2**20,
                     "ratio": got / want, "all-to-all % of step": share * 100})
    emit(rows, COLUMNS, a.json)
    if not a.json:
        print(f"\nZeRO-3 / DDP = {measured['ZeRO-3'] / measured['DDP']:.3f} "
              f"(textbook 1.5 when every parameter is resharded; the root here stays gathered)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
