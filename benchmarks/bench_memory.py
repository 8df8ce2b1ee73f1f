"""Memory and speed trade-offs, measured with real composer.train runs.

1. Activation checkpointing on the debug model at two sequence lengths:
   activation memory at the step's peak (``metrics.memory_breakdown``) and
   step time (a separate run without the tracker, which slows steps) for each
   mode, as ratios to no AC.
2. ZeRO stages 0-3 on 4 ranks: peak memory per rank next to the ZeRO formula.
   The model is deep (64 blocks, so one gathered block is small next to the
   whole) and the batch tiny, so parameters, gradients and AdamW state
   dominate. Training is float32 (4 bytes of weights, 4 of gradients, 8 of
   AdamW moments: the 16 bytes of the 2+2+12 mixed-precision split):
       stage 0: 16 P   stage 1: 8 P + 8 P/N   stage 2: 4 P + 12 P/N   stage 3: 16 P/N
   (P parameters, N ranks), with the fused AdamW: the foreach one (the default
   for DTensors) holds one more parameter-sized temporary during its step.
3. Context parallel at sequence 4096 (the debug model, its max_seq_len raised):
   activation memory per rank for cp 1, 2 and 4 and both methods, next to the
   ideal 1/cp, and the step time (on a machine with fewer cores than ranks the
   times show the overhead, not the speed-up a rank per device would give).

References: table 1 puts each AC mode beside no AC (its activations and step time, and
the ratios); table 2 puts each stage's measured peak beside the ZeRO formula (the
analytic minimum) and their ratio; table 3 puts each layout beside cp 1 (activations,
step time, ratios) and the ideal 1/cp. With ``--json`` every row of the tables run is
printed as one list, each with its ``table`` ("ac", "zero", "cp").

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py [ac] [zero] [cp] [--json]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from composer.job.plan import override_args
from composer.models.llama import flavors, spec
from composer.testing.harness import ROOT
from composer.testing.report import bench_parser, emit_tables

AC_MODES = ("none", "selective_layer", "selective_op", "full")
SEQ_LENS = (256, 1024)
DEEP = "dim=256,n_layers=64"
N = 4
MIB = 2**20
PARTS = ("ac", "zero", "cp")

AC_COLUMNS = ["seq_len", "AC mode", "activations (MiB)", "no AC activations (MiB)",
              "activations ratio", "step time (s)", "no AC step time (s)", "step time ratio"]
ZERO_COLUMNS = ["stage", "formula (MiB)", "peak per rank, max (MiB)", "ratio",
                "params (MiB)", "grads (MiB)", "optimizer (MiB)", "activations (MiB)",
                "other (MiB)"]
CP_COLUMNS = ["documents", "cp", "method", "activations per rank (MiB)", "cp 1 activations (MiB)",
              "ratio to cp 1", "ideal 1/cp", "step time (s)", "cp 1 step time (s)",
              "step time ratio"]


def train(folder: Path, nproc: int, args: list[str]) -> list[dict]:
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}"])
    cmd = [*launcher, "-m", "composer.train", "--job.dump_folder", str(folder),
           "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
           "--validation.enable", "false", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    with open(folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def activation_table(tmp: Path) -> tuple[str, list[dict]]:
    rows = []
    for seq_len in SEQ_LENS:
        base = ["--data.seq_len", str(seq_len), "--training.local_batch_size", "4"]
        ref_mem = ref_time = None
        for mode in AC_MODES:
            args = [*base, "--activation_checkpoint.mode", mode]
            mem = train(tmp / f"mem_{seq_len}_{mode}", 1,
                        [*args, "--training.steps", "2", "--metrics.memory_breakdown"])
            act = mem[-1]["memory"][0]["activations"] * 1024
            timed = train(tmp / f"time_{seq_len}_{mode}", 1, [*args, "--training.steps", "8"])
            step = sorted(r["step_time_s"] for r in timed[2:])[len(timed[2:]) // 2]
            ref_mem, ref_time = ref_mem or act, ref_time or step
            rows.append({"table": "ac", "seq_len": seq_len, "AC mode": mode,
                         "activations (MiB)": act, "no AC activations (MiB)": ref_mem,
                         "activations ratio": act / ref_mem, "step time (s)": step,
                         "no AC step time (s)": ref_time, "step time ratio": step / ref_time})
    return "Activation checkpointing, debug model, 4 sequences", rows


def zero_formula(stage: int, params: int) -> float:
    per_param = {0: 16, 1: 8 + 8 / N, 2: 4 + 12 / N, 3: 16 / N}[stage]
    return per_param * params


def zero_table(tmp: Path) -> tuple[str, list[dict]]:
    params = spec.num_params(override_args(flavors["debug"], DEEP))
    heading = (f"ZeRO on {N} ranks, {params / 1e6:.2f}M parameters (float32, AdamW), "
               f"seq_len 16, 1 sequence per rank; the categories are those at the peak")
    out = []
    for stage in range(4):
        rows = train(tmp / f"zero{stage}", N,
                     ["--model.overrides", DEEP, "--parallelism.zero_stage", str(stage),
                      "--data.seq_len", "16", "--training.local_batch_size", "1",
                      "--training.steps", "2", "--metrics.memory_breakdown",
                      "--optimizer.implementation", "fused"])
        top = max(rows[-1]["memory"], key=lambda r: r["peak"])  # step 2: AdamW state exists
        formula = zero_formula(stage, params) / MIB
        out.append({"table": "zero", "stage": stage, "formula (MiB)": formula,
                    "peak per rank, max (MiB)": top["peak"] * 1024,
                    "ratio": top["peak"] * 1024 / formula,
                    **{f"{k} (MiB)": top[k] * 1024 for k in
                       ("params", "grads", "optimizer", "activations", "other")}})
    return heading, out


def median_step(rows: list[dict]) -> float:
    times = sorted(r["step_time_s"] for r in rows[1:])
    return times[len(times) // 2]


def cp_table(tmp: Path, seq_len: int = 4096) -> tuple[str, list[dict]]:
    base = ["--model.overrides", f"max_seq_len={seq_len}", "--data.seq_len", str(seq_len),
            "--training.local_batch_size", "1"]
    rows = []
    for masked in ("true", "false"):
        ref_mem = ref_time = None
        for cp, method in ((1, "-"), (2, "allgather"), (2, "alltoall"), (4, "allgather"),
                           (4, "alltoall")):
            args = [*base, "--data.document_mask", masked,
                    "--parallelism.context_parallel_degree", str(cp)]
            if cp > 1:
                args += ["--parallelism.context_parallel_method", method]
            name = f"cp_{masked}_{cp}_{method}"
            mem = train(tmp / f"{name}_mem", cp, [*args, "--training.steps", "2",
                                                  "--metrics.memory_breakdown"])
            act = max(r["activations"] for r in mem[-1]["memory"]) * 1024
            step = median_step(train(tmp / f"{name}_time", cp, [*args, "--training.steps", "4"]))
            ref_mem, ref_time = ref_mem or act, ref_time or step
            rows.append({"table": "cp", "documents": "masked" if masked == "true" else "causal",
                         "cp": cp, "method": method, "activations per rank (MiB)": act,
                         "cp 1 activations (MiB)": ref_mem, "ratio to cp 1": act / ref_mem,
                         "ideal 1/cp": 1 / cp, "step time (s)": step,
                         "cp 1 step time (s)": ref_time, "step time ratio": step / ref_time})
    return f"Context parallel, debug model, seq_len {seq_len}, 1 sequence", rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("parts", nargs="*", metavar="part",
                        help=f"which tables to measure, of {', '.join(PARTS)}; all when none")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    parts = args.parts or list(PARTS)
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        if "ac" in parts:
            tables.append((*activation_table(Path(tmp)), AC_COLUMNS))
        if "zero" in parts:
            tables.append((*zero_table(Path(tmp)), ZERO_COLUMNS))
        if "cp" in parts:
            tables.append((*cp_table(Path(tmp)), CP_COLUMNS))
    emit_tables(tables, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
