"""Launch the debug model under torchrun many times in a row and count the
launches whose ranks could not connect.

    python scripts/soak_launch.py [--runs 30] [--nproc 4] [--busy 0] [--extra "--a.b c ..."]

Each launch trains 1 step on nproc CPU ranks (gloo), with nothing retried;
``--extra`` adds training arguments (e.g. a layout whose teardown to watch).
``--busy N`` keeps N busy loops running beside the launches (a loaded machine).
Prints one line per launch that failed, with its cause, then a summary row.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONNECT = ("connectFullMesh", "Connection refused", "Connection reset", "Socket Timeout")


def spin() -> None:
    while True:
        pass


def one_launch(nproc: int, extra: list[str]) -> tuple[int, str, float]:
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "composer.train", "--job.dump_folder", folder,
               "--training.steps", "1", "--data.seq_len", "32", "--training.local_batch_size", "2",
               "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
               "--job.collective_timeout_s", "120", *extra]
        start = time.perf_counter()
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        out = result.stdout + result.stderr
        cause = next((line.strip() for line in out.splitlines() if any(c in line for c in CONNECT)), "")
        return result.returncode, cause or out[-300:].strip(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--extra", default="", help="more training arguments, one string")
    args = parser.parse_args()
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    failed, seconds = 0, []
    try:
        for i in range(1, args.runs + 1):
            code, cause, took = one_launch(args.nproc, args.extra.split())
            seconds.append(took)
            if code != 0:
                failed += 1
                print(f"launch {i}: exit {code}: {cause}", flush=True)
    finally:
        for p in busy:
            p.terminate()
    seconds.sort()
    print(f"| launches | ranks | busy loops | failed | median s | max s |\n| --- | --- | --- | --- | --- | --- |\n"
          f"| {args.runs} | {args.nproc} | {args.busy} | {failed} | {seconds[len(seconds) // 2]:.1f} "
          f"| {seconds[-1]:.1f} |")


if __name__ == "__main__":
    main()
