"""The dry run against a real step on CUDA: ``composer.train --dry-run`` of a config (its
rank 0 traced on fake tensors, on CPU) beside a real run's ``torch.cuda.max_memory_allocated``
of rank 0 at its second step (``metrics.memory_breakdown``'s peak on CUDA).

    python scripts/gpu_dry_run_check.py [--config F] [--tolerance 0.1]

The world is the GPUs visible (at most the 8 the config is written for); with fewer, the
model keeps fewer layers (``--model.overrides n_layers=...``) so that a rank's share is
still what fits, and both runs get the same arguments. Prints one line, PASS or FAIL (exit
1); without a CUDA device, SKIP and exit 0.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "train_configs/llama3_8b.toml"
LAYERS_A_GPU = 4  # on fewer than 8 GPUs: the 8B keeps 32 / 8 layers a GPU


def _env(world: int) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "WORLD_SIZE": str(world), "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def job_args(world: int) -> list[str]:
    """What both runs get: two steps, no accumulation, and on fewer than 8 GPUs a model cut
    to 4 layers a GPU (the 8B's 32 layers at world 8)."""
    args = ["--training.steps", "2", "--training.global_batch_size", str(world),
            "--metrics.log_freq", "1", "--validation.enable", "false"]
    if world < 8:
        args += ["--model.overrides", f"n_layers={LAYERS_A_GPU * world}"]
    return args


def traced_peak(config: str, world: int, args: list[str], timeout: float) -> float:
    """The dry run's traced peak of rank 0, GiB."""
    out = subprocess.run([sys.executable, "-m", "composer.train", "--dry-run", "--json",
                          "--config", config, *args], cwd=ROOT, env=_env(world), timeout=timeout,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["traced"]["memory_gib"]["peak"]


def measured_peak(config: str, world: int, args: list[str], timeout: float) -> float:
    """A real run's rank 0 peak at its last step (max_memory_allocated), GiB."""
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={world}", "-m", "composer.train", "--config", config,
                        *args, "--metrics.memory_breakdown", "--job.dump_folder", folder],
                       cwd=ROOT, env=_env(world), timeout=timeout, check=True,
                       capture_output=True, text=True)
        rows = [json.loads(line) for line in open(Path(folder) / "metrics.jsonl")]
    return [r for r in rows if "memory" in r][-1]["memory"][0]["peak"]


def check(config: str = CONFIG, tolerance: float = 0.1, timeout: float = 600) -> tuple[bool, str]:
    """(passed, its line): the traced peak within ``tolerance`` of the measured one.
    Raises RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    world = min(torch.cuda.device_count(), 8)
    args = job_args(world)
    traced = traced_peak(config, world, args, timeout)
    measured = measured_peak(config, world, args, timeout)
    ratio = traced / measured
    passed = abs(ratio - 1) <= tolerance
    return passed, (f"dry run of {Path(config).name} on {world} GPU(s): traced {traced:.2f} GiB, "
                    f"measured {measured:.2f} GiB (max_memory_allocated), ratio {ratio:.3f} "
                    f"{'PASS' if passed else 'FAIL'} (within {tolerance:.0%})")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=600, help="seconds for each of the two runs")
    return p


def main() -> int:
    a = parser().parse_args()
    if not torch.cuda.is_available():
        print("gpu_dry_run_check: SKIP (no CUDA device)")
        return 0
    try:
        passed, line = check(a.config, a.tolerance, a.timeout)
    except subprocess.CalledProcessError as e:
        print(f"gpu_dry_run_check: FAIL ({' '.join(e.cmd[:6])}...: "
              f"{(e.stderr or '').strip().splitlines()[-1:]})")
        return 1
    print(f"gpu_dry_run_check: {line}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
