"""Launch real training processes with a hard timeout and read what they wrote.

Every multi-process test goes through ``launch``: a hang becomes a failed test
(the whole process group is killed) instead of a stuck CI job.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The parity setting: float64 everywhere, a tiny debug model, a few steps, a
# validation pass every other step.
PARITY = ["--training.dtype", "float64", "--training.steps", "4", "--data.seq_len", "32",
          "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
          "--validation.freq", "2", "--validation.steps", "1", "--lr_scheduler.warmup_steps", "2"]


# On this loaded 2-core machine gloo's rendezvous now and then fails to connect
# two local ranks before anything of ours has run; such a launch is tried again.
GLOO_CONNECT = "Gloo connectFullMesh failed"


def launch(args: list[str], nproc: int = 1, timeout: float = 300,
           program: str = "composer.train") -> subprocess.CompletedProcess:
    """Run ``program`` (a module, or a script ending in .py) with ``args`` as one
    process, or under torchrun with nproc ranks (again, once, if gloo could not
    connect the ranks)."""
    result = _launch(args, nproc, timeout, program)
    if result.returncode != 0 and GLOO_CONNECT in result.stdout + result.stderr:
        result = _launch(args, nproc, timeout, program)
    return result


def _launch(args: list[str], nproc: int, timeout: float, program: str) -> subprocess.CompletedProcess:
    target = [program] if program.endswith(".py") else ["-m", program]
    if nproc == 1:
        cmd = [sys.executable, *target, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *target, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def read_metrics(folder: Path) -> list[dict]:
    with open(folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train(folder: Path, nproc: int = 1, args: list[str] = (), timeout: float = 300) -> list[dict]:
    """Train into ``folder`` and return its metrics rows; fail with the output on error."""
    result = launch(["--job.dump_folder", str(folder), *args], nproc, timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return read_metrics(folder)
