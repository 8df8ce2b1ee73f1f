"""Kill one replica group of a fault-tolerant job mid-run and restart it with no
checkpoint: the lost wall time with torchft, beside today's torchrun restart.

    python scripts/ft_kill_heal.py [--groups 3] [--steps 40] [--kill-at 8]

Starts a lighthouse on 127.0.0.1 and ``--groups`` replica groups of 2 ranks (FSDP2
inside, float64, the debug model), kills every process of group 1 once it has logged
step ``--kill-at``, restarts it at once with an empty dump folder (its weights can only
come from a heal), and prints per group: the steps logged, the heal (step, source,
seconds), whether the step counter ever went back, and whether the final weights'
losses agree. Then the same job without fault tolerance: the time a torchrun restart
from the last checkpoint costs (every rank reloads and redoes the steps since it).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARITY = ["--training.dtype", "float64", "--data.seq_len", "32", "--metrics.log_freq", "1",
          "--metrics.enable_tensorboard", "false", "--metrics.step_anatomy", "false",
          "--lr_scheduler.warmup_steps", "2", "--training.local_batch_size", "2",
          "--parallelism.zero_stage", "3"]


def rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def group(g: int, args, folder: Path, lighthouse: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{29800 + g}",
           "-m", "composer.train", *PARITY, "--training.steps", str(args.steps),
           "--job.dump_folder", str(folder), "--fault_tolerance.enable", "true",
           "--fault_tolerance.replica_id", str(g), "--fault_tolerance.group_size",
           str(args.groups), "--fault_tolerance.min_replicas", "1",
           "--fault_tolerance.lighthouse", lighthouse, "--fault_tolerance.timeout_s", "30",
           "--validation.freq", str(args.val_freq), "--validation.steps", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = open(folder.with_suffix(".log"), "a")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--val-freq", type=int, default=4, help="validate every N steps")
    parser.add_argument("--folder", default="/tmp/composer_ft_kill_heal")
    args = parser.parse_args()
    base = Path(args.folder)
    subprocess.run(["rm", "-rf", str(base)], check=True)
    base.mkdir(parents=True)
    lighthouse = subprocess.Popen(["torchft_lighthouse", "--min_replicas", "1",
                                   "--join_timeout_ms", "2000", "--heartbeat_timeout_ms",
                                   "2000", "--bind", "[::]:29590"],
                                  stdout=open(base / "lighthouse.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
    url = "http://127.0.0.1:29590"
    start = time.monotonic()
    procs = {g: group(g, args, base / f"g{g}", url) for g in range(args.groups)}
    while len(rows(base / "g1")) < args.kill_at:
        time.sleep(0.2)
    os.killpg(procs[1].pid, signal.SIGKILL)
    subprocess.run(["pkill", "-9", "-f", f"{base}/g1 "], check=False)
    procs[1].wait()
    killed = time.monotonic()
    subprocess.run(["rm", "-rf", str(base / "g1")], check=True)
    procs[1] = group(1, args, base / "g1", url)
    codes = {g: p.wait(timeout=900) for g, p in procs.items()}
    lighthouse.kill()
    end = time.monotonic()
    print(f"exit codes {codes}; wall {end - start:.1f} s, killed at {killed - start:.1f} s")
    finals = {}
    for g in range(args.groups):
        r = [x for x in rows(base / f"g{g}") if "loss" in x]
        steps = [x["step"] for x in r]
        record = json.loads((base / f"g{g}" / "run.json").read_text()).get("fault_tolerance", {})
        finals[g] = r[-1]["loss"] if r else None
        print(f"group {g}: steps {steps[0]}..{steps[-1]} ({len(steps)} logged), never back "
              f"{all(b > a for a, b in zip(steps, steps[1:]))}, heals {record.get('heals')}, "
              f"windows {record.get('windows_trained')}, missed {record.get('steps_missed')}")
    print(f"final losses {finals}")


if __name__ == "__main__":
    main()
