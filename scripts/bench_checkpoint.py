"""Checkpoint cost on the debug model per layout: how long training stalls for a
save (synchronous vs asynchronous), how long a resume's load takes, and the
bytes on disk, next to the bytes the state must take (weights + two AdamW
moments, float32, plus the small training state).

Each row is real composer.train jobs (through this script's worker mode, which
times ``Checkpointer.save`` and ``Checkpointer.load`` as the trainer calls them).

    OMP_NUM_THREADS=1 python scripts/bench_checkpoint.py
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from composer.models.llama import flavors, spec  # noqa: E402

LAYOUTS = {"1 process": (1, ["--training.local_batch_size", "8"]),
           "FSDP x2": (2, ["--training.local_batch_size", "4"]),
           "FSDP x4": (4, ["--training.local_batch_size", "2"]),
           "TP2 x FSDP2": (4, ["--training.local_batch_size", "4",
                               "--parallelism.tensor_parallel_degree", "2"])}
STEPS, INTERVAL = 8, 2


def worker(argv: list[str]) -> None:
    """Train as composer.train does, timing every save and load on rank 0."""
    from composer import cli, train
    from composer.checkpoint import dcp as checkpoint
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
    train.Trainer.train_step = timed("step", train.Trainer.train_step)
    code = cli.run_argv(argv)
    if os.environ.get("RANK", "0") == "0":
        folder = Path(argv[argv.index("--job.dump_folder") + 1])
        (folder / "times.json").write_text(json.dumps(times))
    sys.exit(code)


def run(folder: Path, nproc: int, args: list[str]) -> dict:
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}"])
    cmd = [*launcher, __file__, "--worker", "--job.dump_folder", str(folder),
           "--training.steps", str(STEPS), "--data.seq_len", "256", "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
           "--checkpoint.enable", "--checkpoint.interval", str(INTERVAL), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
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


def main() -> None:
    params = spec.num_params(flavors["debug"])
    state = 3 * params * 4  # float32 weights, exp_avg, exp_avg_sq
    print(f"debug model: {params:,} params; weights + AdamW state = {state / 2**20:.2f} MiB; "
          f"{STEPS} steps, a save every {INTERVAL}, batch 8 x seq 256, float32")
    print(f"{'layout':<13}{'step s':>8}{'sync save s':>13}{'async stall s':>15}{'async/sync':>12}"
          f"{'load s':>8}{'on disk MiB':>13}{'/ state':>9}")
    for name, (nproc, args) in LAYOUTS.items():
        m = measure(nproc, args)
        print(f"{name:<13}{m['step']:>8.3f}{m['sync']:>13.3f}{m['async']:>15.3f}"
              f"{m['async'] / m['sync']:>12.2f}{m['load']:>8.3f}{m['bytes'] / 2**20:>13.2f}"
              f"{m['bytes'] / state:>9.3f}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker([arg for arg in sys.argv[1:] if arg != "--worker"])
    main()
