"""Checkpoint cost on the debug model per layout: how long training stalls for a
save (synchronous vs asynchronous), how long a resume's load takes, and the
bytes on disk, next to the bytes the state must take (weights + two AdamW
moments, float32, plus the small training state).

Each row is real composer.train jobs (through this script's worker mode, which
times ``Checkpointer.save`` and ``Checkpointer.load`` as the trainer calls them).
The references: the asynchronous stall stands beside the synchronous save (their
ratio is what async saves), the bytes on disk beside the analytic state size.

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py [--json]
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from composer.models.llama import flavors, spec
from composer.testing.harness import ROOT
from composer.testing.report import bench_parser, emit

LAYOUTS = {"1 process": (1, ["--training.local_batch_size", "8"]),
           "FSDP x2": (2, ["--training.local_batch_size", "4"]),
           "FSDP x4": (4, ["--training.local_batch_size", "2"]),
           "TP2 x FSDP2": (4, ["--training.local_batch_size", "4",
                               "--parallelism.tensor_parallel_degree", "2"])}
STEPS, INTERVAL = 8, 2


def worker(argv: list[str]) -> int:
    """Train as composer.train does, timing every save and load on rank 0."""
    from composer.checkpoint import dcp as checkpoint
    from composer.cli import run_argv
    from composer.trainer.trainer import Trainer
    times: dict[str, list[float]] = {"save": [], "load": [], "step": []}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name].append(time.perf_counter() - start)
        return wrapper

    checkpoint.Checkpointer.save = timed("save", checkpoint.Checkpointer.save)
    checkpoint.Checkpointer.load = timed("load", checkpoint.Checkpointer.load)
    Trainer.train_step = timed("step", Trainer.train_step)
    code = run_argv(argv)
    if os.environ.get("RANK", "0") == "0":
        folder = Path(argv[argv.index("--job.dump_folder") + 1])
        (folder / "times.json").write_text(json.dumps(times))
    return code


def run(folder: Path, nproc: int, args: list[str]) -> dict:
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}"])
    cmd = [*launcher, __file__, "--worker", "--job.dump_folder", str(folder),
           "--training.steps", str(STEPS), "--data.seq_len", "256", "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
           "--checkpoint.enable", "--checkpoint.interval", str(INTERVAL), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    return json.loads((folder / "times.json").read_text())


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(nproc: int, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(Path(tmp) / "sync", nproc, args)
        background = run(Path(tmp) / "async", nproc, [*args, "--checkpoint.async_mode", "async"])
        step = Path(tmp) / "sync" / "checkpoint" / f"step-{STEPS}"
        size = disk_bytes(step)
        shutil.rmtree(step)  # resume from the step before
        resumed = run(Path(tmp) / "sync", nproc, args)
    return {"sync": statistics.median(sync["save"]), "async": statistics.median(background["save"]),
            "step": statistics.median(sync["step"]), "load": resumed["load"][0], "bytes": size}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:  # one training job of a row, launched by run()
        return worker([arg for arg in argv if arg != "--worker"])
    args = bench_parser(__doc__).parse_args(argv)
    params = spec.num_params(flavors["debug"])
    state = 3 * params * 4  # float32 weights, exp_avg, exp_avg_sq
    if not args.json:
        print(f"debug model: {params:,} params; weights + AdamW state = {state / 2**20:.2f} MiB; "
              f"{STEPS} steps, a save every {INTERVAL}, batch 8 x seq 256, float32\n")
    rows = []
    for name, (nproc, layout_args) in LAYOUTS.items():
        m = measure(nproc, layout_args)
        rows.append({"layout": name, "step s": m["step"], "sync save s": m["sync"],
                     "async stall s": m["async"], "async / sync": m["async"] / m["sync"],
                     "load s": m["load"], "on disk MiB": m["bytes"] / 2**20,
                     "state MiB": state / 2**20, "on disk / state": m["bytes"] / state})
    emit(rows, ["layout", "step s", "sync save s", "async stall s", "async / sync", "load s",
                "on disk MiB", "state MiB", "on disk / state"], args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
